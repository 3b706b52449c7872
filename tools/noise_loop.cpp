// The CPU generators in a loop on one core, without the op around them (no allocation, threads or
// dispatch): ns per normal of Philox + Box-Muller (normal_run), ns per pair of ChaCha20 words
// (chacha_run) and per float64 ChaCha20 normal (chacha_normal_run: the pair and its Box-Muller),
// best of 9 passes over 4.5 M elements, and FNV-1a hashes of every normal's bits (Philox, ChaCha20).
// Built and run by tools/noise_loop.py. The hashes of the avx512 and avx2 builds agree; this
// standalone portable build's differs (GCC compiles its Box-Muller differently here than in the
// module, whose bits tests/test_cpu_capability.py checks on every path), so its time is indicative.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../csrc/cpu/noise_cpu.h"

using namespace dpkernels;

template <typename F>
double best_seconds(F f) {
  double best = 1e30;
  for (int rep = 0; rep < 9; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

// FNV-1a over the bit patterns of v's elements.
template <typename T>
uint64_t fnv1a(const std::vector<T>& v) {
  using Bits = std::conditional_t<sizeof(T) == 8, uint64_t, uint32_t>;
  uint64_t hash = 1469598103934665603ull;
  for (const T x : v) {
    Bits bits;
    std::memcpy(&bits, &x, sizeof(bits));
    hash = (hash ^ bits) * 1099511628211ull;
  }
  return hash;
}

int main() {
  const int64_t n = 4500000 / cpu::kRun * cpu::kRun;
  std::vector<float> z(n);
  const NoiseKey key = make_key(123, 1, 0);
  const double normals = best_seconds([&] {
    for (int64_t run = 0; run < n / cpu::kRun; ++run)
      cpu::normal_run(run * cpu::kBatch, key, z.data() + run * cpu::kRun);
  });
  std::vector<uint32_t> words(2 * n / cpu::kChachaWordRun * cpu::kChachaWordRun);
  const ChachaKey ckey{{1, 2, 3, 4, 5, 6, 7, 8}, 1, 0};
  const double chacha = best_seconds([&] {
    for (int64_t run = 0; run < static_cast<int64_t>(words.size()) / cpu::kChachaWordRun; ++run)
      cpu::chacha_run(run * cpu::kBatch, ckey, words.data() + run * cpu::kChachaWordRun);
  });
  std::vector<double> zd(n / cpu::kChachaNormalRun * cpu::kChachaNormalRun);
  const double chacha_normals = best_seconds([&] {
    for (int64_t run = 0; run < static_cast<int64_t>(zd.size()) / cpu::kChachaNormalRun; ++run)
      cpu::chacha_normal_run(run * cpu::kBatch, ckey, zd.data() + run * cpu::kChachaNormalRun);
  });
  std::printf(
      "philox normal %.3f ns  chacha20 word pair %.3f ns  chacha20 normal %.3f ns  hashes %016llx %016llx\n",
      normals / n * 1e9, chacha / words.size() * 2e9, chacha_normals / zd.size() * 1e9,
      static_cast<unsigned long long>(fnv1a(z)), static_cast<unsigned long long>(fnv1a(zd)));
}

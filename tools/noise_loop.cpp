// The CPU generators in a loop on one core, without the op around them (no allocation, threads or
// dispatch): ns per normal of Philox + Box-Muller (normal_run, and cpu::normals in the 512-element
// calls of the fused passes, which then write the same normals), ns per pair of ChaCha20 words
// (chacha_run) and per float64 ChaCha20 normal (chacha_normal_run: the pair and its Box-Muller),
// best of 9 passes over 4.5 M elements, and FNV-1a hashes of every normal's bits (Philox, ChaCha20).
// Also the largest errors of the float64 transform's neg2_log_unit and cossin_2pi against long double
// (64-bit mantissa) on 2^24 random uniforms and on the edges; with --errors only those. Built and
// run by tools/noise_loop.py, and by tests/test_cpu_capability.py for the errors.
// The Philox hash is the same on every path (all hash the same 4,499,968 normals); the ChaCha20 one
// agrees between avx512 and avx2, and with the portable path's only where that path's build has FMA
// (not x86-64's baseline: there the transform rounds products and sums apart; docs/RNG.md).
#include <algorithm>
#include <chrono>
#include <cmath>
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

// ln u in ulps; cos(2 pi u), sin(2 pi u) absolute (their ulp error is unbounded near their zeros).
void print_transform_errors() {
  double log_ulps = 0, cos_abs = 0, sin_abs = 0;
  int64_t points = 0;
  const auto check = [&](const double (&u)[cpu::kDoubleLanes]) {
    cpu::VD x, c, s;
    std::memcpy(&x, u, sizeof(x));
    const cpu::VD l = -0.5 * cpu::neg2_log_unit(x);  // exact scaling: ln u
    cpu::cossin_2pi(x, c, s);
    for (int k = 0; k < cpu::kDoubleLanes; ++k, ++points) {
      const long double lu = logl(u[k]), theta = 6.283185307179586476925286766559L * u[k];
      if (u[k] < 1.0)
        log_ulps = std::max(log_ulps, double(fabsl(l[k] - lu) / std::ldexp(1.0L, ilogbl(lu) - 52)));
      cos_abs = std::max(cos_abs, double(fabsl(c[k] - cosl(theta))));
      sin_abs = std::max(sin_abs, double(fabsl(s[k] - sinl(theta))));
    }
  };
  double u[cpu::kDoubleLanes];
  uint64_t state = 88172645463325252ull;  // xorshift64
  for (int64_t i = 0; i < (int64_t{1} << 24) / cpu::kDoubleLanes; ++i) {
    for (double& x : u) {
      state ^= state << 13, state ^= state >> 7, state ^= state << 17;
      x = uniform53(static_cast<uint32_t>(state), static_cast<uint32_t>(state >> 32));
    }
    check(u);
  }
  // Each power of two down to 2^-54 and the quadrant points q/8, with their neighbours.
  const auto edge = [&](double x0, int steps) {
    for (int d = -steps; d <= steps; ++d) {
      for (int k = 0; k < cpu::kDoubleLanes; ++k)
        u[k] =
            std::clamp(x0 + (d * cpu::kDoubleLanes + k) * std::ldexp(x0 > 0 ? x0 : 1.0, -53), 0x1p-54, 1.0);
      check(u);
    }
  };
  for (int e = 0; e <= 54; ++e) edge(std::ldexp(1.0, -e), 64);
  for (int q = 0; q <= 8; ++q) edge(q / 8.0, 4096);
  // The reference's -2.0 * log(1.0) is -0, and the normal's sign of zero follows it.
  cpu::VD one, sign;
  for (int k = 0; k < cpu::kDoubleLanes; ++k) one[k] = 1.0;
  sign = cpu::neg2_log_unit(one);
  std::printf(
      "         float64 transform on %lld uniforms: ln u within %.3f ulp, cos %.3g, sin %.3g, -2 ln 1 = "
      "%s0\n",
      static_cast<long long>(points), log_ulps, cos_abs, sin_abs, std::signbit(sign[0]) ? "-" : "+");
}

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--errors") == 0) {  // the errors alone (tests/test_cpu_capability.py)
    print_transform_errors();
    return 0;
  }
  // A whole number of runs on every path (kRun and kChachaNormalRun differ between them), so that
  // every path hashes the same normals.
  constexpr int64_t kCommonRun = 128;
  static_assert(kCommonRun % cpu::kRun == 0 && kCommonRun % cpu::kChachaNormalRun == 0);
  const int64_t n = 4500000 / kCommonRun * kCommonRun;
  std::vector<float> z(n);
  const NoiseKey noise_key = make_key(123, 1, 0);
  const cpu::PhiloxKeySchedule key(noise_key);
  const double normals = best_seconds([&] {
    for (int64_t run = 0; run < n / cpu::kRun; ++run)
      cpu::normal_run(run * cpu::kBatch, key, z.data() + run * cpu::kRun);
  });
  // The same normals through cpu::normals in 512-element calls, as the fused passes make them.
  const double chunked = best_seconds([&] {
    for (int64_t e = 0; e < n; e += 512)
      cpu::normals(e, std::min<int64_t>(512, n - e), noise_key, z.data() + e);
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
      "philox normal %.3f ns (in 512-element calls %.3f ns)  chacha20 word pair %.3f ns  "
      "chacha20 normal %.3f ns  hashes %016llx %016llx\n",
      normals / n * 1e9, chunked / n * 1e9, chacha / words.size() * 2e9, chacha_normals / zd.size() * 1e9,
      static_cast<unsigned long long>(fnv1a(z)), static_cast<unsigned long long>(fnv1a(zd)));
  print_transform_errors();
}

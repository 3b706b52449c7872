// The portable path's vfma (csrc/cpu/noise_cpu.h) against the C library's fmaf, bit for bit.
// Built with the portable module's flags by tests/test_cpu_capability.py and run there, once as
// it is and once with FMA hidden from glibc. Cases, in groups of four lanes:
//   - sums that rounding to double puts exactly on a midpoint between two floats, from either side,
//     in every binade of c (subnormals and FLT_MAX, where c + h overflows, included), either sign:
//     a b = ±h (1 - 2^-46) with h half an ulp of c, so that c + a b lies 2^-46 h from the midpoint
//     c ± h, under half a double's ulp;
//   - random bit patterns for a, b and c (zeros, subnormals, infinities, NaN included);
//   - products that overflow or underflow float, and sums that cancel to zero.
// Prints: cases, mismatches, and how many cases a double-rounded a b + c gets wrong (so the first
// kind of case reaches the code that rounds them right).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "../csrc/cpu/noise_cpu.h"

namespace {

uint32_t bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
}

float from_bits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof(x));
  return x;
}

struct Case {
  float a, b, c;
};

}  // namespace

int main() {
  std::mt19937_64 rng(20261129);
  std::vector<Case> cases;
  const float up = 1.0f + 0x1p-23f, down = 1.0f - 0x1p-23f;  // up * down = 1 - 2^-46
  for (int e = -149; e <= 127; ++e) {
    for (int i = 0; i < 48; ++i) {
      const uint32_t m = static_cast<uint32_t>(rng());
      float c = e >= -126 ? std::ldexp(1.0f + static_cast<float>(m % (1u << 23)) * 0x1p-23f, e)
                          : from_bits((1u << (e + 149)) | (m & ((1u << (e + 149)) - 1)));  // subnormal
      if (e == 127 && i == 0) c = FLT_MAX;  // c + h is where float overflows
      if (rng() & 1) c = -c;
      const int eh = std::max(std::ilogb(c), -126) - 24;         // h = 2^eh, half an ulp of c
      const int k = eh / 2 + static_cast<int>(rng() % 41) - 20;  // a and b both normal
      const float a = std::ldexp(up, k), b = std::ldexp(down, eh - k);
      for (const float s : {1.0f, -1.0f}) {
        cases.push_back({a, s * b, c});                                 // c + s h, from c's side
        cases.push_back({a, -s * b, std::nextafter(c, s * INFINITY)});  // the same, from the other
      }
    }
  }
  for (int i = 0; i < 200000; ++i) {
    cases.push_back({from_bits(static_cast<uint32_t>(rng())), from_bits(static_cast<uint32_t>(rng())),
                     from_bits(static_cast<uint32_t>(rng()))});
  }
  for (int i = 0; i < 20000; ++i) {
    const float a =
        std::ldexp(1.0f + static_cast<float>(rng() % 4096) / 4096, static_cast<int>(rng() % 40) + 60);
    const float b =
        std::ldexp(1.0f + static_cast<float>(rng() % 4096) / 4096, static_cast<int>(rng() % 40) + 40);
    cases.push_back({a, b, -a * b});                              // cancels to a b's rounding error
    cases.push_back({a, b, 1.0f});                                // overflows
    cases.push_back({1.0f / a, 1.0f / b, 0x1p-126f});             // underflows past the normal range
    cases.push_back({1.0f / a, -1.0f / b, 0x1p-149f * (i % 7)});  // subnormal results and zeros
  }
  while (cases.size() % 4 != 0) cases.push_back({1.0f, 1.0f, 1.0f});

  long mismatches = 0, double_rounded_wrong = 0;
  for (size_t i = 0; i < cases.size(); i += 4) {
    dpkernels::cpu::VF a, b, c;
    for (int j = 0; j < 4; ++j) a[j] = cases[i + j].a, b[j] = cases[i + j].b, c[j] = cases[i + j].c;
    const dpkernels::cpu::VF got = dpkernels::cpu::vfma(a, b, c);
    for (int j = 0; j < 4; ++j) {
      const float want = std::fma(a[j], b[j], c[j]);
      const float naive = static_cast<float>(static_cast<double>(a[j]) * b[j] + c[j]);
      double_rounded_wrong += bits(naive) != bits(want) && !std::isnan(want);
      if (bits(got[j]) != bits(want) && !(std::isnan(got[j]) && std::isnan(want))) {
        if (++mismatches <= 5)
          std::printf("# fma(%a, %a, %a) = %a, vfma gave %a\n", a[j], b[j], c[j], want, got[j]);
      }
    }
  }
  std::printf("%zu %ld %ld\n", cases.size(), mismatches, double_rounded_wrong);
}

// Philox4x32-10 and the Box-Muller transform of dpkernels' noise spec (docs/RNG.md), shared by
// the CPU and CUDA kernels. The Python reference is dpkernels/reference/noise.py and the Triton
// version triton_kernels/noise.py; the uint32 words are bit-identical on all four.
#pragma once

#include <cmath>
#include <cstdint>

#include "dpkernels/macros.h"

namespace dpkernels {

struct Philox4 {
  uint32_t x[4];
};

DPK_HOST_DEVICE inline void mulhilo32(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

constexpr uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;
constexpr int kPhiloxRounds = 10;

// One Philox round on counter (c0..c3) with round key (k0, k1). T is uint32_t, or a SIMD lane
// type that provides mulhilo32(uint32_t, T, T&, T&) and operator^ (the CPU kernels' U32Vec).
template <typename T>
DPK_HOST_DEVICE inline void philox_round(T& c0, T& c1, T& c2, T& c3, uint32_t k0, uint32_t k1) {
  T hi0, lo0, hi1, lo1;
  mulhilo32(kPhiloxM0, c0, hi0, lo0);
  mulhilo32(kPhiloxM1, c2, hi1, lo1);
  c0 = hi1 ^ c1 ^ k0;
  c1 = lo1;
  c2 = hi0 ^ c3 ^ k1;
  c3 = lo0;
}

// Salmon et al. (SC'11), Random123's philox4x32 with 10 rounds. counter = (block lo, block hi,
// step, stream), key = 64-bit seed.
DPK_HOST_DEVICE inline Philox4 philox4x32_10(uint64_t block, uint32_t step, uint32_t stream, uint64_t seed) {
  uint32_t c0 = static_cast<uint32_t>(block), c1 = static_cast<uint32_t>(block >> 32), c2 = step, c3 = stream;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int r = 0; r < kPhiloxRounds; ++r, k0 += kPhiloxW0, k1 += kPhiloxW1)
    philox_round(c0, c1, c2, c3, k0, k1);
  return {{c0, c1, c2, c3}};
}

// u = float(x) * 2^-32 + 2^-33, in (0, 1]: never 0, so log(u) is finite.
DPK_HOST_DEVICE inline float uniform_open0(uint32_t x) {
  return static_cast<float>(x) * 2.3283064365386963e-10f + 1.1641532182693481e-10f;
}

// Box-Muller on one word pair: z_first = r cos(2 pi u_b), z_second = r sin(2 pi u_b),
// r = sqrt(-2 ln u_a). fp32 throughout.
DPK_HOST_DEVICE inline void box_muller(uint32_t a, uint32_t b, float& z0, float& z1) {
  const float r = sqrtf(-2.0f * logf(uniform_open0(a)));
  const float theta = 6.2831853071795865f * uniform_open0(b);
  z0 = r * cosf(theta);
  z1 = r * sinf(theta);
}

}  // namespace dpkernels

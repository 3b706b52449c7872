// Philox4x32-10 and the Box-Muller transform of dpkernels' noise spec (docs/RNG.md), shared by
// the CPU and CUDA kernels. The Python reference is dpkernels/reference/noise.py and the Triton
// version triton_kernels/noise.py; the uint32 words are bit-identical on all four.
#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>

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
// type that provides mulhilo32(uint32_t, T, T&, T&) and operator^ with T and with K, the key in
// every lane (the CPU kernels' PhiloxVec and Slot).
template <typename T, typename K>
DPK_HOST_DEVICE inline void philox_round(T& c0, T& c1, T& c2, T& c3, const K& k0, const K& k1) {
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

// The float type F, its int32 twin I, the conversions and the lane-wise select the templates below
// need, for scalars; the CPU kernels define the same for their SIMD lane vectors
// (csrc/cpu/noise_cpu.h). A comparison of F or I gives a mask that select() takes.
struct ScalarLanes {
  using F = float;
  using I = int32_t;
  DPK_HOST_DEVICE static I bits(F x) {
#if defined(__CUDA_ARCH__)
    return __float_as_int(x);
#else
    I i;
    __builtin_memcpy(&i, &x, sizeof(i));
    return i;
#endif
  }
  DPK_HOST_DEVICE static F from_bits(I i) {
#if defined(__CUDA_ARCH__)
    return __int_as_float(i);
#else
    F x;
    __builtin_memcpy(&x, &i, sizeof(x));
    return x;
#endif
  }
  DPK_HOST_DEVICE static I trunc(F x) { return static_cast<I>(x); }
  DPK_HOST_DEVICE static F to_float(I i) { return static_cast<F>(i); }
  DPK_HOST_DEVICE static F splat(float c) { return c; }
  DPK_HOST_DEVICE static F select(bool mask, F a, F b) { return mask ? a : b; }
  // a b + c for the polynomials (fused where the hardware has it: one rounding, fewer instructions).
  DPK_HOST_DEVICE static F fma(F a, F b, F c) {
#if defined(__CUDA_ARCH__) || defined(__FMA__)
    return fmaf(a, b, c);
#else
    return a * b + c;
#endif
  }
  // a b + c where a b is exact in float (a power of two or a short constant times a float): fused
  // or not it is rounded once, the same bits, so a target without FMA may take the unfused form
  // (the CPU's portable path, where a fused multiply-add is emulated).
  DPK_HOST_DEVICE static F fma_exact_product(F a, F b, F c) { return fma(a, b, c); }
};

// ln u for a normal u in (0, 1] (every uniform_open0 value): Cephes' logf. u = m 2^k with m in
// [sqrt(1/2), sqrt(2)) (exponent and mantissa from the bits, exact), f = m - 1, ln u = k ln2 + f -
// f^2/2 + f^3 P(f), ln2 split in two parts so that k ln2 adds no rounding. Lanes: ScalarLanes or a
// SIMD equivalent.
template <typename Lanes, typename F = typename Lanes::F>
DPK_HOST_DEVICE inline F log_open01(F u) {
  using I = typename Lanes::I;
  // u's bits less those of sqrt(1/2) rounded up (0x3F3504F4): the exponent field is k, and the
  // mantissa field plus 0x3F3504F4 gives m = 1.mant, or 1.mant / 2 where 1.mant > sqrt(2) rounded
  // (mant >= 0x3504F4). d >> 23 is an arithmetic shift, so k < 0 comes out right. One shift, no
  // compare and select.
  const I d = Lanes::bits(u) - 0x3F3504F4;
  const F m = Lanes::from_bits((d & 0x007FFFFF) + 0x3F3504F4);  // [sqrt(1/2), sqrt(2))
  const F k = Lanes::to_float(d >> 23);
  const F f = m - 1.0f, f2 = f * f;
  F p = Lanes::splat(7.0376836292e-2f);
  for (const float c : {-1.1514610310e-1f, 1.1676998740e-1f, -1.2420140846e-1f, 1.4249322787e-1f,
                        -1.6668057665e-1f, 2.0000714765e-1f, -2.4999993993e-1f, 3.3333331174e-1f}) {
    p = Lanes::fma(p, f, Lanes::splat(c));
  }
  F y = f * f2 * p;
  y = Lanes::fma(k, Lanes::splat(-2.12194440e-4f), y);
  y = Lanes::fma_exact_product(Lanes::splat(-0.5f), f2, y);
  return Lanes::fma_exact_product(k, Lanes::splat(0.693359375f), f + y);  // |k| <= 2^6, 9-bit constant
}

// cos and sin of theta = 2 pi u in (0, 2 pi], the evaluation every backend shares (the Triton twin is
// triton_kernels/philox.py): theta = j pi/2 + x, j = round(2 theta/pi) in 0..4 with a three-part
// Cody-Waite pi/2 (the first two parts make j C exact), Cephes' sinf/cosf polynomials on
// |x| <= pi/4, then the quadrant's rotation. <= 7.8e-8 from cos/sin of the fp32 theta for every u;
// no Payne-Hanek slow path (so no local memory on the GPU), unlike sinf/cosf.
template <typename Lanes, typename F = typename Lanes::F>
DPK_HOST_DEVICE inline void sincos_2pi(F theta, F& cos_out, F& sin_out) {
  using I = typename Lanes::I;
  const I j = Lanes::trunc(theta * 0.6366197723675814f + 0.5f);  // theta >= 0: truncation rounds
  const F jf = Lanes::to_float(j);
  F x = theta - jf * 1.5703125f;
  x = x - jf * 4.837512969970703125e-4f;
  x = x - jf * 7.54978995489188216e-8f;
  const F x2 = x * x;
  const F ps = Lanes::fma(Lanes::fma(Lanes::splat(-1.9515295891e-4f), x2, Lanes::splat(8.3321608736e-3f)), x2,
                          Lanes::splat(-1.6666654611e-1f));
  const F sn = Lanes::fma(x * x2, ps, x);
  const F pc =
      Lanes::fma(Lanes::fma(Lanes::splat(2.443315711809948e-5f), x2, Lanes::splat(-1.388731625493765e-3f)),
                 x2, Lanes::splat(4.166664568298827e-2f));
  const F cs = Lanes::fma(pc * x2, x2, Lanes::fma_exact_product(Lanes::splat(-0.5f), x2, Lanes::splat(1.0f)));
  // Quadrant j mod 4: (cos, sin) = (c, s), (-s, c), (-c, -s), (s, -c); the negations as sign-bit
  // flips, the same bits as -x without a select: bit 1 of j + 1 and of j, from q = j << 30 (bits 1
  // and 0 of j in bits 31 and 30).
  const I q = j << 30;
  const auto swap = (j & 1) != 0;
  const F c = Lanes::select(swap, sn, cs), s = Lanes::select(swap, cs, sn);
  cos_out = Lanes::from_bits(Lanes::bits(c) ^ ((q + (1 << 30)) & INT32_MIN));
  sin_out = Lanes::from_bits(Lanes::bits(s) ^ (q & INT32_MIN));
}

// Box-Muller on one word pair: z_first = r cos(2 pi u_b), z_second = r sin(2 pi u_b),
// r = sqrt(-2 ln u_a). fp32 throughout; logf on the GPU (precise, no slow path), sin/cos as above.
DPK_HOST_DEVICE inline void box_muller(uint32_t a, uint32_t b, float& z0, float& z1) {
#if defined(__CUDA_ARCH__)
  const float r = sqrtf(-2.0f * logf(uniform_open0(a)));
#else
  const float r = sqrtf(-2.0f * log_open01<ScalarLanes>(uniform_open0(a)));
#endif
  float c, s;
  sincos_2pi<ScalarLanes>(6.2831853071795865f * uniform_open0(b), c, s);
  z0 = r * c;
  z1 = r * s;
}

}  // namespace dpkernels

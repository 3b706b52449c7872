// CPU building blocks of dpkernels' noise, shared by the noise ops (noise.cpp) and the fused
// private sum (clip.cpp): runs of kBatch Philox blocks from philox.h, computed lane-parallel, with
// the Box-Muller transform in SIMD.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>
#if defined(__AVX512F__)
#include <sleef.h>
#endif

#include <algorithm>
#include <cstdint>

#include "dpkernels/chacha20.h"
#include "dpkernels/macros.h"
#include "dpkernels/noise_key.h"
#include "dpkernels/philox.h"

namespace dpkernels {
namespace cpu {

// One U32Vec holds one Philox word of kBatch consecutive blocks (lane-major), so counters are
// built, rounds run and words converted to uniforms without transposes; only the final values
// are put in element order. Three builds of the same operations:
//   AVX-512  16 lanes, Box-Muller with Cephes' logf and the Triton kernels' sin/cos, inlined;
//   AVX2      8 lanes, Box-Muller with at::vec (Sleef log u10, sin/cos u35);
//   portable  8 lanes in plain arrays (the compiler may still vectorise), at::vec Box-Muller.
// All three give the same words; their normals agree with the reference to a few ulps (tests).
#if defined(__AVX512F__)
constexpr int kBatch = 16;

struct U32Vec {
  __m512i v;
  static U32Vec broadcast(uint32_t x) { return {_mm512_set1_epi32(static_cast<int>(x))}; }
  // (x, x + 1, ..., x + 15); the caller guarantees no lane wraps.
  static U32Vec iota(uint32_t x) {
    return {_mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(x)),
                             _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15))};
  }
  void store(uint32_t* p) const { _mm512_storeu_si512(p, v); }
  friend U32Vec operator^(U32Vec a, U32Vec b) { return {_mm512_xor_si512(a.v, b.v)}; }
  friend U32Vec operator^(U32Vec a, uint32_t k) {
    return {_mm512_xor_si512(a.v, _mm512_set1_epi32(static_cast<int>(k)))};
  }
  friend U32Vec operator+(U32Vec a, U32Vec b) { return {_mm512_add_epi32(a.v, b.v)}; }
};

inline U32Vec rotl32(U32Vec a, int n) { return {_mm512_rolv_epi32(a.v, _mm512_set1_epi32(n))}; }

// 32x32 -> 64-bit products of the even and odd lanes (vpmuludq), split into high and low words.
inline void mulhilo32(uint32_t m, U32Vec a, U32Vec& hi, U32Vec& lo) {
  const __m512i mv = _mm512_set1_epi32(static_cast<int>(m));
  const __m512i even = _mm512_mul_epu32(a.v, mv);
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a.v, 32), mv);
  lo = {_mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32))};
  hi = {_mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd)};
}

// uniform_open0() of every lane (vcvtudq2ps rounds to nearest-even, as the scalar cast).
inline __m512 uniform_lanes(const U32Vec& x) {
  return _mm512_fmadd_ps(_mm512_cvtepu32_ps(x.v), _mm512_set1_ps(2.3283064365386963e-10f),
                         _mm512_set1_ps(1.1641532182693481e-10f));
}

// cos θ and sin θ for θ = 2π·u ∈ (0, 2π], the Triton kernels' evaluation (triton_kernels/philox.py):
// θ = j·π/2 + x, j = round(2θ/π) ∈ 0..4 with a three-part Cody–Waite π/2 (the first two parts
// make j·C exact), Cephes' sinf/cosf polynomials on |x| ≤ π/4, then the quadrant's rotation.
// No FMA, as the interpreter; ≤ 7.8e-8 from cos/sin of the fp32 θ over every possible u.
inline void sincos_2pi(__m512 theta, __m512& cos_out, __m512& sin_out) {
  const __m512i j = _mm512_cvttps_epi32(
      _mm512_add_ps(_mm512_mul_ps(theta, _mm512_set1_ps(0.6366197723675814f)), _mm512_set1_ps(0.5f)));
  const __m512 jf = _mm512_cvtepi32_ps(j);
  __m512 x = _mm512_sub_ps(theta, _mm512_mul_ps(jf, _mm512_set1_ps(1.5703125f)));
  x = _mm512_sub_ps(x, _mm512_mul_ps(jf, _mm512_set1_ps(4.837512969970703125e-4f)));
  x = _mm512_sub_ps(x, _mm512_mul_ps(jf, _mm512_set1_ps(7.54978995489188216e-8f)));
  const __m512 x2 = _mm512_mul_ps(x, x);
  __m512 ps =
      _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(-1.9515295891e-4f), x2), _mm512_set1_ps(8.3321608736e-3f));
  ps = _mm512_add_ps(_mm512_mul_ps(ps, x2), _mm512_set1_ps(-1.6666654611e-1f));
  const __m512 sn = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(x, x2), ps), x);
  __m512 pc = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(2.443315711809948e-5f), x2),
                            _mm512_set1_ps(-1.388731625493765e-3f));
  pc = _mm512_add_ps(_mm512_mul_ps(pc, x2), _mm512_set1_ps(4.166664568298827e-2f));
  __m512 cs = _mm512_mul_ps(_mm512_mul_ps(pc, x2), x2);
  cs = _mm512_add_ps(_mm512_sub_ps(cs, _mm512_mul_ps(_mm512_set1_ps(0.5f), x2)), _mm512_set1_ps(1.0f));
  // Quadrant q = j mod 4: (cos θ, sin θ) = (c, s), (−s, c), (−c, −s), (s, −c).
  const __m512i q = _mm512_and_si512(j, _mm512_set1_epi32(3));
  const __mmask16 swap = _mm512_test_epi32_mask(q, _mm512_set1_epi32(1));
  const __mmask16 neg_cos =
      _mm512_test_epi32_mask(_mm512_add_epi32(q, _mm512_set1_epi32(1)), _mm512_set1_epi32(2));
  const __mmask16 neg_sin = _mm512_test_epi32_mask(q, _mm512_set1_epi32(2));
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m512 c_val = _mm512_mask_blend_ps(swap, cs, sn), s_val = _mm512_mask_blend_ps(swap, sn, cs);
  cos_out = _mm512_castsi512_ps(
      _mm512_mask_xor_epi32(_mm512_castps_si512(c_val), neg_cos, _mm512_castps_si512(c_val), sign));
  sin_out = _mm512_castsi512_ps(
      _mm512_mask_xor_epi32(_mm512_castps_si512(s_val), neg_sin, _mm512_castps_si512(s_val), sign));
}

// ln u for u ∈ (0, 1] (normal floats): Cephes' logf. u = m·2^k with m ∈ [√½, √2) (getexp/getmant,
// exact), f = m − 1, ln u = k·ln2 + f − f²/2 + f³·P(f) with ln2 split in two parts so k·ln2 adds
// no rounding; ≤ 1 ulp-class error, like Sleef's u10 at a third of its cost.
inline __m512 log_open01(__m512 u) {
  __m512 k = _mm512_getexp_ps(u);
  __m512 m = _mm512_getmant_ps(u, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
  const __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356f), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));
  k = _mm512_mask_add_ps(k, big, k, _mm512_set1_ps(1.0f));
  const __m512 f = _mm512_sub_ps(m, _mm512_set1_ps(1.0f));
  const __m512 f2 = _mm512_mul_ps(f, f);
  __m512 p = _mm512_set1_ps(7.0376836292e-2f);
  for (const float c : {-1.1514610310e-1f, 1.1676998740e-1f, -1.2420140846e-1f, 1.4249322787e-1f,
                        -1.6668057665e-1f, 2.0000714765e-1f, -2.4999993993e-1f, 3.3333331174e-1f}) {
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  }
  __m512 y = _mm512_mul_ps(_mm512_mul_ps(f, f2), p);
  y = _mm512_fmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), y);
  y = _mm512_fnmadd_ps(_mm512_set1_ps(0.5f), f2, y);
  return _mm512_fmadd_ps(k, _mm512_set1_ps(0.693359375f), _mm512_add_ps(f, y));
}

// out[4b + j] = z[j][b]: a 4x16 transpose in registers (within 128-bit lanes, then across them).
inline void store_element_order(const __m512 z[4], float* out) {
  const __m512 t0 = _mm512_unpacklo_ps(z[0], z[1]), t1 = _mm512_unpackhi_ps(z[0], z[1]);
  const __m512 t2 = _mm512_unpacklo_ps(z[2], z[3]), t3 = _mm512_unpackhi_ps(z[2], z[3]);
  // u_k, 128-bit lane q: the four normals of block 4q + k.
  const __m512 u0 = _mm512_shuffle_ps(t0, t2, 0x44), u1 = _mm512_shuffle_ps(t0, t2, 0xEE);
  const __m512 u2 = _mm512_shuffle_ps(t1, t3, 0x44), u3 = _mm512_shuffle_ps(t1, t3, 0xEE);
  const __m512 v0 = _mm512_shuffle_f32x4(u0, u1, 0x44), v1 = _mm512_shuffle_f32x4(u2, u3, 0x44);
  const __m512 v2 = _mm512_shuffle_f32x4(u0, u1, 0xEE), v3 = _mm512_shuffle_f32x4(u2, u3, 0xEE);
  _mm512_storeu_ps(out, _mm512_shuffle_f32x4(v0, v1, 0x88));
  _mm512_storeu_ps(out + 16, _mm512_shuffle_f32x4(v0, v1, 0xDD));
  _mm512_storeu_ps(out + 32, _mm512_shuffle_f32x4(v2, v3, 0x88));
  _mm512_storeu_ps(out + 48, _mm512_shuffle_f32x4(v2, v3, 0xDD));
}

// box_muller() of philox.h on the word pairs (0, 1) and (2, 3) of every lane, stored in element
// order: z[4b + j] = normal j of block b.
inline void box_muller_lanes(const U32Vec w[4], float* z) {
  __m512 out[4];
  for (int pair = 0; pair < 2; ++pair) {
    const __m512 r =
        _mm512_sqrt_ps(_mm512_mul_ps(_mm512_set1_ps(-2.0f), log_open01(uniform_lanes(w[2 * pair]))));
    const __m512 theta = _mm512_mul_ps(_mm512_set1_ps(6.2831853071795865f), uniform_lanes(w[2 * pair + 1]));
    __m512 c, s;
    sincos_2pi(theta, c, s);
    out[2 * pair] = _mm512_mul_ps(r, c);
    out[2 * pair + 1] = _mm512_mul_ps(r, s);
  }
  store_element_order(out, z);
}
#else
constexpr int kBatch = 8;
using fVec8 = at::vec::Vectorized<float>;
static_assert(fVec8::size() == kBatch, "the at::vec Box-Muller takes one vector per Philox word");

#if defined(CPU_CAPABILITY_AVX2)
struct U32Vec {
  __m256i v;
  static U32Vec broadcast(uint32_t x) { return {_mm256_set1_epi32(static_cast<int>(x))}; }
  // (x, x + 1, ..., x + 7); the caller guarantees no lane wraps.
  static U32Vec iota(uint32_t x) {
    return {
        _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(x)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))};
  }
  void store(uint32_t* p) const { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  friend U32Vec operator^(U32Vec a, U32Vec b) { return {_mm256_xor_si256(a.v, b.v)}; }
  friend U32Vec operator^(U32Vec a, uint32_t k) {
    return {_mm256_xor_si256(a.v, _mm256_set1_epi32(static_cast<int>(k)))};
  }
  friend U32Vec operator+(U32Vec a, U32Vec b) { return {_mm256_add_epi32(a.v, b.v)}; }
};

inline U32Vec rotl32(U32Vec a, int n) {
  return {_mm256_or_si256(_mm256_slli_epi32(a.v, n), _mm256_srli_epi32(a.v, 32 - n))};
}

inline void mulhilo32(uint32_t m, U32Vec a, U32Vec& hi, U32Vec& lo) {
  const __m256i mv = _mm256_set1_epi32(static_cast<int>(m));
  const __m256i even = _mm256_mul_epu32(a.v, mv);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a.v, 32), mv);
  lo = {_mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0b10101010)};
  hi = {_mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0b10101010)};
}

// AVX2 converts only signed int32, so float(x) is formed as float(x >> 16) * 2^16 +
// float(x & 0xFFFF): both terms are exact and the one addition rounds x to nearest-even,
// bit-identical to the scalar cast.
inline fVec8 uniform_lanes(const U32Vec& x) {
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(x.v, 16));
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(x.v, _mm256_set1_epi32(0xFFFF)));
  const __m256 f = _mm256_add_ps(_mm256_mul_ps(hi, _mm256_set1_ps(65536.0f)), lo);
  return _mm256_fmadd_ps(f, _mm256_set1_ps(2.3283064365386963e-10f), _mm256_set1_ps(1.1641532182693481e-10f));
}

// out[4b + j] = z[j][b]: a 4x8 transpose in registers.
inline void store_element_order(const fVec8 z[4], float* out) {
  const __m256 t0 = _mm256_unpacklo_ps(z[0], z[1]), t1 = _mm256_unpackhi_ps(z[0], z[1]);
  const __m256 t2 = _mm256_unpacklo_ps(z[2], z[3]), t3 = _mm256_unpackhi_ps(z[2], z[3]);
  const __m256 b04 = _mm256_shuffle_ps(t0, t2, 0x44), b15 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 b26 = _mm256_shuffle_ps(t1, t3, 0x44), b37 = _mm256_shuffle_ps(t1, t3, 0xEE);
  _mm256_storeu_ps(out, _mm256_permute2f128_ps(b04, b15, 0x20));
  _mm256_storeu_ps(out + 8, _mm256_permute2f128_ps(b26, b37, 0x20));
  _mm256_storeu_ps(out + 16, _mm256_permute2f128_ps(b04, b15, 0x31));
  _mm256_storeu_ps(out + 24, _mm256_permute2f128_ps(b26, b37, 0x31));
}
#else
struct U32Vec {
  uint32_t v[kBatch];
  static U32Vec broadcast(uint32_t x) {
    U32Vec r;
    std::fill(r.v, r.v + kBatch, x);
    return r;
  }
  static U32Vec iota(uint32_t x) {
    U32Vec r;
    for (int i = 0; i < kBatch; ++i) r.v[i] = x + static_cast<uint32_t>(i);
    return r;
  }
  void store(uint32_t* p) const { std::copy(v, v + kBatch, p); }
  friend U32Vec operator^(U32Vec a, U32Vec b) {
    for (int i = 0; i < kBatch; ++i) a.v[i] ^= b.v[i];
    return a;
  }
  friend U32Vec operator^(U32Vec a, uint32_t k) {
    for (int i = 0; i < kBatch; ++i) a.v[i] ^= k;
    return a;
  }
  friend U32Vec operator+(U32Vec a, U32Vec b) {
    for (int i = 0; i < kBatch; ++i) a.v[i] += b.v[i];
    return a;
  }
};

inline U32Vec rotl32(U32Vec a, int n) {
  for (int i = 0; i < kBatch; ++i) a.v[i] = dpkernels::rotl32(a.v[i], n);
  return a;
}

inline void mulhilo32(uint32_t m, U32Vec a, U32Vec& hi, U32Vec& lo) {
  for (int i = 0; i < kBatch; ++i) dpkernels::mulhilo32(m, a.v[i], hi.v[i], lo.v[i]);
}

inline fVec8 uniform_lanes(const U32Vec& x) {
  alignas(64) float u[kBatch];
  for (int i = 0; i < kBatch; ++i) u[i] = uniform_open0(x.v[i]);
  return fVec8::loadu(u);
}

inline void store_element_order(const fVec8 z[4], float* out) {
  alignas(64) float lanes[4][kBatch];
  for (int j = 0; j < 4; ++j) z[j].store(lanes[j]);
  for (int b = 0; b < kBatch; ++b) {
    for (int j = 0; j < 4; ++j) out[4 * b + j] = lanes[j][b];
  }
}
#endif

// box_muller() of philox.h on the word pairs (0, 1) and (2, 3) of every lane, stored in element
// order: z[4b + j] = normal j of block b.
inline void box_muller_lanes(const U32Vec w[4], float* z) {
  fVec8 out[4];
  for (int pair = 0; pair < 2; ++pair) {
    const fVec8 r = (fVec8(-2.0f) * uniform_lanes(w[2 * pair]).log()).sqrt();
    const fVec8 theta = fVec8(6.2831853071795865f) * uniform_lanes(w[2 * pair + 1]);
    out[2 * pair] = r * theta.cos();
    out[2 * pair + 1] = r * theta.sin();
  }
  store_element_order(out, z);
}
#endif

constexpr int64_t kRun = 4 * kBatch;  // elements per run

// philox4x32_10() of the kBatch blocks starting at `block`, lane-major: w[j] holds word j. block
// is a multiple of kBatch (runs are aligned), so the counter's low word never carries.
inline void philox_lanes(uint64_t block, const NoiseKey& key, U32Vec w[4]) {
  w[0] = U32Vec::iota(static_cast<uint32_t>(block));
  w[1] = U32Vec::broadcast(static_cast<uint32_t>(block >> 32));
  w[2] = U32Vec::broadcast(key.step);
  w[3] = U32Vec::broadcast(key.stream);
  uint32_t k0 = static_cast<uint32_t>(key.seed), k1 = static_cast<uint32_t>(key.seed >> 32);
  for (int r = 0; r < kPhiloxRounds; ++r, k0 += kPhiloxW0, k1 += kPhiloxW1)
    philox_round(w[0], w[1], w[2], w[3], k0, k1);
}

// Words of kBatch consecutive blocks starting at `block`, element order (4 words per block).
inline void philox_run(uint64_t block, const NoiseKey& key, uint32_t* words) {
  U32Vec w[4];
  philox_lanes(block, key, w);
  alignas(64) uint32_t lanes[4][kBatch];
  for (int j = 0; j < 4; ++j) w[j].store(lanes[j]);
  for (int b = 0; b < kBatch; ++b) {
    for (int j = 0; j < 4; ++j) words[4 * b + j] = lanes[j][b];
  }
}

// Standard normals of kBatch consecutive blocks, element order.
inline void normal_run(uint64_t block, const NoiseKey& key, float* z) {
  U32Vec w[4];
  philox_lanes(block, key, w);
  box_muller_lanes(w, z);
}

// out[i] = z(e0 + i) for i < n: standard normals of an arbitrary element range.
inline void normals(int64_t e0, int64_t n, const NoiseKey& key, float* out) {
  alignas(64) float z[kRun];
  for (int64_t e = e0; e < e0 + n;) {
    const int64_t run = e / kRun, lo = e - run * kRun, take = std::min(kRun - lo, e0 + n - e);
    normal_run(static_cast<uint64_t>(run) * kBatch, key, z);
    std::copy(z + lo, z + lo + take, out + (e - e0));
    e += take;
  }
}

// ---------------------------------------------------------------------------------------------
// ChaCha20 (secure mode, docs/RNG.md §6): runs of kBatch blocks, one per U32Vec lane.
// ---------------------------------------------------------------------------------------------

constexpr int64_t kChachaWordRun = 16 * kBatch;   // raw words per run
constexpr int64_t kChachaNormalRun = 8 * kBatch;  // float64 normals per run

// Words of the kBatch blocks starting at `block` (a multiple of kBatch, so the counter's low word
// never carries), element order (16 words per block): chacha20_rounds() on kBatch states at
// once, state word i of block b in lane b of x[i].
inline void chacha_run(uint64_t block, const ChachaKey& key, uint32_t* words) {
  U32Vec x[16] = {U32Vec::broadcast(kChacha0), U32Vec::broadcast(kChacha1), U32Vec::broadcast(kChacha2),
                  U32Vec::broadcast(kChacha3)};
  for (int i = 0; i < 8; ++i) x[4 + i] = U32Vec::broadcast(key.k[i]);
  x[12] = U32Vec::iota(static_cast<uint32_t>(block));
  x[13] = U32Vec::broadcast(static_cast<uint32_t>(block >> 32));
  x[14] = U32Vec::broadcast(key.step);
  x[15] = U32Vec::broadcast(key.stream);
  chacha20_rounds(x);
  alignas(64) uint32_t lanes[16][kBatch];
  for (int i = 0; i < 16; ++i) x[i].store(lanes[i]);
  for (int b = 0; b < kBatch; ++b) {
    for (int i = 0; i < 16; ++i) words[16 * b + i] = lanes[i][b];
  }
}

// float64 standard normals of the kBatch blocks starting at `block`, element order (8 per block): the
// uniform53()/box_muller64() formulas of chacha20.h with at::vec (Sleef) log/sin/cos.
inline void chacha_normal_run(uint64_t block, const ChachaKey& key, double* z) {
  using VecD = at::vec::Vectorized<double>;
  alignas(64) uint32_t w[16 * kBatch];
  chacha_run(block, key, w);
  // u[i][b]: uniform i (0..7) of block b.
  alignas(64) double u[8][kBatch];
  for (int b = 0; b < kBatch; ++b) {
    for (int i = 0; i < 8; ++i) u[i][b] = uniform53(w[16 * b + 2 * i], w[16 * b + 2 * i + 1]);
  }
  alignas(64) double out[8][kBatch];
  for (int k = 0; k < 4; ++k) {
    for (int b = 0; b < kBatch; b += VecD::size()) {
      const VecD r = (VecD(-2.0) * VecD::loadu(&u[2 * k][b]).log()).sqrt();
      const VecD theta = VecD(6.283185307179586) * VecD::loadu(&u[2 * k + 1][b]);
      (r * theta.cos()).store(&out[2 * k][b]);
      (r * theta.sin()).store(&out[2 * k + 1][b]);
    }
  }
  for (int b = 0; b < kBatch; ++b) {
    for (int i = 0; i < 8; ++i) z[8 * b + i] = out[i][b];
  }
}

// out[i] = z(e0 + i) for i < n: float64 ChaCha20 normals of an arbitrary element range.
inline void chacha_normals(int64_t e0, int64_t n, const ChachaKey& key, double* out) {
  alignas(64) double z[kChachaNormalRun];
  for (int64_t e = e0; e < e0 + n;) {
    const int64_t run = e / kChachaNormalRun, lo = e - run * kChachaNormalRun;
    const int64_t take = std::min(kChachaNormalRun - lo, e0 + n - e);
    chacha_normal_run(static_cast<uint64_t>(run) * kBatch, key, z);
    std::copy(z + lo, z + lo + take, out + (e - e0));
    e += take;
  }
}

}  // namespace cpu
}  // namespace dpkernels

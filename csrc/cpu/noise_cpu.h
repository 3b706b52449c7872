// CPU building blocks of dpkernels' noise, shared by the noise ops (noise.cpp) and the fused
// private sum (clip.cpp): runs of kBatch Philox blocks from philox.h, computed lane-parallel, with
// the Box-Muller transform in SIMD.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "dpkernels/chacha20.h"
#include "dpkernels/macros.h"
#include "dpkernels/noise_key.h"
#include "dpkernels/philox.h"

namespace dpkernels {
namespace cpu {

// One U32Vec holds one Philox or ChaCha20 word of kBatch consecutive blocks (lane-major), so
// counters are built, rounds run and words converted to uniforms without transposes; only the
// final values are put in element order. Philox's rounds run on another layout of the same
// lanes, kSlots registers of Slot per word: each word in the low half of a 64-bit lane, the
// high half don't-care. vpmuludq then gives a whole product in place, lo where it is and hi one
// shift away, and the round keys are xored from a table built once per call (PhiloxKeySchedule):
// 8 vector instructions a round per 4 blocks, where packed words took 10 (a shift to reach the
// odd lanes, a shift and a blend each to pack hi and lo, and the keys' broadcasts); one shuffle a
// word packs the result into a U32Vec (docs/BENCHMARKS.md, "Twelfth session"). Three builds of the same
// operations (kBatch blocks per run, in kParts vectors VF of kBatch / kParts lanes each):
//   AVX-512  16 blocks, one 16-lane vector;
//   AVX2     16 blocks, two 8-lane vectors: two independent chains per word, which hide the
//            latency of ChaCha20's rounds (Philox's run on four Slot registers a word);
//   portable 8 blocks in plain arrays, 16-byte vectors (the width every SIMD baseline has).
// Philox's Box-Muller is written once below on GCC vector types, kChains VF registers at a time
// (Chains). All three give the same words and the same Philox normals, bit for bit (every fused
// multiply-add stays fused); the normals agree with the reference to a few ulps (tests).
// ChaCha20's float64 normals: see box_muller64_lanes.
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
  friend U32Vec operator+(U32Vec a, U32Vec b) { return {_mm512_add_epi32(a.v, b.v)}; }
};

inline U32Vec rotl32(U32Vec a, int n) { return {_mm512_rolv_epi32(a.v, _mm512_set1_epi32(n))}; }

// 8 blocks of one Philox word, in the low halves of 64-bit lanes.
struct Slot {
  __m512i v;
  static Slot broadcast(uint32_t x) { return {_mm512_set1_epi32(static_cast<int>(x))}; }
  friend Slot operator^(Slot a, Slot b) { return {_mm512_xor_si512(a.v, b.v)}; }
};

inline void mulhilo32(uint32_t m, Slot a, Slot& hi, Slot& lo) {
  const __m512i p = _mm512_mul_epu32(a.v, _mm512_set1_epi32(static_cast<int>(m)));
  lo = {p};
  hi = {_mm512_srli_epi64(p, 32)};
}

// Slot register i of a run holds blocks 8i .. 8i + 7, and one vpermt2d packs the two.
constexpr int kSlots = 2;
inline Slot block_slot(uint32_t first, int i) {
  const int o = 8 * i;
  return {_mm512_add_epi32(
      _mm512_set1_epi32(static_cast<int>(first)),
      _mm512_setr_epi32(o, 0, o + 1, 0, o + 2, 0, o + 3, 0, o + 4, 0, o + 5, 0, o + 6, 0, o + 7, 0))};
}
inline U32Vec pack_slots(const Slot (&q)[kSlots]) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  return {_mm512_permutex2var_epi32(q[0].v, even, q[1].v)};
}

using VF = float __attribute__((vector_size(64)));  // kBatch fp32 lanes, __m512 without may_alias
constexpr int kParts = 1;                           // VF vectors per U32Vec
constexpr int kChains = 2;                          // Box-Muller chains in flight: both word pairs
inline __m512i part(const U32Vec& x, int) { return x.v; }

inline VF vsqrt(VF x) { return _mm512_sqrt_ps(x); }
inline VF vfma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }

// out[4b + j] = z[j][b]: a 4x16 transpose in registers (within 128-bit lanes, then across them).
inline void store_element_order(const VF z[4], float* out) {
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

#elif defined(__AVX2__)
constexpr int kBatch = 16;

// One 8-lane register of words.
struct Lane8 {
  __m256i v;
  static Lane8 broadcast(uint32_t x) { return {_mm256_set1_epi32(static_cast<int>(x))}; }
  // (x, x + 1, ..., x + 7); the caller guarantees no lane wraps.
  static Lane8 iota(uint32_t x) {
    return {
        _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(x)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))};
  }
  void store(uint32_t* p) const { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  friend Lane8 operator^(Lane8 a, Lane8 b) { return {_mm256_xor_si256(a.v, b.v)}; }
  friend Lane8 operator+(Lane8 a, Lane8 b) { return {_mm256_add_epi32(a.v, b.v)}; }
};

// AVX2 has no rotate; rotations by 16 and 8 (two of ChaCha20's four) move whole bytes, one shuffle.
inline Lane8 rotl32(Lane8 a, int n) {
  if (n == 16) {
    return {_mm256_shuffle_epi8(a.v, _mm256_setr_epi8(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13, 2,
                                                      3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13))};
  }
  if (n == 8) {
    return {_mm256_shuffle_epi8(a.v, _mm256_setr_epi8(3, 0, 1, 2, 7, 4, 5, 6, 11, 8, 9, 10, 15, 12, 13, 14, 3,
                                                      0, 1, 2, 7, 4, 5, 6, 11, 8, 9, 10, 15, 12, 13, 14))};
  }
  return {_mm256_or_si256(_mm256_slli_epi32(a.v, n), _mm256_srli_epi32(a.v, 32 - n))};
}

// Two 8-lane registers per ChaCha20 (or packed Philox) word, so every operation is two independent
// instructions, which hides the latency of the chains that one register's worth of work leaves
// exposed (although ChaCha20's 32 live registers then spill: word pairs 1.07x faster than
// with one half after the other, docs/BENCHMARKS.md).
struct U32Vec {
  Lane8 h[2];
  static U32Vec broadcast(uint32_t x) { return {{Lane8::broadcast(x), Lane8::broadcast(x)}}; }
  static U32Vec iota(uint32_t x) { return {{Lane8::iota(x), Lane8::iota(x + 8)}}; }
  void store(uint32_t* p) const {
    h[0].store(p);
    h[1].store(p + 8);
  }
  friend U32Vec operator^(U32Vec a, U32Vec b) { return {{a.h[0] ^ b.h[0], a.h[1] ^ b.h[1]}}; }
  friend U32Vec operator+(U32Vec a, U32Vec b) { return {{a.h[0] + b.h[0], a.h[1] + b.h[1]}}; }
};

inline U32Vec rotl32(U32Vec a, int n) { return {{rotl32(a.h[0], n), rotl32(a.h[1], n)}}; }

// 4 blocks of one Philox word, in the low halves of 64-bit lanes.
struct Slot {
  __m256i v;
  static Slot broadcast(uint32_t x) { return {_mm256_set1_epi32(static_cast<int>(x))}; }
  friend Slot operator^(Slot a, Slot b) { return {_mm256_xor_si256(a.v, b.v)}; }
};

inline void mulhilo32(uint32_t m, Slot a, Slot& hi, Slot& lo) {
  const __m256i p = _mm256_mul_epu32(a.v, _mm256_set1_epi32(static_cast<int>(m)));
  lo = {p};
  hi = {_mm256_srli_epi64(p, 32)};
}

// Slot registers 2h and 2h + 1 of a run hold blocks 8h + (0, 1, 4, 5) and 8h + (2, 3, 6, 7), so
// that one vshufps of the pair (within 128-bit lanes) puts half h in block order. The 16 registers
// of a run's four words leave no room for the constants, so some state spills; its xors then take
// memory operands (load ports, not vector ALU ports).
constexpr int kSlots = 4;
inline Slot block_slot(uint32_t first, int i) {
  const int o = 8 * (i / 2) + 2 * (i % 2);
  return {_mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first)),
                           _mm256_setr_epi32(o, 0, o + 1, 0, o + 4, 0, o + 5, 0))};
}
inline U32Vec pack_slots(const Slot (&q)[kSlots]) {
  U32Vec w;
  for (int h = 0; h < 2; ++h) {
    w.h[h] = {_mm256_castps_si256(
        _mm256_shuffle_ps(_mm256_castsi256_ps(q[2 * h].v), _mm256_castsi256_ps(q[2 * h + 1].v), 0x88))};
  }
  return w;
}

// The Box-Muller runs on the native 8-lane vectors, one per half of a word (kParts = 2).
using VF = float __attribute__((vector_size(32)));  // __m256 without may_alias
constexpr int kParts = 2;                           // VF vectors per U32Vec
constexpr int kChains = 4;                          // Box-Muller chains in flight: all four word pairs
inline __m256i part(const U32Vec& x, int h) { return x.h[h].v; }

inline VF vsqrt(VF x) { return _mm256_sqrt_ps(x); }
inline VF vfma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }

// out[4b + j] = z[j][b] for 8 lanes: a 4x8 transpose in registers.
inline void store_element_order(const VF z[4], float* out) {
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
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
constexpr int kBatch = 8;

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
  friend U32Vec operator+(U32Vec a, U32Vec b) {
    for (int i = 0; i < kBatch; ++i) a.v[i] += b.v[i];
    return a;
  }
};

inline U32Vec rotl32(U32Vec a, int n) {
  for (int i = 0; i < kBatch; ++i) a.v[i] = dpkernels::rotl32(a.v[i], n);
  return a;
}

// The kBatch blocks of one Philox word, plain 32-bit lanes (the compiler vectorises the scalar
// mulhilo32).
struct Slot {
  uint32_t v[kBatch];
  static Slot broadcast(uint32_t x) {
    Slot r;
    std::fill(r.v, r.v + kBatch, x);
    return r;
  }
  friend Slot operator^(Slot a, const Slot& b) {
    for (int i = 0; i < kBatch; ++i) a.v[i] ^= b.v[i];
    return a;
  }
};

inline void mulhilo32(uint32_t m, const Slot& a, Slot& hi, Slot& lo) {
  for (int i = 0; i < kBatch; ++i) dpkernels::mulhilo32(m, a.v[i], hi.v[i], lo.v[i]);
}

constexpr int kSlots = 1;
inline Slot block_slot(uint32_t first, int) {
  Slot r;
  for (int i = 0; i < kBatch; ++i) r.v[i] = first + static_cast<uint32_t>(i);
  return r;
}
inline U32Vec pack_slots(const Slot (&q)[kSlots]) {
  U32Vec w;
  std::copy(q[0].v, q[0].v + kBatch, w.v);
  return w;
}

// 16-byte vectors, the width every SIMD baseline has (SSE2, NEON): wider generic vectors would
// have their compares and selects split into scalar code.
constexpr int kParts = 2;  // VF vectors per U32Vec
// Box-Muller chains in flight: vfma in double is a long chain of dependent steps, and four hide it
// (tools/noise_loop.py --hide-fma, one core: 15.9-16.1 ns a normal with 1, 12.9 with 2, 11.8-11.9
// with 4).
constexpr int kChains = 4;
using VF = float __attribute__((vector_size(16)));
using VUPart = uint32_t __attribute__((vector_size(16)));
inline VUPart part(const U32Vec& x, int h) {
  VUPart r;
  __builtin_memcpy(&r, x.v + 4 * h, sizeof(r));
  return r;
}

inline VF vsqrt(VF x) {
  for (int i = 0; i < 4; ++i) x[i] = std::sqrt(x[i]);
  return x;
}

// The noise must be bit-identical on every path, so the fused multiply-add stays fused: rounded
// once, as the SIMD paths' FMA instructions round. Where fmaf is one instruction (__FP_FAST_FMAF:
// aarch64, x86 built with FMA) vfma calls it. On baseline x86-64 the C library's fmaf is software,
// and on a CPU without FMA glibc's saves and restores the floating-point environment on every call:
// the generator took 795 ns a normal there (`tools/noise_loop.py --hide-fma`, which hides FMA from
// glibc as such a CPU does; docs/BENCHMARKS.md). So vfma computes in double: a b is exact (48
// bits), d = a b + c rounds once and float(d) once more, and the two roundings give the single
// one unless d falls exactly on a midpoint between two floats while a b + c does not. (Round to
// nearest is monotonic, so otherwise a b + c and d lie between the same two midpoints.) The
// generator's polynomials land on a midpoint in 1.2% of the calls, always as exact sums; an inexact
// sum there moves one double ulp toward a b + c, by TwoSum's exact error, which is rounding to odd
// (Boldo and Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using
// rounding to odd", IEEE Trans. Computers 57(4), 2008). A result outside float's normal range,
// where the midpoints sit elsewhere, is left to fmaf.
inline float fma_by_double(float a, float b, float c) {
  const double p = static_cast<double>(a) * b, d = p + c;
  if (!(std::fabs(d) >= 0x1p-125 && std::fabs(d) < 0x1p127)) return __builtin_fmaf(a, b, c);
  const double t = d - p, e = (p - (d - t)) + (c - t);  // TwoSum: p + c = d + e exactly
  uint64_t bits = __builtin_bit_cast(uint64_t, d);
  if ((bits & 0x1FFFFFFF) == 0x10000000 && e != 0) bits += (e > 0) == (d > 0) ? 1 : -1;
  return static_cast<float>(__builtin_bit_cast(double, bits));
}

inline VF vfma(VF a, VF b, VF c) {
#if defined(__SSE2__) && !defined(__FP_FAST_FMAF)
  // fma_by_double on two pairs of double lanes, its tests on all four lanes at once; a vector that
  // fails them (none of the 4.5 M normals of tools/noise_loop.py) runs it lane by lane.
  const auto widen = [](VF x, __m128d& lo, __m128d& hi) {
    lo = _mm_cvtps_pd(x);
    hi = _mm_cvtps_pd(_mm_movehl_ps(x, x));
  };
  __m128d a0, a1, b0, b1, c0, c1;
  widen(a, a0, a1);
  widen(b, b0, b1);
  widen(c, c0, c1);
  const __m128d p0 = _mm_mul_pd(a0, b0), p1 = _mm_mul_pd(a1, b1);
  const __m128d d0 = _mm_add_pd(p0, c0), d1 = _mm_add_pd(p1, c1);
  // The low (k = 0) or high (k = 1) 32-bit words of two pairs of 64-bit lanes, in one vector.
  const auto words = [](__m128d x0, __m128d x1, int k) {
    const __m128 y0 = _mm_castpd_ps(x0), y1 = _mm_castpd_ps(x1);
    return _mm_castps_si128(k == 0 ? _mm_shuffle_ps(y0, y1, _MM_SHUFFLE(2, 0, 2, 0))
                                   : _mm_shuffle_ps(y0, y1, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  const auto inexact = [](__m128d p, __m128d c, __m128d d) {
    const __m128d t = _mm_sub_pd(d, p);
    return _mm_cmpneq_pd(_mm_add_pd(_mm_sub_pd(p, _mm_sub_pd(d, t)), _mm_sub_pd(c, t)), _mm_setzero_pd());
  };
  const __m128i on_midpoint = _mm_cmpeq_epi32(_mm_and_si128(words(d0, d1, 0), _mm_set1_epi32(0x1FFFFFFF)),
                                              _mm_set1_epi32(0x10000000));
  const __m128i exponent = _mm_and_si128(words(d0, d1, 1), _mm_set1_epi32(0x7FF00000));
  const __m128i outside = _mm_or_si128(_mm_cmplt_epi32(exponent, _mm_set1_epi32((1023 - 125) << 20)),
                                       _mm_cmpgt_epi32(exponent, _mm_set1_epi32((1023 + 126) << 20)));
  const __m128i rounded_twice =
      _mm_and_si128(on_midpoint, words(inexact(p0, c0, d0), inexact(p1, c1, d1), 0));
  if (__builtin_expect(_mm_movemask_epi8(_mm_or_si128(rounded_twice, outside)) == 0, 1))
    return _mm_movelh_ps(_mm_cvtpd_ps(d0), _mm_cvtpd_ps(d1));
  for (int i = 0; i < 4; ++i) c[i] = fma_by_double(a[i], b[i], c[i]);
#else
  for (int i = 0; i < 4; ++i) c[i] = __builtin_fmaf(a[i], b[i], c[i]);
#endif
  return c;
}

inline void store_element_order(const VF z[4], float* out) {
  for (int b = 0; b < 4; ++b) {
    for (int j = 0; j < 4; ++j) out[4 * b + j] = z[j][b];
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// Box-Muller on kBatch lanes: philox.h's log_open01/sincos_2pi on the ISA section's VF (a GCC
// vector type), with its vsqrt, vfma and store_element_order.
// ---------------------------------------------------------------------------------------------

constexpr int kVecLanes = kBatch / kParts;  // lanes of one VF
constexpr int kPairs = 2 * kParts;          // VF-wide word pairs of a run
static_assert(sizeof(U32Vec) == kParts * sizeof(VF), "one lane per Philox block");
using VU = uint32_t __attribute__((vector_size(4 * kVecLanes)));
using VI = int32_t __attribute__((vector_size(4 * kVecLanes)));

// N registers of V evaluated as one value, operation by operation. The transform's polynomials
// are chains of dependent multiply-adds; evaluating kChains of a run's kPairs word pairs at once
// keeps that many chains in flight, where one pair at a time leaves the core waiting on latency
// (tools/noise_loop.py, one core: AVX2 1.21x faster per normal with 4 chains than with one 16-lane
// pair of registers at a time, AVX-512 1.09x with 2 than 1; docs/BENCHMARKS.md).
#define DPK_LANE_OP_LAMBDA __attribute__((always_inline))
template <typename V, int N>
struct Chains {
  V v[N];
};

// Chains{op(0), ..., op(N - 1)}.
template <int N, typename Op, size_t... I>
DPK_ALWAYS_INLINE auto each_impl(const Op& op, std::index_sequence<I...>) {
  return Chains<decltype(op(0)), N>{{op(I)...}};
}
template <int N, typename Op>
DPK_ALWAYS_INLINE auto each(const Op& op) {
  return each_impl<N>(op, std::make_index_sequence<N>());
}

// The operators philox.h's templates use, register by register (a scalar operand applies to all).
#define DPK_CHAINS_OPERATOR(OP)                                                                  \
  template <typename V, int N>                                                                   \
  DPK_ALWAYS_INLINE auto operator OP(const Chains<V, N>& a, const Chains<V, N>& b) {             \
    return each<N>([&](int i) DPK_LANE_OP_LAMBDA { return a.v[i] OP b.v[i]; });                  \
  }                                                                                              \
  template <typename V, int N, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>> \
  DPK_ALWAYS_INLINE auto operator OP(const Chains<V, N>& a, S c) {                               \
    return each<N>([&](int i) DPK_LANE_OP_LAMBDA { return a.v[i] OP c; });                       \
  }                                                                                              \
  template <typename V, int N, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>> \
  DPK_ALWAYS_INLINE auto operator OP(S c, const Chains<V, N>& b) {                               \
    return each<N>([&](int i) DPK_LANE_OP_LAMBDA { return c OP b.v[i]; });                       \
  }
DPK_CHAINS_OPERATOR(+)
DPK_CHAINS_OPERATOR(-)
DPK_CHAINS_OPERATOR(*)
DPK_CHAINS_OPERATOR(&)
DPK_CHAINS_OPERATOR(|)
DPK_CHAINS_OPERATOR(>>)
DPK_CHAINS_OPERATOR(<<)
DPK_CHAINS_OPERATOR(^)
DPK_CHAINS_OPERATOR(!=)
#undef DPK_CHAINS_OPERATOR
template <typename V, int N>
DPK_ALWAYS_INLINE Chains<V, N> operator-(const Chains<V, N>& a) {
  return each<N>([&](int i) DPK_LANE_OP_LAMBDA { return -a.v[i]; });
}

// philox.h's ScalarLanes for N registers of VF, so its log_open01/sincos_2pi templates run on them.
template <int N>
struct VecLanes {
  using F = Chains<VF, N>;
  using I = Chains<VI, N>;
  static DPK_ALWAYS_INLINE I bits(const F& x) {
    return each<N>([&](int i) DPK_LANE_OP_LAMBDA { return __builtin_bit_cast(VI, x.v[i]); });
  }
  static DPK_ALWAYS_INLINE F from_bits(const I& x) {
    return each<N>([&](int i) DPK_LANE_OP_LAMBDA { return __builtin_bit_cast(VF, x.v[i]); });
  }
  static DPK_ALWAYS_INLINE I trunc(const F& x) {
    return each<N>([&](int i) DPK_LANE_OP_LAMBDA { return __builtin_convertvector(x.v[i], VI); });
  }
  static DPK_ALWAYS_INLINE F to_float(const I& x) {
    return each<N>([&](int i) DPK_LANE_OP_LAMBDA { return __builtin_convertvector(x.v[i], VF); });
  }
  static DPK_ALWAYS_INLINE F splat(float c) {
    return each<N>([&](int) DPK_LANE_OP_LAMBDA { return VF{} + c; });
  }
  static DPK_ALWAYS_INLINE F fma(const F& a, const F& b, const F& c) {
    return each<N>([&](int i) DPK_LANE_OP_LAMBDA { return vfma(a.v[i], b.v[i], c.v[i]); });
  }
  static DPK_ALWAYS_INLINE F fma_exact_product(const F& a, const F& b, const F& c) {
#if defined(__FP_FAST_FMAF)
    return fma(a, b, c);
#else
    return a * b + c;  // the add is the one rounding: no need for vfma's float64 emulation
#endif
  }
  static DPK_ALWAYS_INLINE F select(const I& mask, const F& a, const F& b) {
    return each<N>([&](int i) DPK_LANE_OP_LAMBDA { return mask.v[i] ? a.v[i] : b.v[i]; });
  }
};

// uniform_open0() of every lane of part h of x. float(w) is rounded once, as the scalar cast: two
// exact conversions of 16-bit halves and one rounding add (a compiler's unsigned conversion may
// instead convert as signed and add 2^32, rounding twice: 1 ulp off for some w on SSE2). Both
// products are exact, so a fused multiply-add, where the target has one, gives the same bits.
inline VF uniform_lanes(const U32Vec& x, int h) {
  const VU w = __builtin_bit_cast(VU, part(x, h));
  const VF hi = __builtin_convertvector(__builtin_bit_cast(VI, w >> 16), VF);
  const VF lo = __builtin_convertvector(__builtin_bit_cast(VI, w & 0xFFFFu), VF);
#if defined(__FMA__)
  return vfma(vfma(hi, VF{} + 65536.0f, lo), VF{} + 2.3283064365386963e-10f, VF{} + 1.1641532182693481e-10f);
#else
  return (hi * 65536.0f + lo) * 2.3283064365386963e-10f + 1.1641532182693481e-10f;
#endif
}

// box_muller() of philox.h on the word pairs (0, 1) and (2, 3) of every lane, stored in element
// order: z[4b + j] = normal j of block b. Chain 2h + p is word pair p of part h.
inline void box_muller_lanes(const U32Vec w[4], float* z) {
  using L = VecLanes<kChains>;
  VF out[kPairs][2];  // out[2h + p] = the two normals of word pair p of part h
  for (int g = 0; g < kPairs; g += kChains) {
    const auto word = [&](int c, int j)
                          DPK_LANE_OP_LAMBDA { return uniform_lanes(w[2 * ((g + c) % 2) + j], (g + c) / 2); };
    const L::F ln = log_open01<L>(each<kChains>([&](int c) DPK_LANE_OP_LAMBDA { return word(c, 0); }));
    L::F cs, sn;
    sincos_2pi<L>(6.2831853071795865f * each<kChains>([&](int c) DPK_LANE_OP_LAMBDA { return word(c, 1); }),
                  cs, sn);
    for (int c = 0; c < kChains; ++c) {
      const VF r = vsqrt(-2.0f * ln.v[c]);
      out[g + c][0] = r * cs.v[c];
      out[g + c][1] = r * sn.v[c];
    }
  }
  for (int h = 0; h < kParts; ++h) {
    const VF zh[4] = {out[2 * h][0], out[2 * h][1], out[2 * h + 1][0], out[2 * h + 1][1]};
    store_element_order(zh, z + 4 * kVecLanes * h);
  }
}
#undef DPK_LANE_OP_LAMBDA

constexpr int64_t kRun = 4 * kBatch;  // elements per run

// One Philox word of a run's kBatch blocks, in kSlots Slot registers (the operations philox.h's
// philox_round needs).
struct PhiloxVec {
  Slot q[kSlots];
  static PhiloxVec broadcast(uint32_t x) {
    PhiloxVec r;
    std::fill(r.q, r.q + kSlots, Slot::broadcast(x));
    return r;
  }
  friend PhiloxVec operator^(PhiloxVec a, const PhiloxVec& b) {
    for (int i = 0; i < kSlots; ++i) a.q[i] = a.q[i] ^ b.q[i];
    return a;
  }
  friend PhiloxVec operator^(PhiloxVec a, const Slot& key) {
    for (int i = 0; i < kSlots; ++i) a.q[i] = a.q[i] ^ key;
    return a;
  }
};

inline void mulhilo32(uint32_t m, const PhiloxVec& a, PhiloxVec& hi, PhiloxVec& lo) {
  for (int i = 0; i < kSlots; ++i) mulhilo32(m, a.q[i], hi.q[i], lo.q[i]);
}

// A NoiseKey with its ten round keys in every lane, built once per call rather than once per round
// of every run.
struct PhiloxKeySchedule {
  Slot round[kPhiloxRounds][2];
  uint32_t step, stream;
  explicit PhiloxKeySchedule(const NoiseKey& key) : step(key.step), stream(key.stream) {
    // One key word at a time: with both stored in one loop, GCC 12.2 -O3 gave round[r][1] the
    // value of round[r][0] on the portable path (plain arrays).
    for (int j = 0; j < 2; ++j) {
      uint32_t k = static_cast<uint32_t>(key.seed >> (32 * j));
      for (int r = 0; r < kPhiloxRounds; ++r, k += j == 0 ? kPhiloxW0 : kPhiloxW1)
        round[r][j] = Slot::broadcast(k);
    }
  }
};

// philox4x32_10() of the kBatch blocks starting at `block`, lane-major: w[j] holds word j. block
// is a multiple of kBatch (runs are aligned), so the counter's low word never carries.
inline void philox_lanes(uint64_t block, const PhiloxKeySchedule& key, U32Vec w[4]) {
  PhiloxVec c[4] = {{},
                    PhiloxVec::broadcast(static_cast<uint32_t>(block >> 32)),
                    PhiloxVec::broadcast(key.step),
                    PhiloxVec::broadcast(key.stream)};
  for (int i = 0; i < kSlots; ++i) c[0].q[i] = block_slot(static_cast<uint32_t>(block), i);
#pragma GCC unroll 10
  for (int r = 0; r < kPhiloxRounds; ++r)
    philox_round(c[0], c[1], c[2], c[3], key.round[r][0], key.round[r][1]);
  for (int j = 0; j < 4; ++j) w[j] = pack_slots(c[j].q);
}

// Words of kBatch consecutive blocks starting at `block`, element order (4 words per block).
inline void philox_run(uint64_t block, const PhiloxKeySchedule& key, uint32_t* words) {
  U32Vec w[4];
  philox_lanes(block, key, w);
  alignas(64) uint32_t lanes[4][kBatch];
  for (int j = 0; j < 4; ++j) w[j].store(lanes[j]);
  for (int b = 0; b < kBatch; ++b) {
    for (int j = 0; j < 4; ++j) words[4 * b + j] = lanes[j][b];
  }
}

// Standard normals of kBatch consecutive blocks, element order.
inline void normal_run(uint64_t block, const PhiloxKeySchedule& key, float* z) {
  U32Vec w[4];
  philox_lanes(block, key, w);
  box_muller_lanes(w, z);
}

struct NothingBetweenRuns {
  void operator()(int64_t, int64_t) const {}
};

// cpu::normals makes the Philox words of kGroup runs before their Box-Muller transforms. Each
// phase is then a string of short independent pieces that the core overlaps; one run's rounds
// followed by its transform (350 instructions on AVX-512, 825 on AVX2) leave the next run's work
// outside the reorder window (tools/noise_loop.py, one core, 512-element calls: AVX-512 0.95-0.98
// -> 0.83-0.86 ns per normal). AVX2 makes each run whole, as the portable path does: its rounds
// already spill, and groups of 8 took it from 1.15-1.19 to 1.22-1.28 ns (docs/BENCHMARKS.md).
#if defined(__AVX512F__)
constexpr int kGroup = 8;
#else
constexpr int kGroup = 1;
#endif

// out[i] = z(e0 + i) for i < n: standard normals of an arbitrary element range. Whole runs are
// written in place; only a partial run at either end goes through a buffer. (Copying every run out
// of one cost the AVX2 path a fifth of its time, per 512-element call as the fused passes make
// them: 1.55-1.60 against 1.23 ns a normal, AVX-512 1.06-1.12 against 1.03-1.05; docs/BENCHMARKS.md.)
// between(k, calls) is called `calls` = 2 x runs times, k = 0, 1, ..., after each run's Philox
// words and after each run's transform: the streaming passes spread their next chunk's prefetches
// over the generator with it (cpu::ChunkPrefetch). Twice per run rather than once, each request
// is half as many lines, and stalls the generator less: the fused passes 2-9% faster on AVX-512,
// unchanged on AVX2 (builds alternating; docs/BENCHMARKS.md, "Sixteenth session").
template <typename Between = NothingBetweenRuns>
inline void normals(int64_t e0, int64_t n, const NoiseKey& noise_key, float* out,
                    const Between& between = {}) {
  const PhiloxKeySchedule key(noise_key);
  alignas(64) float z[kRun];
  U32Vec w[kGroup][4];  // the words of the group of runs in progress
  const int64_t runs = n > 0 ? (e0 + n - 1) / kRun - e0 / kRun + 1 : 0, calls = 2 * runs;
  int64_t k = 0;
  for (int64_t e = e0, r = 0; e < e0 + n; ++r) {
    const int64_t run = e / kRun, lo = e - run * kRun, take = std::min(kRun - lo, e0 + n - e);
    float* dst = take == kRun ? out + (e - e0) : z;
    // Groups of one in plain locals: GCC compiled the grouped form slower on AVX2 (1.22 against
    // 1.13-1.16 ns a normal in 512-element calls, tools/noise_loop.py).
    if constexpr (kGroup == 1) {
      U32Vec words[4];
      philox_lanes(static_cast<uint64_t>(run) * kBatch, key, words);
      between(k++, calls);
      box_muller_lanes(words, dst);
    } else {
      if (r % kGroup == 0) {
        for (int64_t i = 0; i < std::min<int64_t>(kGroup, runs - r); ++i) {
          philox_lanes(static_cast<uint64_t>(run + i) * kBatch, key, w[i]);
          between(k++, calls);
        }
      }
      box_muller_lanes(w[r % kGroup], dst);
    }
    between(k++, calls);
    if (take != kRun) std::copy(z + lo, z + lo + take, out + (e - e0));
    e += take;
  }
}

// ---------------------------------------------------------------------------------------------
// ChaCha20 (secure mode, docs/RNG.md §6): runs of kBatch blocks, one per U32Vec lane.
// ---------------------------------------------------------------------------------------------

constexpr int64_t kChachaWordRun = 16 * kBatch;   // raw words per run
constexpr int64_t kChachaNormalRun = 8 * kBatch;  // float64 normals per run

// chacha20_rounds() of the kBatch blocks starting at `block` (a multiple of kBatch, so the
// counter's low word never carries), lane-major: lanes[i][b] is word i of block b.
inline void chacha_lanes(uint64_t block, const ChachaKey& key, uint32_t (&lanes)[16][kBatch]) {
  U32Vec x[16] = {U32Vec::broadcast(kChacha0), U32Vec::broadcast(kChacha1), U32Vec::broadcast(kChacha2),
                  U32Vec::broadcast(kChacha3)};
  for (int i = 0; i < 8; ++i) x[4 + i] = U32Vec::broadcast(key.k[i]);
  x[12] = U32Vec::iota(static_cast<uint32_t>(block));
  x[13] = U32Vec::broadcast(static_cast<uint32_t>(block >> 32));
  x[14] = U32Vec::broadcast(key.step);
  x[15] = U32Vec::broadcast(key.stream);
  chacha20_rounds(x);
  for (int i = 0; i < 16; ++i) x[i].store(lanes[i]);
}

// Words of the kBatch blocks starting at `block` (a multiple of kBatch, so the counter's low word
// never carries), element order (16 words per block): chacha20_rounds() on kBatch states at
// once, state word i of block b in lane b of x[i].
inline void chacha_run(uint64_t block, const ChachaKey& key, uint32_t* words) {
  alignas(64) uint32_t lanes[16][kBatch];
  chacha_lanes(block, key, lanes);
  for (int b = 0; b < kBatch; ++b) {
    for (int i = 0; i < 16; ++i) words[16 * b + i] = lanes[i][b];
  }
}

// (r cos theta, r sin theta), r = sqrt(-2 ln u0), theta = 2 pi u1 (chacha20.h's box_muller64), on
// kDoubleLanes lanes, by the polynomials below, written once on GCC vector types for every path.
// With FMA (the AVX2 and AVX-512 paths, and the portable one where its target has FMA, as aarch64)
// they give the same bits on every path: against a 64-bit-mantissa reference on 1.7e7 uniforms
// (random, and every edge: u near 1, 2^-54 and the quadrant points), ln u within 0.81 ulp and cos,
// sin within 1.5e-16, closer than cos(theta) of the rounded theta the reference takes (up to
// 4.4e-16; tools/noise_loop.py prints these errors). They replaced Sleef's log and sincos (a
// ChaCha20 normal 1.2x faster on AVX2) and, on the portable path, the C library's log, sin and cos
// (1.6x; docs/BENCHMARKS.md). Without FMA (baseline x86-64) products and sums round apart: ln u
// within 0.83 ulp, cos and sin 1.5e-16; those last-bit differences vanish in the one rounding to
// the output dtype except within ~1e-15 of a rounding boundary (docs/RNG.md §5).
#if defined(__AVX512F__)
constexpr int kDoubleLanes = 8;  // one register
#elif defined(__AVX2__)
constexpr int kDoubleLanes = 4;
#else
constexpr int kDoubleLanes = 2;  // 16 bytes: SSE2, or any other target's vectors
#endif

using VD = double __attribute__((vector_size(8 * kDoubleLanes)));
using VU64 = uint64_t __attribute__((vector_size(8 * kDoubleLanes)));

inline VD fma_d(VD a, VD b, VD c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_pd(a, b, c);
#elif defined(__AVX2__)
  return _mm256_fmadd_pd(a, b, c);
#elif defined(__FP_FAST_FMA)
  for (int i = 0; i < kDoubleLanes; ++i) a[i] = std::fma(a[i], b[i], c[i]);
  return a;
#else
  return a * b + c;
#endif
}

inline VD sqrt_d(VD x) {
#if defined(__AVX512F__)
  return _mm512_sqrt_pd(x);
#elif defined(__AVX2__)
  return _mm256_sqrt_pd(x);
#else
  for (int i = 0; i < kDoubleLanes; ++i) x[i] = std::sqrt(x[i]);
  return x;
#endif
}

// p(z) = c[0] + c[1] z + ... by Horner's rule, one FMA per coefficient.
template <size_t N>
inline VD horner(VD z, const double (&c)[N]) {
  VD p = VD{} + c[N - 1];
  for (size_t i = N - 1; i-- > 0;) p = fma_d(p, z, VD{} + c[i]);
  return p;
}

// -2 ln u for u in [2^-54, 1] (every uniform53 value: normal, positive, no special cases), as
// -2 times the form below. u = m 2^k with m in [sqrt(1/2), sqrt(2)) from the bits alone: adding 1's
// bits minus sqrt(1/2)'s carries into the exponent field exactly when the mantissa is at least
// sqrt(2)'s, so no compare and select. f = m - 1 (exact), s = f / (m + 1), and
// ln(1 + f) = 2 atanh(s) = f - (f^2/2 - s (f^2/2 + R)), R = 2 s^2/3 + 2 s^4/5 + ... = z P(z) for
// z = s^2 <= (3 - 2 sqrt(2))^2; k ln2 in two parts, the first exact. P is a Chebyshev fit
// (mpmath.chebyfit, degree 6: 3e-16 from the series, which moves ln u by < 2e-18). Every term is
// scaled by -2, which is exact, so the bits are those of -2.0 * (the form above); the order of the
// last subtraction keeps -2 ln 1 = -0, as the reference's -2.0 * log(1.0).
inline VD neg2_log_unit(VD u) {
  constexpr uint64_t kSqrtHalf = 0x3FE6A09E667F3BCDull;
  const VU64 t = __builtin_bit_cast(VU64, u) + (0x3FF0000000000000ull - kSqrtHalf);
  const VD m = __builtin_bit_cast(VD, (t & 0x000FFFFFFFFFFFFFull) + kSqrtHalf);
  const VD k = __builtin_bit_cast(VD, (t >> 52) | 0x4330000000000000ull) - (0x1p52 + 1023.0);
  const VD f = m - 1.0, s = f / (m + 1.0), z = s * s, f2 = f * f;
  static constexpr double kP2[] = {2 * 0.666666666666667,  2 * 0.39999999999899505, 2 * 0.28571428625975487,
                                   2 * 0.2222221113479508, 2 * 0.18182889125261723, 2 * 0.15331721600556042,
                                   2 * 0.14616449685043406};  // 2 P
  const VD r2 = z * horner(z, kP2);
  return k * (-2 * 0.6931467056274414) -
         ((f + f) - (f2 - fma_d(s, f2 + r2, k * (2 * 4.7493250390316726e-07))));
}

// The lanes whose q is odd. AVX2's vblendvpd reads only each lane's sign bit, which q << 63 is.
inline auto odd_lanes(VU64 q) {
#if defined(__AVX512F__)
  return (q & 1) != 0;
#else
  using VI64 = int64_t __attribute__((vector_size(8 * kDoubleLanes)));
  return __builtin_bit_cast(VI64, q << 63) < 0;
#endif
}

// cos(2 pi u), sin(2 pi u) for u in [0, 1], with no rounding of the angle (as the GPU's
// sincospi(2u)): 4u = q + f, q the nearest integer, f in [-1/2, 1/2] (both exact), so 2 pi u =
// q pi/2 + f pi/2; sin(f pi/2) = f S(f^2) and cos(f pi/2) = C(f^2), then the quadrant's swap and
// signs. S and C are Chebyshev fits on f^2 in [0, 1/4] (mpmath.chebyfit, degrees 6 and 7: 5e-18
// and 3e-20 from the functions).
inline void cossin_2pi(VD u, VD& c, VD& s) {
  const VD t = 4.0 * u;
  const VD shifted = t + 0x1.8p52;  // t rounded to an integer, which lands in the low bits
  const VU64 q = __builtin_bit_cast(VU64, shifted);
  const VD f = t - (shifted - 0x1.8p52), f2 = f * f;
  static constexpr double kS[] = {1.5707963267948966,    -0.6459640975062443,   0.07969262624604301,
                                  -0.004681754132340976, 0.0001604411507421909, -3.59864335298231e-06,
                                  5.633933781537854e-08};
  static constexpr double kC[] = {1.0,
                                  -1.2337005501361697,
                                  0.2536695079010467,
                                  -0.02086348076331121,
                                  0.0009192602741831558,
                                  -2.520203677046026e-05,
                                  4.710609726757823e-07,
                                  -6.321256869628588e-09};
  const VD sn = f * horner(f2, kS), cs = horner(f2, kC);
  const auto odd = odd_lanes(q);
  const VU64 sign_s = (q & 2) << 62, sign_c = ((q + 1) & 2) << 62;
  c = __builtin_bit_cast(VD, __builtin_bit_cast(VU64, odd ? sn : cs) ^ sign_c);
  s = __builtin_bit_cast(VD, __builtin_bit_cast(VU64, odd ? cs : sn) ^ sign_s);
}

// z[8 j] = zc[j] and z[8 j + 1] = zs[j] for every lane j: lane j of a run's kDoubleLanes blocks starts
// its block's 8 normals 8 elements after lane j - 1.
template <size_t... J>
inline void store_pairs(VD zc, VD zs, double* z, std::index_sequence<J...>) {
  using V2 = double __attribute__((vector_size(16)));
  const auto store = [&](auto j) {
    const V2 pair = __builtin_shufflevector(zc, zs, j(), kDoubleLanes + j());
    __builtin_memcpy(z + 8 * j(), &pair, sizeof(pair));
  };
  (store(std::integral_constant<size_t, J>()), ...);
}

// box_muller64() of u0, u1's kDoubleLanes lanes, to z + 8 j (lane j: cos, then sin).
inline void box_muller64_lanes(const double* u0, const double* u1, double* z) {
  VD a, b;
  __builtin_memcpy(&a, u0, sizeof(VD));
  __builtin_memcpy(&b, u1, sizeof(VD));
  const VD r = sqrt_d(neg2_log_unit(a));
  VD cs, sn;
  cossin_2pi(b, cs, sn);
  const VD zc = r * cs, zs = r * sn;
  store_pairs(zc, zs, z, std::make_index_sequence<kDoubleLanes>());
}

using VI4 = int32_t __attribute__((vector_size(16)));
using VD4 = double __attribute__((vector_size(32)));

// Four int32 as float64 (exact): one vcvtdq2pd where AVX has it (GCC's generic lowering converts
// the halves separately and joins them). By reference: a by-value 32-byte vector changes the ABI
// of the portable build.
inline void int_to_double(VI4 x, VD4& out) {
#if defined(__AVX__)
  out = reinterpret_cast<VD4>(_mm256_cvtepi32_pd(reinterpret_cast<__m128i>(x)));
#else
  out = __builtin_convertvector(x, VD4);
#endif
}

// float64 standard normals of the kBatch blocks starting at `block`, element order (8 per block): the
// uniform53()/box_muller64() formulas of chacha20.h, kDoubleLanes blocks at a time.
inline void chacha_normal_run(uint64_t block, const ChachaKey& key, double* z) {
  alignas(64) uint32_t w[16][kBatch];
  chacha_lanes(block, key, w);
  // u[i][b] = uniform53(w[2i][b], w[2i + 1][b]), 4 lanes at a time: the 53-bit integer
  // hi 2^21 + (lo >> 11) is formed exactly in float64 (exact conversions, carry-free adds). Both
  // words go through the signed conversion, hi offset by 2^31: below AVX-512 there is no unsigned
  // one, and GCC's emulation of it cost a quarter of the transform on AVX2.
  using VU4 = uint32_t __attribute__((vector_size(16)));
  alignas(64) double u[8][kBatch];
  for (int i = 0; i < 8; ++i) {
    for (int b = 0; b < kBatch; b += 4) {
      VU4 lo, hi;
      __builtin_memcpy(&lo, &w[2 * i][b], sizeof(lo));
      __builtin_memcpy(&hi, &w[2 * i + 1][b], sizeof(hi));
      VD4 h, l;
      int_to_double(reinterpret_cast<VI4>(hi ^ 0x80000000u), h);
      int_to_double(reinterpret_cast<VI4>(lo >> 11), l);
      const VD4 m = (h + 0x1p31) * 0x1p21 + l;
      const VD4 v = m * 0x1p-53 + 0x1p-54;
      __builtin_memcpy(&u[i][b], &v, sizeof(v));
    }
  }
  for (int k = 0; k < 4; ++k) {
    for (int b = 0; b < kBatch; b += kDoubleLanes)
      box_muller64_lanes(&u[2 * k][b], &u[2 * k + 1][b], z + 8 * b + 2 * k);
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

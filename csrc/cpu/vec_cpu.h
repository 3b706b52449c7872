// The SIMD vectors of the CPU streaming kernels (clip.cpp, optim.cpp, layers.cpp, filter_chunk in
// stream_cpu.h), one set of names for every CPU capability:
//
//   Vec, DVec         fp32 and fp64 vectors (size(), loadu, store, broadcast, + - * /);
//   fmadd(a, b, c)    a · b + c, on Vecs or floats with the same rounding;
//   load_widened(p)   2 · Vec::size() elements of fp32, fp16 or bf16 as two fp32 Vecs;
//   widen_to_float    a whole array of them into fp32;
//   WideSum           fp64 accumulators that fp32 vectors are widened into.
//
// The AVX2 and AVX-512 modules use ATen's at::vec (256-bit; see tools/build_config.py), whose
// fmadd is one fused instruction. The portable module has its own 16-byte GCC vector types, the
// width every SIMD baseline has (SSE2 on x86-64, NEON, ...). ATen's portable Vectorized<float> is
// an array that GCC keeps in memory: per_sample_sumsq ran at 0.32x and the register-tiled BK
// kernels at 0.25-0.29x of the AVX2 module's speed with it, one thread (docs/BENCHMARKS.md, tenth
// session). Its fmadd rounds the product and the sum separately, as ATen's portable fmadd does:
// baseline x86-64 has no fused instruction, and the C library's correctly rounded fmaf costs ~2 ns
// a call.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "dpkernels/macros.h"

#if defined(CPU_CAPABILITY_AVX2)
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/vec_convert.h>
#include <immintrin.h>
#endif

namespace dpkernels {
namespace cpu {

#if defined(CPU_CAPABILITY_AVX2)

using Vec = at::vec::Vectorized<float>;
using DVec = at::vec::Vectorized<double>;

DPK_ALWAYS_INLINE Vec fmadd(const Vec& a, const Vec& b, const Vec& c) { return at::vec::fmadd(a, b, c); }
DPK_ALWAYS_INLINE float fmadd(float a, float b, float c) { return std::fma(a, b, c); }

template <typename scalar_t>
DPK_ALWAYS_INLINE std::pair<Vec, Vec> load_widened(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return {Vec::loadu(p), Vec::loadu(p + Vec::size())};
  } else {
    // VecConvert, not convert_to_float: the latter is inline for AVX2 only.
    const auto f = at::vec::VecConvert<float, 2, scalar_t, 1>::apply(
        at::vec::VectorizedN<scalar_t, 1>(at::vec::Vectorized<scalar_t>::loadu(p)));
    return {f[0], f[1]};
  }
}

// d[q] += the fp64 values of lanes [q · DVec::size(), (q + 1) · DVec::size()) of v.
DPK_ALWAYS_INLINE void widen_add(const Vec& v, DVec* d) {
  const __m256 x = v;
  d[0] = d[0] + DVec(_mm256_cvtps_pd(_mm256_castps256_ps128(x)));
  d[1] = d[1] + DVec(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
}

#else

// The 16-byte GCC vector of T (outside the template: GCC drops vector_size on a dependent type).
template <typename T>
struct Reg16;
template <>
struct Reg16<float> {
  using type = float __attribute__((vector_size(16)));
};
template <>
struct Reg16<double> {
  using type = double __attribute__((vector_size(16)));
};

// One 16-byte register of T lanes. A plain struct around a GCC vector, so that it lives in a
// register; loads and stores go through memcpy (unaligned, no aliasing assumption).
template <typename T>
struct SimdVec {
  using Reg = typename Reg16<T>::type;
  Reg v;

  static constexpr int size() { return 16 / sizeof(T); }
  SimdVec() = default;
  DPK_ALWAYS_INLINE SimdVec(Reg r) : v(r) {}
  // Every lane = x. An initializer list, which GCC emits as one shuffle (lane-by-lane writes
  // become a chain of inserts; x + Reg{} would turn -0.0 into +0.0).
  DPK_ALWAYS_INLINE SimdVec(T x) {
    if constexpr (size() == 4) {
      v = Reg{x, x, x, x};
    } else {
      v = Reg{x, x};
    }
  }
  static DPK_ALWAYS_INLINE SimdVec loadu(const T* p) {
    SimdVec r;
    std::memcpy(&r.v, p, sizeof(Reg));
    return r;
  }
  // The first `count` lanes from p, the others 0 (a whole vector in one load when count allows).
  static DPK_ALWAYS_INLINE SimdVec loadu(const T* p, int64_t count) {
    if (count == size()) return loadu(p);
    SimdVec r(Reg{});
    for (int64_t i = 0; i < count; ++i) r.v[i] = p[i];
    return r;
  }
  DPK_ALWAYS_INLINE void store(T* p) const { std::memcpy(p, &v, sizeof(Reg)); }
  DPK_ALWAYS_INLINE void store(T* p, int64_t count) const {
    if (count == size()) return store(p);
    for (int64_t i = 0; i < count; ++i) p[i] = v[i];
  }

  friend DPK_ALWAYS_INLINE SimdVec operator+(const SimdVec& a, const SimdVec& b) { return a.v + b.v; }
  friend DPK_ALWAYS_INLINE SimdVec operator-(const SimdVec& a, const SimdVec& b) { return a.v - b.v; }
  friend DPK_ALWAYS_INLINE SimdVec operator*(const SimdVec& a, const SimdVec& b) { return a.v * b.v; }
  friend DPK_ALWAYS_INLINE SimdVec operator/(const SimdVec& a, const SimdVec& b) { return a.v / b.v; }
};

using Vec = SimdVec<float>;
using DVec = SimdVec<double>;
using U32 = uint32_t __attribute__((vector_size(16)));
using I32 = int32_t __attribute__((vector_size(16)));

DPK_ALWAYS_INLINE Vec fmadd(const Vec& a, const Vec& b, const Vec& c) { return a * b + c; }
DPK_ALWAYS_INLINE float fmadd(float a, float b, float c) { return a * b + c; }

// The fp32 values of the 16-bit values (bf16 or IEEE half) in the high halves of w's lanes, the
// low halves 0. bf16 is the top half of an fp32 already. Half is converted exactly, without a
// conversion instruction, by the branch-free method of c10's fp16_ieee_to_fp32_value: a normal
// number moves its exponent and mantissa into place and rescales the exponent bias with one exact
// multiply (which also keeps Inf and NaN); a subnormal comes out of one exact subtraction from a
// power of two. No operand is an fp32 subnormal, so flush-to-zero modes change nothing.
template <typename scalar_t>
DPK_ALWAYS_INLINE Vec widened_bits(U32 w) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return Vec(__builtin_bit_cast(Vec::Reg, w));
  } else {
    static_assert(std::is_same_v<scalar_t, c10::Half>);
    const U32 sign = w & 0x80000000u;
    const U32 two_w = w + w;
    const Vec::Reg normal = __builtin_bit_cast(Vec::Reg, (two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const Vec::Reg subnormal = __builtin_bit_cast(Vec::Reg, (two_w >> 17) | (126u << 23)) - 0.5f;
    // two_w < 2^27 exactly when the exponent field is 0; two_w >> 1 < 2^26 keeps the signed
    // compare (the only one SSE2 has) exact.
    const I32 is_subnormal = __builtin_bit_cast(I32, two_w >> 1) < (1 << 26);
    const U32 mag = is_subnormal ? __builtin_bit_cast(U32, subnormal) : __builtin_bit_cast(U32, normal);
    return Vec(__builtin_bit_cast(Vec::Reg, sign | mag));
  }
}

template <typename scalar_t>
DPK_ALWAYS_INLINE std::pair<Vec, Vec> load_widened(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return {Vec::loadu(p), Vec::loadu(p + Vec::size())};
  } else {
    static_assert(sizeof(scalar_t) == 2);
    using U16 = uint16_t __attribute__((vector_size(16)));
    U16 h;
    std::memcpy(&h, p, sizeof(h));
    // Interleaving with zeros puts each value in the high half of a 32-bit lane (punpck[lh]wd).
    static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the interleave assumes little-endian lanes");
    const U16 zero{};
    // GCC has __builtin_shuffle (and __builtin_shufflevector only from GCC 12), clang the latter.
#if __has_builtin(__builtin_shuffle)
    const U16 lo = __builtin_shuffle(zero, h, U16{0, 8, 1, 9, 2, 10, 3, 11});
    const U16 hi = __builtin_shuffle(zero, h, U16{4, 12, 5, 13, 6, 14, 7, 15});
#else
    const U16 lo = __builtin_shufflevector(zero, h, 0, 8, 1, 9, 2, 10, 3, 11);
    const U16 hi = __builtin_shufflevector(zero, h, 4, 12, 5, 13, 6, 14, 7, 15);
#endif
    return {widened_bits<scalar_t>(__builtin_bit_cast(U32, lo)),
            widened_bits<scalar_t>(__builtin_bit_cast(U32, hi))};
  }
}

DPK_ALWAYS_INLINE void widen_add(const Vec& v, DVec* d) {
  using D4 = double __attribute__((vector_size(32)));  // two registers' worth: GCC splits it
  DVec::Reg half[2];
  const D4 wide = __builtin_convertvector(v.v, D4);
  std::memcpy(half, &wide, sizeof(half));
  d[0] = d[0] + DVec(half[0]);
  d[1] = d[1] + DVec(half[1]);
}

#endif

static_assert(Vec::size() == 2 * DVec::size(), "widen_add fills two fp64 vectors");

// dst[0:n) = src[0:n) as fp32, from fp32, fp16 or bf16.
template <typename scalar_t>
inline void widen_to_float(const scalar_t* src, int64_t n, float* dst) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    int64_t e = 0;
    for (; e + 2 * Vec::size() <= n; e += 2 * Vec::size()) {
      const auto [x, y] = load_widened(src + e);
      x.store(dst + e);
      y.store(dst + e + Vec::size());
    }
    for (; e < n; ++e) dst[e] = static_cast<float>(src[e]);
  }
}

// fp64 sums of fp32 vectors: lane e of every added vector goes to fp64 lane e, and total() adds the
// lanes in order. The additions are the same whatever the thread count, so a task's result is.
struct WideSum {
  DVec d[2];

  WideSum() : d{DVec(0.0), DVec(0.0)} {}
  void add(const Vec& v) { widen_add(v, d); }
  // x[0:m) in Vec::size() steps, the last one zero-padded.
  void add(const float* x, int64_t m) {
    for (int64_t i = 0; i < m; i += Vec::size())
      add(Vec::loadu(x + i, std::min<int64_t>(Vec::size(), m - i)));
  }
  double total() const {
    alignas(64) double lanes[Vec::size()];
    d[0].store(lanes);
    d[1].store(lanes + DVec::size());
    double s = 0.0;
    for (double x : lanes) s += x;
    return s;
  }
};

}  // namespace cpu
}  // namespace dpkernels

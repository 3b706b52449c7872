// ChaCha20 (RFC 8439 §2.3), its 53-bit uniforms and one rounding to the output dtype, shared by the
// CPU and CUDA kernels, and the GPU's float64 Box-Muller transform of dpkernels' secure noise mode
// (docs/RNG.md §6). The Python reference is
// dpkernels/reference/noise.py (chacha20_*) and the Triton version triton_kernels/chacha.py; the
// uint32 words are bit-identical on all four.
#pragma once

#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "dpkernels/macros.h"

namespace dpkernels {

// The 256-bit key (state words 4..11, little-endian) and the counter words 14 (step) and 15 (stream).
struct ChachaKey {
  uint32_t k[8];
  uint32_t step, stream;
};

// The key travels through op schemas as 4 int64 limbs, limb j = key bits 64j .. 64j + 63 (signed).
inline ChachaKey make_chacha_key(c10::ArrayRef<int64_t> key, int64_t step, int64_t stream) {
  DPK_CHECK(key.size() == 4, "a ChaCha20 key is 4 int64 limbs (256 bits), got ", key.size());
  DPK_CHECK(step >= 0 && step < (int64_t{1} << 32), "step must be in [0, 2^32), got ", step);
  DPK_CHECK(stream >= 0 && stream < (int64_t{1} << 32), "stream must be in [0, 2^32), got ", stream);
  ChachaKey k{};
  for (int j = 0; j < 4; ++j) {
    const auto limb = static_cast<uint64_t>(key[j]);
    k.k[2 * j] = static_cast<uint32_t>(limb);
    k.k[2 * j + 1] = static_cast<uint32_t>(limb >> 32);
  }
  k.step = static_cast<uint32_t>(step);
  k.stream = static_cast<uint32_t>(stream);
  return k;
}

// "expand 32-byte k", state words 0..3.
constexpr uint32_t kChacha0 = 0x61707865u, kChacha1 = 0x3320646eu, kChacha2 = 0x79622d32u,
                   kChacha3 = 0x6b206574u;
constexpr int kChachaDoubleRounds = 10;

DPK_HOST_DEVICE inline uint32_t rotl32(uint32_t x, int n) { return (x << n) | (x >> (32 - n)); }

// T is uint32_t, or a SIMD lane type with operator+, operator^ and rotl32(T, int) (the CPU
// kernels' U32Vec).
template <typename T>
DPK_HOST_DEVICE inline void chacha_quarter_round(T& a, T& b, T& c, T& d) {
  a = a + b;
  d = rotl32(d ^ a, 16);
  c = c + d;
  b = rotl32(b ^ c, 12);
  a = a + b;
  d = rotl32(d ^ a, 8);
  c = c + d;
  b = rotl32(b ^ c, 7);
}

// RFC 8439 §2.3: 10 double rounds (columns, then diagonals) on x, then x += the input state.
template <typename T>
DPK_HOST_DEVICE inline void chacha20_rounds(T (&x)[16]) {
  T in[16];
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int i = 0; i < 16; ++i) in[i] = x[i];
#if defined(__CUDACC__)
#pragma unroll 1
#endif
  for (int r = 0; r < kChachaDoubleRounds; ++r) {
    chacha_quarter_round(x[0], x[4], x[8], x[12]);
    chacha_quarter_round(x[1], x[5], x[9], x[13]);
    chacha_quarter_round(x[2], x[6], x[10], x[14]);
    chacha_quarter_round(x[3], x[7], x[11], x[15]);
    chacha_quarter_round(x[0], x[5], x[10], x[15]);
    chacha_quarter_round(x[1], x[6], x[11], x[12]);
    chacha_quarter_round(x[2], x[7], x[8], x[13]);
    chacha_quarter_round(x[3], x[4], x[9], x[14]);
  }
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int i = 0; i < 16; ++i) x[i] = x[i] + in[i];
}

// The 16 output words of block `block`: state = (constants, key, block lo, block hi, step, stream).
DPK_HOST_DEVICE inline void chacha20_block(uint64_t block, const ChachaKey& key, uint32_t (&x)[16]) {
  x[0] = kChacha0;
  x[1] = kChacha1;
  x[2] = kChacha2;
  x[3] = kChacha3;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int i = 0; i < 8; ++i) x[4 + i] = key.k[i];
  x[12] = static_cast<uint32_t>(block);
  x[13] = static_cast<uint32_t>(block >> 32);
  x[14] = key.step;
  x[15] = key.stream;
  chacha20_rounds(x);
}

// u = (v >> 11) * 2^-53 + 2^-54 for v = hi * 2^32 + lo, rounded to nearest-even: in [2^-54, 1].
// The product is exact, so an FMA contraction gives the same value.
DPK_HOST_DEVICE inline double uniform53(uint32_t lo, uint32_t hi) {
  const uint64_t m = ((static_cast<uint64_t>(hi) << 32) | lo) >> 11;
  return static_cast<double>(m) * 0x1p-53 + 0x1p-54;
}

#if defined(__CUDACC__)
// Box-Muller in float64 on the GPU: z0 = r cos(2 pi u_b), z1 = r sin(2 pi u_b), r = sqrt(-2 ln u_a),
// by sincospi(2 u_b) (no rounding of theta; no Payne-Hanek slow path, so no local memory). The CPU
// kernels evaluate the same formula with their own polynomials (csrc/cpu/noise_cpu.h,
// box_muller64_lanes); the two differ in the last bits (docs/RNG.md §5).
DPK_DEVICE inline void box_muller64(double ua, double ub, double& z0, double& z1) {
  const double r = sqrt(-2.0 * log(ua));
  double s, c;
  sincospi(2.0 * ub, &s, &c);
  z0 = r * c;
  z1 = r * s;
}

// The 8 float64 normals of one block's 16 words: uniform u_i from (w[2i], w[2i+1]), pairs (u_2k, u_2k+1).
DPK_DEVICE inline void chacha_normals(const uint32_t (&w)[16], double (&z)[8]) {
#pragma unroll
  for (int k = 0; k < 4; ++k)
    box_muller64(uniform53(w[4 * k], w[4 * k + 1]), uniform53(w[4 * k + 2], w[4 * k + 3]), z[2 * k],
                 z[2 * k + 1]);
}
#endif

// The float64 value rounded once to T. Directly for float; for the 16-bit types via float with
// round-to-odd (truncate, then set the last bit if inexact), which float's 13+ extra bits make
// equal to a single round-to-nearest-even of the double (Boldo & Melquiond, "Emulation of FMA and
// correctly rounded sums: proved algorithms using rounding to odd", 2008).
DPK_HOST_DEVICE inline float float_round_to_odd(double d) {
  float f = static_cast<float>(d);
  if (static_cast<double>(f) != d) {
    if (fabs(static_cast<double>(f)) > fabs(d)) f = nextafterf(f, 0.0f);
    uint32_t bits;
    memcpy(&bits, &f, sizeof(bits));
    bits |= 1u;
    memcpy(&f, &bits, sizeof(bits));
  }
  return f;
}

template <typename T>
DPK_HOST_DEVICE inline T round_once(double d) {
  if constexpr (sizeof(T) >= sizeof(float)) {
    return static_cast<T>(d);
  } else {
    return static_cast<T>(float_round_to_odd(d));
  }
}

}  // namespace dpkernels

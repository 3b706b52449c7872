// CPU building blocks of dpkernels' noise, shared by the noise ops (noise.cpp) and the fused
// private sum (clip.cpp): runs of kNoiseBatch Philox blocks from philox.h, with the Box-Muller
// transform in at::vec (Sleef log/sin/cos, <= 1 ulp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>

#include "dpkernels/chacha20.h"
#include "dpkernels/macros.h"
#include "dpkernels/noise_key.h"
#include "dpkernels/philox.h"

namespace dpkernels {
namespace cpu {

constexpr int kBatch = at::vec::Vectorized<float>::size();  // Philox blocks per run
constexpr int64_t kRun = 4 * kBatch;                        // elements per run

// Eight uint32 lanes for philox_round(): AVX2 registers when built for AVX2, plain arrays (which
// the compiler may still vectorise) otherwise.
#if defined(CPU_CAPABILITY_AVX2)
struct U32Vec {
  __m256i v;
  static U32Vec load(const uint32_t* p) { return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))}; }
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

// 32x32 -> 64-bit products of the even and odd lanes (vpmuludq), split into high and low words.
inline void mulhilo32(uint32_t m, U32Vec a, U32Vec& hi, U32Vec& lo) {
  const __m256i mv = _mm256_set1_epi32(static_cast<int>(m));
  const __m256i even = _mm256_mul_epu32(a.v, mv);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a.v, 32), mv);
  lo = {_mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0b10101010)};
  hi = {_mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0b10101010)};
}
#else
struct U32Vec {
  uint32_t v[8];
  static U32Vec load(const uint32_t* p) {
    U32Vec r;
    std::copy(p, p + 8, r.v);
    return r;
  }
  void store(uint32_t* p) const { std::copy(v, v + 8, p); }
  friend U32Vec operator^(U32Vec a, U32Vec b) {
    for (int i = 0; i < 8; ++i) a.v[i] ^= b.v[i];
    return a;
  }
  friend U32Vec operator^(U32Vec a, uint32_t k) {
    for (int i = 0; i < 8; ++i) a.v[i] ^= k;
    return a;
  }
  friend U32Vec operator+(U32Vec a, U32Vec b) {
    for (int i = 0; i < 8; ++i) a.v[i] += b.v[i];
    return a;
  }
};

inline U32Vec rotl32(U32Vec a, int n) {
  for (int i = 0; i < 8; ++i) a.v[i] = dpkernels::rotl32(a.v[i], n);
  return a;
}

inline void mulhilo32(uint32_t m, U32Vec a, U32Vec& hi, U32Vec& lo) {
  for (int i = 0; i < 8; ++i) dpkernels::mulhilo32(m, a.v[i], hi.v[i], lo.v[i]);
}
#endif

// Words of kBatch consecutive blocks starting at `block`, element order (4 words per block):
// philox4x32_10() on eight counters at once via philox_round<U32Vec>.
inline void philox_run(uint64_t block, const NoiseKey& key, uint32_t* words) {
  static_assert(kBatch % 8 == 0, "Philox runs are whole U32Vec groups");
  for (int g = 0; g < kBatch; g += 8) {
    alignas(64) uint32_t lanes[4][8];
    for (int b = 0; b < 8; ++b) {
      const uint64_t blk = block + g + b;
      lanes[0][b] = static_cast<uint32_t>(blk);
      lanes[1][b] = static_cast<uint32_t>(blk >> 32);
      lanes[2][b] = key.step;
      lanes[3][b] = key.stream;
    }
    U32Vec c0 = U32Vec::load(lanes[0]), c1 = U32Vec::load(lanes[1]), c2 = U32Vec::load(lanes[2]),
           c3 = U32Vec::load(lanes[3]);
    uint32_t k0 = static_cast<uint32_t>(key.seed), k1 = static_cast<uint32_t>(key.seed >> 32);
    for (int r = 0; r < kPhiloxRounds; ++r, k0 += kPhiloxW0, k1 += kPhiloxW1)
      philox_round(c0, c1, c2, c3, k0, k1);
    c0.store(lanes[0]);
    c1.store(lanes[1]);
    c2.store(lanes[2]);
    c3.store(lanes[3]);
    for (int b = 0; b < 8; ++b) {
      for (int w = 0; w < 4; ++w) words[4 * (g + b) + w] = lanes[w][b];
    }
  }
}

// Standard normals of kBatch consecutive blocks, element order.
inline void normal_run(uint64_t block, const NoiseKey& key, float* z) {
  alignas(64) uint32_t words[kRun];
  philox_run(block, key, words);
  alignas(64) float u[4][kBatch];
  for (int b = 0; b < kBatch; ++b) {
    for (int w = 0; w < 4; ++w) u[w][b] = uniform_open0(words[4 * b + w]);
  }
  alignas(64) float out[4][kBatch];
  for (int pair = 0; pair < 2; ++pair) {
    // Same formula as box_muller() in philox.h, kBatch lanes at a time.
    const at::vec::Vectorized<float> r =
        (at::vec::Vectorized<float>(-2.0f) * at::vec::Vectorized<float>::loadu(u[2 * pair]).log()).sqrt();
    const at::vec::Vectorized<float> theta =
        at::vec::Vectorized<float>(6.2831853071795865f) * at::vec::Vectorized<float>::loadu(u[2 * pair + 1]);
    (r * theta.cos()).store(out[2 * pair]);
    (r * theta.sin()).store(out[2 * pair + 1]);
  }
  for (int b = 0; b < kBatch; ++b) {
    for (int w = 0; w < 4; ++w) z[4 * b + w] = out[w][b];
  }
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
// ChaCha20 (secure mode, docs/RNG.md §6): runs of kChachaBatch = 8 blocks, one per U32Vec lane.
// ---------------------------------------------------------------------------------------------

constexpr int kChachaBatch = 8;
constexpr int64_t kChachaWordRun = 16 * kChachaBatch;   // raw words per run
constexpr int64_t kChachaNormalRun = 8 * kChachaBatch;  // float64 normals per run

// Words of blocks block .. block + 7, element order (16 words per block): chacha20_rounds() on
// eight states at once, state word i of block b in lane b of x[i].
inline void chacha_run(uint64_t block, const ChachaKey& key, uint32_t* words) {
  alignas(64) uint32_t lanes[16][kChachaBatch];
  for (int b = 0; b < kChachaBatch; ++b) {
    const uint64_t blk = block + b;
    lanes[0][b] = kChacha0;
    lanes[1][b] = kChacha1;
    lanes[2][b] = kChacha2;
    lanes[3][b] = kChacha3;
    for (int i = 0; i < 8; ++i) lanes[4 + i][b] = key.k[i];
    lanes[12][b] = static_cast<uint32_t>(blk);
    lanes[13][b] = static_cast<uint32_t>(blk >> 32);
    lanes[14][b] = key.step;
    lanes[15][b] = key.stream;
  }
  U32Vec x[16];
  for (int i = 0; i < 16; ++i) x[i] = U32Vec::load(lanes[i]);
  chacha20_rounds(x);
  for (int i = 0; i < 16; ++i) x[i].store(lanes[i]);
  for (int b = 0; b < kChachaBatch; ++b) {
    for (int i = 0; i < 16; ++i) words[16 * b + i] = lanes[i][b];
  }
}

// float64 standard normals of blocks block .. block + 7, element order (8 per block): the
// uniform53()/box_muller64() formulas of chacha20.h with at::vec (Sleef) log/sin/cos.
inline void chacha_normal_run(uint64_t block, const ChachaKey& key, double* z) {
  using VecD = at::vec::Vectorized<double>;
  alignas(64) uint32_t w[16 * kChachaBatch];
  chacha_run(block, key, w);
  // u[i][b]: uniform i (0..7) of block b.
  alignas(64) double u[8][kChachaBatch];
  for (int b = 0; b < kChachaBatch; ++b) {
    for (int i = 0; i < 8; ++i) u[i][b] = uniform53(w[16 * b + 2 * i], w[16 * b + 2 * i + 1]);
  }
  alignas(64) double out[8][kChachaBatch];
  for (int k = 0; k < 4; ++k) {
    for (int b = 0; b < kChachaBatch; b += VecD::size()) {
      const VecD r = (VecD(-2.0) * VecD::loadu(&u[2 * k][b]).log()).sqrt();
      const VecD theta = VecD(6.283185307179586) * VecD::loadu(&u[2 * k + 1][b]);
      (r * theta.cos()).store(&out[2 * k][b]);
      (r * theta.sin()).store(&out[2 * k + 1][b]);
    }
  }
  for (int b = 0; b < kChachaBatch; ++b) {
    for (int i = 0; i < 8; ++i) z[8 * b + i] = out[i][b];
  }
}

// out[i] = z(e0 + i) for i < n: float64 ChaCha20 normals of an arbitrary element range.
inline void chacha_normals(int64_t e0, int64_t n, const ChachaKey& key, double* out) {
  alignas(64) double z[kChachaNormalRun];
  for (int64_t e = e0; e < e0 + n;) {
    const int64_t run = e / kChachaNormalRun, lo = e - run * kChachaNormalRun;
    const int64_t take = std::min(kChachaNormalRun - lo, e0 + n - e);
    chacha_normal_run(static_cast<uint64_t>(run) * kChachaBatch, key, z);
    std::copy(z + lo, z + lo + take, out + (e - e0));
    e += take;
  }
}

}  // namespace cpu
}  // namespace dpkernels

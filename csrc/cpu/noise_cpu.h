// CPU building blocks of dpkernels' noise, shared by the noise ops (noise.cpp) and the fused
// private sum (clip.cpp): runs of kNoiseBatch Philox blocks from philox.h, with the Box-Muller
// transform in at::vec (Sleef log/sin/cos, <= 1 ulp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>

#include "dpkernels/macros.h"
#include "dpkernels/philox.h"

namespace dpkernels {
namespace cpu {

constexpr int kBatch = at::vec::Vectorized<float>::size();  // Philox blocks per run
constexpr int64_t kRun = 4 * kBatch;                          // elements per run

struct NoiseKey {
  uint64_t seed;
  uint32_t step, stream;
};

inline NoiseKey make_key(int64_t seed, int64_t step, int64_t stream) {
  DPK_CHECK(step >= 0 && step < (int64_t{1} << 32), "step must be in [0, 2^32), got ", step);
  DPK_CHECK(stream >= 0 && stream < (int64_t{1} << 32), "stream must be in [0, 2^32), got ", stream);
  // The schema carries the 64-bit seed as a signed int64; reinterpret its bits.
  return {static_cast<uint64_t>(seed), static_cast<uint32_t>(step), static_cast<uint32_t>(stream)};
}

// Words of kBatch consecutive blocks starting at `block`, element order (4 words per block).
// philox4x32_10() one lane at a time, with the rounds outside the lane loop so that the lanes
// vectorise.
inline void philox_run(uint64_t block, const NoiseKey& key, uint32_t* words) {
  alignas(64) uint32_t c0[kBatch], c1[kBatch], c2[kBatch], c3[kBatch];
  for (int b = 0; b < kBatch; ++b) {
    c0[b] = static_cast<uint32_t>(block + b);
    c1[b] = static_cast<uint32_t>((block + b) >> 32);
    c2[b] = key.step;
    c3[b] = key.stream;
  }
  uint32_t k0 = static_cast<uint32_t>(key.seed), k1 = static_cast<uint32_t>(key.seed >> 32);
  for (int r = 0; r < kPhiloxRounds; ++r, k0 += kPhiloxW0, k1 += kPhiloxW1) {
    for (int b = 0; b < kBatch; ++b) philox_round(c0[b], c1[b], c2[b], c3[b], k0, k1);
  }
  for (int b = 0; b < kBatch; ++b) {
    words[4 * b] = c0[b];
    words[4 * b + 1] = c1[b];
    words[4 * b + 2] = c2[b];
    words[4 * b + 3] = c3[b];
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
    const at::vec::Vectorized<float> r = (at::vec::Vectorized<float>(-2.0f) * at::vec::Vectorized<float>::loadu(u[2 * pair]).log()).sqrt();
    const at::vec::Vectorized<float> theta = at::vec::Vectorized<float>(6.2831853071795865f) * at::vec::Vectorized<float>::loadu(u[2 * pair + 1]);
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

}  // namespace cpu
}  // namespace dpkernels

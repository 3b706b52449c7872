// The Philox key and counter fields of one noise draw (docs/RNG.md), validated once on the host
// and shared by the CPU and CUDA launchers.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>

#include "dpkernels/macros.h"

namespace dpkernels {

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

}  // namespace dpkernels

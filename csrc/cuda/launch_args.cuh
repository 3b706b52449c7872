// Kernel-argument budget shared by the multi-tensor CUDA launchers (clip.cu, noise.cu,
// step_stream.cuh), which pass their tensor tables by value as __grid_constant__ arguments, and the
// chunk-to-tensor search of their tables.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dpkernels {

// Drivers of CUDA 12.1+ accept 32 KiB of kernel arguments on Volta and newer; like ATen
// (MultiTensorApply.cuh) we rely on it only in CUDA 13 builds and stay under 4 KiB otherwise.
#if defined(CUDART_VERSION) && CUDART_VERSION >= 13000
constexpr bool kLargeKernelArgs = true;
constexpr size_t kArgBytes = 32764;
#else
constexpr bool kLargeKernelArgs = false;
constexpr size_t kArgBytes = 4096;
#endif
// Room left for the scalar arguments that follow a table in a kernel's parameter list.
constexpr size_t kScalarArgBytes = 64;

// The slot of chunk c in a table whose slots start at chunks first_chunk[0] = 0 < first_chunk[1] <
// ... < first_chunk[count - 1]: a binary search, uniform across a CUDA block (so the table reads are
// broadcasts from the constant cache).
__device__ __forceinline__ int find_chunk_slot(const int64_t* first_chunk, int count, int64_t c) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first_chunk[mid] <= c) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace dpkernels

// Kernel-argument budget shared by the multi-tensor CUDA launchers (clip.cu, noise.cu), which pass
// their tensor tables by value as __grid_constant__ arguments.
#pragma once

#include <cstddef>

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

}  // namespace dpkernels

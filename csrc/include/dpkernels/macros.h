// Macros shared by every C++ and CUDA translation unit of dpkernels.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define DPK_HOST_DEVICE __host__ __device__
#define DPK_DEVICE __device__
#else
#define DPK_HOST_DEVICE
#define DPK_DEVICE
#endif

// For the small SIMD helpers of the CPU kernels: a call, or a vector spilled across one, costs more
// than the body.
#define DPK_ALWAYS_INLINE __attribute__((always_inline)) inline

#define DPK_CHECK(cond, ...) TORCH_CHECK(cond, "dpkernels: ", __VA_ARGS__)

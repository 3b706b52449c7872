// The CUDA kernels of csrc/cuda/*.cu, registered for the ops csrc/ops.cpp defines. Compiled by the
// host compiler into dpkernels._C when the CUDA part is built: torch/library.h stays out of the .cu
// files, whose nvcc passes would each parse it again (csrc/include/dpkernels/kernels.h).
#include <torch/library.h>

#include "dpkernels/kernels.h"

TORCH_LIBRARY_IMPL(dpkernels_C, CUDA, m) {
#define DPK_REGISTER_CUDA(op, kernel, ret, params) m.impl(#op, &dpkernels::kernel##_cuda);
  DPK_FOR_EACH_KERNEL(DPK_REGISTER_CUDA)
#undef DPK_REGISTER_CUDA
}

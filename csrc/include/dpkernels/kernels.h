// The native ops' kernels, declared once: for each op of csrc/ops.cpp, `<kernel>_cpu` (csrc/cpu/,
// built once per instruction set) and `<kernel>_cuda` (csrc/cuda/). They are registered with the
// dispatcher in one file per device (csrc/cpu/module.cpp, csrc/cuda/register.cpp), so that the
// kernels' own translation units include neither torch/library.h nor ATen/ATen.h: under nvcc, whose
// device passes parse every header again, those two cost ~35 s and ~40 s per file, against ~14 s
// for ATen/core/Tensor.h (docs/BENCHMARKS.md, "Build time").
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

namespace dpkernels {

using OptionalTensor = std::optional<at::Tensor>;
using TensorPair = std::tuple<at::Tensor, at::Tensor>;
using ClipPipelineOut = std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor>;  // sums, norms, weights

// X(op, kernel, return type, parameters) for every op, in csrc/ops.cpp's order, with the C++ types of
// its schema (the dispatcher checks each registered kernel against the schema when it loads).
// kernel is the op's name without an in-place op's trailing underscore.
// clang-format off
#define DPK_FOR_EACH_KERNEL(X)                                                                               \
  X(per_sample_sumsq, per_sample_sumsq, at::Tensor,                                                          \
    (at::TensorList grads, at::ArrayRef<double> coeffs, at::TensorList shift, at::TensorList scale))         \
  X(clip_factors, clip_factors, at::Tensor,                                                                  \
    (const at::Tensor& norms, at::ArrayRef<double> max_grad_norm, c10::string_view mode, double r))          \
  X(weighted_sum, weighted_sum, std::vector<at::Tensor>,                                                     \
    (at::TensorList grads, at::ArrayRef<double> coeffs, const at::Tensor& weights))                          \
  X(clip_pipeline, clip_pipeline, ClipPipelineOut,                                                           \
    (at::TensorList grads, at::ArrayRef<double> coeffs, at::ArrayRef<double> max_grad_norm,                  \
     c10::string_view mode, double r, at::TensorList shift, at::TensorList scale, bool per_layer,            \
     bool drop_nonfinite, double norm_scale, c10::string_view rng, double noise_std, at::IntArrayRef key,    \
     int64_t step, int64_t stream, double out_scale, at::TensorList noise))                                  \
  X(philox_uint32_, philox_uint32, void,                                                                     \
    (at::Tensor& out, int64_t seed, int64_t step, int64_t stream, int64_t offset))                           \
  X(gaussian_fill_, gaussian_fill, void,                                                                     \
    (at::Tensor& out, double std, int64_t seed, int64_t step, int64_t stream, int64_t offset))               \
  X(add_gaussian_noise_, add_gaussian_noise, void,                                                           \
    (at::TensorList tensors, double std, int64_t seed, int64_t step, int64_t stream,                         \
     int64_t offset))                                                                                        \
  X(chacha20_uint32_, chacha20_uint32, void,                                                                 \
    (at::Tensor& out, at::IntArrayRef key, int64_t step, int64_t stream, int64_t offset))                    \
  X(chacha20_gaussian_fill_, chacha20_gaussian_fill, void,                                                   \
    (at::Tensor& out, double std, at::IntArrayRef key, int64_t step, int64_t stream,                         \
     int64_t offset))                                                                                        \
  X(chacha20_add_gaussian_noise_, chacha20_add_gaussian_noise, void,                                         \
    (at::TensorList tensors, double std, at::IntArrayRef key, int64_t step,                                  \
     int64_t stream, int64_t offset))                                                                        \
  X(linear_filter_, linear_filter, void,                                                                     \
    (at::TensorList inputs, at::TensorList state, at::TensorList out, at::ArrayRef<double> coeffs,           \
     bool accumulate, double noise_std, int64_t seed, int64_t step, int64_t stream, int64_t offset))         \
  X(sgd_step_, sgd_step, void,                                                                               \
    (at::TensorList params, at::TensorList sums, at::TensorList state, at::ArrayRef<double> dir_coeffs,      \
     at::TensorList past, at::TensorList noise, at::TensorList noise_state,                                  \
     at::ArrayRef<double> noise_coeffs, double noise_std, int64_t seed, int64_t step, int64_t stream,        \
     int64_t offset, at::ArrayRef<double> hyper))                                                            \
  X(dp2_step_, dp2_step, void, DPK_FAMILY_STEP_PARAMS)                                                       \
  X(adam_step_, adam_step, void, DPK_FAMILY_STEP_PARAMS)                                                     \
  X(macadam_step_, macadam_step, at::Tensor, DPK_FAMILY_STEP_PARAMS)                                         \
  X(linear_sumsq_tiled, linear_sumsq_tiled, at::Tensor,                                                      \
    (const at::Tensor& a, const at::Tensor& g, const OptionalTensor& scale,                                  \
     const OptionalTensor& shift))                                                                           \
  X(conv2d_sumsq_tiled, conv2d_sumsq_tiled, at::Tensor,                                                      \
    (const at::Tensor& x, const at::Tensor& g, at::IntArrayRef kernel_size, at::IntArrayRef stride,          \
     at::IntArrayRef padding, at::IntArrayRef dilation, const OptionalTensor& scale,                         \
     const OptionalTensor& shift))
// Ops with a CPU kernel only: on CUDA their Python callers use an ATen op instead (cuDNN).
#define DPK_FOR_EACH_CPU_KERNEL(X)                                                                           \
  X(conv2d_weighted_sum, conv2d_weighted_sum, at::Tensor,                                                    \
    (const at::Tensor& x, const at::Tensor& g, const at::Tensor& weights, at::IntArrayRef kernel_size,       \
     at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation))                             \
  X(linear_sumsq_gram, linear_sumsq_gram, at::Tensor, (const at::Tensor& a, const at::Tensor& g))           \
  X(linear_sumsq_t1, linear_sumsq_t1, at::Tensor,                                                            \
    (const at::Tensor& a, const at::Tensor& g, const OptionalTensor& scale, const OptionalTensor& shift))     \
  X(conv2d_sumsq_grad_sample, conv2d_sumsq_grad_sample, TensorPair,                                          \
    (const at::Tensor& x, const at::Tensor& g, at::IntArrayRef kernel_size, at::IntArrayRef stride,          \
     at::IntArrayRef padding, at::IntArrayRef dilation, const OptionalTensor& scale,                         \
     const OptionalTensor& shift))
// The parameters of the dp2, adam and macadam steps.
#define DPK_FAMILY_STEP_PARAMS                                                                               \
  (at::TensorList params, at::TensorList sums, at::TensorList state, at::TensorList noise,                   \
   at::TensorList noise_state, at::ArrayRef<double> noise_coeffs, double noise_std, int64_t seed,            \
   int64_t step, int64_t stream, int64_t offset, at::ArrayRef<double> hyper)
// clang-format on

#define DPK_DECLARE_KERNELS(op, kernel, ret, params) \
  ret kernel##_cpu params;                           \
  ret kernel##_cuda params;
DPK_FOR_EACH_KERNEL(DPK_DECLARE_KERNELS)
#undef DPK_DECLARE_KERNELS
#define DPK_DECLARE_CPU_KERNEL(op, kernel, ret, params) ret kernel##_cpu params;
DPK_FOR_EACH_CPU_KERNEL(DPK_DECLARE_CPU_KERNEL)
#undef DPK_DECLARE_CPU_KERNEL

}  // namespace dpkernels

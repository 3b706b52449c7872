// What the translation units of the CUDA clipping ops share (schemas in csrc/ops.cpp, element math in
// clip_math.h, semantics in dpkernels/reference/clip.py): clip_norms.cu (the norms pass,
// per_sample_sumsq), clip_sum.cu (the sum pass and its private epilogue, weighted_sum) and
// clip_pipeline.cu (clip_factors and the fused clip_pipeline, which runs both passes). The two passes
// stream the k gradient sets of every parameter through the driver of multi_tensor.cuh; their table
// has two op-specific lists first, then the gradient sets.
//
// [note: determinism]
// per_sample_sumsq writes one fp64 partial per (sample, chunk) into a [B, num_chunks] buffer, and a
// second kernel sums the contiguous chunk range of each parameter in a fixed order. weighted_sum gives
// every output element to one thread, which walks the samples in order. No atomics anywhere, so both
// results are bitwise reproducible from run to run.
//
// [note: alignment]
// A parameter takes the 128-bit path (its slot's width is ilp, see [note: vector and tail paths] in
// multi_tensor.cuh) when every row of every gradient set (and of the other lists) starts on a 16-byte
// boundary: 16-byte aligned base pointers and a per-sample numel that is a multiple of the vector
// width. Chunk starts are multiples of the vector width too, so on that path a thread's vector is
// either entirely inside the parameter or entirely past its end, and no tail loop is needed. Any other
// parameter takes the tail path, in which thread t reads elements t, t + blockDim, ..., which is just
// as coalesced, only with 4-byte or 2-byte transactions per thread.
#pragma once

#include <ATen/core/Tensor.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "dpkernels/clip_layout.h"
#include "dpkernels/macros.h"
#include "multi_tensor.cuh"

namespace dpkernels {

// The interface between the clipping translation units (external linkage, so outside the anonymous
// namespace below).
namespace cuda_clip {

// What weighted_sum_kernel does with a finished accumulator, by value in the kernel arguments; the
// CUDA twin of SumEpilogue in csrc/cpu/clip.cpp. kNone is the plain weighted sum.
enum class SumMode : int32_t { kNone, kScale, kNoise, kPhilox, kChacha };
struct SumEpilogue {
  uint64_t seed = 0;              // Philox key
  float std = 0.f;                // kPhilox: ν = std * z(global index)
  float scale = 1.f;              // out = (S + ν) * scale
  uint32_t step = 0, stream = 0;  // Philox counter words 2 and 3
  SumMode mode = SumMode::kNone;
  // kChacha: device array of the 8 key words, step, stream and the float64 std (low, high word); in
  // memory because the key does not fit the scalar argument budget.
  const uint32_t* chacha = nullptr;
};

// The norms pass over inputs already checked into lay: [B, L] float64 sums of squares (clip_norms.cu).
at::Tensor sumsq_pass(at::TensorList grads, at::ArrayRef<double> coeffs, at::TensorList shift,
                      at::TensorList scale, const ClipLayout& lay);

// The sum pass over inputs already checked into lay, with the epilogue ep (mode kNone: the plain op).
// noise: empty, or the pre-drawn noise of every parameter (ep.mode == kNoise), already checked by
// clip_pipeline_cuda (clip_sum.cu).
std::vector<at::Tensor> sum_pass(at::TensorList grads, at::ArrayRef<double> coeffs, const at::Tensor& weights,
                                 const SumEpilogue& ep, at::TensorList noise, const ClipLayout& lay);

}  // namespace cuda_clip

namespace {

// Parameters per reduction launch, and clip bounds per clip_factors launch.
constexpr int kMaxRanges = kLargeKernelArgs ? 3072 : 448;
// Gradient sets (DP-PMLF's k) per call; their coefficients ride in every launch's arguments.
constexpr int kMaxSets = 64;

// The table of both passes: lists kExtraA and kExtraB (per pass: shift and scale, or out and noise;
// null when absent), then gradient set j at kGradList + j. 2 + k pointers per slot.
constexpr int kExtraA = 0, kExtraB = 1, kGradList = 2;
using ClipTable = TensorTable<kLargeKernelArgs ? 512 : 40, kLargeKernelArgs ? 1536 : 160>;
static_assert(ClipTable::kPtrs >= kGradList + kMaxSets);

// Coefficients α_j of the gradient sets, in fp32 like the math.
struct SetCoeffs {
  float alpha[kMaxSets];
  int32_t k;
};
static_assert(sizeof(ClipTable) + sizeof(SetCoeffs) + kScalarArgBytes <= kArgBytes);

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// Elements per 128-bit load.
constexpr int ilp(int64_t itemsize) { return static_cast<int>(16 / itemsize); }

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------------------------
// Device helpers.
// ---------------------------------------------------------------------------------------------

// Loads the N elements that a thread owns from offset c of p (a chunk), widened to fp32. kVec: N
// consecutive elements as 128-bit loads (p + c aligned, and c < len implies c + N <= len). Otherwise
// elements c, c + kStride, ..., so that a warp reads consecutive addresses. Offsets at or past len
// read as 0. Offsets are 32-bit (a chunk is small); the 64-bit part of the address is in p.
template <int N, bool kVec, int kStride, typename T>
__device__ __forceinline__ void load_elems(const T* p, int c, int len, float (&x)[N]) {
  if constexpr (kVec) {
    if (c < len) {
      load_vec<ilp(sizeof(T))>(p + c, x);
    } else {
#pragma unroll
      for (int e = 0; e < N; ++e) x[e] = 0.f;
    }
  } else {
    load_tail<N, kStride, false>(p, c, len, x);
  }
}

// Whether element e of the group that load_elems read from offset c lies before len.
template <bool kVec, int kStride>
__device__ __forceinline__ bool in_range(int c, int e, int len) {
  return kVec ? c < len : c + e * kStride < len;
}

template <typename T>
__device__ __forceinline__ const T* grad_row(const ClipTable& tab, int s, int j, int64_t row_offset) {
  return tab.tensor<const T>(s, kGradList, j) + row_offset;
}

// Fixed shuffle tree, so the rounding of the sum does not depend on timing.
__device__ __forceinline__ double warp_sum(double x) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off /= 2) x += __shfl_down_sync(kFullMask, x, off);
  return x;
}

// ---------------------------------------------------------------------------------------------
// Host helpers.
// ---------------------------------------------------------------------------------------------

// check_clip_inputs checks the device type only; one kernel reads all tensors, so they must share
// one device.
inline void check_one_device(at::TensorList grads, at::TensorList shift, at::TensorList scale) {
  const c10::Device dev = grads[0].device();
  for (size_t t = 0; t < grads.size(); ++t) {
    DPK_CHECK(grads[t].device() == dev, "grads[", t, "] is on ", grads[t].device(), " but grads[0] is on ",
              dev);
  }
  for (size_t t = 0; t < shift.size(); ++t) {
    DPK_CHECK(shift[t].device() == dev, "shift[", t, "] is on ", shift[t].device(), ", expected ", dev);
  }
  for (size_t t = 0; t < scale.size(); ++t) {
    DPK_CHECK(scale[t].device() == dev, "scale[", t, "] is on ", scale[t].device(), ", expected ", dev);
  }
}

// Every check of the clipping ops' inputs, once per call: the layout, one device, the set count.
inline ClipLayout check_cuda_inputs(at::TensorList grads, at::ArrayRef<double> coeffs, at::TensorList shift,
                                    at::TensorList scale) {
  ClipLayout lay = check_clip_inputs(grads, coeffs, shift, scale, c10::DeviceType::CUDA);
  check_one_device(grads, shift, scale);
  DPK_CHECK(lay.k <= kMaxSets, "the cuda kernels combine at most ", kMaxSets, " gradient sets, got ", lay.k);
  return lay;
}

inline SetCoeffs set_coeffs(at::ArrayRef<double> coeffs) {
  SetCoeffs sets{};
  sets.k = static_cast<int32_t>(coeffs.size());
  for (size_t j = 0; j < coeffs.size(); ++j) sets.alpha[j] = static_cast<float>(coeffs[j]);
  return sets;
}

// The nonempty parameters by storage dtype; a parameter's elem0 is its global flat index in parameter
// order (docs/RNG.md §1), on which the sum pass's noise is keyed.
inline TypeGroups param_groups(at::TensorList grads, const ClipLayout& lay) {
  return group_by_type(tensor_refs(lay.numel, 0), [&](int64_t l) { return grads[l].scalar_type(); });
}

// Writes the table row of parameter l (lists a and b, then its k gradient sets) and returns its width
// (see [note: alignment]).
inline int clip_row(const void** row, at::TensorList grads, const ClipLayout& lay, int64_t l, const void* a,
                    const void* b) {
  row[kExtraA] = a;
  row[kExtraB] = b;
  for (int64_t j = 0; j < lay.k; ++j) row[kGradList + j] = grads[j * lay.L + l].const_data_ptr();
  const int width = ilp(grads[l].element_size());
  return lay.numel[l] % width == 0 && all_aligned(row, kGradList + static_cast<int>(lay.k), 16) ? width : 1;
}

}  // namespace
}  // namespace dpkernels

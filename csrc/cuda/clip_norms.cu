// The norms pass of the CUDA clipping ops (see clip.cuh): per_sample_sumsq, and the first stage of
// clip_pipeline. per_sample_sumsq_kernel streams every parameter's chunks for a group of samples at
// once and writes one fp64 partial per (sample, chunk); sumsq_reduce_kernel sums each parameter's
// partials (see [note: determinism] in clip.cuh).
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "clip.cuh"
#include "dpkernels/clip_layout.h"
#include "dpkernels/clip_math.h"
#include "dpkernels/dispatch.h"
#include "dpkernels/kernels.h"
#include "dpkernels/macros.h"
#include "multi_tensor.cuh"

namespace dpkernels {
namespace {

// per_sample_sumsq: one block reduces a chunk of kSumsqSteps block-wide 128-bit steps (16 KiB of a
// row) for kSumsqSamples samples at once. The samples of a block share every shift/scale load, and
// their rows are the loads a thread keeps in flight.
constexpr int kSumsqThreads = 256;
constexpr int kSumsqSteps = 4;
constexpr int kSumsqSamples = 4;
// Resident blocks per SM that the register budget must allow (<= 85 registers). By Little's law an
// SM needs about 20 KiB of loads in flight to stream at full HBM bandwidth on H100 (3.35 TB/s x
// ~0.8 us / 132 SMs); 768 threads x 64 bytes is 48 KiB. An estimate, not a measurement.
constexpr int kSumsqMinBlocks = 3;
constexpr int kReduceThreads = 256;
// per_sample_sumsq puts the chunks of a launch on gridDim.y.
constexpr int64_t kMaxGridY = 65535;

template <typename T>
using SumsqChunks = Chunking<int64_t{kSumsqThreads} * ilp(sizeof(T)) * kSumsqSteps>;

// Parameters first_param .. first_param + count - 1; the chunks of parameter first_param + e are
// columns begin[e] .. begin[e] + len[e] - 1 of the partial buffer.
struct RangeArgs {
  int32_t begin[kMaxRanges];
  int32_t len[kMaxRanges];
  int32_t first_param;
  int32_t count;
};
static_assert(sizeof(RangeArgs) + kScalarArgBytes <= kArgBytes);

// Block-wide sums of x[0 .. S-1], valid in thread 0.
template <int kThreads, int S>
__device__ __forceinline__ void block_sums(double (&x)[S]) {
  constexpr int kWarps = kThreads / kWarp;
  __shared__ double warp_sums[S][kWarps];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
  for (int q = 0; q < S; ++q) {
    x[q] = warp_sum(x[q]);
    if (lane == 0) warp_sums[q][warp] = x[q];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int q = 0; q < S; ++q) x[q] = warp_sum(lane < kWarps ? warp_sums[q][lane] : 0.0);
  }
}

// acc[q] = Σ over the elements this thread owns in the chunk [start, start + len[q]) of row
// i0 + q of slot s, of shift_scale(Σ_j α_j g_j)². len[q] is 0 for a row past the batch. Combination
// and shift/scale in fp32, as on every backend. The square is taken in fp64: the square of an fp32
// value is exact there and cannot overflow, and it costs the same one conversion and one fp64
// instruction per element as squaring in fp32 and adding in fp64.
template <typename T, bool kShift, bool kScale, bool kVec>
__device__ __forceinline__ void sumsq_thread(const ClipTable& tab, const SetCoeffs& sets, int s, int64_t n,
                                             int64_t start, int64_t i0, const int (&len)[kSumsqSamples],
                                             double (&acc)[kSumsqSamples]) {
  // Elements per thread and step: one 128-bit vector, or on the scalar path half as many single
  // loads, so that S rows of them fit in the same registers.
  constexpr int N = kVec ? ilp(sizeof(T)) : ilp(sizeof(T)) / 2;
  constexpr int S = kSumsqSamples;
  constexpr int kStride = kVec ? 1 : kSumsqThreads;
  constexpr int kStep = kSumsqThreads * N;
  const int k = sets.k;
  const float alpha0 = sets.alpha[0];
  int64_t offset[S];
#pragma unroll
  for (int q = 0; q < S; ++q) offset[q] = (i0 + q) * n + start;
  const float* shift = kShift ? tab.tensor<const float>(s, kExtraA) + start : nullptr;
  const float* scale = kScale ? tab.tensor<const float>(s, kExtraB) + start : nullptr;
  const int first = kVec ? static_cast<int>(threadIdx.x) * N : static_cast<int>(threadIdx.x);
  // Block-uniform trip count: a short chunk stops after the steps it needs. Not unrolled: the S
  // rows already keep S loads per thread in flight, and unrolling would multiply the registers.
#pragma unroll 1
  for (int c = first; c - first < len[0]; c += kStep) {
    float v[S][N];
#pragma unroll
    for (int q = 0; q < S; ++q) {
      load_elems<N, kVec, kStride>(grad_row<T>(tab, s, 0, offset[q]), c, len[q], v[q]);
#pragma unroll
      for (int e = 0; e < N; ++e) v[q][e] *= alpha0;
    }
#pragma unroll 1
    for (int j = 1; j < k; ++j) {
      const float aj = sets.alpha[j];
#pragma unroll
      for (int q = 0; q < S; ++q) {
        float x[N];
        load_elems<N, kVec, kStride>(grad_row<T>(tab, s, j, offset[q]), c, len[q], x);
#pragma unroll
        for (int e = 0; e < N; ++e) v[q][e] = fmaf(aj, x[e], v[q][e]);
      }
    }
    float sh[N], sc[N];
    if constexpr (kShift) load_elems<N, kVec, kStride>(shift, c, len[0], sh);
    if constexpr (kScale) load_elems<N, kVec, kStride>(scale, c, len[0], sc);
#pragma unroll
    for (int q = 0; q < S; ++q) {
#pragma unroll
      for (int e = 0; e < N; ++e) {
        // Out-of-range lanes hold 0, but (0 - shift) * scale need not be 0.
        if (in_range<kVec, kStride>(c, e, len[q])) {
          const double y = shift_scale<kShift, kScale>(v[q][e], kShift ? sh[e] : 0.f, kScale ? sc[e] : 1.f);
          acc[q] = fma(y, y, acc[q]);
        }
      }
    }
  }
}

// partial[i, chunk_base + b] = Σ_{e in chunk b} shift_scale(Σ_j α_j g_j[i, e], shift[e], scale[e])²
// in fp64, for launch chunk b = blockIdx.y and the kSumsqSamples samples i of blockIdx.x. Samples
// vary fastest over the grid, so the blocks that reread one chunk of shift/scale run close together
// and find it in L2.
template <typename T, bool kShift, bool kScale>
__global__ void __launch_bounds__(kSumsqThreads, kSumsqMinBlocks)
    per_sample_sumsq_kernel(const __grid_constant__ ClipTable tab, const __grid_constant__ SetCoeffs sets,
                            int64_t chunk_base, int64_t B, int64_t num_chunks, double* __restrict__ partial) {
  constexpr int64_t kChunk = SumsqChunks<T>::kElems;
  constexpr int S = kSumsqSamples;
  const ChunkRef ch = SumsqChunks<T>::locate(tab, blockIdx.y);
  const int64_t start = SumsqChunks<T>::start(ch);
  const int64_t i0 = int64_t{blockIdx.x} * S;
  int len[S];
#pragma unroll
  for (int q = 0; q < S; ++q) len[q] = i0 + q < B ? static_cast<int>(std::min(kChunk, ch.numel - start)) : 0;
  double acc[S];
#pragma unroll
  for (int q = 0; q < S; ++q) acc[q] = 0.0;
  if (ch.width != 1) {
    sumsq_thread<T, kShift, kScale, true>(tab, sets, ch.slot, ch.numel, start, i0, len, acc);
  } else {
    sumsq_thread<T, kShift, kScale, false>(tab, sets, ch.slot, ch.numel, start, i0, len, acc);
  }
  block_sums<kSumsqThreads>(acc);
  if (threadIdx.x == 0) {
    double* out = partial + i0 * num_chunks + chunk_base + blockIdx.y;
#pragma unroll
    for (int q = 0; q < S; ++q) {
      if (len[q] > 0) out[q * num_chunks] = acc[q];
    }
  }
}

// out[i, l] = Σ_{c < len} partial[i, begin + c] for l = first_param + e: one warp per (i, e), lanes
// striding over the chunks, then a fixed shuffle tree.
__global__ void __launch_bounds__(kReduceThreads)
    sumsq_reduce_kernel(const __grid_constant__ RangeArgs a, int64_t B, int64_t L, int64_t num_chunks,
                        const double* __restrict__ partial, double* __restrict__ out) {
  const int64_t w = (int64_t{blockIdx.x} * kReduceThreads + threadIdx.x) / kWarp;
  if (w >= B * a.count) return;  // whole warps leave, so the shuffles below see full warps
  const int lane = threadIdx.x % kWarp;
  const int64_t i = w / a.count;
  const int e = static_cast<int>(w - i * a.count);
  const double* p = partial + i * num_chunks + a.begin[e];
  double acc = 0.0;
  for (int c = lane; c < a.len[e]; c += kWarp) acc += p[c];
  acc = warp_sum(acc);
  if (lane == 0) out[i * L + a.first_param + e] = acc;
}

}  // namespace

at::Tensor per_sample_sumsq_cuda(at::TensorList grads, at::ArrayRef<double> coeffs, at::TensorList shift,
                                 at::TensorList scale) {
  return cuda_clip::sumsq_pass(grads, coeffs, shift, scale, check_cuda_inputs(grads, coeffs, shift, scale));
}

at::Tensor cuda_clip::sumsq_pass(at::TensorList grads, at::ArrayRef<double> coeffs, at::TensorList shift,
                                 at::TensorList scale, const ClipLayout& lay) {
  const c10::cuda::CUDAGuard guard(grads[0].device());
  const auto opts = grads[0].options().dtype(at::kDouble);
  const TypeGroups groups = param_groups(grads, lay);

  // Global chunk numbering: dtype groups in kStorageTypes order, parameters in order within a group,
  // chunks in order within a parameter; for_each_table emits them in exactly this order.
  std::vector<int64_t> chunk_begin(lay.L), chunk_len(lay.L);
  int64_t num_chunks = 0;
  for_each_type(groups, [&](auto tag, const std::vector<TensorRef>& refs) {
    for (const TensorRef& t : refs) {
      chunk_begin[t.index] = num_chunks;
      chunk_len[t.index] = SumsqChunks<typename decltype(tag)::type>::count(t.numel, t.elem0);
      num_chunks += chunk_len[t.index];
    }
  });
  if (lay.B == 0 || num_chunks == 0) return at::zeros({lay.B, lay.L}, opts);
  DPK_CHECK(num_chunks <= std::numeric_limits<int32_t>::max(), "too many elements per sample: ", num_chunks,
            " chunks");

  // Both are written in full (new_output poisons them under the test suite, which would expose a
  // missed partial as a NaN sum).
  auto partial = new_output({lay.B, num_chunks}, opts);
  auto out = new_output({lay.B, lay.L}, opts);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool has_shift = !shift.empty(), has_scale = !scale.empty();
  const int64_t sample_groups = ceil_div(lay.B, kSumsqSamples);
  DPK_CHECK(sample_groups <= std::numeric_limits<int32_t>::max(), "batch too large: ", lay.B);
  const SetCoeffs sets = set_coeffs(coeffs);
  const int lists = kGradList + static_cast<int>(lay.k);

  int64_t launched = 0;  // chunks covered by the launches of the dtype groups before
  for_each_type(groups, [&](auto tag, const std::vector<TensorRef>& refs) {
    using T = typename decltype(tag)::type;
    dispatch_shift_scale(has_shift, has_scale, [&](auto shift_tag, auto scale_tag) {
      constexpr bool kShift = decltype(shift_tag)::value, kScale = decltype(scale_tag)::value;
      const auto fill = [&](const void** row, const TensorRef& t) {
        return clip_row(row, grads, lay, t.index, kShift ? shift[t.index].const_data_ptr() : nullptr,
                        kScale ? scale[t.index].const_data_ptr() : nullptr);
      };
      const int64_t chunks = for_each_table<SumsqChunks<T>, ClipTable>(
          refs, lists, kMaxGridY, fill, [&](const ClipTable& tab, int64_t n, int64_t chunk_base) {
            per_sample_sumsq_kernel<T, kShift, kScale>
                <<<dim3(static_cast<unsigned>(sample_groups), static_cast<unsigned>(n)), kSumsqThreads, 0,
                   stream>>>(tab, sets, launched + chunk_base, lay.B, num_chunks, partial.data_ptr<double>());
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          });
      launched += chunks;
    });
  });
  TORCH_INTERNAL_ASSERT(launched == num_chunks);

  // Every (i, l) is written, including parameters with no elements (an empty range sums to 0).
  RangeArgs ranges{};
  for (int64_t l0 = 0; l0 < lay.L; l0 += kMaxRanges) {
    ranges.first_param = static_cast<int32_t>(l0);
    ranges.count = static_cast<int32_t>(std::min<int64_t>(kMaxRanges, lay.L - l0));
    for (int e = 0; e < ranges.count; ++e) {
      ranges.begin[e] = static_cast<int32_t>(chunk_begin[l0 + e]);
      ranges.len[e] = static_cast<int32_t>(chunk_len[l0 + e]);
    }
    const int64_t blocks = ceil_div(lay.B * ranges.count * kWarp, kReduceThreads);
    DPK_CHECK(blocks <= std::numeric_limits<int32_t>::max(), "batch too large: ", lay.B);
    sumsq_reduce_kernel<<<static_cast<unsigned>(blocks), kReduceThreads, 0, stream>>>(
        ranges, lay.B, lay.L, num_chunks, partial.const_data_ptr<double>(), out.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

}  // namespace dpkernels

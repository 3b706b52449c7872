// CUDA kernel of linear_filter_ (math: filter.h; semantics: dpkernels/reference/filter.py; the CPU
// kernel is csrc/cpu/filter.cpp).
//
// [note: filter work items]
// The streaming skeleton of step_stream.cuh (see [note: stream work items] and [note: stream
// launches]): one thread per Philox block, x = inputs + s z as an F4, filter_step() once on it with the
// state buffers moved 16 bytes at a time when the slot is aligned. A buffer that feeds y and keeps
// part of its old value (c_k != 0, d_k != 0) is loaded twice (once for y, once for its update); the
// second load is an L1 hit. Products and sums are rounded as in the reference ([note: stream
// rounding]).
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "dpkernels/filter.h"
#include "dpkernels/filter_layout.h"
#include "dpkernels/kernels.h"
#include "dpkernels/macros.h"
#include "dpkernels/noise_key.h"
#include "multi_tensor.cuh"
#include "step_stream.cuh"

namespace dpkernels {
namespace {

// Tensor lists of the table: inputs, out, then state buffer k at kFilterState + k.
constexpr int kFilterIn = 0, kFilterOut = 1, kFilterState = 2;
static_assert(sizeof(StreamTable) + sizeof(FilterCoeffs) + kScalarArgBytes <= kArgBytes);
static_assert(kFilterState + kMaxFilterBuffers <= StreamTable::kPtrs);

// Flags of one launch (uniform over the grid).
struct FilterFlags {
  bool has_in, has_out, accumulate, noise;
};

template <typename T>
__global__ void __launch_bounds__(kStreamThreads)
    filter_kernel(const __grid_constant__ StreamTable tab, const __grid_constant__ FilterCoeffs fc,
                  int64_t num_chunks, NoiseKey key, float s, FilterFlags fl) {
  const auto body = [&](const BlockRef& b, uint64_t block) {
    F4 x(0.f);
    if (fl.has_in) x = b.load<T>(kFilterIn);
    if (fl.noise) {
      const F4 sz = F4(s) * philox_normals(key, block);
      x = fl.has_in ? x + sz : sz;
    }
    const auto load = [&](int k) { return b.load<float>(kFilterState + k); };
    const auto store = [&](int k, const F4& v) { b.store<float>(kFilterState + k, v); };
    F4 y = filter_step(fc, x, load, store);
    if (fl.has_out) {
      if (fl.accumulate) y = b.load<T>(kFilterOut) + y;
      b.store<T>(kFilterOut, y);
    }
  };
  stream_blocks(tab, num_chunks, body, [](int64_t) {});
}

}  // namespace

void linear_filter_cuda(at::TensorList inputs, at::TensorList state, at::TensorList out,
                        at::ArrayRef<double> coeffs, bool accumulate, double noise_std, int64_t seed,
                        int64_t step, int64_t stream, int64_t offset) {
  const FilterLayout lay = check_filter_inputs(inputs, state, out, coeffs, noise_std, c10::DeviceType::CUDA);
  const NoiseKey key = make_key(seed, step, stream);
  DPK_CHECK(offset >= 0, "offset must be >= 0, got ", offset);
  const c10::cuda::CUDAGuard guard(common_device({out, inputs, state}));
  const int K = lay.fc.K;
  const FilterFlags fl{!inputs.empty(), !out.empty(), accumulate, noise_std > 0};
  const float s = static_cast<float>(noise_std);
  const TypeGroups groups = group_by_type(tensor_refs(lay.numel, offset), [&](int64_t l) {
    return !out.empty() ? out[l].scalar_type() : (!inputs.empty() ? inputs[l].scalar_type() : at::kFloat);
  });
  const auto fill = [&](const void** row, const TensorRef& t) {
    const int64_t l = t.index;
    row[kFilterIn] = inputs.empty() ? nullptr : inputs[l].data_ptr();
    row[kFilterOut] = out.empty() ? nullptr : out[l].data_ptr();
    for (int k = 0; k < K; ++k) row[kFilterState + k] = state[k * lay.L + l].data_ptr();
    return stream_width(row, kFilterState + K, t.elem0);
  };
  const cudaStream_t cuda_stream = at::cuda::getCurrentCUDAStream();
  for_each_type(groups, [&](auto tag, const std::vector<TensorRef>& refs) {
    const auto kernel = filter_kernel<typename decltype(tag)::type>;
    for_each_table<StreamChunks, StreamTable>(
        refs, kFilterState + K, kAnyChunks, fill, [&](const StreamTable& tab, int64_t chunks, int64_t) {
          kernel<<<one_wave(kernel, kStreamThreads, chunks), kStreamThreads, 0, cuda_stream>>>(
              tab, lay.fc, chunks, key, s, fl);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
  });
}

}  // namespace dpkernels

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
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <vector>

#include "dpkernels/dispatch.h"
#include "dpkernels/filter.h"
#include "dpkernels/filter_layout.h"
#include "dpkernels/macros.h"
#include "dpkernels/noise_key.h"
#include "launch_args.cuh"
#include "step_stream.cuh"

namespace dpkernels {
namespace {

// Tensor lists of the table: inputs, out, then state buffer k at kFilterState + k.
constexpr int kFilterIn = 0, kFilterOut = 1, kFilterState = 2;
static_assert(sizeof(StreamTable) + sizeof(FilterCoeffs) + kScalarArgBytes <= kArgBytes);
static_assert(kFilterState + kMaxFilterBuffers <= kStreamPtrs);

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

template <typename T>
void launch_filter(const std::vector<StreamItem>& items, const FilterCoeffs& fc, const NoiseKey& key, float s,
                   FilterFlags fl) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  for_each_stream_table(items, kFilterState + fc.K, [&](const StreamTable& tab, int64_t chunks, int64_t) {
    filter_kernel<T>
        <<<stream_grid(filter_kernel<T>, chunks), kStreamThreads, 0, stream>>>(tab, fc, chunks, key, s, fl);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void linear_filter_cuda(at::TensorList inputs, at::TensorList state, at::TensorList out,
                        at::ArrayRef<double> coeffs, bool accumulate, double noise_std, int64_t seed,
                        int64_t step, int64_t stream, int64_t offset) {
  const FilterLayout lay = check_filter_inputs(inputs, state, out, coeffs, noise_std, c10::DeviceType::CUDA);
  const NoiseKey key = make_key(seed, step, stream);
  DPK_CHECK(offset >= 0, "offset must be >= 0, got ", offset);
  const c10::cuda::CUDAGuard guard(common_device({out, inputs, state}));
  const int K = lay.fc.K;
  const FilterFlags fl{!inputs.empty(), !out.empty(), accumulate, noise_std > 0};
  std::array<std::vector<StreamItem>, kStreamTypes.size()> groups;
  int64_t base = offset;
  for (int64_t l = 0; l < lay.L; ++l) {
    if (lay.numel[l] > 0) {
      std::vector<void*> ptrs{inputs.empty() ? nullptr : inputs[l].data_ptr(),
                              out.empty() ? nullptr : out[l].data_ptr()};
      for (int k = 0; k < K; ++k) ptrs.push_back(state[k * lay.L + l].data_ptr());
      const at::ScalarType type =
          !out.empty() ? out[l].scalar_type() : (!inputs.empty() ? inputs[l].scalar_type() : at::kFloat);
      groups[stream_type_index(type)].push_back(make_stream_item(std::move(ptrs), lay.numel[l], base));
    }
    base += lay.numel[l];
  }
  const float s = static_cast<float>(noise_std);
  for (size_t g = 0; g < groups.size(); ++g) {
    DPK_DISPATCH_GRAD_TYPES(kStreamTypes[g], "linear_filter_",
                            [&] { launch_filter<scalar_t>(groups[g], lay.fc, key, s, fl); });
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(dpkernels_C, CUDA, m) { m.impl("linear_filter_", &linear_filter_cuda); }

}  // namespace dpkernels

// CUDA kernel of linear_filter_ (math: filter.h; semantics: dpkernels/reference/filter.py; the CPU
// kernel is csrc/cpu/filter.cpp).
//
// [note: filter work items]
// As the noise kernels (see [note: noise work items] in noise.cu): one thread owns one Philox block
// of the global index, i.e. 4 consecutive elements of one tensor, generates their 4 normals in
// registers when noise is on, and runs filter_step() once on them as an F4 (4 fp32 lanes): the
// state buffers are moved with one 16-byte access per buffer and thread when the slot is aligned
// (every pointer 16-byte aligned and the tensor's first element on a Philox block boundary), else
// element by element. All tensors of one storage dtype go in one launch through a __grid_constant__
// table (state pointers of slot s, buffer k at state[k * count + s]); CUDA blocks take chunks of
// kFilterChunk Philox blocks and find their tensor by a binary search over the first chunks, and the
// grid is one wave of resident blocks striding over the chunks.
//
// [note: filter rounding]
// F4 multiplies and adds with __fmul_rn/__fadd_rn, so nvcc does not contract them into FMAs: every
// product and sum is rounded as in the reference and the CPU kernel. A buffer that feeds y and keeps
// part of its old value (c_k != 0, d_k != 0) is loaded twice (once for y, once for its update); the
// second load is an L1 hit.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "dpkernels/dispatch.h"
#include "dpkernels/filter.h"
#include "dpkernels/filter_layout.h"
#include "dpkernels/macros.h"
#include "dpkernels/noise_key.h"
#include "dpkernels/philox.h"
#include "launch_args.cuh"

namespace dpkernels {
namespace {

constexpr int kFilterThreads = 256;
constexpr int kFilterIters = 4;  // Philox blocks per thread and chunk
constexpr int64_t kFilterChunk = int64_t{kFilterThreads} * kFilterIters;
// Tensors and state pointers per launch, within the kernel-argument budget.
constexpr int kFilterSlots = kLargeKernelArgs ? 256 : 24;
constexpr int kFilterStatePtrs = kLargeKernelArgs ? 1024 : 96;

struct FilterTable {
  const void* in[kFilterSlots];
  void* out[kFilterSlots];
  float* state[kFilterStatePtrs];
  int64_t numel[kFilterSlots];
  int64_t elem0[kFilterSlots];
  int64_t first_chunk[kFilterSlots];
  int32_t count;
  uint8_t aligned[kFilterSlots];  // slot s takes whole-vector accesses; see [note: filter work items]
};
static_assert(sizeof(FilterTable) + sizeof(FilterCoeffs) + kScalarArgBytes <= kArgBytes);

// Four fp32 lanes with separately rounded products and sums (see [note: filter rounding]).
struct F4 {
  float v[4];
  F4() = default;
  __device__ explicit F4(float s) : v{s, s, s, s} {}
  __device__ friend F4 operator+(const F4& a, const F4& b) {
    F4 r;
#pragma unroll
    for (int j = 0; j < 4; ++j) r.v[j] = __fadd_rn(a.v[j], b.v[j]);
    return r;
  }
  __device__ friend F4 operator*(const F4& a, const F4& b) {
    F4 r;
#pragma unroll
    for (int j = 0; j < 4; ++j) r.v[j] = __fmul_rn(a.v[j], b.v[j]);
    return r;
  }
};

// 4 elements of T at p + i0 (lanes outside [0, n) read as 0 / are not written). kVec: one access of
// 4 elements (16 bytes for fp32, 8 for 16-bit types), p + i0 aligned to it.
template <typename T>
using Raw4 = std::conditional_t<sizeof(T) == 4, uint4, uint2>;

template <typename T>
__device__ __forceinline__ F4 load4(const T* p, int64_t i0, int64_t n, bool vec) {
  F4 x(0.f);
  if (vec) {
    const Raw4<T> r = *reinterpret_cast<const Raw4<T>*>(p + i0);
    T v[4];
    memcpy(v, &r, sizeof(r));
#pragma unroll
    for (int j = 0; j < 4; ++j) x.v[j] = static_cast<float>(v[j]);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (i0 + j >= 0 && i0 + j < n) x.v[j] = static_cast<float>(p[i0 + j]);
    }
  }
  return x;
}

template <typename T>
__device__ __forceinline__ void store4(T* p, int64_t i0, int64_t n, bool vec, const F4& x) {
  T v[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] = static_cast<T>(x.v[j]);
  if (vec) {
    Raw4<T> r;
    memcpy(&r, v, sizeof(r));
    *reinterpret_cast<Raw4<T>*>(p + i0) = r;
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (i0 + j >= 0 && i0 + j < n) p[i0 + j] = v[j];
    }
  }
}

__device__ __forceinline__ int find_filter_slot(const FilterTable& tab, int64_t c) {
  int lo = 0, hi = tab.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tab.first_chunk[mid] <= c) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Flags of one launch (uniform over the grid).
struct FilterFlags {
  bool has_in, has_out, accumulate, noise;
};

template <typename T>
__global__ void __launch_bounds__(kFilterThreads)
    filter_kernel(const __grid_constant__ FilterTable tab, const __grid_constant__ FilterCoeffs fc,
                  int64_t num_chunks, NoiseKey key, float s, FilterFlags fl) {
  for (int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const int slot = find_filter_slot(tab, c);
    const int64_t n = tab.numel[slot], e0 = tab.elem0[slot];
    const bool aligned = tab.aligned[slot] != 0;
    const uint64_t first_block = static_cast<uint64_t>(e0) / 4;
    const int64_t lead = e0 % 4;
    const int64_t u0 = (c - tab.first_chunk[slot]) * kFilterChunk + threadIdx.x;
#pragma unroll 1
    for (int it = 0; it < kFilterIters; ++it) {
      const int64_t u = u0 + int64_t{it} * kFilterThreads;
      const int64_t i0 = 4 * u - lead;
      if (i0 >= n) break;
      const bool vec = aligned && i0 + 4 <= n;  // aligned slots have lead == 0
      F4 x(0.f);
      if (fl.has_in) x = load4(static_cast<const T*>(tab.in[slot]), i0, n, vec);
      if (fl.noise) {
        const Philox4 w =
            philox4x32_10(first_block + static_cast<uint64_t>(u), key.step, key.stream, key.seed);
        F4 z;
        box_muller(w.x[0], w.x[1], z.v[0], z.v[1]);
        box_muller(w.x[2], w.x[3], z.v[2], z.v[3]);
        const F4 sz = F4(s) * z;
        x = fl.has_in ? x + sz : sz;
      }
      const auto load = [&](int k) { return load4(tab.state[k * tab.count + slot], i0, n, vec); };
      const auto store = [&](int k, const F4& v) { store4(tab.state[k * tab.count + slot], i0, n, vec, v); };
      F4 y = filter_step(fc, x, load, store);
      if (fl.has_out) {
        T* o = static_cast<T*>(tab.out[slot]);
        if (fl.accumulate) y = load4(o, i0, n, vec) + y;
        store4(o, i0, n, vec, y);
      }
    }
  }
}

// A tensor's share of the work: numel > 0 elements from global index elem0.
struct FilterItem {
  const void* in;
  void* out;
  std::vector<float*> state;
  int64_t numel, elem0;
  bool aligned;
};

template <typename T>
void launch_filter(const std::vector<FilterItem>& items, const FilterCoeffs& fc, const NoiseKey& key, float s,
                   FilterFlags fl) {
  if (items.empty()) return;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, filter_kernel<T>, kFilterThreads, 0));
  const int64_t max_grid = int64_t{prop->multiProcessorCount} * std::max(1, per_sm);
  const int K = fc.K;
  const int max_count = std::min<int>(kFilterSlots, K > 0 ? kFilterStatePtrs / K : kFilterSlots);
  size_t next = 0;
  while (next < items.size()) {
    const int count = static_cast<int>(std::min<size_t>(max_count, items.size() - next));
    FilterTable tab{};
    tab.count = count;
    int64_t chunks = 0;
    for (int sl = 0; sl < count; ++sl) {
      const FilterItem& it = items[next + sl];
      tab.in[sl] = it.in;
      tab.out[sl] = it.out;
      for (int k = 0; k < K; ++k) tab.state[k * count + sl] = it.state[k];
      tab.numel[sl] = it.numel;
      tab.elem0[sl] = it.elem0;
      tab.aligned[sl] = it.aligned ? 1 : 0;
      tab.first_chunk[sl] = chunks;
      const int64_t blocks = (it.elem0 + it.numel + 3) / 4 - it.elem0 / 4;
      chunks += (blocks + kFilterChunk - 1) / kFilterChunk;
    }
    const auto grid = static_cast<unsigned>(std::min(chunks, max_grid));
    filter_kernel<T><<<grid, kFilterThreads, 0, stream>>>(tab, fc, chunks, key, s, fl);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    next += count;
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

constexpr std::array<at::ScalarType, 3> kFilterTypes = {at::kFloat, at::kHalf, at::kBFloat16};

void linear_filter_cuda(at::TensorList inputs, at::TensorList state, at::TensorList out,
                        at::ArrayRef<double> coeffs, bool accumulate, double noise_std, int64_t seed,
                        int64_t step, int64_t stream, int64_t offset) {
  const FilterLayout lay = check_filter_inputs(inputs, state, out, coeffs, noise_std, c10::DeviceType::CUDA);
  const NoiseKey key = make_key(seed, step, stream);
  DPK_CHECK(offset >= 0, "offset must be >= 0, got ", offset);
  const at::Tensor& first = !out.empty() ? out[0] : (!inputs.empty() ? inputs[0] : state[0]);
  const c10::Device dev = first.device();
  const auto same_device = [&](const at::Tensor& t) { return t.device() == dev; };
  DPK_CHECK(std::all_of(inputs.begin(), inputs.end(), same_device) &&
                std::all_of(state.begin(), state.end(), same_device) &&
                std::all_of(out.begin(), out.end(), same_device),
            "all tensors must be on ", dev);
  const c10::cuda::CUDAGuard guard(dev);
  const int K = lay.fc.K;
  const FilterFlags fl{!inputs.empty(), !out.empty(), accumulate, noise_std > 0};
  std::array<std::vector<FilterItem>, 3> groups;
  int64_t base = offset;
  for (int64_t l = 0; l < lay.L; ++l) {
    if (lay.numel[l] > 0) {
      FilterItem it{inputs.empty() ? nullptr : inputs[l].data_ptr(),
                    out.empty() ? nullptr : out[l].data_ptr(),
                    {},
                    lay.numel[l],
                    base,
                    base % 4 == 0};
      it.aligned =
          it.aligned && (it.in == nullptr || aligned16(it.in)) && (it.out == nullptr || aligned16(it.out));
      for (int k = 0; k < K; ++k) {
        it.state.push_back(state[k * lay.L + l].data_ptr<float>());
        it.aligned = it.aligned && aligned16(it.state.back());
      }
      const at::ScalarType type =
          !out.empty() ? out[l].scalar_type() : (!inputs.empty() ? inputs[l].scalar_type() : at::kFloat);
      groups[std::find(kFilterTypes.begin(), kFilterTypes.end(), type) - kFilterTypes.begin()].push_back(
          std::move(it));
    }
    base += lay.numel[l];
  }
  const float s = static_cast<float>(noise_std);
  for (size_t g = 0; g < groups.size(); ++g) {
    DPK_DISPATCH_GRAD_TYPES(kFilterTypes[g], "linear_filter_",
                            [&] { launch_filter<scalar_t>(groups[g], lay.fc, key, s, fl); });
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(dpkernels_C, CUDA, m) { m.impl("linear_filter_", &linear_filter_cuda); }

}  // namespace dpkernels

// clip_factors and the fused clip_pipeline of the CUDA clipping ops (see clip.cuh): the per-sample
// weights from the norms, and the pipeline's three stages (the norms pass of clip_norms.cu, the
// weights, the sum pass of clip_sum.cu with its private epilogue).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "clip.cuh"
#include "dpkernels/chacha20.h"
#include "dpkernels/clip_layout.h"
#include "dpkernels/clip_math.h"
#include "dpkernels/kernels.h"
#include "dpkernels/macros.h"
#include "dpkernels/noise_key.h"
#include "multi_tensor.cuh"

namespace dpkernels {
namespace {

using cuda_clip::SumEpilogue;
using cuda_clip::SumMode;

constexpr int kClipThreads = 256;

// Clip bounds of columns first .. first + count - 1.
struct BoundArgs {
  double bound[kMaxRanges];
  int32_t first;
  int32_t count;
};
static_assert(sizeof(BoundArgs) + kScalarArgBytes <= kArgBytes);

// out[i, c] = weight_of_norm(mode, norms[i, c], bound[c - first], r) over rows i and the columns
// first .. first + count - 1 of a row-major [rows, L] tensor.
template <typename T>
__global__ void __launch_bounds__(kClipThreads)
    clip_factors_kernel(const __grid_constant__ BoundArgs a, const T* __restrict__ norms, T* __restrict__ out,
                        int64_t rows, int64_t L, ClipMode mode, double r) {
  const int64_t total = rows * a.count;
  for (int64_t e = int64_t{blockIdx.x} * kClipThreads + threadIdx.x; e < total;
       e += int64_t{gridDim.x} * kClipThreads) {
    const int64_t i = e / a.count;
    const int c = static_cast<int>(e - i * a.count);
    const int64_t idx = i * L + a.first + c;
    out[idx] = weight_of_norm<T>(mode, norms[idx], a.bound[c], r);
  }
}

// Stage 2 of clip_pipeline, one thread per sample: clip_sample_weights (clip_math.h) on row i
// of the [B, L] sums of squares; ok[i] = 0 marks a sample with a non-finite gradient.
__global__ void __launch_bounds__(kClipThreads)
    sample_weights_kernel(const double* __restrict__ sumsq, int64_t B, int64_t L, bool per_layer,
                          ClipMode mode, const double* __restrict__ bounds, double r, double norm_scale,
                          float* __restrict__ w, float* __restrict__ norms, uint8_t* __restrict__ ok) {
  const int64_t i = int64_t{blockIdx.x} * kClipThreads + threadIdx.x;
  if (i >= B) return;
  ok[i] = clip_sample_weights(sumsq + i * L, static_cast<int>(L), per_layer, mode, bounds, r, norm_scale,
                              w + i * L, norms + i * (per_layer ? L : 1));
}

}  // namespace

at::Tensor clip_factors_cuda(const at::Tensor& norms, at::ArrayRef<double> max_grad_norm,
                             c10::string_view mode, double r) {
  DPK_CHECK(norms.is_cuda(), "norms must be a CUDA tensor for the cuda kernel, got ", norms.device());
  const std::vector<double> C = clip_bounds(max_grad_norm, norms);
  const ClipMode m = parse_clip_mode(mode);
  auto out = new_output(norms.sizes(), norms.options());
  if (norms.numel() == 0) return out;
  const c10::cuda::CUDAGuard guard(norms.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t L = static_cast<int64_t>(C.size());
  const bool uniform = std::all_of(C.begin(), C.end(), [&](double c) { return c == C[0]; });
  AT_DISPATCH_FLOATING_TYPES(norms.scalar_type(), "clip_factors", [&] {
    const auto launch = [&](const BoundArgs& a, int64_t rows, int64_t cols) {
      const int64_t blocks = std::min<int64_t>(ceil_div(rows * a.count, kClipThreads), 65535);
      clip_factors_kernel<scalar_t><<<static_cast<unsigned>(blocks), kClipThreads, 0, stream>>>(
          a, norms.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, cols, m, r);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    BoundArgs a{};
    if (uniform) {
      // One bound for every column: the tensor is a single [numel, 1] column.
      a.bound[0] = C[0];
      a.first = 0;
      a.count = 1;
      launch(a, norms.numel(), 1);
      return;
    }
    for (int64_t l0 = 0; l0 < L; l0 += kMaxRanges) {
      a.first = static_cast<int32_t>(l0);
      a.count = static_cast<int32_t>(std::min<int64_t>(kMaxRanges, L - l0));
      std::copy(C.begin() + l0, C.begin() + l0 + a.count, a.bound);
      launch(a, norms.size(0), L);
    }
  });
  return out;
}

namespace {

// The sum pass's epilogue for a pipeline call (clip_layout.h NoiseSpec). The ChaCha20 key words
// travel in a device array, returned in *table: the caller keeps it alive until after the launch
// (the caching allocator then orders its reuse after the kernel on this stream).
SumEpilogue pipeline_epilogue(const NoiseSpec& spec, bool has_noise, const c10::Device& device,
                              at::Tensor* table) {
  SumEpilogue ep;
  ep.std = static_cast<float>(spec.noise_std);
  ep.scale = static_cast<float>(spec.out_scale);
  // Scale 1 and no noise is the plain weighted sum (the kernel's non-private instantiation).
  ep.mode = spec.out_scale == 1.0 ? SumMode::kNone : SumMode::kScale;
  if (has_noise) {
    ep.mode = SumMode::kNoise;
  } else if (spec.rng == NoiseRng::kPhilox) {
    const NoiseKey key = make_key(spec.key[0], spec.step, spec.stream);
    ep.mode = SumMode::kPhilox;
    ep.seed = key.seed;
    ep.step = key.step;
    ep.stream = key.stream;
  } else if (spec.rng == NoiseRng::kChacha20) {
    const ChachaKey k = make_chacha_key(spec.key, spec.step, spec.stream);
    uint64_t std_bits;
    std::memcpy(&std_bits, &spec.noise_std, sizeof(std_bits));
    std::vector<int32_t> words(k.k, k.k + 8);
    for (const uint32_t v :
         {k.step, k.stream, static_cast<uint32_t>(std_bits), static_cast<uint32_t>(std_bits >> 32)})
      words.push_back(static_cast<int32_t>(v));
    *table = at::tensor(words, at::dtype(at::kInt)).to(device);
    ep.mode = SumMode::kChacha;
    ep.chacha = reinterpret_cast<const uint32_t*>(table->const_data_ptr<int32_t>());
  }
  return ep;
}

}  // namespace

// The three stages with the same kernels as the separate ops; the weights never leave the device.
// drop_nonfinite = false copies B flags to the host (one sync, as the reference's check does).
std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor> clip_pipeline_cuda(
    at::TensorList grads, at::ArrayRef<double> coeffs, at::ArrayRef<double> max_grad_norm,
    c10::string_view mode, double r, at::TensorList shift, at::TensorList scale, bool per_layer,
    bool drop_nonfinite, double norm_scale, c10::string_view rng, double noise_std, at::IntArrayRef key,
    int64_t step, int64_t stream, double out_scale, at::TensorList noise) {
  const ClipMode m = parse_clip_mode(mode);
  const NoiseSpec spec = parse_noise_spec(rng, noise_std, key, step, stream, out_scale);
  const ClipLayout lay = check_cuda_inputs(grads, coeffs, shift, scale);
  if (!noise.empty()) check_noise_list(noise, grads, lay);
  const at::Tensor sumsq = cuda_clip::sumsq_pass(grads, coeffs, shift, scale, lay);
  const std::vector<double> bounds = pipeline_bounds(max_grad_norm, per_layer, lay.L);
  const c10::cuda::CUDAGuard guard(sumsq.device());
  const auto opts = sumsq.options().dtype(at::kFloat);
  auto weights = new_output({lay.B, lay.L}, opts);
  auto norms = per_layer ? new_output({lay.B, lay.L}, opts) : new_output({lay.B}, opts);
  if (lay.B > 0) {
    const at::Tensor dev_bounds = at::tensor(bounds, at::dtype(at::kDouble)).to(sumsq.device());
    const at::Tensor ok = at::empty({lay.B}, opts.dtype(at::kByte));
    sample_weights_kernel<<<static_cast<unsigned>(ceil_div(lay.B, kClipThreads)), kClipThreads, 0,
                            at::cuda::getCurrentCUDAStream()>>>(
        sumsq.const_data_ptr<double>(), lay.B, lay.L, per_layer, m, dev_bounds.const_data_ptr<double>(), r,
        norm_scale, weights.data_ptr<float>(), norms.data_ptr<float>(), ok.data_ptr<uint8_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (!drop_nonfinite) check_nonfinite(ok.cpu().const_data_ptr<uint8_t>(), lay.B);
  }
  at::Tensor table;
  const SumEpilogue ep = pipeline_epilogue(spec, !noise.empty(), sumsq.device(), &table);
  return {cuda_clip::sum_pass(grads, coeffs, weights, ep, noise, lay), norms, weights};
}

}  // namespace dpkernels

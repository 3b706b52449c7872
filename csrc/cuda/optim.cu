// CUDA kernels of the fused DP optimizer steps sgd_step_, dp2_step_, adam_step_ and macadam_step_
// (schemas and argument meaning: csrc/ops.cpp; element math: optim_math.h; host validation:
// optim_layout.h; semantics: dpkernels/reference/optim.py; the CPU kernels are csrc/cpu/optim.cpp).
//
// [note: step kernels]
// One kernel per family and parameter dtype, on the streaming skeleton of step_stream.cuh (see
// [note: stream work items] and [note: stream launches]): one thread per Philox block of 4 elements.
// Per block it reads S (fp32) and θ, forms the noise on the sum ν (the pre-drawn noise, or
// noise_std · filter_step(noise_fc, z) on the 4 in-register Philox normals z of the block, through the
// noise buffers, or 0 when nothing is generated), then runs the family's element math (optim_math.h,
// one lane at a time with T = Rn, so no product or sum is contracted into an FMA: see [note: stream
// rounding]) and writes θ and the state. The sgd family runs filter_step a second time, on the four
// lanes of x = g̃ + λθ through its direction buffers. Table lists: the parameters, the sums, the
// pre-drawn noise, the past iterates (sgd), the noise buffers, then the family's state buffers
// (buffer-major as in the schema); the lists not passed are null. Phase and variant flags are uniform
// over a launch, so a buffer that a call neither reads nor writes is not touched.
//
// [note: macadam sum]
// macadam_step_ returns Σ √ŝ over all elements as float64, deterministically: each thread sums the
// √ŝ of its own elements (lanes in order, its Philox blocks in order) in fp64, each chunk's threads are
// summed by a fixed tree (warp shuffles, then the warps in order) into partials[chunk], chunks being
// numbered over all launches of the call (dtype groups, then tables, then chunks), and one block sums
// the partials in a fixed order. The chunk layout depends only on the tensors (kStreamChunk), never on
// the grid size, so the result is the same on every GPU.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/ops/empty.h>
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
#include "dpkernels/optim_layout.h"
#include "dpkernels/optim_math.h"
#include "multi_tensor.cuh"
#include "step_stream.cuh"

namespace dpkernels {
namespace {

// Tensor lists of the table (see [note: step kernels]); the family's state buffer k is list
// kStepNoiseState + noise_fc.K + k.
constexpr int kStepParam = 0, kStepSum = 1, kStepNoise = 2, kStepPast = 3, kStepNoiseState = 4;

// Where ν comes from (uniform over a call).
enum class NoiseSource : int { kNone = 0, kGiven = 1, kFresh = 2 };

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// Σ x over the CUDA block in a fixed order, valid in thread 0; every thread must call it.
__device__ __forceinline__ double block_sum(double x) {
  __shared__ double warp_sums[kStreamThreads / kWarp];
#pragma unroll
  for (int off = kWarp / 2; off > 0; off /= 2) x += __shfl_down_sync(kFullMask, x, off);
  if (threadIdx.x % kWarp == 0) warp_sums[threadIdx.x / kWarp] = x;
  __syncthreads();
  double total = 0.0;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int w = 0; w < kStreamThreads / kWarp; ++w) total += warp_sums[w];
  }
  __syncthreads();  // warp_sums is reused by the next call
  return total;
}

// The families: Args (the kernel's family argument), kSum (whether the step returns Σ√ŝ) and
// step(), which turns (S, ν, θ) of one block into the new θ and updates the state buffers, the first
// of which is list s0.

struct SgdFamily {
  struct Args {
    SgdHyper h;
    FilterCoeffs dir;  // the direction filter over the K state buffers
    bool past;         // the old θ is written to the past list
  };
  static constexpr bool kSum = false;
  template <typename T>
  __device__ __forceinline__ static void step(const Args& a, const BlockRef& b, int s0, const F4& S,
                                              const F4& nu, F4& theta, double&) {
    F4 x;
#pragma unroll
    for (int j = 0; j < 4; ++j) x.v[j] = sgd_input(a.h, S.v[j], nu.v[j], theta.v[j]);
    const auto load = [&](int k) { return b.load<float>(s0 + k); };
    const auto store = [&](int k, const F4& v) { b.store<float>(s0 + k, v); };
    const F4 d = filter_step(a.dir, x, load, store);
    if (a.past) b.store<T>(kStepPast, theta);
#pragma unroll
    for (int j = 0; j < 4; ++j) theta.v[j] = sgd_apply(a.h, theta.v[j], d.v[j]);
  }
};

struct Dp2Family {
  using Args = Dp2Hyper;
  static constexpr bool kSum = false;
  template <typename T>
  __device__ __forceinline__ static void step(const Args& h, const BlockRef& b, int s0, const F4& S,
                                              const F4& nu, F4& theta, double&) {
    const bool adaptive = static_cast<Dp2Phase>(h.phase) == Dp2Phase::kAdaptive;
    F4 G(0.f), inv_d(0.f);  // state [G, inv_d]: G is used in the SGD phase, inv_d in the adaptive one
    if (adaptive) {
      inv_d = b.load<float>(s0 + 1);
    } else {
      G = b.load<float>(s0);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) theta.v[j] = dp2_step(h, S.v[j], nu.v[j], theta.v[j], G.v[j], inv_d.v[j]);
    if (!adaptive) b.store<float>(s0, G);
  }
};

struct AdamFamily {
  using Args = AdamHyper;
  static constexpr bool kSum = false;
  template <typename T>
  __device__ __forceinline__ static void step(const Args& h, const BlockRef& b, int s0, const F4& S,
                                              const F4& nu, F4& theta, double&) {
    // state [m, v] or [m, v, scale] (STP); scale is only written.
    F4 m = b.load<float>(s0), v = b.load<float>(s0 + 1), scale(0.f);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      theta.v[j] = adam_step(h, S.v[j], nu.v[j], theta.v[j], m.v[j], v.v[j], scale.v[j]);
    b.store<float>(s0, m);
    b.store<float>(s0 + 1, v);
    if (static_cast<AdamVariant>(h.variant) == AdamVariant::kSTP) b.store<float>(s0 + 2, scale);
  }
};

struct MacAdamFamily {
  using Args = MacAdamHyper;
  static constexpr bool kSum = true;
  template <typename T>
  __device__ __forceinline__ static void step(const Args& h, const BlockRef& b, int s0, const F4& S,
                                              const F4& nu, F4& theta, double& sum) {
    // state [m, v, s, b_u, inv_bu, shift]; inv_bu is only written, b_u and inv_bu only when κ != 0.
    F4 m = b.load<float>(s0), v = b.load<float>(s0 + 1), s = b.load<float>(s0 + 2);
    F4 b_u = b.load<float>(s0 + 3), inv_bu(0.f), shift = b.load<float>(s0 + 5);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      Rn sqrt_s_hat;
      theta.v[j] = macadam_step(h, S.v[j], nu.v[j], theta.v[j], m.v[j], v.v[j], s.v[j], b_u.v[j], inv_bu.v[j],
                                shift.v[j], sqrt_s_hat);
      // Lanes of other tensors are not elements (branch-free: the branch made ptxas spill on sm_80).
      sum += b.owns(j) ? static_cast<double>(sqrt_s_hat.v) : 0.0;
    }
    b.store<float>(s0, m);
    b.store<float>(s0 + 1, v);
    b.store<float>(s0 + 2, s);
    if (h.kappa != 0.f) {
      b.store<float>(s0 + 3, b_u);
      b.store<float>(s0 + 4, inv_bu);
    }
    b.store<float>(s0 + 5, shift);
  }
};

template <typename T, typename Family>
__global__ void __launch_bounds__(kStreamThreads)
    step_kernel(const __grid_constant__ StreamTable tab, const __grid_constant__ FilterCoeffs noise_fc,
                const __grid_constant__ typename Family::Args args, int64_t num_chunks, NoiseKey key,
                float noise_std, NoiseSource source, double* __restrict__ partials) {
  const int s0 = kStepNoiseState + noise_fc.K;
  double sum = 0.0;
  const auto body = [&](const BlockRef& b, uint64_t block) {
    F4 nu(0.f);
    if (source == NoiseSource::kGiven) {
      nu = b.load<float>(kStepNoise);
    } else if (source == NoiseSource::kFresh) {
      const auto load = [&](int k) { return b.load<float>(kStepNoiseState + k); };
      const auto store = [&](int k, const F4& v) { b.store<float>(kStepNoiseState + k, v); };
      nu = F4(noise_std) * filter_step(noise_fc, philox_normals(key, block), load, store);
    }
    const F4 S = b.load<float>(kStepSum);
    F4 theta = b.load<T>(kStepParam);
    Family::template step<T>(args, b, s0, S, nu, theta, sum);
    b.store<T>(kStepParam, theta);
  };
  if constexpr (Family::kSum) {
    stream_blocks(tab, num_chunks, body, [&](int64_t c) {
      const double total = block_sum(sum);
      if (threadIdx.x == 0) partials[c] = total;
      sum = 0.0;
    });
  } else {
    stream_blocks(tab, num_chunks, body, [](int64_t) {});
  }
}

// out[0] = Σ partials[0 .. n) in a fixed order (one block; see [note: macadam sum]).
__global__ void __launch_bounds__(kStreamThreads)
    sum_partials_kernel(const double* __restrict__ partials, int64_t n, double* __restrict__ out) {
  double x = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kStreamThreads) x += partials[i];
  const double total = block_sum(x);
  if (threadIdx.x == 0) out[0] = total;
}

// The tensors of one call besides the family's hyper-parameters.
struct StepTensors {
  at::TensorList params, sums, state, noise, noise_state, past;
};

// Validates the tensors shared by every family and launches Family's kernel once per parameter
// dtype (and table); returns Σ√ŝ as a float64 scalar tensor for macadam, an undefined tensor else.
template <typename Family>
at::Tensor run_step(const StepTensors& t, int64_t n_state, at::ArrayRef<double> noise_coeffs,
                    double noise_std, int64_t seed, int64_t step, int64_t stream, int64_t offset,
                    const typename Family::Args& args) {
  static_assert(sizeof(StreamTable) + sizeof(FilterCoeffs) + sizeof(typename Family::Args) +
                    kScalarArgBytes <=
                kArgBytes);
  const StepLayout lay = check_step_inputs(t.params, t.sums, t.state, n_state, t.noise, t.noise_state,
                                           noise_coeffs, noise_std, c10::DeviceType::CUDA);
  const NoiseKey key = make_key(seed, step, stream);
  DPK_CHECK(offset >= 0, "offset must be >= 0, got ", offset);
  const c10::Device dev = common_device({t.params, t.sums, t.state, t.noise, t.noise_state, t.past});
  const c10::cuda::CUDAGuard guard(dev);
  const int Kn = lay.noise_fc.K;
  const int lists = kStepNoiseState + Kn + static_cast<int>(n_state);
  const NoiseSource source =
      lay.given_noise ? NoiseSource::kGiven : (lay.generate ? NoiseSource::kFresh : NoiseSource::kNone);
  const std::vector<TensorRef> refs = tensor_refs(lay.numel, offset);
  int64_t total_chunks = 0;
  for (const TensorRef& r : refs) total_chunks += StreamChunks::count(r.numel, r.elem0);
  at::Tensor partials;
  if constexpr (Family::kSum) {
    partials = at::empty({total_chunks}, at::TensorOptions().dtype(at::kDouble).device(dev));
  }
  double* const partials_ptr = Family::kSum ? partials.data_ptr<double>() : nullptr;
  const auto fill = [&](const void** row, const TensorRef& r) {
    const int64_t l = r.index;
    row[kStepParam] = t.params[l].data_ptr();
    row[kStepSum] = t.sums[l].data_ptr();
    row[kStepNoise] = lay.given_noise ? t.noise[l].data_ptr() : nullptr;
    row[kStepPast] = t.past.empty() ? nullptr : t.past[l].data_ptr();
    for (int k = 0; k < Kn; ++k) row[kStepNoiseState + k] = t.noise_state[k * lay.L + l].data_ptr();
    for (int64_t k = 0; k < n_state; ++k) row[kStepNoiseState + Kn + k] = t.state[k * lay.L + l].data_ptr();
    return stream_width(row, lists, r.elem0);
  };
  const cudaStream_t cuda_stream = at::cuda::getCurrentCUDAStream();
  const float s = static_cast<float>(noise_std);
  int64_t group_base = 0;  // chunks of the dtype groups before
  const auto type_of = [&](int64_t l) { return t.params[l].scalar_type(); };
  for_each_type(group_by_type(refs, type_of), [&](auto tag, const std::vector<TensorRef>& group) {
    const auto kernel = step_kernel<typename decltype(tag)::type, Family>;
    const int64_t chunks = for_each_table<StreamChunks, StreamTable>(
        group, lists, kAnyChunks, fill, [&](const StreamTable& tab, int64_t n, int64_t chunk_base) {
          double* const out = partials_ptr != nullptr ? partials_ptr + group_base + chunk_base : nullptr;
          kernel<<<one_wave(kernel, kStreamThreads, n), kStreamThreads, 0, cuda_stream>>>(
              tab, lay.noise_fc, args, n, key, s, source, out);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
    group_base += chunks;
  });
  if constexpr (Family::kSum) {
    at::Tensor total = at::empty({}, at::TensorOptions().dtype(at::kDouble).device(dev));
    sum_partials_kernel<<<1, kStreamThreads, 0, cuda_stream>>>(partials_ptr, total_chunks,
                                                               total.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return total;
  } else {
    return {};
  }
}

}  // namespace

void sgd_step_cuda(at::TensorList params, at::TensorList sums, at::TensorList state,
                   at::ArrayRef<double> dir_coeffs, at::TensorList past, at::TensorList noise,
                   at::TensorList noise_state, at::ArrayRef<double> noise_coeffs, double noise_std,
                   int64_t seed, int64_t step, int64_t stream, int64_t offset, at::ArrayRef<double> hyper) {
  const SgdFamily::Args a{parse_sgd_hyper(hyper), parse_filter_coeffs(dir_coeffs, "dir_coeffs"),
                          !past.empty()};
  check_past(params, past, c10::DeviceType::CUDA);
  run_step<SgdFamily>({params, sums, state, noise, noise_state, past}, a.dir.K, noise_coeffs, noise_std, seed,
                      step, stream, offset, a);
}

void dp2_step_cuda(at::TensorList params, at::TensorList sums, at::TensorList state, at::TensorList noise,
                   at::TensorList noise_state, at::ArrayRef<double> noise_coeffs, double noise_std,
                   int64_t seed, int64_t step, int64_t stream, int64_t offset, at::ArrayRef<double> hyper) {
  run_step<Dp2Family>({params, sums, state, noise, noise_state, {}}, 2, noise_coeffs, noise_std, seed, step,
                      stream, offset, parse_dp2_hyper(hyper));
}

void adam_step_cuda(at::TensorList params, at::TensorList sums, at::TensorList state, at::TensorList noise,
                    at::TensorList noise_state, at::ArrayRef<double> noise_coeffs, double noise_std,
                    int64_t seed, int64_t step, int64_t stream, int64_t offset, at::ArrayRef<double> hyper) {
  const AdamHyper h = parse_adam_hyper(hyper);
  const int64_t n_state = static_cast<AdamVariant>(h.variant) == AdamVariant::kSTP ? 3 : 2;
  run_step<AdamFamily>({params, sums, state, noise, noise_state, {}}, n_state, noise_coeffs, noise_std, seed,
                       step, stream, offset, h);
}

at::Tensor macadam_step_cuda(at::TensorList params, at::TensorList sums, at::TensorList state,
                             at::TensorList noise, at::TensorList noise_state,
                             at::ArrayRef<double> noise_coeffs, double noise_std, int64_t seed, int64_t step,
                             int64_t stream, int64_t offset, at::ArrayRef<double> hyper) {
  return run_step<MacAdamFamily>({params, sums, state, noise, noise_state, {}}, 6, noise_coeffs, noise_std,
                                 seed, step, stream, offset, parse_macadam_hyper(hyper));
}

}  // namespace dpkernels

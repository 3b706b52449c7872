// CPU kernels of the fused DP optimizer steps sgd_step_, dp2_step_, adam_step_, macadam_step_
// (schemas: csrc/ops.cpp; element math: optim_math.h; semantics: dpkernels/reference/optim.py).
//
// Each op is one pass over its parameter list with the streaming skeleton of stream_cpu.h
// (run_step below): per chunk of at most kChunk elements, ν is formed in a stack buffer (the
// pre-drawn tensor is read in place; fresh Philox normals go through the noise filter and are
// scaled by noise_std; nothing is generated when there is no noise), 16-bit parameters are
// widened into an fp32 buffer, and the family's functor runs its element math from
// optim_math.h over plain fp32 arrays, which GCC vectorises. The family's variant (Adam variant,
// MacAdam bias correction, DP² phase) is a template parameter, so the hot loop holds no
// per-element dispatch; the sgd family's direction filter runs on at::vec lanes
// (cpu::filter_chunk), in place in the chunk's buffer.
//
// Products and sums are rounded separately, as in the reference (no FMA contraction).
// math-errno and trapping-math are off so that sqrt and the branch-free selects vectorise; they
// change no result.
#pragma GCC optimize("fp-contract=off", "no-math-errno", "no-trapping-math")
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "dpkernels/dispatch.h"
#include "dpkernels/filter.h"
#include "dpkernels/macros.h"
#include "dpkernels/noise_key.h"
#include "dpkernels/optim_layout.h"
#include "dpkernels/optim_math.h"
#include "noise_cpu.h"
#include "stream_cpu.h"

namespace dpkernels {
namespace {

using cpu::DVec;
using cpu::kChunk;
using cpu::Vec;

alignas(64) constexpr float kZeros[kChunk] = {};

// ν of one call: the pre-drawn tensors, noise_std · (noise filter of the Philox normals), or 0.
class StepNoise {
 public:
  StepNoise(const StepLayout& lay, at::TensorList noise, at::TensorList noise_state, double noise_std,
            const NoiseKey& key)
      : lay_(lay), bufs_(noise_state, lay.L), key_(key), std_(static_cast<float>(noise_std)) {
    for (const at::Tensor& t : noise) given_.push_back(t.const_data_ptr<float>());
  }

  // ν of elements [i0, i0 + m) of tensor l (global index e0); `scratch` holds kChunk floats.
  const float* chunk(int64_t l, int64_t i0, int64_t m, int64_t e0, float* scratch) const {
    if (lay_.given_noise) return given_[l] + i0;
    if (!lay_.generate) return kZeros;
    cpu::normals(e0, m, key_, scratch);
    cpu::filter_chunk(lay_.noise_fc, scratch, scratch, m, bufs_, l, i0);
    for (int64_t i = 0; i < m; ++i) scratch[i] = std_ * scratch[i];
    return scratch;
  }

 private:
  const StepLayout& lay_;
  std::vector<const float*> given_;
  cpu::BufferTable bufs_;
  NoiseKey key_;
  float std_;
};

// A task's fp64 partial sum in fixed SIMD lanes: the same additions in the same order whatever the
// thread count.
struct SumLanes {
  DVec d[Vec::size() / DVec::size()];

  SumLanes() {
    for (auto& v : d) v = DVec(0.0);
  }
  void add(const float* x, int64_t m) {
    for (int64_t i = 0; i < m; i += Vec::size()) {
      cpu::widen_add(Vec::loadu(x + i, static_cast<int>(std::min<int64_t>(Vec::size(), m - i))), d);
    }
  }
  double sum() const {
    alignas(64) double lanes[Vec::size()];
    for (int q = 0; q < Vec::size() / DVec::size(); ++q) d[q].store(lanes + q * DVec::size());
    double s = 0.0;
    for (double x : lanes) s += x;
    return s;
  }
};

// θ of a chunk as fp32: the parameter itself when it is fp32, else widened into `buf`.
template <typename scalar_t>
float* load_theta(scalar_t* p, int64_t m, float* buf) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return p;
  } else {
    using V = at::vec::Vectorized<scalar_t>;
    int64_t i = 0;
    for (; i + V::size() <= m; i += V::size()) {
      const auto [a, b] = at::vec::convert_to_float<scalar_t>(V::loadu(p + i));
      a.store(buf + i);
      b.store(buf + i + Vec::size());
    }
    for (; i < m; ++i) buf[i] = static_cast<float>(p[i]);
    return buf;
  }
}

// Rounds the updated fp32 θ once to the parameter's dtype (a no-op for fp32: updated in place).
template <typename scalar_t>
void store_theta(const float* th, scalar_t* p, int64_t m) {
  if constexpr (!std::is_same_v<scalar_t, float>) at::vec::convert(th, p, m);
}

// The pass shared by the four ops. family(l, i0, m, th, S, nu, acc) runs the element math on
// elements [i0, i0 + m) of parameter l: th is its fp32 θ (updated in place), S and nu its clipped
// sum and noise, acc the task's fp64 lanes. `past` ([] or one tensor per parameter) receives the
// old θ. Returns the sum of the tasks' partial sums, in task order.
template <typename Family>
double run_step(const StepLayout& lay, at::TensorList params, at::TensorList sums, at::TensorList past,
                const StepNoise& noise, int64_t offset, const Family& family) {
  DPK_CHECK(offset >= 0, "offset must be >= 0, got ", offset);
  const cpu::StreamPlan plan(lay.numel, offset);
  std::vector<double> partial(plan.tasks.size(), 0.0);
  plan.parallel([&](int64_t t, const cpu::StreamTask& task) {
    const int64_t l = task.l;
    DPK_DISPATCH_GRAD_TYPES(params[l].scalar_type(), "optimizer step", [&] {
      scalar_t* p = params[l].data_ptr<scalar_t>();
      scalar_t* old = past.empty() ? nullptr : past[l].data_ptr<scalar_t>();
      const float* S = sums[l].const_data_ptr<float>();
      alignas(64) float nu_buf[kChunk];
      alignas(64) float th_buf[kChunk];
      SumLanes acc;
      plan.chunks(task, [&](int64_t i0, int64_t m, int64_t e0) {
        const float* nu = noise.chunk(l, i0, m, e0, nu_buf);
        if (old != nullptr) std::copy(p + i0, p + i0 + m, old + i0);
        float* th = load_theta(p + i0, m, th_buf);
        family(l, i0, m, th, S + i0, nu, acc);
        store_theta(th, p + i0, m);
      });
      partial[t] = acc.sum();
    });
  });
  double total = 0.0;
  for (double x : partial) total += x;
  return total;
}

// fn(std::integral_constant<E, E(v)>) for v in [0, N): a runtime enumerator as a template argument.
template <typename E, int N, int I = 0, typename F>
double with_enum(int v, const F& fn) {
  if constexpr (I + 1 < N) {
    if (v != I) return with_enum<E, N, I + 1>(v, fn);
  }
  return fn(std::integral_constant<E, static_cast<E>(I)>{});
}

// ---------------------------------------------------------------------------------------------
// Families: the element math of one chunk. Hyper-parameters are copied to locals so that the
// compiler sees them as loop invariants (and the variant field as a constant).
// ---------------------------------------------------------------------------------------------

struct SgdChunk {
  SgdHyper hyper;
  const FilterCoeffs& dir;
  const cpu::BufferTable& state;

  void operator()(int64_t l, int64_t i0, int64_t m, float* __restrict th, const float* __restrict S,
                  const float* __restrict nu, SumLanes&) const {
    const SgdHyper h = hyper;
    alignas(64) float d[kChunk];
    for (int64_t i = 0; i < m; ++i) d[i] = sgd_input(h, S[i], nu[i], th[i]);
    cpu::filter_chunk(dir, d, d, m, state, l, i0);
    for (int64_t i = 0; i < m; ++i) th[i] = sgd_apply(h, th[i], d[i]);
  }
};

template <Dp2Phase kPhase>
struct Dp2Chunk {
  Dp2Hyper hyper;
  const cpu::BufferTable& state;

  void operator()(int64_t l, int64_t i0, int64_t m, float* __restrict th, const float* __restrict S,
                  const float* __restrict nu, SumLanes&) const {
    Dp2Hyper h = hyper;
    h.phase = static_cast<int>(kPhase);
    float* __restrict G = state.at(0, l) + i0;
    const float* __restrict inv_d = state.at(1, l) + i0;
    for (int64_t i = 0; i < m; ++i) {
      float g = kPhase == Dp2Phase::kSgd ? G[i] : 0.f;
      th[i] = dp2_step(h, S[i], nu[i], th[i], g, kPhase == Dp2Phase::kAdaptive ? inv_d[i] : 0.f);
      if constexpr (kPhase == Dp2Phase::kSgd) G[i] = g;
    }
  }
};

template <AdamVariant kVariant>
struct AdamChunk {
  AdamHyper hyper;
  const cpu::BufferTable& state;

  void operator()(int64_t l, int64_t i0, int64_t m, float* __restrict th, const float* __restrict S,
                  const float* __restrict nu, SumLanes&) const {
    constexpr bool kStp = kVariant == AdamVariant::kSTP;
    AdamHyper h = hyper;
    h.variant = static_cast<int>(kVariant);
    float* __restrict mo = state.at(0, l) + i0;
    float* __restrict vo = state.at(1, l) + i0;
    float* __restrict so = kStp ? state.at(2, l) + i0 : nullptr;
    for (int64_t i = 0; i < m; ++i) {
      float mi = mo[i], vi = vo[i], scale = 0.f;
      th[i] = adam_step(h, S[i], nu[i], th[i], mi, vi, scale);
      mo[i] = mi;
      vo[i] = vi;
      if constexpr (kStp) so[i] = scale;
    }
  }
};

template <MacAdamBC kBC>
struct MacAdamChunk {
  MacAdamHyper hyper;
  const cpu::BufferTable& state;

  void operator()(int64_t l, int64_t i0, int64_t m, float* __restrict th, const float* __restrict S,
                  const float* __restrict nu, SumLanes& acc) const {
    MacAdamHyper h = hyper;
    h.bc = static_cast<int>(kBC);
    float* __restrict mo = state.at(0, l) + i0;
    float* __restrict vo = state.at(1, l) + i0;
    float* __restrict so = state.at(2, l) + i0;
    float* __restrict bo = state.at(3, l) + i0;
    float* __restrict ibo = state.at(4, l) + i0;
    float* __restrict sho = state.at(5, l) + i0;
    alignas(64) float root[kChunk];
    for (int64_t i = 0; i < m; ++i) {
      float mi = mo[i], vi = vo[i], si = so[i], bi = bo[i], ibi = ibo[i], shi = sho[i], r;
      th[i] = macadam_step(h, S[i], nu[i], th[i], mi, vi, si, bi, ibi, shi, r);
      mo[i] = mi;
      vo[i] = vi;
      so[i] = si;
      bo[i] = bi;
      ibo[i] = ibi;
      sho[i] = shi;
      root[i] = r;
    }
    acc.add(root, m);
  }
};

// ---------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------

void sgd_step_cpu(at::TensorList params, at::TensorList sums, at::TensorList state, at::ArrayRef<double> dir_coeffs,
                  at::TensorList past, at::TensorList noise, at::TensorList noise_state,
                  at::ArrayRef<double> noise_coeffs, double noise_std, int64_t seed, int64_t step, int64_t stream,
                  int64_t offset, at::ArrayRef<double> hyper) {
  const FilterCoeffs dir = parse_filter_coeffs(dir_coeffs, "dir_coeffs");
  const StepLayout lay = check_step_inputs(params, sums, state, dir.K, noise, noise_state, noise_coeffs, noise_std,
                                           c10::DeviceType::CPU);
  check_past(params, past, c10::DeviceType::CPU);
  const SgdHyper h = parse_sgd_hyper(hyper);
  const StepNoise nz(lay, noise, noise_state, noise_std, make_key(seed, step, stream));
  const cpu::BufferTable st(state, lay.L);
  run_step(lay, params, sums, past, nz, offset, SgdChunk{h, dir, st});
}

void dp2_step_cpu(at::TensorList params, at::TensorList sums, at::TensorList state, at::TensorList noise,
                  at::TensorList noise_state, at::ArrayRef<double> noise_coeffs, double noise_std, int64_t seed,
                  int64_t step, int64_t stream, int64_t offset, at::ArrayRef<double> hyper) {
  const StepLayout lay =
      check_step_inputs(params, sums, state, 2, noise, noise_state, noise_coeffs, noise_std, c10::DeviceType::CPU);
  const Dp2Hyper h = parse_dp2_hyper(hyper);
  const StepNoise nz(lay, noise, noise_state, noise_std, make_key(seed, step, stream));
  const cpu::BufferTable st(state, lay.L);
  with_enum<Dp2Phase, 2>(h.phase, [&](auto phase) {
    return run_step(lay, params, sums, {}, nz, offset, Dp2Chunk<decltype(phase)::value>{h, st});
  });
}

void adam_step_cpu(at::TensorList params, at::TensorList sums, at::TensorList state, at::TensorList noise,
                   at::TensorList noise_state, at::ArrayRef<double> noise_coeffs, double noise_std, int64_t seed,
                   int64_t step, int64_t stream, int64_t offset, at::ArrayRef<double> hyper) {
  const AdamHyper h = parse_adam_hyper(hyper);
  const int64_t n_state = static_cast<AdamVariant>(h.variant) == AdamVariant::kSTP ? 3 : 2;
  const StepLayout lay = check_step_inputs(params, sums, state, n_state, noise, noise_state, noise_coeffs, noise_std,
                                           c10::DeviceType::CPU);
  const StepNoise nz(lay, noise, noise_state, noise_std, make_key(seed, step, stream));
  const cpu::BufferTable st(state, lay.L);
  with_enum<AdamVariant, 3>(h.variant, [&](auto variant) {
    return run_step(lay, params, sums, {}, nz, offset, AdamChunk<decltype(variant)::value>{h, st});
  });
}

at::Tensor macadam_step_cpu(at::TensorList params, at::TensorList sums, at::TensorList state, at::TensorList noise,
                            at::TensorList noise_state, at::ArrayRef<double> noise_coeffs, double noise_std,
                            int64_t seed, int64_t step, int64_t stream, int64_t offset, at::ArrayRef<double> hyper) {
  const StepLayout lay =
      check_step_inputs(params, sums, state, 6, noise, noise_state, noise_coeffs, noise_std, c10::DeviceType::CPU);
  const MacAdamHyper h = parse_macadam_hyper(hyper);
  const StepNoise nz(lay, noise, noise_state, noise_std, make_key(seed, step, stream));
  const cpu::BufferTable st(state, lay.L);
  const double total = with_enum<MacAdamBC, 3>(h.bc, [&](auto bc) {
    return run_step(lay, params, sums, {}, nz, offset, MacAdamChunk<decltype(bc)::value>{h, st});
  });
  return at::scalar_tensor(total, at::dtype(at::kDouble));
}

}  // namespace

TORCH_LIBRARY_IMPL(dpkernels_C, CPU, m) {
  m.impl("sgd_step_", &sgd_step_cpu);
  m.impl("dp2_step_", &dp2_step_cpu);
  m.impl("adam_step_", &adam_step_cpu);
  m.impl("macadam_step_", &macadam_step_cpu);
}

}  // namespace dpkernels

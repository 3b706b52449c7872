// CPU kernels of the fused DP optimizer steps sgd_step_, dp2_step_, adam_step_, macadam_step_
// (schemas: csrc/ops.cpp; element math: optim_math.h; semantics: dpkernels/reference/optim.py).
//
// Each op is one pass over its parameter list with the streaming skeleton of stream_cpu.h
// (run_step below): per chunk of at most kChunk elements, ν is formed in a stack buffer (the
// pre-drawn tensor is read in place; fresh Philox normals go through the noise filter, and the
// family's loop scales them by noise_std; nothing is generated when there is no noise), 16-bit
// parameters are widened into an fp32 buffer, and the family's functor runs its element math
// from optim_math.h over plain fp32 arrays, which GCC vectorises. The family's variant (Adam
// variant, MacAdam bias correction, DP² phase) is a template parameter, so the hot loop holds no
// per-element dispatch. The sgd family runs its input, direction filter and update in one loop
// when the filter is the identity or of the heavy-ball shape (momentum), else in turn, the filter
// term by term (cpu::filter_chunk).
//
// Products and sums are rounded separately, as in the reference (the build's -ffp-contract=off).
// trapping-math is off here and math-errno in the whole build (setup.py) so that the loops with
// sqrt and the selects of optim_math.h vectorise; neither changes a result.
#pragma GCC optimize("no-trapping-math")
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/scalar_tensor.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "dpkernels/dispatch.h"
#include "dpkernels/filter.h"
#include "dpkernels/kernels.h"
#include "dpkernels/macros.h"
#include "dpkernels/noise_key.h"
#include "dpkernels/optim_layout.h"
#include "dpkernels/optim_math.h"
#include "noise_cpu.h"
#include "stream_cpu.h"
#include "vec_cpu.h"

namespace dpkernels {
namespace {

using cpu::kChunk;

alignas(64) constexpr float kZeros[kChunk] = {};

// ν of a chunk: ν[i] = scale · x[i]. The families apply the scale inside their own loop rather
// than in a loop of its own, one walk over the chunk less (with plain DP-SGD's single loop, 6% of
// its AVX-512 pass and 9% of its AVX2 one; docs/BENCHMARKS.md).
struct ChunkNoise {
  const float* x;
  float scale;
};

// ν of one call: the pre-drawn tensors, noise_std · (noise filter of the Philox normals), or 0.
class StepNoise {
 public:
  StepNoise(const StepLayout& lay, at::TensorList noise, at::TensorList noise_state, double noise_std,
            const NoiseKey& key)
      : lay_(lay), bufs_(noise_state, lay.L), key_(key), std_(static_cast<float>(noise_std)) {
    for (const at::Tensor& t : noise) given_.push_back(t.const_data_ptr<float>());
  }

  // ν of elements [i0, i0 + m) of tensor l (global index e0); `scratch` holds 2 kChunk floats.
  // between(k, calls) is cpu::normals' callback, called while the generator runs, when it runs.
  template <typename Between>
  ChunkNoise chunk(int64_t l, int64_t i0, int64_t m, int64_t e0, float* scratch,
                   const Between& between) const {
    if (lay_.given_noise) return {given_[l] + i0, 1.f};
    if (!lay_.generate) return {kZeros, 1.f};
    cpu::normals(e0, m, key_, scratch, between);
    return {cpu::filter_chunk(lay_.noise_fc, scratch, scratch + kChunk, m, bufs_, l, i0), std_};
  }

  // Adds the noise filter's buffers at elements [i0, i0 + m) of tensor l to `lines`.
  void add_lines(int64_t l, int64_t i0, int64_t m, cpu::ChunkLines& lines) const {
    bufs_.add_lines(l, i0, m, lines);
  }

 private:
  const StepLayout& lay_;
  std::vector<const float*> given_;
  cpu::BufferTable bufs_;
  NoiseKey key_;
  float std_;
};

// θ of a chunk as fp32: the parameter itself when it is fp32, else widened into `buf`.
template <typename scalar_t>
float* load_theta(scalar_t* p, int64_t m, float* buf) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return p;
  } else {
    cpu::widen_to_float(p, m, buf);
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
// sum and noise (ChunkNoise), acc the task's fp64 lanes. `past` ([] or one tensor per parameter)
// receives the old θ. Returns the sum of the tasks' partial sums, in task order.
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
      alignas(64) float nu_buf[2 * kChunk];
      alignas(64) float th_buf[kChunk];
      cpu::WideSum acc;
      const auto arrays = [&](int64_t i0, int64_t m, cpu::ChunkLines& lines) {
        lines.add(p + i0, m);
        lines.add(S + i0, m);
        family.state.add_lines(l, i0, m, lines);
        noise.add_lines(l, i0, m, lines);
      };
      cpu::ChunkPrefetch prefetch(task, arrays);
      plan.chunks(task, [&](int64_t i0, int64_t m, int64_t e0) {
        const ChunkNoise nu = noise.chunk(l, i0, m, e0, nu_buf, prefetch.begin_chunk(i0, m));
        if (old != nullptr) std::copy(p + i0, p + i0 + m, old + i0);
        float* th = load_theta(p + i0, m, th_buf);
        family(l, i0, m, th, S + i0, nu, acc);
        store_theta(th, p + i0, m);
      });
      partial[t] = acc.total();
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
// Families: the element math of one chunk, as loops over __restrict arrays (function parameters:
// GCC honours restrict there, so the loops vectorise without run-time alias checks). The
// hyper-parameters are a local copy, loop invariants to the compiler, with the variant field set
// from the template argument so that its branches fold away.
// ---------------------------------------------------------------------------------------------

// Both in one loop, when the direction filter between them is the identity.
void sgd_loop(const SgdHyper& h, int64_t m, float* __restrict th, const float* __restrict S,
              const float* __restrict nu, float s) {
  for (int64_t i = 0; i < m; ++i) th[i] = sgd_apply(h, th[i], sgd_input(h, S[i], s * nu[i], th[i]));
}

// The three in one loop, when the direction filter is of the heavy-ball shape (momentum, PMLF's
// one-pole presets): a third of the instructions of the input, the filter term by term and the
// update in turn, and the generator shares the core with them (DPSGD with momentum 5-7% and
// DP-PMLF 8-10% faster; docs/BENCHMARKS.md, "Seventeenth session").
void sgd_heavy_ball_loop(const SgdHyper& h, const HeavyBall& hb, int64_t m, float* __restrict th,
                         const float* __restrict S, const float* __restrict nu, float s,
                         float* __restrict b) {
  for (int64_t i = 0; i < m; ++i)
    th[i] = sgd_apply(h, th[i], heavy_ball_step(hb, sgd_input(h, S[i], s * nu[i], th[i]), b[i]));
}

// Or, for any other filter, the input, the filter (cpu::filter_chunk) and the update in turn.
void sgd_inputs(const SgdHyper& h, int64_t m, float* __restrict x, const float* __restrict th,
                const float* __restrict S, const float* __restrict nu, float s) {
  for (int64_t i = 0; i < m; ++i) x[i] = sgd_input(h, S[i], s * nu[i], th[i]);
}

void sgd_applies(const SgdHyper& h, int64_t m, float* __restrict th, const float* __restrict d) {
  for (int64_t i = 0; i < m; ++i) th[i] = sgd_apply(h, th[i], d[i]);
}

struct SgdChunk {
  SgdHyper hyper;
  const FilterCoeffs& dir;
  const cpu::BufferTable& state;

  void operator()(int64_t l, int64_t i0, int64_t m, float* th, const float* S, const ChunkNoise& nu,
                  cpu::WideSum&) const {
    const SgdHyper h = hyper;
    if (cpu::is_identity(dir)) {
      sgd_loop(h, m, th, S, nu.x, nu.scale);
      return;
    }
    if (is_heavy_ball(dir)) {
      sgd_heavy_ball_loop(h, heavy_ball(dir), m, th, S, nu.x, nu.scale, state.at(0, l) + i0);
      return;
    }
    if (m <= 0) return;  // never (a chunk has elements): GCC then sees x written before it is read
    alignas(64) float x[kChunk];
    alignas(64) float y[kChunk];
    sgd_inputs(h, m, x, th, S, nu.x, nu.scale);
    sgd_applies(h, m, th, cpu::filter_chunk(dir, x, y, m, state, l, i0));
  }
};

template <Dp2Phase kPhase>
void dp2_loop(const Dp2Hyper& hyper, int64_t m, float* __restrict th, const float* __restrict S,
              const float* __restrict nu, float s, float* __restrict G, const float* __restrict inv_d) {
  Dp2Hyper h = hyper;
  h.phase = static_cast<int>(kPhase);
  for (int64_t i = 0; i < m; ++i) {
    float g = kPhase == Dp2Phase::kSgd ? G[i] : 0.f;
    th[i] = dp2_step(h, S[i], s * nu[i], th[i], g, kPhase == Dp2Phase::kAdaptive ? inv_d[i] : 0.f);
    if constexpr (kPhase == Dp2Phase::kSgd) G[i] = g;
  }
}

template <Dp2Phase kPhase>
struct Dp2Chunk {
  Dp2Hyper hyper;
  const cpu::BufferTable& state;

  void operator()(int64_t l, int64_t i0, int64_t m, float* th, const float* S, const ChunkNoise& nu,
                  cpu::WideSum&) const {
    dp2_loop<kPhase>(hyper, m, th, S, nu.x, nu.scale, state.at(0, l) + i0, state.at(1, l) + i0);
  }
};

// so: STP's clip scale (unused by the other variants).
template <AdamVariant kVariant>
void adam_loop(const AdamHyper& hyper, int64_t m, float* __restrict th, const float* __restrict S,
               const float* __restrict nu, float s, float* __restrict mo, float* __restrict vo,
               float* __restrict so) {
  AdamHyper h = hyper;
  h.variant = static_cast<int>(kVariant);
  for (int64_t i = 0; i < m; ++i) {
    float mi = mo[i], vi = vo[i], scale = 0.f;
    th[i] = adam_step(h, S[i], s * nu[i], th[i], mi, vi, scale);
    mo[i] = mi;
    vo[i] = vi;
    if constexpr (kVariant == AdamVariant::kSTP) so[i] = scale;
  }
}

template <AdamVariant kVariant>
struct AdamChunk {
  AdamHyper hyper;
  const cpu::BufferTable& state;

  void operator()(int64_t l, int64_t i0, int64_t m, float* th, const float* S, const ChunkNoise& nu,
                  cpu::WideSum&) const {
    float* so = kVariant == AdamVariant::kSTP ? state.at(2, l) + i0 : nullptr;
    adam_loop<kVariant>(hyper, m, th, S, nu.x, nu.scale, state.at(0, l) + i0, state.at(1, l) + i0, so);
  }
};

// root[i]: √ŝ of element i (0 when the step does not update ŝ).
template <MacAdamBC kBC>
void macadam_loop(const MacAdamHyper& hyper, int64_t m, float* __restrict th, const float* __restrict S,
                  const float* __restrict nu, float s, float* __restrict mo, float* __restrict vo,
                  float* __restrict so, float* __restrict bo, float* __restrict ibo, float* __restrict sho,
                  float* __restrict root) {
  MacAdamHyper h = hyper;
  h.bc = static_cast<int>(kBC);
  for (int64_t i = 0; i < m; ++i) {
    float mi = mo[i], vi = vo[i], si = so[i], bi = bo[i], ibi = ibo[i], shi = sho[i], r;
    th[i] = macadam_step(h, S[i], s * nu[i], th[i], mi, vi, si, bi, ibi, shi, r);
    mo[i] = mi;
    vo[i] = vi;
    so[i] = si;
    bo[i] = bi;
    ibo[i] = ibi;
    sho[i] = shi;
    root[i] = r;
  }
}

template <MacAdamBC kBC>
struct MacAdamChunk {
  MacAdamHyper hyper;
  const cpu::BufferTable& state;

  void operator()(int64_t l, int64_t i0, int64_t m, float* th, const float* S, const ChunkNoise& nu,
                  cpu::WideSum& acc) const {
    alignas(64) float root[kChunk];
    const auto buf = [&](int k) { return state.at(k, l) + i0; };
    macadam_loop<kBC>(hyper, m, th, S, nu.x, nu.scale, buf(0), buf(1), buf(2), buf(3), buf(4), buf(5), root);
    acc.add(root, m);
  }
};

// ---------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------

}  // namespace

void sgd_step_cpu(at::TensorList params, at::TensorList sums, at::TensorList state,
                  at::ArrayRef<double> dir_coeffs, at::TensorList past, at::TensorList noise,
                  at::TensorList noise_state, at::ArrayRef<double> noise_coeffs, double noise_std,
                  int64_t seed, int64_t step, int64_t stream, int64_t offset, at::ArrayRef<double> hyper) {
  const FilterCoeffs dir = parse_filter_coeffs(dir_coeffs, "dir_coeffs");
  const StepLayout lay = check_step_inputs(params, sums, state, dir.K, noise, noise_state, noise_coeffs,
                                           noise_std, c10::DeviceType::CPU);
  check_past(params, past, c10::DeviceType::CPU);
  const SgdHyper h = parse_sgd_hyper(hyper);
  const StepNoise nz(lay, noise, noise_state, noise_std, make_key(seed, step, stream));
  const cpu::BufferTable st(state, lay.L);
  run_step(lay, params, sums, past, nz, offset, SgdChunk{h, dir, st});
}

namespace {

// dp2_step_, adam_step_, macadam_step_: validation, then one pass of Chunk<variant> (E's value
// `variant`, of N) over the list with n_state state buffers per parameter.
template <template <auto> class Chunk, typename E, int N, typename Hyper>
double family_step(const Hyper& h, int variant, int64_t n_state, at::TensorList params, at::TensorList sums,
                   at::TensorList state, at::TensorList noise, at::TensorList noise_state,
                   at::ArrayRef<double> noise_coeffs, double noise_std, int64_t seed, int64_t step,
                   int64_t stream, int64_t offset) {
  const StepLayout lay = check_step_inputs(params, sums, state, n_state, noise, noise_state, noise_coeffs,
                                           noise_std, c10::DeviceType::CPU);
  const StepNoise nz(lay, noise, noise_state, noise_std, make_key(seed, step, stream));
  const cpu::BufferTable st(state, lay.L);
  return with_enum<E, N>(variant, [&](auto v) {
    return run_step(lay, params, sums, {}, nz, offset, Chunk<decltype(v)::value>{h, st});
  });
}

}  // namespace

void dp2_step_cpu(at::TensorList params, at::TensorList sums, at::TensorList state, at::TensorList noise,
                  at::TensorList noise_state, at::ArrayRef<double> noise_coeffs, double noise_std,
                  int64_t seed, int64_t step, int64_t stream, int64_t offset, at::ArrayRef<double> hyper) {
  const Dp2Hyper h = parse_dp2_hyper(hyper);
  family_step<Dp2Chunk, Dp2Phase, 2>(h, h.phase, 2, params, sums, state, noise, noise_state, noise_coeffs,
                                     noise_std, seed, step, stream, offset);
}

void adam_step_cpu(at::TensorList params, at::TensorList sums, at::TensorList state, at::TensorList noise,
                   at::TensorList noise_state, at::ArrayRef<double> noise_coeffs, double noise_std,
                   int64_t seed, int64_t step, int64_t stream, int64_t offset, at::ArrayRef<double> hyper) {
  const AdamHyper h = parse_adam_hyper(hyper);
  const int64_t n_state = static_cast<AdamVariant>(h.variant) == AdamVariant::kSTP ? 3 : 2;
  family_step<AdamChunk, AdamVariant, 3>(h, h.variant, n_state, params, sums, state, noise, noise_state,
                                         noise_coeffs, noise_std, seed, step, stream, offset);
}

at::Tensor macadam_step_cpu(at::TensorList params, at::TensorList sums, at::TensorList state,
                            at::TensorList noise, at::TensorList noise_state,
                            at::ArrayRef<double> noise_coeffs, double noise_std, int64_t seed, int64_t step,
                            int64_t stream, int64_t offset, at::ArrayRef<double> hyper) {
  const MacAdamHyper h = parse_macadam_hyper(hyper);
  const double total =
      family_step<MacAdamChunk, MacAdamBC, 3>(h, h.bc, 6, params, sums, state, noise, noise_state,
                                              noise_coeffs, noise_std, seed, step, stream, offset);
  return at::scalar_tensor(total, at::dtype(at::kDouble));
}

}  // namespace dpkernels

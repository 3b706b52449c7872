// Element math of the fused DP optimizer steps, shared by the CPU and CUDA kernels. Semantics:
// dpkernels/reference/optim.py (the reference step functions); the Triton twin is
// triton_kernels/optim.py; docs/ALGORITHMS.md ("Fused optimizer steps") lists the contract.
//
// Scalars are computed once on the host in float64 and rounded to fp32 (1 − β, 1 − β^t, 1/B,
// 1 − ηλ, ...), exactly as the reference's Python-scalar × fp32-tensor products round them.
//
// Every step reads, per element, the clipped sum S (fp32, from clip_and_accumulate), the noise on
// the sum ν (fp32: a pre-drawn value, or noise_std · the output of the noise filter on a fresh
// Philox z, see filter.h), the parameter θ (fp32/fp16/bf16, math in fp32) and the family's fp32
// state, and writes θ and the state. Expressions follow the reference's operation order so that
// the fp32 results agree to rounding (the CPU kernels are compiled without FMA contraction).
//
// T is float on the host and the device; the functions are scalar (the CPU kernels vectorise the
// loops around them or call them per element).
#pragma once

#include <cmath>

#include "dpkernels/kernel_args.h"
#include "dpkernels/macros.h"

namespace dpkernels {

#if !defined(__CUDACC__)
// sqrt(float) in fp32. The host's unqualified sqrt is otherwise C's sqrt(double): the float was
// widened, and the rest of the expression (+ ε, × ν) computed in float64 and rounded once. That
// is not the reference's fp32 arithmetic, and the CPU loops ran in float64 lanes: DPAdam's pass
// took 1.3x, DPAdamSTP's 1.6x and DPMacAdam's 1.15x as long (docs/BENCHMARKS.md, "Seventeenth
// session"). The device has float overloads of its own.
using std::sqrt;
#endif

// ---------------------------------------------------------------------------------------------
// Families and their scalar arguments: the structs SgdHyper, Dp2Hyper, AdamHyper, MacAdamHyper
// and the enums Dp2Phase, AdamVariant, MacAdamBC are generated from dpkernels/_kernel_args.py
// into kernel_args.h (tools/gen_kernel_args.py), as is the code that fills them from each op's
// `hyper` list (kernel_args_parse.h).
//
// sgd: DP-SGD (+ coupled weight decay, heavy-ball momentum), DP-PSAC, DP-PMLF. The direction
// d = filter(g + λθ) is linear_filter_'s element step on the family's K direction buffers
// (momentum: 1 buffer; PMLF: the m and v̄ rings; plain SGD: none).
// dp2: DP² delayed preconditioner. `phase` says which branch of the cycle this step is
// (kSgd: g̃ = (S + ν)/B, G ← G + g̃, θ ← θ − η g̃;
// kAdaptive: g̃ = (S · inv_d + ν)/B, θ ← θ − η2 g̃).
// The refresh v ← βv + (1−β)(G/s1)², inv_d ← 1/(√v + ε), G ← 0 runs once per cycle, before the
// first adaptive step's clipping, as plain tensor ops (dpkernels/optim/dp2.py).
// adam: DP-Adam(W), DP-AdamBC, scale-then-privatize. The bias corrections enter as reciprocals
// formed on the host in float64: a multiply per element instead of a division.
// macadam: DP-MacAdam(-BC). b_t = ŝ_t^{1/4}·√(Σ_j √ŝ_{t,j}) is kept as b_u = ŝ^{1/4} per element
// and the global scalar bscale = √(Σ√ŝ): the sum is accumulated during the step pass and applied
// in the next step (no extra pass over D). The step also writes the next clip pass's inputs:
// shift = m̂_t and inv_bu = 1/b_u (its norms are then multiplied by 1/bscale).
// ---------------------------------------------------------------------------------------------

// One element of a DP-MacAdam step; returns the new θ. State: m, v, s (fp32), b_u, inv_bu, shift.
// sqrt_sum accumulates √ŝ of the updated elements (the caller reduces it in float64).
template <typename T>
DPK_HOST_DEVICE inline T macadam_step(const MacAdamHyper& h, T S, T nu, T theta, T& m, T& v, T& s, T& b_u,
                                      T& inv_bu, T& shift, T& sqrt_s_hat) {
  const T b = b_u * T(h.bscale);  // b_{t−1}
  const T mh = shift;             // m̂_{t−1}
  const T g = ((S - T(h.c_total) * mh) + b * nu) * T(h.inv_b) + mh;
  m = T(h.beta1) * m + T(h.one_minus_beta1) * g;
  v = T(h.beta2) * v + T(h.one_minus_beta2) * g * g;
  const T m_hat = m * T(h.inv_bc1), v_hat = v * T(h.inv_bc2);
  const MacAdamBC bc = static_cast<MacAdamBC>(h.bc);
  T denom;
  if (bc == MacAdamBC::kOff) {
    denom = sqrt(v_hat) + T(h.eps);
  } else {
    const T phi = bc == MacAdamBC::kPaper ? T(h.noise_var) : b * b * T(h.noise_var);
    const T r = v_hat - phi;
    denom = sqrt(r < T(h.gamma) ? T(h.gamma) : r);
  }
  const T theta_new = theta - T(h.lr) * m_hat / denom;
  const T dev = g - m_hat;
  s = T(h.beta1) * s + T(h.one_minus_beta1) * (dev * dev);
  sqrt_s_hat = T(0.f);
  if (h.kappa != 0.f) {
    T s_hat = s * T(h.inv_kappa) - b * b * T(h.noise_var);
    s_hat = s_hat < T(h.h1) ? T(h.h1) : s_hat;  // torch.clamp: a NaN stays NaN
    s_hat = s_hat > T(h.h2) ? T(h.h2) : s_hat;
    sqrt_s_hat = sqrt(s_hat);
    b_u = sqrt(sqrt_s_hat);
    inv_bu = T(1.f) / b_u;
  }
  shift = m_hat;
  return theta_new;
}

// ---------------------------------------------------------------------------------------------
// sgd
// ---------------------------------------------------------------------------------------------

// g̃ = (S + ν)·(1/B), then x = g̃ + λθ: the filter's input. The caller runs the direction filter
// on x and applies sgd_apply.
template <typename T>
DPK_HOST_DEVICE inline T sgd_input(const SgdHyper& h, T S, T nu, T theta) {
  const T g = (S + nu) * T(h.inv_b);
  return h.weight_decay != 0.f ? g + T(h.weight_decay) * theta : g;
}

// θ ← θ − η·d (d: the filter output, already multiplied by its g coefficient, e.g. PMLF's 1/c_t).
template <typename T>
DPK_HOST_DEVICE inline T sgd_apply(const SgdHyper& h, T theta, T d) {
  return theta - T(h.lr) * d;
}

// ---------------------------------------------------------------------------------------------
// dp2
// ---------------------------------------------------------------------------------------------

// One element of a DP² step; returns the new θ. G (fp32) is written in the SGD phases, inv_d
// (fp32, 1/(√v + ε)) read in the adaptive phase.
template <typename T>
DPK_HOST_DEVICE inline T dp2_step(const Dp2Hyper& h, T S, T nu, T theta, T& G, T inv_d) {
  const Dp2Phase phase = static_cast<Dp2Phase>(h.phase);
  if (phase == Dp2Phase::kAdaptive) {
    const T g = (S * inv_d + nu) * T(h.inv_b);
    return theta - T(h.lr) * g;
  }
  const T g = (S + nu) * T(h.inv_b);
  G = G + g;
  return theta - T(h.lr) * g;
}

// ---------------------------------------------------------------------------------------------
// adam
// ---------------------------------------------------------------------------------------------

// One element of an Adam-family step. m, v: Adam moments; scale (STP only): the per-coordinate
// clip scale s = 1/(√v̂ + ε₁) of the NEXT step, written here so the next clip pass reads it.
// Returns the new θ.
template <typename T>
DPK_HOST_DEVICE inline T adam_step(const AdamHyper& h, T S, T nu, T theta, T& m, T& v, T& scale) {
  const AdamVariant variant = static_cast<AdamVariant>(h.variant);
  if (variant == AdamVariant::kSTP) {
    // Noise in the scaled space, un-scaled by √v̂_{t−1} + ε₁ (v̂_0 = 0: inv_bc2_prev = 0 at t = 1).
    nu = (sqrt(v * T(h.inv_bc2_prev)) + T(h.eps1)) * nu;
  }
  const T g = (S + nu) * T(h.inv_b);
  m = T(h.beta1) * m + T(h.one_minus_beta1) * g;
  v = T(h.beta2) * v + T(h.one_minus_beta2) * g * g;
  const T m_hat = m * T(h.inv_bc1), v_hat = v * T(h.inv_bc2);
  T denom;
  if (variant == AdamVariant::kBC) {
    const T r = v_hat - T(h.phi);
    denom = sqrt(r < T(h.gamma) ? T(h.gamma) : r);  // torch.clamp(min=γ'): a NaN stays NaN
  } else {
    denom = sqrt(v_hat) + T(h.eps);
  }
  if (variant == AdamVariant::kSTP) scale = T(1.f) / (sqrt(v_hat) + T(h.eps1));
  const T decayed = h.decay != 1.f ? theta * T(h.decay) : theta;
  return decayed - T(h.lr) * m_hat / denom;
}

}  // namespace dpkernels

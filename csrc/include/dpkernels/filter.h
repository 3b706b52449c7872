// Element math of linear_filter_, the one IIR step that serves correlated noise (BLT, banded
// matrix factorisation), momentum, EMA and DOPPLER-style filters. Spec and reference:
// dpkernels/reference/filter.py; the Triton twin is triton_kernels/filter.py.
//
// Per element, with K fp32 state buffers S_k and host coefficients (a, g, c_k, d_k, e_k, f_k):
//     y   = a x + Σ_k c_k S_k
//     S_k <- d_k S_k + e_k y + f_k x      (buffers with (d, e, f) = (1, 0, 0) are left alone)
//     out = g y                           (written, or added to a target)
// A term whose coefficient is exactly 0 is not evaluated, so a buffer that is only written (d = 0)
// is never read and an inf/NaN in a term that is switched off does not leak into the result. The
// terms are summed in the order written (a x first, then k = 0, 1, ...), in fp32.
//
// T is float on the host and the device, or cpu::Vec in the CPU SIMD loops;
// buffer k is reached through load(k) / store(k, value), so the same functions serve any layout.
#pragma once

#include "dpkernels/macros.h"

namespace dpkernels {

// Buffers per call; the CUDA launcher's pointer table is sized by it.
constexpr int kMaxFilterBuffers = 32;

// Coefficients of one call (fp32, as the kernels use them). Lives on the host (CPU kernels) or in
// the kernel's parameter space (CUDA).
struct FilterCoeffs {
  float a, g;
  float c[kMaxFilterBuffers], d[kMaxFilterBuffers], e[kMaxFilterBuffers], f[kMaxFilterBuffers];
  int K;
};

// Whether buffer k changes: any (d, e, f) other than (1, 0, 0).
DPK_HOST_DEVICE inline bool filter_updates(const FilterCoeffs& fc, int k) {
  return !(fc.d[k] == 1.f && fc.e[k] == 0.f && fc.f[k] == 0.f);
}

// Whether the old value of buffer k is needed: it is read for y or kept in its own update.
DPK_HOST_DEVICE inline bool filter_reads(const FilterCoeffs& fc, int k) {
  return fc.c[k] != 0.f || (fc.d[k] != 0.f && filter_updates(fc, k));
}

// y = a x + Σ_k c_k S_k.
template <typename T, typename Load>
DPK_HOST_DEVICE inline T filter_output(const FilterCoeffs& fc, T x, const Load& load) {
  T y = fc.a != 0.f ? T(fc.a) * x : T(0.f);
  for (int k = 0; k < fc.K; ++k) {
    if (fc.c[k] != 0.f) y = y + T(fc.c[k]) * load(k);
  }
  return y;
}

// New value of buffer k (only called when filter_updates(fc, k)): d_k S_k + e_k y + f_k x.
template <typename T>
DPK_HOST_DEVICE inline T filter_state(const FilterCoeffs& fc, int k, T s, T x, T y) {
  T v = fc.d[k] != 0.f ? T(fc.d[k]) * s : T(0.f);
  if (fc.e[k] != 0.f) v = v + T(fc.e[k]) * y;
  if (fc.f[k] != 0.f) v = v + T(fc.f[k]) * x;
  return v;
}

// One whole step on one element (or one SIMD vector): returns g y and updates the buffers.
template <typename T, typename Load, typename Store>
DPK_HOST_DEVICE inline T filter_step(const FilterCoeffs& fc, T x, const Load& load, const Store& store) {
  const T y = filter_output(fc, x, load);
  for (int k = 0; k < fc.K; ++k) {
    if (filter_updates(fc, k)) store(k, filter_state(fc, k, fc.d[k] != 0.f ? load(k) : T(0.f), x, y));
  }
  return T(fc.g) * y;
}

// The heavy-ball shape: one buffer, y = a x + c S, S <- e y, out = g y (a, c, e != 0, d = f = 0).
// Heavy-ball momentum is a = e = g = 1, c = μ; DP-PMLF's one-pole presets are one too.
struct HeavyBall {
  float a, c, e, g;
};
DPK_HOST_DEVICE inline bool is_heavy_ball(const FilterCoeffs& fc) {
  return fc.K == 1 && fc.a != 0.f && fc.c[0] != 0.f && fc.d[0] == 0.f && fc.e[0] != 0.f && fc.f[0] == 0.f;
}
DPK_HOST_DEVICE inline HeavyBall heavy_ball(const FilterCoeffs& fc) { return {fc.a, fc.c[0], fc.e[0], fc.g}; }

// filter_step on heavy-ball coefficients: its operations in its order (the new S summed from 0),
// so the same bits.
template <typename T>
DPK_HOST_DEVICE inline T heavy_ball_step(const HeavyBall& hb, T x, T& S) {
  const T y = T(hb.a) * x + T(hb.c) * S;
  S = T(0.f) + T(hb.e) * y;
  return T(hb.g) * y;
}

}  // namespace dpkernels

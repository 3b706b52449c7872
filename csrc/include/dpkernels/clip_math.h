// Element math of the per-sample clipping pipeline, shared by the CPU and CUDA kernels.
//
// Every function is a template on T so that one formula serves scalars (float, double) on the
// host and the device and at::vec::Vectorized<float> in the CPU SIMD loops. The Python
// reference (dpkernels/reference/clip.py) and the Triton kernels (triton_kernels/clip.py) spell
// the same formulas; tests hold all four to the reference.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "dpkernels/macros.h"

namespace dpkernels {

// Numbering shared with the Python side (dpkernels/reference/clip.py CLIP_MODES order).
enum class ClipMode : int { kClip = 0, kAutoS = 1, kAutoV = 2, kPsac = 3 };

// Opacus's guard in min(1, C/(n + eps)); also makes n = 0 finite.
constexpr double kClipEps = 1e-6;
// Auto-V's C/n stops growing below this norm, so zero and denormal norms give finite weights.
constexpr double kAutoVMinNorm = 1e-12;

// Per-sample weight c = f(n). Comparisons are written so that a NaN norm gives a NaN weight, as
// torch.clamp does in the reference (the pipeline zeroes such samples explicitly).
template <typename T>
DPK_HOST_DEVICE inline T clip_weight(ClipMode mode, T n, T C, T r) {
  switch (mode) {
    case ClipMode::kClip: {
      const T c = C / (n + T(kClipEps));
      return c > T(1) ? T(1) : c;
    }
    case ClipMode::kAutoS:
      return C / (n + r);
    case ClipMode::kAutoV:
      return C / (n < T(kAutoVMinNorm) ? T(kAutoVMinNorm) : n);
    case ClipMode::kPsac:
      // Nested form: n + r/(n + r) >= 2*sqrt(r) - r > 0, and nothing is squared, so it neither
      // divides by zero nor overflows (the expanded (n+r)/(n^2+rn+r) overflows for n > 1.8e19).
      return C / (n + r / (n + r));
  }
  return T(0);
}

// c (a weight formed in double) as a float rounded toward zero: |result| <= |c|, saturating at
// FLT_MAX. Why not to nearest: a weight in the subnormal range has few significant bits, so
// rounding up can nearly double it (0.54 * 2^-149 becomes 2^-149), and a sample would contribute
// up to ~2C. Rounding toward zero keeps c * n <= C wherever it held in double. An infinite c (the
// double quotient C/(n + r) overflowing for a tiny r) stands for a finite value beyond the float
// range, so it saturates as well; NaN stays NaN.
DPK_HOST_DEVICE inline float round_weight(double c) {
  const float f = static_cast<float>(c);
  const double a = fabs(c);
  return (fabs(static_cast<double>(f)) > a || a > DBL_MAX) ? nextafterf(f, 0.f) : f;
}

// The weight of norm n in the norms' own type T: f evaluated in double (C and r as given, never
// rounded to float first), a float result rounded toward zero. The clip_factors kernels use it,
// so a weight from the staged path never exceeds the fused pipeline's.
template <typename T>
DPK_HOST_DEVICE inline T weight_of_norm(ClipMode mode, T n, double C, double r) {
  const double c = clip_weight<double>(mode, static_cast<double>(n), C, r);
  if constexpr (sizeof(T) == sizeof(float)) {
    return round_weight(c);
  } else {
    return c;
  }
}

// The vector whose norm is taken: (v - shift) * scale, the optional parts compiled out.
template <bool kShift, bool kScale, typename T>
DPK_HOST_DEVICE inline T shift_scale(T v, T shift, T scale) {
  if constexpr (kShift) v = v - shift;
  if constexpr (kScale) v = v * scale;
  return v;
}

// Stage 2 of the pipeline for one sample (docs/ALGORITHMS.md), from its per-tensor sums of squares
// s[0, L): the norms (flat: one, sqrt(Σ_l s_l); per layer: L, sqrt(s_l)), each times norm_scale,
// and the weight of every tensor, w_l = clip_weight(n, C) with C = bounds[0] (flat) or bounds[l].
// The weights are formed in double, as the reference forms them from its fp64 norms, then rounded
// toward zero to fp32 (the gradients' compute type; round_weight says why). A sample with a
// non-finite s_l gets weight 0 on every tensor, so that the weighted sum can skip it; returns
// whether the sample is finite. (L and the loop indices are int: with int64 ones ptxas spilled
// this loop on sm_90.)
DPK_HOST_DEVICE inline bool clip_sample_weights(const double* s, int L, bool per_layer, ClipMode mode,
                                                const double* bounds, double r, double norm_scale, float* w,
                                                float* norms) {
  bool finite = true;
  double total = 0.0;
  for (int l = 0; l < L; ++l) {
    // x - x is 0 for finite x and NaN for Inf or NaN.
    finite &= (s[l] - s[l] == 0.0);
    total += s[l];
  }
  if (!per_layer) {
    const double n = sqrt(total) * norm_scale;
    const float c = finite ? round_weight(clip_weight<double>(mode, n, bounds[0], r)) : 0.f;
    for (int l = 0; l < L; ++l) w[l] = c;
    norms[0] = static_cast<float>(n);
    return finite;
  }
  for (int l = 0; l < L; ++l) {
    const double n = sqrt(s[l]) * norm_scale;
    w[l] = finite ? round_weight(clip_weight<double>(mode, n, bounds[l], r)) : 0.f;
    norms[l] = static_cast<float>(n);
  }
  return finite;
}

}  // namespace dpkernels

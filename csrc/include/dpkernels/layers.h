// Book-keeping (BK) layer norms: the element math and the input checks of
// dpkernels_C::linear_sumsq_tiled (schema in csrc/ops.cpp), shared by its CPU kernel
// (csrc/cpu/layers.cpp) and its CUDA kernel (csrc/cuda/layers.cu). Semantics:
// dpkernels/reference/layers.py::linear_sumsq.
//
// Per sample i, with a_i [T, d_in] and g_i [T, d_out], the per-sample weight gradient is
// P_i = g_iᵀ a_i, P_i[o, k] = Σ_t g[i, t, o] a[i, t, k] (fp32 products and sums of the inputs
// upcast to fp32), and the op returns the fp32 [B] vector
//
//   out[i] = Σ_{o, k} (scale[o, k] (P_i[o, k] - shift[o, k]))²,
//
// the squares summed in fp32 within a register tile, the tiles combined in fp64, the total rounded
// once to fp32 (scale = 1 and shift = 0 when absent). P_i is never stored: the kernels compute it
// tile by tile and square it in the epilogue. A square that overflows fp32 (|y| > 1.8e19) makes
// the fp32 result infinite anyway, so the fp32 squares lose nothing there.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <utility>

#include "dpkernels/macros.h"

namespace dpkernels {

// A stored input element as fp32 (float, c10::Half, c10::BFloat16; host and device).
template <typename T>
DPK_HOST_DEVICE inline float bk_to_float(T x) {
  return static_cast<float>(x);
}

// One coordinate of the shifted, scaled per-sample gradient, y = scale (p - shift), the optional
// parts compiled out. T is float on the host and the device, or at::vec::Vectorized<float> in the
// CPU kernel's SIMD epilogue.
template <bool kShift, bool kScale, typename T>
DPK_HOST_DEVICE inline T bk_shift_scale(T p, T shift, T scale) {
  if constexpr (kShift) p = p - shift;
  if constexpr (kScale) p = scale * p;
  return p;
}

// The contribution of one coordinate to the squared norm, y² in fp32 (scalar form; the SIMD and
// register-tile loops spell the same product as an FMA into the tile's fp32 sum).
template <bool kShift, bool kScale>
DPK_HOST_DEVICE inline float bk_square(float p, float shift, float scale) {
  const float y = bk_shift_scale<kShift, kScale>(p, shift, scale);
  return y * y;
}

// ---------------------------------------------------------------------------------------------
// Host side: the launchers' input checks.
// ---------------------------------------------------------------------------------------------

struct LinearShape {
  int64_t B = 0, T = 0, d_in = 0, d_out = 0;
};

// Checks the inputs of linear_sumsq_tiled for a kernel on `device` and returns their sizes: a
// [B, T, d_in] and g [B, T, d_out] of one dtype (float32, float16 or bfloat16), contiguous, on one
// device; scale and shift absent or contiguous float32 [d_out, d_in] on the same device.
inline LinearShape check_linear_sumsq_inputs(const at::Tensor& a, const at::Tensor& g,
                                             const std::optional<at::Tensor>& scale,
                                             const std::optional<at::Tensor>& shift, c10::DeviceType device) {
  DPK_CHECK(a.dim() == 3, "linear_sumsq_tiled: a must be 3-D [B, T, d_in], got ", a.dim(), "-D ", a.sizes());
  DPK_CHECK(g.dim() == 3, "linear_sumsq_tiled: g must be 3-D [B, T, d_out], got ", g.dim(), "-D ", g.sizes());
  DPK_CHECK(a.size(0) == g.size(0), "linear_sumsq_tiled: a and g must have the same batch size B, got a ",
            a.sizes(), " and g ", g.sizes());
  DPK_CHECK(a.size(1) == g.size(1),
            "linear_sumsq_tiled: a and g must have the same sequence length T, got a ", a.sizes(), " and g ",
            g.sizes());
  const auto dt = a.scalar_type();
  DPK_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, "linear_sumsq_tiled: a has dtype ",
            dt, "; supported: float32, float16, bfloat16");
  DPK_CHECK(g.scalar_type() == dt, "linear_sumsq_tiled: a and g must have the same dtype, got a ", dt,
            " and g ", g.scalar_type());
  DPK_CHECK(a.device().type() == device, "linear_sumsq_tiled: a is on ", a.device(), ", expected a ", device,
            " tensor for this kernel");
  DPK_CHECK(g.device() == a.device(), "linear_sumsq_tiled: g is on ", g.device(), " but a is on ",
            a.device());
  DPK_CHECK(a.is_contiguous(), "linear_sumsq_tiled: a must be contiguous");
  DPK_CHECK(g.is_contiguous(), "linear_sumsq_tiled: g must be contiguous");
  const LinearShape s{a.size(0), a.size(1), a.size(2), g.size(2)};
  for (const auto& [name, t] : {std::pair{"scale", &scale}, std::pair{"shift", &shift}}) {
    if (!t->has_value()) continue;
    const at::Tensor& v = **t;
    DPK_CHECK(v.dim() == 2 && v.size(0) == s.d_out && v.size(1) == s.d_in, "linear_sumsq_tiled: ", name,
              " must be [d_out, d_in] = [", s.d_out, ", ", s.d_in, "], got ", v.sizes());
    DPK_CHECK(v.scalar_type() == at::kFloat, "linear_sumsq_tiled: ", name, " must be float32, got ",
              v.scalar_type());
    DPK_CHECK(v.is_contiguous(), "linear_sumsq_tiled: ", name, " must be contiguous");
    DPK_CHECK(v.device() == a.device(), "linear_sumsq_tiled: ", name, " is on ", v.device(), " but a is on ",
              a.device());
  }
  return s;
}

}  // namespace dpkernels

// Book-keeping (BK) layer norms: the element math and the input checks of
// dpkernels_C::linear_sumsq_tiled and dpkernels_C::conv2d_sumsq_tiled (schemas in csrc/ops.cpp),
// shared by their CPU kernels (csrc/cpu/layers.cpp) and CUDA kernels (csrc/cuda/layers.cu).
// Semantics: dpkernels/reference/layers.py::linear_sumsq (a Conv2d is the linear layer over its
// im2col patches, ConvShape below).
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

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <type_traits>
#include <utility>

#include "dpkernels/macros.h"

namespace dpkernels {

// A stored input element as fp32 (float, c10::Half, c10::BFloat16; host and device).
template <typename T>
DPK_HOST_DEVICE inline float bk_to_float(T x) {
  return static_cast<float>(x);
}

// One coordinate of the shifted, scaled per-sample gradient, y = scale (p - shift), the optional
// parts compiled out. T is float on the host and the device, or cpu::Vec in the
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

// scale and shift of a tiled norm: absent, or contiguous float32 [d_out, d_in] on `like`'s device.
inline void check_epilogue_inputs(const char* op, const LinearShape& s, const at::Tensor& like,
                                  const std::optional<at::Tensor>& scale,
                                  const std::optional<at::Tensor>& shift) {
  for (const auto& [name, t] : {std::pair{"scale", &scale}, std::pair{"shift", &shift}}) {
    if (!t->has_value()) continue;
    const at::Tensor& v = **t;
    DPK_CHECK(v.dim() == 2 && v.size(0) == s.d_out && v.size(1) == s.d_in, op, ": ", name,
              " must be [d_out, d_in] = [", s.d_out, ", ", s.d_in, "], got ", v.sizes());
    DPK_CHECK(v.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", v.scalar_type());
    DPK_CHECK(v.is_contiguous(), op, ": ", name, " must be contiguous");
    DPK_CHECK(v.device() == like.device(), op, ": ", name, " is on ", v.device(),
              " but the activations are on ", like.device());
  }
}

// Checks the inputs of `op` (linear_sumsq_tiled, linear_sumsq_gram) for a kernel on `device` and
// returns their sizes: a [B, T, d_in] and g [B, T, d_out] of one dtype (float32, float16 or bfloat16),
// contiguous, on one device; scale and shift absent or contiguous float32 [d_out, d_in] on the same device.
inline LinearShape check_linear_sumsq_inputs(const char* op, const at::Tensor& a, const at::Tensor& g,
                                             const std::optional<at::Tensor>& scale,
                                             const std::optional<at::Tensor>& shift, c10::DeviceType device) {
  DPK_CHECK(a.dim() == 3, op, ": a must be 3-D [B, T, d_in], got ", a.dim(), "-D ", a.sizes());
  DPK_CHECK(g.dim() == 3, op, ": g must be 3-D [B, T, d_out], got ", g.dim(), "-D ", g.sizes());
  DPK_CHECK(a.size(0) == g.size(0), op, ": a and g must have the same batch size B, got a ", a.sizes(),
            " and g ", g.sizes());
  DPK_CHECK(a.size(1) == g.size(1), op, ": a and g must have the same sequence length T, got a ", a.sizes(),
            " and g ", g.sizes());
  const auto dt = a.scalar_type();
  DPK_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, op, ": a has dtype ", dt,
            "; supported: float32, float16, bfloat16");
  DPK_CHECK(g.scalar_type() == dt, op, ": a and g must have the same dtype, got a ", dt, " and g ",
            g.scalar_type());
  DPK_CHECK(a.device().type() == device, op, ": a is on ", a.device(), ", expected a ", device,
            " tensor for this kernel");
  DPK_CHECK(g.device() == a.device(), op, ": g is on ", g.device(), " but a is on ", a.device());
  DPK_CHECK(a.is_contiguous(), op, ": a must be contiguous");
  DPK_CHECK(g.is_contiguous(), op, ": g must be contiguous");
  const LinearShape s{a.size(0), a.size(1), a.size(2), g.size(2)};
  check_epilogue_inputs(op, s, a, scale, shift);
  return s;
}

// A Conv2d as the linear layer over its im2col patches (T = H_out · W_out positions, d_in = C · kh
// · kw columns in weight[o].flatten() order, d_out = O), read in place: x [B, C, H, W] and g [B, O,
// H_out, W_out] with each channel's plane contiguous (any batch and channel strides, so a group's
// channel slice of a contiguous tensor is read as it is).
struct ConvShape {
  int64_t B = 0, C = 0, H = 0, W = 0, O = 0, H_out = 0, W_out = 0;
  int64_t kh = 0, kw = 0, stride_h = 0, stride_w = 0, pad_h = 0, pad_w = 0, dilation_h = 0, dilation_w = 0;
  int64_t x_batch_stride = 0, x_channel_stride = 0, g_batch_stride = 0, g_channel_stride = 0;

  LinearShape linear() const { return {B, H_out * W_out, C * kh * kw, O}; }
};

// Checks the inputs of a conv op (conv2d_sumsq_tiled, conv2d_weighted_sum) for a kernel on
// `device`: x [B, C, H, W] and g [B, O, H_out, W_out] of one dtype (float32, float16, bfloat16) on
// one device, each channel's plane contiguous, H_out and W_out those of the convolution;
// kernel_size, stride, padding and dilation pairs (kernel, stride and dilation >= 1, padding >= 0);
// scale and shift absent or contiguous float32 [O, C · kh · kw] on the same device.
inline ConvShape check_conv2d_inputs(const char* op, const at::Tensor& x, const at::Tensor& g,
                                     at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                     at::IntArrayRef padding, at::IntArrayRef dilation,
                                     const std::optional<at::Tensor>& scale,
                                     const std::optional<at::Tensor>& shift, c10::DeviceType device) {
  DPK_CHECK(x.dim() == 4, op, ": x must be 4-D [B, C, H, W], got ", x.dim(), "-D ", x.sizes());
  DPK_CHECK(g.dim() == 4, op, ": g must be 4-D [B, O, H_out, W_out], got ", g.dim(), "-D ", g.sizes());
  DPK_CHECK(x.size(0) == g.size(0), op, ": x and g must have the same batch size B, got x ", x.sizes(),
            " and g ", g.sizes());
  const auto dt = x.scalar_type();
  DPK_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, op, ": x has dtype ", dt,
            "; supported: float32, float16, bfloat16");
  DPK_CHECK(g.scalar_type() == dt, op, ": x and g must have the same dtype, got x ", dt, " and g ",
            g.scalar_type());
  DPK_CHECK(x.device().type() == device, op, ": x is on ", x.device(), ", expected a ", device,
            " tensor for this kernel");
  DPK_CHECK(g.device() == x.device(), op, ": g is on ", g.device(), " but x is on ", x.device());
  for (const auto& [name, v] : {std::pair{"kernel_size", kernel_size}, std::pair{"stride", stride},
                                std::pair{"padding", padding}, std::pair{"dilation", dilation}}) {
    DPK_CHECK(v.size() == 2, op, ": ", name, " must have 2 values, got ", v);
  }
  DPK_CHECK(kernel_size[0] >= 1 && kernel_size[1] >= 1, op, ": kernel_size must be positive, got ",
            kernel_size);
  DPK_CHECK(stride[0] >= 1 && stride[1] >= 1, op, ": stride must be positive, got ", stride);
  DPK_CHECK(dilation[0] >= 1 && dilation[1] >= 1, op, ": dilation must be positive, got ", dilation);
  DPK_CHECK(padding[0] >= 0 && padding[1] >= 0, op, ": padding must be non-negative, got ", padding);
  ConvShape c;
  c.B = x.size(0), c.C = x.size(1), c.H = x.size(2), c.W = x.size(3), c.O = g.size(1);
  c.kh = kernel_size[0], c.kw = kernel_size[1], c.stride_h = stride[0], c.stride_w = stride[1];
  c.pad_h = padding[0], c.pad_w = padding[1], c.dilation_h = dilation[0], c.dilation_w = dilation[1];
  const int64_t span_h = c.H + 2 * c.pad_h - c.dilation_h * (c.kh - 1) - 1;
  const int64_t span_w = c.W + 2 * c.pad_w - c.dilation_w * (c.kw - 1) - 1;
  DPK_CHECK(span_h >= 0 && span_w >= 0, op, ": the kernel (", kernel_size, ", dilation ", dilation,
            ") is larger than the padded input ", x.sizes());
  c.H_out = span_h / c.stride_h + 1, c.W_out = span_w / c.stride_w + 1;
  DPK_CHECK(g.size(2) == c.H_out && g.size(3) == c.W_out, op, ": g's spatial size [", g.size(2), ", ",
            g.size(3), "] is not the convolution's output size [", c.H_out, ", ", c.W_out, "] for x ",
            x.sizes());
  const auto plane_contiguous = [](const at::Tensor& t) {
    return (t.size(3) <= 1 || t.stride(3) == 1) && (t.size(2) <= 1 || t.stride(2) == t.size(3));
  };
  DPK_CHECK(plane_contiguous(x), op, ": each channel of x must be a contiguous H x W plane, got strides ",
            x.strides());
  DPK_CHECK(plane_contiguous(g), op,
            ": each channel of g must be a contiguous H_out x W_out plane, got strides ", g.strides());
  c.x_batch_stride = x.stride(0), c.x_channel_stride = x.stride(1);
  c.g_batch_stride = g.stride(0), c.g_channel_stride = g.stride(1);
  check_epilogue_inputs(op, c.linear(), x, scale, shift);
  return c;
}

// The per-sample weights of a weighted sum: contiguous float32 [B] on x's device.
inline void check_sample_weights(const char* op, const at::Tensor& weights, const at::Tensor& x) {
  DPK_CHECK(weights.dim() == 1 && weights.size(0) == x.size(0), op, ": weights must be [B] = [", x.size(0),
            "], got ", weights.sizes());
  DPK_CHECK(weights.scalar_type() == at::kFloat, op, ": weights must be float32, got ",
            weights.scalar_type());
  DPK_CHECK(weights.is_contiguous(), op, ": weights must be contiguous");
  DPK_CHECK(weights.device() == x.device(), op, ": weights are on ", weights.device(), " but x is on ",
            x.device());
}

}  // namespace dpkernels

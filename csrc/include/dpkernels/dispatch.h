// Dispatch helpers of the launchers: the per-sample gradients' storage types (math is fp32), and
// the optional shift and scale as compile-time switches.
#pragma once

#include <ATen/Dispatch.h>

#include <type_traits>

#define DPK_DISPATCH_GRAD_TYPES(TYPE, NAME, ...)                                                        \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                                                        \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__) \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace dpkernels {

// f(shift_tag, scale_tag) with std::true_type / std::false_type tags for the optional shift and
// scale, so that each kernel instantiation compiles the epilogue it needs and nothing else.
template <typename F>
void dispatch_shift_scale(bool has_shift, bool has_scale, const F& f) {
  using Y = std::true_type;
  using N = std::false_type;
  if (has_shift) {
    has_scale ? f(Y{}, Y{}) : f(Y{}, N{});
  } else {
    has_scale ? f(N{}, Y{}) : f(N{}, N{});
  }
}

}  // namespace dpkernels

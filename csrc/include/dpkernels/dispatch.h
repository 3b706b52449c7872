// Dtype dispatch for per-sample gradients: the storage types dpkernels streams (math is fp32).
#pragma once

#include <ATen/Dispatch.h>

#define DPK_DISPATCH_GRAD_TYPES(TYPE, NAME, ...)                                                        \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                                                        \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__) \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

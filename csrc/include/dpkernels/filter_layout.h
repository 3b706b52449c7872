// Host-side validation of a linear_filter_ call, shared by the CPU and CUDA launchers.
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <vector>

#include "dpkernels/filter.h"
#include "dpkernels/kernel_args_parse.h"
#include "dpkernels/macros.h"

namespace dpkernels {

// coeffs = [a, g, c_0..c_{K-1}, d_0.., e_0.., f_0..]; state[k * L + l] is buffer k of tensor l.
struct FilterLayout {
  FilterCoeffs fc{};
  int64_t L = 0;
  std::vector<int64_t> numel;  // elements of tensor l
};

inline bool is_grad_type(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

inline FilterLayout check_filter_inputs(at::TensorList inputs, at::TensorList state, at::TensorList out,
                                        at::ArrayRef<double> coeffs, double noise_std,
                                        c10::DeviceType device) {
  FilterLayout lay;
  DPK_CHECK(coeffs.size() >= static_cast<size_t>(kFilterScalars) &&
                (coeffs.size() - kFilterScalars) % kFilterGroups == 0,
            "coeffs must hold 2 + 4K values [a, g, c.., d.., e.., f..], got ", coeffs.size());
  const int K = static_cast<int>((coeffs.size() - kFilterScalars) / kFilterGroups);
  DPK_CHECK(K <= kMaxFilterBuffers, "at most ", kMaxFilterBuffers, " state buffers per call, got ", K);
  for (size_t i = 0; i < coeffs.size(); ++i) {
    DPK_CHECK(std::isfinite(coeffs[i]), "coeffs[", i, "] is not finite: ", coeffs[i]);
  }
  DPK_CHECK(std::isfinite(noise_std) && noise_std >= 0, "noise_std must be finite and >= 0, got ", noise_std);
  fill_filter_coeffs(coeffs, K, lay.fc);
  if (!out.empty()) {
    lay.L = static_cast<int64_t>(out.size());
  } else if (!inputs.empty()) {
    lay.L = static_cast<int64_t>(inputs.size());
  } else {
    DPK_CHECK(K > 0 && !state.empty(), "linear_filter_ needs inputs, out or state tensors");
    lay.L = static_cast<int64_t>(state.size()) / K;
  }
  DPK_CHECK(lay.L > 0, "linear_filter_ needs at least one tensor");
  DPK_CHECK(inputs.empty() || static_cast<int64_t>(inputs.size()) == lay.L, "inputs must hold ", lay.L,
            " tensors, got ", inputs.size());
  DPK_CHECK(static_cast<int64_t>(state.size()) == K * lay.L, "state must hold K * L = ", K * lay.L,
            " tensors (buffer-major), got ", state.size());
  const auto check = [&](const at::Tensor& t, const char* what, int64_t idx) {
    DPK_CHECK(t.device().type() == device, what, "[", idx, "] is on ", t.device(), ", expected ", device);
    DPK_CHECK(t.is_contiguous(), what, "[", idx, "] must be contiguous");
  };
  for (int64_t l = 0; l < lay.L; ++l) {
    const at::Tensor& ref = !out.empty() ? out[l] : (!inputs.empty() ? inputs[l] : state[l]);
    lay.numel.push_back(ref.numel());
    if (!out.empty()) {
      check(out[l], "out", l);
      DPK_CHECK(is_grad_type(out[l].scalar_type()), "out[", l, "] has dtype ", out[l].scalar_type(),
                "; supported: float32, float16, bfloat16");
    }
    if (!inputs.empty()) {
      check(inputs[l], "inputs", l);
      DPK_CHECK(is_grad_type(inputs[l].scalar_type()), "inputs[", l, "] has dtype ", inputs[l].scalar_type(),
                "; supported: float32, float16, bfloat16");
      DPK_CHECK(inputs[l].numel() == ref.numel(), "inputs[", l, "] has ", inputs[l].numel(),
                " elements, expected ", ref.numel());
      DPK_CHECK(out.empty() || inputs[l].scalar_type() == out[l].scalar_type(), "inputs[", l, "] and out[", l,
                "] must have the same dtype");
    }
    for (int k = 0; k < K; ++k) {
      const at::Tensor& s = state[k * lay.L + l];
      check(s, "state", k * lay.L + l);
      DPK_CHECK(s.scalar_type() == at::kFloat, "state[", k * lay.L + l, "] must be float32, got ",
                s.scalar_type());
      DPK_CHECK(s.numel() == ref.numel(), "state[", k * lay.L + l, "] has ", s.numel(),
                " elements, expected ", ref.numel());
    }
  }
  return lay;
}

}  // namespace dpkernels

// Host-side validation and argument parsing of the fused optimizer steps (schemas: csrc/ops.cpp),
// shared by the CPU and CUDA launchers. The hyper lists are parsed by the generated
// kernel_args_parse.h (parse_<family>_hyper).
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <vector>

#include "dpkernels/filter.h"
#include "dpkernels/filter_layout.h"
#include "dpkernels/kernel_args_parse.h"
#include "dpkernels/macros.h"
#include "dpkernels/optim_math.h"

namespace dpkernels {

// The validated arguments every family shares.
struct StepLayout {
  int64_t L = 0;
  std::vector<int64_t> numel;  // elements of parameter l
  bool given_noise = false;    // noise[l] holds nu; otherwise nu is generated in the pass
  FilterCoeffs noise_fc{};     // the noise filter (K = number of noise buffers; [1, 1] = independent)
  bool generate = false;       // in-pass noise is generated (noise_std > 0 or noise buffers present)
};

inline FilterCoeffs parse_filter_coeffs(at::ArrayRef<double> coeffs, const char* what) {
  DPK_CHECK(coeffs.size() >= static_cast<size_t>(kFilterScalars) &&
                (coeffs.size() - kFilterScalars) % kFilterGroups == 0,
            what, " must hold 2 + 4K values [a, g, c.., d.., e.., f..], got ", coeffs.size());
  FilterCoeffs fc{};
  fc.K = static_cast<int>((coeffs.size() - kFilterScalars) / kFilterGroups);
  DPK_CHECK(fc.K <= kMaxFilterBuffers, what, ": at most ", kMaxFilterBuffers, " buffers, got ", fc.K);
  for (size_t i = 0; i < coeffs.size(); ++i) {
    DPK_CHECK(std::isfinite(coeffs[i]), what, "[", i, "] is not finite: ", coeffs[i]);
  }
  fill_filter_coeffs(coeffs, fc.K, fc);
  return fc;
}

// params (fp32/fp16/bf16), sums and every fp32 buffer list (state, noise_state) are checked for
// device, contiguity, dtype and element count; `n_state` is the family's number of state buffers.
inline StepLayout check_step_inputs(at::TensorList params, at::TensorList sums, at::TensorList state,
                                    int64_t n_state, at::TensorList noise, at::TensorList noise_state,
                                    at::ArrayRef<double> noise_coeffs, double noise_std,
                                    c10::DeviceType device) {
  StepLayout lay;
  lay.L = static_cast<int64_t>(params.size());
  DPK_CHECK(lay.L > 0, "params must not be empty");
  DPK_CHECK(static_cast<int64_t>(sums.size()) == lay.L, "sums must hold ", lay.L, " tensors, got ",
            sums.size());
  DPK_CHECK(static_cast<int64_t>(state.size()) == n_state * lay.L, "state must hold ", n_state, " x ", lay.L,
            " tensors (buffer-major), got ", state.size());
  DPK_CHECK(std::isfinite(noise_std) && noise_std >= 0, "noise_std must be finite and >= 0, got ", noise_std);
  lay.given_noise = !noise.empty();
  DPK_CHECK(!lay.given_noise || static_cast<int64_t>(noise.size()) == lay.L, "noise must hold ", lay.L,
            " tensors or none, got ", noise.size());
  lay.noise_fc = parse_filter_coeffs(noise_coeffs, "noise_coeffs");
  DPK_CHECK(static_cast<int64_t>(noise_state.size()) == lay.noise_fc.K * lay.L, "noise_state must hold ",
            lay.noise_fc.K, " x ", lay.L, " tensors (buffer-major), got ", noise_state.size());
  DPK_CHECK(!lay.given_noise || lay.noise_fc.K == 0, "pre-drawn noise cannot be combined with noise buffers");
  lay.generate = !lay.given_noise && (noise_std > 0 || lay.noise_fc.K > 0);
  const auto check = [&](const at::Tensor& t, const char* what, int64_t idx, int64_t numel, bool fp32) {
    DPK_CHECK(t.device().type() == device, what, "[", idx, "] is on ", t.device(), ", expected ", device);
    DPK_CHECK(t.is_contiguous(), what, "[", idx, "] must be contiguous");
    DPK_CHECK(t.numel() == numel, what, "[", idx, "] has ", t.numel(), " elements, expected ", numel);
    DPK_CHECK(fp32 ? t.scalar_type() == at::kFloat : is_grad_type(t.scalar_type()), what, "[", idx,
              "] has dtype ", t.scalar_type(),
              fp32 ? "; expected float32" : "; supported: float32, float16, bfloat16");
  };
  for (int64_t l = 0; l < lay.L; ++l) {
    lay.numel.push_back(params[l].numel());
    check(params[l], "params", l, lay.numel[l], false);
    check(sums[l], "sums", l, lay.numel[l], true);
    if (lay.given_noise) check(noise[l], "noise", l, lay.numel[l], true);
    for (int64_t k = 0; k < n_state; ++k)
      check(state[k * lay.L + l], "state", k * lay.L + l, lay.numel[l], true);
    for (int k = 0; k < lay.noise_fc.K; ++k) {
      check(noise_state[k * lay.L + l], "noise_state", k * lay.L + l, lay.numel[l], true);
    }
  }
  return lay;
}

// sgd_step_'s `past`: [] or one tensor per parameter, shaped and typed like it, that receives the
// parameter's old value.
inline void check_past(at::TensorList params, at::TensorList past, c10::DeviceType device) {
  if (past.empty()) return;
  DPK_CHECK(past.size() == params.size(), "past must hold ", params.size(), " tensors or none, got ",
            past.size());
  for (size_t l = 0; l < past.size(); ++l) {
    DPK_CHECK(past[l].device().type() == device, "past[", l, "] is on ", past[l].device(), ", expected ",
              device);
    DPK_CHECK(past[l].is_contiguous(), "past[", l, "] must be contiguous");
    DPK_CHECK(past[l].numel() == params[l].numel(), "past[", l, "] has ", past[l].numel(),
              " elements, expected ", params[l].numel());
    DPK_CHECK(past[l].scalar_type() == params[l].scalar_type(), "past[", l, "] has dtype ",
              past[l].scalar_type(), ", expected the parameter's ", params[l].scalar_type());
  }
}

}  // namespace dpkernels

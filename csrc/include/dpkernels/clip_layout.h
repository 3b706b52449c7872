// Host-side validation and layout of a per-sample gradient list, shared by the CPU and CUDA
// launchers of the clipping ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "dpkernels/clip_math.h"
#include "dpkernels/macros.h"

namespace dpkernels {

// grads holds k sets of L tensors, set-major: grads[j * L + l] is set j, parameter l, [B, ...].
struct ClipLayout {
  int64_t k = 0, L = 0, B = 0;
  std::vector<int64_t> numel;  // elements per sample of parameter l
};

inline ClipLayout check_clip_inputs(at::TensorList grads, at::ArrayRef<double> coeffs, at::TensorList shift,
                                    at::TensorList scale, c10::DeviceType device) {
  ClipLayout lay;
  lay.k = static_cast<int64_t>(coeffs.size());
  DPK_CHECK(lay.k > 0, "coeffs must not be empty");
  DPK_CHECK(!grads.empty() && grads.size() % lay.k == 0, "got ", grads.size(), " gradient tensors for ",
            lay.k, " sets");
  lay.L = static_cast<int64_t>(grads.size()) / lay.k;
  lay.B = grads[0].dim() > 0 ? grads[0].size(0) : 0;
  for (size_t t = 0; t < grads.size(); ++t) {
    const auto& g = grads[t];
    const int64_t l = static_cast<int64_t>(t) % lay.L;
    DPK_CHECK(g.device().type() == device, "grads[", t, "] is on ", g.device(), ", expected ", device);
    DPK_CHECK(g.dim() >= 1 && g.size(0) == lay.B, "grads[", t, "] must be [B=", lay.B, ", ...], got ",
              g.sizes());
    DPK_CHECK(g.is_contiguous(), "grads[", t, "] must be contiguous");
    DPK_CHECK(
        g.scalar_type() == at::kFloat || g.scalar_type() == at::kHalf || g.scalar_type() == at::kBFloat16,
        "grads[", t, "] has dtype ", g.scalar_type(), "; supported: float32, float16, bfloat16");
    DPK_CHECK(g.scalar_type() == grads[l].scalar_type() && g.sizes() == grads[l].sizes(), "grads[", t,
              "] must match set 0's tensor ", l, " in shape and dtype");
    if (t < static_cast<size_t>(lay.L)) lay.numel.push_back(c10::multiply_integers(g.sizes().slice(1)));
  }
  for (auto* vecs : {&shift, &scale}) {
    if (vecs->empty()) continue;
    DPK_CHECK(static_cast<int64_t>(vecs->size()) == lay.L, "shift/scale must hold one tensor per parameter (",
              lay.L, "), got ", vecs->size());
    for (int64_t l = 0; l < lay.L; ++l) {
      const auto& v = (*vecs)[l];
      DPK_CHECK(v.scalar_type() == at::kFloat && v.is_contiguous() && v.numel() == lay.numel[l] &&
                    v.device().type() == device,
                "shift/scale[", l, "] must be a contiguous float32 tensor of ", lay.numel[l], " elements on ",
                device);
    }
  }
  return lay;
}

// Allocates an output that the kernel fully overwrites. With DPKERNELS_POISON_OUTPUTS=1 (set by the
// test suite) it is filled with NaN first, so an element the kernel forgets to write is caught.
inline at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  static const bool poison = [] {
    const char* v = std::getenv("DPKERNELS_POISON_OUTPUTS");
    return v != nullptr && v[0] == '1';
  }();
  auto out = at::empty(sizes, options);
  if (poison) out.fill_(std::numeric_limits<float>::quiet_NaN());
  return out;
}

// One output per shape, all carved from a single allocation but each with its own storage, so that
// they neither alias one another (torch.library forbids aliased returns) nor share a version
// counter. Why one allocation: glibc hands freed chunks above its trim threshold back to the kernel,
// and L separate outputs of a few hundred KiB each were returned and faulted back in on every call
// (+1.8 ms of page faults per weighted_sum on 148 tensors of 1.5 M floats, measured); one chunk of
// D floats raises glibc's dynamic thresholds past itself and is reused without faults. Each output's
// storage holds a reference to the slab's storage as its data context, rather than a per-output
// deleter object, so an output costs its TensorImpl and StorageImpl only. Each output starts on a
// 64-byte line, so that no two share a line and vector stores into them can be aligned.
inline std::vector<at::Tensor> new_outputs(const std::vector<at::IntArrayRef>& shapes,
                                           const at::TensorOptions& options) {
  const int64_t line =
      64 / static_cast<int64_t>(c10::elementSize(c10::typeMetaToScalarType(options.dtype())));
  const auto padded = [line](int64_t n) { return (n + line - 1) / line * line; };
  int64_t total = 0;
  for (const auto& s : shapes) total += padded(c10::multiply_integers(s));
  const at::Tensor slab = new_output({total}, options);
  c10::StorageImpl* const holder = slab.storage().unsafeGetStorageImpl();
  const auto release = [](void* ctx) {
    c10::raw::intrusive_ptr::decref(static_cast<c10::StorageImpl*>(ctx));
  };
  const c10::DispatchKeySet keys(c10::computeDispatchKey(slab.scalar_type(), slab.layout(), slab.device()));
  auto* base = static_cast<char*>(slab.data_ptr());
  const auto itemsize = static_cast<int64_t>(slab.element_size());
  std::vector<at::Tensor> out;
  out.reserve(shapes.size());
  int64_t offset = 0;
  for (const auto& s : shapes) {
    const int64_t n = c10::multiply_integers(s);
    c10::raw::intrusive_ptr::incref(holder);
    c10::Storage storage(c10::Storage::use_byte_size_t(), n * itemsize,
                         at::DataPtr(base + offset * itemsize, holder, release, slab.device()),
                         /*allocator=*/nullptr, /*resizable=*/false);
    auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), keys, slab.dtype());
    t.unsafeGetTensorImpl()->set_sizes_contiguous(s);
    out.push_back(std::move(t));
    offset += padded(n);
  }
  return out;
}

inline ClipMode parse_clip_mode(c10::string_view mode) {
  if (mode == "clip") return ClipMode::kClip;
  if (mode == "auto_s") return ClipMode::kAutoS;
  if (mode == "auto_v") return ClipMode::kAutoV;
  if (mode == "psac") return ClipMode::kPsac;
  TORCH_CHECK(false, "dpkernels: unknown clip mode '", std::string(mode), "'");
}

// The bounds of the fused pipeline: one value (flat clipping), or with per_layer one per tensor
// (a single value stands for all L).
inline std::vector<double> pipeline_bounds(at::ArrayRef<double> max_grad_norm, bool per_layer, int64_t L) {
  DPK_CHECK(max_grad_norm.size() == 1 || (per_layer && static_cast<int64_t>(max_grad_norm.size()) == L),
            "max_grad_norm must hold 1", per_layer ? " or L=" + std::to_string(L) : std::string(),
            " values, got ", max_grad_norm.size());
  for (const double c : max_grad_norm) {
    TORCH_CHECK_VALUE(std::isfinite(c) && c > 0, "max_grad_norm must be finite and > 0, got ", c);
  }
  if (max_grad_norm.size() == 1) return std::vector<double>(per_layer ? L : 1, max_grad_norm[0]);
  return std::vector<double>(max_grad_norm.begin(), max_grad_norm.end());
}

// The bounds of clip_factors' [B] or [B, L] norms, as pipeline_bounds gives them.
inline std::vector<double> clip_bounds(at::ArrayRef<double> max_grad_norm, const at::Tensor& norms) {
  DPK_CHECK(norms.dim() == 1 || norms.dim() == 2, "norms must be [B] or [B, L], got ", norms.sizes());
  DPK_CHECK(norms.scalar_type() == at::kFloat || norms.scalar_type() == at::kDouble,
            "norms must be float32 or float64, got ", norms.scalar_type());
  DPK_CHECK(norms.is_contiguous(), "norms must be contiguous");
  return pipeline_bounds(max_grad_norm, norms.dim() == 2, norms.dim() == 2 ? norms.size(1) : 1);
}

// The noise of a clip_pipeline call (csrc/ops.cpp): none, Philox (key = [seed]) or ChaCha20 (key = 4
// limbs); the sum pass writes (S + noise) * out_scale.
enum class NoiseRng { kNone, kPhilox, kChacha20 };
struct NoiseSpec {
  NoiseRng rng = NoiseRng::kNone;
  double noise_std = 0.0, out_scale = 1.0;
  at::IntArrayRef key;
  int64_t step = 0, stream = 0;
};

inline NoiseSpec parse_noise_spec(c10::string_view rng, double noise_std, at::IntArrayRef key, int64_t step,
                                  int64_t stream, double out_scale) {
  DPK_CHECK(std::isfinite(noise_std) && noise_std >= 0, "noise_std must be finite and >= 0, got ", noise_std);
  DPK_CHECK(std::isfinite(out_scale), "out_scale must be finite, got ", out_scale);
  NoiseSpec spec{NoiseRng::kNone, noise_std, out_scale, key, step, stream};
  if (rng == "philox") {
    DPK_CHECK(key.size() == 1, "philox takes a 1-element key (the seed), got ", key.size());
    spec.rng = NoiseRng::kPhilox;
  } else if (rng == "chacha20") {
    spec.rng = NoiseRng::kChacha20;  // make_chacha_key checks the 4 limbs
  } else {
    DPK_CHECK(rng == "none", "rng must be 'none', 'philox' or 'chacha20', got '", std::string(rng), "'");
  }
  // No noise to draw: the plain (or pre-drawn noise) epilogue.
  if (noise_std == 0.0) spec.rng = NoiseRng::kNone;
  return spec;
}

// A pre-drawn noise list: one contiguous float32 tensor per parameter, shaped like it and on its device.
inline void check_noise_list(at::TensorList noise, at::TensorList grads, const ClipLayout& lay) {
  DPK_CHECK(static_cast<int64_t>(noise.size()) == lay.L, "noise must hold one tensor per parameter (", lay.L,
            "), got ", noise.size());
  for (int64_t l = 0; l < lay.L; ++l) {
    DPK_CHECK(noise[l].device() == grads[l].device() && noise[l].scalar_type() == at::kFloat &&
                  noise[l].is_contiguous() && noise[l].sizes() == grads[l].sizes().slice(1),
              "noise[", l, "] must be a contiguous float32 tensor shaped like parameter ", l, " ",
              grads[l].sizes().slice(1), " on ", grads[l].device(), ", got ", noise[l].sizes(), " ",
              noise[l].scalar_type(), " on ", noise[l].device());
  }
}

// Raises the pipeline's ValueError for nonfinite="raise" when a sample has a non-finite gradient
// (finite[i] == 0 for sample i of B); the message is the reference's (dpkernels/reference/clip.py
// check_nonfinite).
inline void check_nonfinite(const uint8_t* finite, int64_t B) {
  std::vector<int64_t> bad;
  for (int64_t i = 0; i < B; ++i) {
    if (!finite[i]) bad.push_back(i);
  }
  if (bad.empty()) return;
  std::string shown;
  for (size_t q = 0; q < bad.size() && q < 20; ++q) shown += (q ? ", " : "") + std::to_string(bad[q]);
  if (bad.size() > 20) shown += ", ...";
  TORCH_CHECK_VALUE(false, "non-finite per-sample gradient for ", bad.size(), " sample(s) at batch indices [",
                    shown, "]; pass nonfinite='drop' to give those samples weight 0 instead");
}

}  // namespace dpkernels

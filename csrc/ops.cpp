// Schemas of the native ops. Kernels: csrc/cpu/*.cpp (CPU key) and csrc/cuda/*.cu (CUDA key).
// Python wraps them in the public dpkernels::* custom ops (dpkernels/clip.py) and registers
// their fake (meta) kernels, so they work under torch.compile and torch.library.opcheck.
#include <Python.h>
#include <torch/library.h>

// Importing dpkernels._C loads this library and runs the static registrations below; no
// Python-level bindings are needed (the pytorch/extension-cpp pattern).
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY(dpkernels_C, m) {
  // [B, L] float64: per-sample, per-tensor sums of squares of (Σ_j coeffs[j] grads[j*L+l] - shift) * scale.
  m.def("per_sample_sumsq(Tensor[] grads, float[] coeffs, Tensor[] shift, Tensor[] scale) -> Tensor");
  // Per-sample weights f(norms) for a clip mode, same shape/dtype as norms ([B] or [B, L]).
  m.def("clip_factors(Tensor norms, float[] max_grad_norm, str mode, float r) -> Tensor");
  // One float32 tensor per parameter: Σ_i weights[i, l] Σ_j coeffs[j] grads[j*L+l][i].
  m.def("weighted_sum(Tensor[] grads, float[] coeffs, Tensor weights) -> Tensor[]");
  // weighted_sum with the private epilogue: (S_l + noise_l) * out_scale, noise_l = noise_std * z(global
  // index) from Philox (seed, step, stream) generated in the same pass, or the pre-drawn noise[l] if given.
  m.def(
      "privatized_sum(Tensor[] grads, float[] coeffs, Tensor weights, float noise_std, int seed, int step, "
      "int stream, float out_scale, Tensor[] noise) -> Tensor[]");
  // Secure mode (docs/RNG.md §6): round_fp32(S_l + noise_std * z) * out_scale, z the float64 ChaCha20
  // normal of the global index (key: 4 int64 limbs), the sum formed in float64, in the same pass.
  m.def(
      "privatized_sum_chacha20(Tensor[] grads, float[] coeffs, Tensor weights, float noise_std, int[] key, "
      "int step, int stream, float out_scale) -> Tensor[]");

  // Counter-based noise (docs/RNG.md). The 64-bit seed travels as the bits of a signed int.
  // out[i] = Philox word of element offset + i, as int64 in [0, 2^32).
  m.def("philox_uint32_(Tensor(a!) out, int seed, int step, int stream, int offset) -> ()");
  // out[i] = std * z(offset + i).
  m.def("gaussian_fill_(Tensor(a!) out, float std, int seed, int step, int stream, int offset) -> ()");
  // tensors[t][i] += std * z(offset + global index), the index running across the whole list.
  m.def(
      "add_gaussian_noise_(Tensor(a!)[] tensors, float std, int seed, int step, int stream, int offset) -> "
      "()");
  // Secure mode (docs/RNG.md §6): the same three ops with ChaCha20. key: the 256-bit key as 4 int64
  // limbs, limb j = bits 64j .. 64j + 63. Normals are float64; std * z (+ the element) is rounded once.
  m.def("chacha20_uint32_(Tensor(a!) out, int[] key, int step, int stream, int offset) -> ()");
  m.def(
      "chacha20_gaussian_fill_(Tensor(a!) out, float std, int[] key, int step, int stream, int offset) -> "
      "()");
  m.def(
      "chacha20_add_gaussian_noise_(Tensor(a!)[] tensors, float std, int[] key, int step, int stream, "
      "int offset) -> ()");

  // linear_filter_ (dpkernels/filter.py; math: include/dpkernels/filter.h). Per element, x = inputs (or
  // none) + noise_std * z(offset + global index), y = a x + sum_k c_k S_k, S_k <- d_k S_k + e_k y + f_k x,
  // out = g y (or out += g y with accumulate). coeffs = [a, g, c.., d.., e.., f..]; state[k * L + l]
  // is fp32 buffer k of tensor l; inputs and out may be empty lists.
  m.def(
      "linear_filter_(Tensor[] inputs, Tensor(a!)[] state, Tensor(b!)[] out, float[] coeffs, bool "
      "accumulate, "
      "float noise_std, int seed, int step, int stream, int offset) -> ()");
}

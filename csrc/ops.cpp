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
}

// Schemas of the native ops. Kernels: csrc/cpu/*.cpp (CPU key) and csrc/cuda/*.cu (CUDA key).
// Python wraps them in the public dpkernels::* custom ops (dpkernels/clip.py) and registers
// their fake (meta) kernels, so they work under torch.compile and torch.library.opcheck.
// Importing dpkernels._C (csrc/python.cpp) loads this library and runs the registrations below.
#include <torch/library.h>

TORCH_LIBRARY(dpkernels_C, m) {
  // [B, L] float64: per-sample, per-tensor sums of squares of (Σ_j coeffs[j] grads[j*L+l] - shift) * scale.
  m.def("per_sample_sumsq(Tensor[] grads, float[] coeffs, Tensor[] shift, Tensor[] scale) -> Tensor");
  // Per-sample weights f(norms) for a clip mode, same shape/dtype as norms ([B] or [B, L]).
  m.def("clip_factors(Tensor norms, float[] max_grad_norm, str mode, float r) -> Tensor");
  // One float32 tensor per parameter: Σ_i weights[i, l] Σ_j coeffs[j] grads[j*L+l][i].
  m.def("weighted_sum(Tensor[] grads, float[] coeffs, Tensor weights) -> Tensor[]");
  // The three stages in one call (clip_and_accumulate, privatize, the optimizers' clipped sums):
  // norms n = ||(Σ_j coeffs[j] grads[j*L+l] - shift) * scale|| * norm_scale ([B] flat, [B, L] with
  // per_layer), weights w = f(n) for the clip mode with one bound or one per tensor ([B, L] float32,
  // 0 for a sample with a non-finite gradient, which raises ValueError naming it unless
  // drop_nonfinite), and per parameter (Σ_i w[i, l] Σ_j coeffs[j] grads[j*L+l][i] + ν_l) * out_scale with
  // ν the pre-drawn noise[l], else noise_std * z(global index) from rng 'philox' (key = [seed]) or
  // 'chacha20' (key = 4 int64 limbs; docs/RNG.md §6: formed in float64, rounded once), else none.
  // Returns (sums, norms, weights).
  m.def(
      "clip_pipeline(Tensor[] grads, float[] coeffs, float[] max_grad_norm, str mode, float r, Tensor[] "
      "shift, "
      "Tensor[] scale, bool per_layer, bool drop_nonfinite, float norm_scale, str rng, float noise_std, "
      "int[] "
      "key, int step, int stream, float out_scale, Tensor[] noise) -> (Tensor[], Tensor, Tensor)");

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

  // Fused DP optimizer steps (dpkernels/optim.py; math: include/dpkernels/optim_math.h). Shared:
  //   params  L parameters (fp32/fp16/bf16), updated in place; sums: L fp32 clipped sums;
  //   state   the family's fp32 buffers, buffer-major (state[k * L + l]);
  //   noise   L pre-drawn fp32 tensors nu (noise_std is then unused), or [] for in-pass noise
  //           nu = noise_std * g y, y = a z + sum_k c_k N_k, N_k <- d_k N_k + e_k y + f_k z (filter.h)
  //           over noise_state (fp32, buffer-major; [] for independent noise, coefficients [1, 1]),
  //           z the Philox normal of element offset + global index (seed, step, stream). With no
  //           noise buffers and noise_std = 0, nothing is generated;
  //   hyper   the family's scalars in optim_math.h struct order (integer fields as exact floats).
  // sgd: state = the K direction-filter buffers; d = g dir_filter(g~ + wd theta), theta <- theta - lr d;
  // past: [] or L tensors (parameter dtype) that receive the old theta (DP-PMLF's past iterates).
  m.def(
      "sgd_step_(Tensor(a!)[] params, Tensor[] sums, Tensor(b!)[] state, float[] dir_coeffs, Tensor(c!)[] "
      "past, "
      "Tensor[] noise, Tensor(d!)[] noise_state, float[] noise_coeffs, float noise_std, int seed, int step, "
      "int stream, int offset, float[] hyper) -> ()");
  // dp2: state = [G, inv_d].
  m.def(
      "dp2_step_(Tensor(a!)[] params, Tensor[] sums, Tensor(b!)[] state, Tensor[] noise, Tensor(d!)[] "
      "noise_state, float[] noise_coeffs, float noise_std, int seed, int step, int stream, int offset, "
      "float[] "
      "hyper) -> ()");
  // adam: state = [m, v], or [m, v, scale] for scale-then-privatize.
  m.def(
      "adam_step_(Tensor(a!)[] params, Tensor[] sums, Tensor(b!)[] state, Tensor[] noise, Tensor(d!)[] "
      "noise_state, float[] noise_coeffs, float noise_std, int seed, int step, int stream, int offset, "
      "float[] "
      "hyper) -> ()");
  // macadam: state = [m, v, s, b_u, inv_bu, shift]; returns sum of sqrt(s_hat) over the updated elements
  // as a float64 scalar tensor (0 when kappa = 0).
  m.def(
      "macadam_step_(Tensor(a!)[] params, Tensor[] sums, Tensor(b!)[] state, Tensor[] noise, Tensor(d!)[] "
      "noise_state, float[] noise_coeffs, float noise_std, int seed, int step, int stream, int offset, "
      "float[] "
      "hyper) -> Tensor");

  // Book-keeping layer norms (dpkernels/layers.py, method "tiled"; math: include/dpkernels/layers.h).
  // a [B, T, d_in], g [B, T, d_out] (one dtype: float32, float16, bfloat16); scale, shift: None or
  // float32 [d_out, d_in]. Returns float32 [B]: out[i] = Σ_{o,k} (scale (g_iᵀ a_i - shift))²[o, k],
  // products and tile sums in fp32, tiles combined in fp64, the per-sample gradient never stored.
  m.def("linear_sumsq_tiled(Tensor a, Tensor g, Tensor? scale, Tensor? shift) -> Tensor");
  // The same for a Conv2d's weight gradient, the linear layer over x's im2col patches, read in place
  // (implicit im2col): x [B, C, H, W], g [B, O, H_out, W_out] (each channel plane contiguous);
  // scale, shift: None or float32 [O, C * kh * kw].
  m.def(
      "conv2d_sumsq_tiled(Tensor x, Tensor g, int[2] kernel_size, int[2] stride, int[2] padding, int[2] "
      "dilation, Tensor? scale, Tensor? shift) -> Tensor");
  // Its clipped sum Σ_i weights[i] g_iᵀ a_i (weights float32 [B]) from the same inputs: float32 [O, C,
  // kh, kw], products and sums in fp32 (CPU only: CUDA's is cuDNN's weight gradient, dpkernels/layers.py).
  m.def(
      "conv2d_weighted_sum(Tensor x, Tensor g, Tensor weights, int[2] kernel_size, int[2] stride, int[2] "
      "padding, int[2] dilation) -> Tensor");
  // The Gram form of linear_sumsq_tiled without scale or shift, ⟨A_i A_iᵀ, G_i G_iᵀ⟩ over the upper
  // triangle, no Gram stored; the same inputs and output (CPU only: CUDA's is two cuBLAS batched GEMMs,
  // dpkernels/layers.py).
  m.def("linear_sumsq_gram(Tensor a, Tensor g) -> Tensor");
  // linear_sumsq_tiled at T = 1, ‖scale ⊙ (g_i a_iᵀ − shift)‖² for a [B, d_in] and g [B, d_out]
  // (float32, float16 or bfloat16), scale and shift float32 [d_out, d_in], at least one of them: with
  // a scale only one GEMM for the batch, Σ_{o,k} scale² g² a², the squared scale never stored; with a
  // shift element by element (no cancellation). CPU only: CUDA's is cuBLAS's GEMM and the tiled kernel,
  // dpkernels/layers.py.
  m.def("linear_sumsq_t1(Tensor a, Tensor g, Tensor? scale, Tensor? shift) -> Tensor");
  // conv2d_sumsq_tiled's norms and the per-sample products they square, (float32 [B], float32 [B, O, C,
  // kh, kw] stored as [B, kh, kw, C, O]): the clipped sum is then a weighted sum over B, not a product
  // over B·T positions (CPU only; the BK engine's choice, dpkernels/bk.py).
  m.def(
      "conv2d_sumsq_grad_sample(Tensor x, Tensor g, int[2] kernel_size, int[2] stride, int[2] padding, "
      "int[2] "
      "dilation, Tensor? scale, Tensor? shift) -> (Tensor, Tensor)");
}

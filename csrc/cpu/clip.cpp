// CPU kernels of the per-sample clipping ops (schemas in csrc/ops.cpp, math in clip_math.h).
//
// Both streaming passes cut the whole tensor list into tasks of bounded size, which the threads
// claim in contiguous runs of about equal cost (cpu::parallel_over_tasks, stream_cpu.h), so one
// pass covers hundreds of tensors with a single parallel region and no per-tensor dispatch.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include "dpkernels/clip_layout.h"
#include "dpkernels/clip_math.h"
#include "dpkernels/dispatch.h"
#include "dpkernels/kernels.h"
#include "noise_cpu.h"
#include "stream_cpu.h"
#include "vec_cpu.h"

namespace dpkernels {
namespace {

using cpu::Vec;
// Elements per SIMD step: one vector of a 16-bit type, i.e. two fp32 vectors.
constexpr int64_t kStep = 2 * Vec::size();
// Elements per norm task: large enough to amortise the task, small enough to balance threads.
constexpr int64_t kSumsqChunk = 1 << 15;
// Columns per weighted-sum task: the fp32 accumulator (16 KiB) stays in L1 while B rows stream.
constexpr int64_t kSumChunk = 1 << 12;

// ---------------------------------------------------------------------------------------------
// per_sample_sumsq: s[i, l] = Σ_e shift_scale(Σ_j α_j g_j[i, e])², squares accumulated in fp64.
// ---------------------------------------------------------------------------------------------

struct SumsqTask {
  int64_t l, i, begin, end;
};

// Loads kStep elements of Σ_j α_j g_j at offset e and applies shift/scale, as two fp32 vectors.
template <typename scalar_t, bool kPlain, bool kShift, bool kScale>
inline std::pair<Vec, Vec> combined_step(const scalar_t* const* rows, const double* alpha, int64_t k,
                                         const float* shift, const float* scale, int64_t e) {
  auto [v0, v1] = cpu::load_widened(rows[0] + e);
  if constexpr (!kPlain) {
    const Vec a0(static_cast<float>(alpha[0]));
    v0 = v0 * a0;
    v1 = v1 * a0;
    for (int64_t j = 1; j < k; ++j) {
      const auto [a, b] = cpu::load_widened(rows[j] + e);
      const Vec aj(static_cast<float>(alpha[j]));
      v0 = cpu::fmadd(aj, a, v0);
      v1 = cpu::fmadd(aj, b, v1);
    }
  }
  if constexpr (kShift || kScale) {
    const Vec s0 = kShift ? Vec::loadu(shift + e) : Vec(0.f);
    const Vec s1 = kShift ? Vec::loadu(shift + e + Vec::size()) : Vec(0.f);
    const Vec c0 = kScale ? Vec::loadu(scale + e) : Vec(1.f);
    const Vec c1 = kScale ? Vec::loadu(scale + e + Vec::size()) : Vec(1.f);
    v0 = shift_scale<kShift, kScale>(v0, s0, c0);
    v1 = shift_scale<kShift, kScale>(v1, s1, c1);
  }
  return {v0, v1};
}

// One element of Σ_j α_j g_j with the vector path's roundings: α_0·g_0, then one cpu::fmadd per
// further set. The sum pass combines with the same function (and combined_step),
// so the vector whose norm bounds a sample is exactly the vector that is added.
template <typename scalar_t>
inline float combined_elem(const scalar_t* const* rows, const double* alpha, int64_t k, int64_t e) {
  float v = static_cast<float>(alpha[0]) * static_cast<float>(rows[0][e]);
  for (int64_t j = 1; j < k; ++j)
    v = cpu::fmadd(static_cast<float>(alpha[j]), static_cast<float>(rows[j][e]), v);
  return v;
}

// Scalar path with every square taken in fp64: the semantics of the op, used for the tail and
// whenever the fast path's fp32 squares overflow (elements beyond ~1.8e19).
template <typename scalar_t, bool kShift, bool kScale>
double sumsq_exact(const scalar_t* const* rows, const double* alpha, int64_t k, const float* shift,
                   const float* scale, int64_t begin, int64_t end) {
  double total = 0.0;
  for (int64_t e = begin; e < end; ++e) {
    float v = combined_elem(rows, alpha, k, e);
    v = shift_scale<kShift, kScale>(v, kShift ? shift[e] : 0.f, kScale ? scale[e] : 1.f);
    total += static_cast<double>(v) * v;
  }
  return total;
}

// Fast path: squares are summed in four fp32 SIMD accumulators for kFlush steps, then widened
// into fp64. Each fp32 lane holds at most kFlush/2 = 8 terms, so its relative rounding error
// stays below 8 * 2^-24 (< 5e-7 on the squared norm, < 2.5e-7 on the norm). fp32 squares overflow
// above ~1.8e19 and underflow below ~1e-19, so a result that is non-finite, or small enough for
// underflow to matter (< 1e-30 per element), is recomputed on the exact path.
template <typename scalar_t, bool kPlain, bool kShift, bool kScale>
double sumsq_range(const scalar_t* const* rows, const double* alpha, int64_t k, const float* shift,
                   const float* scale, int64_t begin, int64_t end) {
  constexpr int kFlush = 16;
  cpu::WideSum wide;
  int64_t e = begin;
  while (e + 2 * kStep <= end) {
    // Four independent chains hide the FMA latency.
    Vec acc[4] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
    for (int it = 0; it < kFlush && e + 2 * kStep <= end; it += 2, e += 2 * kStep) {
      const auto [v0, v1] = combined_step<scalar_t, kPlain, kShift, kScale>(rows, alpha, k, shift, scale, e);
      const auto [v2, v3] =
          combined_step<scalar_t, kPlain, kShift, kScale>(rows, alpha, k, shift, scale, e + kStep);
      acc[0] = cpu::fmadd(v0, v0, acc[0]);
      acc[1] = cpu::fmadd(v1, v1, acc[1]);
      acc[2] = cpu::fmadd(v2, v2, acc[2]);
      acc[3] = cpu::fmadd(v3, v3, acc[3]);
    }
    for (const auto& a : acc) wide.add(a);
  }
  const double total =
      wide.total() + sumsq_exact<scalar_t, kShift, kScale>(rows, alpha, k, shift, scale, e, end);
  const bool trusted = std::isfinite(total) && total >= 1e-30 * static_cast<double>(end - begin);
  return trusted ? total : sumsq_exact<scalar_t, kShift, kScale>(rows, alpha, k, shift, scale, begin, end);
}

// The norms pass over inputs already checked into lay: [B, L] float64 sums of squares.
at::Tensor sumsq_pass(at::TensorList grads, at::ArrayRef<double> coeffs, at::TensorList shift,
                      at::TensorList scale, const ClipLayout& lay) {
  std::vector<SumsqTask> tasks;
  std::vector<int64_t> cost;
  for (int64_t l = 0; l < lay.L; ++l) {
    for (int64_t i = 0; i < lay.B; ++i) {
      for (int64_t b = 0; b < lay.numel[l]; b += kSumsqChunk) {
        tasks.push_back({l, i, b, std::min(b + kSumsqChunk, lay.numel[l])});
        cost.push_back((tasks.back().end - b) * lay.k + 64);  // + a fixed per-task overhead
      }
    }
  }
  std::vector<double> partial(tasks.size());
  const bool has_shift = !shift.empty(), has_scale = !scale.empty();
  // One set with coefficient 1 and no shift/scale (plain DP-SGD): the norm of the raw rows.
  const bool plain = lay.k == 1 && coeffs[0] == 1.0 && !has_shift && !has_scale;
  cpu::parallel_over_tasks(cost, [&](int64_t t0, int64_t t1) {
    std::vector<const void*> rows(lay.k);
    for (int64_t t = t0; t < t1; ++t) {
      const SumsqTask& task = tasks[t];
      const float* sh = has_shift ? shift[task.l].const_data_ptr<float>() : nullptr;
      const float* sc = has_scale ? scale[task.l].const_data_ptr<float>() : nullptr;
      DPK_DISPATCH_GRAD_TYPES(grads[task.l].scalar_type(), "per_sample_sumsq", [&] {
        for (int64_t j = 0; j < lay.k; ++j) {
          rows[j] = grads[j * lay.L + task.l].const_data_ptr<scalar_t>() + task.i * lay.numel[task.l];
        }
        const auto* r = reinterpret_cast<const scalar_t* const*>(rows.data());
        // Compile-time variants keep the hot loop free of per-step branches.
        const auto run = [&](auto plain, auto shift_tag, auto scale_tag) {
          return sumsq_range<scalar_t, decltype(plain)::value, decltype(shift_tag)::value,
                             decltype(scale_tag)::value>(r, coeffs.data(), lay.k, sh, sc, task.begin,
                                                         task.end);
        };
        using T = std::true_type;
        using F = std::false_type;
        if (plain) {
          partial[t] = run(T{}, F{}, F{});
        } else {
          partial[t] = has_shift ? (has_scale ? run(F{}, T{}, T{}) : run(F{}, T{}, F{}))
                                 : (has_scale ? run(F{}, F{}, T{}) : run(F{}, F{}, F{}));
        }
      });
    }
  });
  // Tasks of one (l, i) are consecutive, so a fixed left-to-right sum keeps the result
  // independent of the thread count.
  auto out = at::zeros({lay.B, lay.L}, at::dtype(at::kDouble));
  double* o = out.data_ptr<double>();
  for (size_t t = 0; t < tasks.size(); ++t) o[tasks[t].i * lay.L + tasks[t].l] += partial[t];
  return out;
}

}  // namespace

at::Tensor per_sample_sumsq_cpu(at::TensorList grads, at::ArrayRef<double> coeffs, at::TensorList shift,
                                at::TensorList scale) {
  return sumsq_pass(grads, coeffs, shift, scale,
                    check_clip_inputs(grads, coeffs, shift, scale, c10::DeviceType::CPU));
}

// ---------------------------------------------------------------------------------------------
// clip_factors: c = clip_weight(mode, n, C_l, r), elementwise over [B] or [B, L].
// ---------------------------------------------------------------------------------------------

at::Tensor clip_factors_cpu(const at::Tensor& norms, at::ArrayRef<double> max_grad_norm,
                            c10::string_view mode, double r) {
  DPK_CHECK(norms.device().is_cpu(), "norms must be a CPU tensor for the cpu kernel");
  const std::vector<double> C = clip_bounds(max_grad_norm, norms);
  const ClipMode m = parse_clip_mode(mode);
  auto out = new_output(norms.sizes(), norms.options());
  const int64_t L = static_cast<int64_t>(C.size()), n = norms.numel();
  AT_DISPATCH_FLOATING_TYPES(norms.scalar_type(), "clip_factors", [&] {
    const scalar_t* x = norms.const_data_ptr<scalar_t>();
    scalar_t* y = out.data_ptr<scalar_t>();
    for (int64_t e = 0; e < n; ++e) {
      y[e] = weight_of_norm<scalar_t>(m, x[e], C[e % L], r);
    }
  });
  return out;
}

namespace {

// ---------------------------------------------------------------------------------------------
// weighted_sum: S_l = Σ_i w[i, l] Σ_j α_j g_j[i], fp32 accumulation; zero-weight samples skipped.
// ---------------------------------------------------------------------------------------------

struct SumTask {
  int64_t l, begin, end;
};

// What happens to a finished accumulator chunk: out = (acc + noise) * scale, where noise is
// std * z(global index) from Philox (docs/RNG.md: generated in the pass that writes the result,
// never stored), a pre-drawn tensor, or nothing (plain weighted sum, scale 1). Secure mode
// (chacha): out = float(double(acc) + std64 * z) * scale with z the float64 ChaCha20 normal.
struct SumEpilogue {
  float std = 0.f, scale = 1.f;
  bool philox = false;
  NoiseKey key{};
  bool chacha = false;
  double std64 = 0.0;
  ChachaKey chacha_key{};
  std::vector<int64_t> offset;      // global element index of each parameter's first element
  std::vector<const float*> noise;  // pre-drawn noise per parameter, or empty
  cpu::OutputStore store{0};        // set by sum_pass from the bytes it streams

  void finish(int64_t l, int64_t begin, int64_t n, float* acc, float* out) const {
    if (philox) {
      alignas(64) float z[kSumChunk];
      cpu::normals(offset[l] + begin, n, key, z);
      for (int64_t e = 0; e < n; ++e) acc[e] = (acc[e] + std * z[e]) * scale;
    } else if (chacha) {
      alignas(64) double z[kSumChunk];
      cpu::chacha_normals(offset[l] + begin, n, chacha_key, z);
      for (int64_t e = 0; e < n; ++e) {
        const double nu = std64 * z[e];
        acc[e] = round_once<float>(static_cast<double>(acc[e]) + nu) * scale;
      }
    } else if (!noise.empty()) {
      const float* z = noise[l] + begin;
      for (int64_t e = 0; e < n; ++e) acc[e] = (acc[e] + z[e]) * scale;
    } else if (scale != 1.f) {
      for (int64_t e = 0; e < n; ++e) acc[e] = acc[e] * scale;
    }
    store(acc, n, out + begin);
  }
};

// acc[0:n) += Σ_m c[m] * rows[m][0:n) for M rows at once: M input streams in flight and one
// accumulator load/store per M rows instead of per row.
template <int M, typename scalar_t>
void axpy_rows(float* acc, const scalar_t* const* rows, const float* c, int64_t n) {
  int64_t e = 0;
  for (; e + kStep <= n; e += kStep) {
    Vec a0 = Vec::loadu(acc + e), a1 = Vec::loadu(acc + e + Vec::size());
    for (int m = 0; m < M; ++m) {
      const auto [x, y] = cpu::load_widened(rows[m] + e);
      a0 = cpu::fmadd(Vec(c[m]), x, a0);
      a1 = cpu::fmadd(Vec(c[m]), y, a1);
    }
    a0.store(acc + e);
    a1.store(acc + e + Vec::size());
  }
  for (; e < n; ++e) {
    float a = acc[e];
    for (int m = 0; m < M; ++m) a += c[m] * static_cast<float>(rows[m][e]);
    acc[e] = a;
  }
}

// acc[0:n) += w_i · v_i for every sample with w_i != 0, where v_i = Σ_j α_j g_j[i] is formed first,
// with the norm pass's roundings (combined_step, combined_elem). Folding w_i into the coefficients
// (acc += (w_i α_j) g_j) would round w_i α_j, which can double a subnormal product, and would
// recombine the sets with other roundings than those of the norm that bounds v_i: under
// cancellation between sets, the added vector could be far longer than the clipped one.
template <typename scalar_t>
void weighted_sum_combined(float* acc, const scalar_t* const* bases, int64_t numel, int64_t B, int64_t k,
                           const double* alpha, const float* w, int64_t w_stride, int64_t begin, int64_t n) {
  alignas(64) float v[kSumChunk];
  const float* vrow[1] = {v};
  std::vector<const scalar_t*> rows(k);
  for (int64_t i = 0; i < B; ++i) {
    const float wi = w[i * w_stride];
    if (wi == 0.f) continue;  // skipped, not multiplied (as below)
    for (int64_t j = 0; j < k; ++j) rows[j] = bases[j] + i * numel + begin;
    int64_t e = 0;
    for (; e + kStep <= n; e += kStep) {
      const auto [v0, v1] =
          combined_step<scalar_t, false, false, false>(rows.data(), alpha, k, nullptr, nullptr, e);
      v0.store(v + e);
      v1.store(v + e + Vec::size());
    }
    for (; e < n; ++e) v[e] = combined_elem(rows.data(), alpha, k, e);
    axpy_rows<1>(acc, vrow, &wi, n);
  }
}

template <typename scalar_t>
void weighted_sum_range(const scalar_t* const* bases, int64_t numel, int64_t B, int64_t k,
                        const double* alpha, const float* w, int64_t w_stride, float* out, int64_t l,
                        int64_t begin, int64_t end, const SumEpilogue& ep) {
  alignas(64) float acc[kSumChunk];
  const int64_t n = end - begin;
  std::fill(acc, acc + n, 0.f);
  if (k != 1 || alpha[0] != 1.0) {
    weighted_sum_combined(acc, bases, numel, B, k, alpha, w, w_stride, begin, n);
    ep.finish(l, begin, n, acc, out);
    return;
  }
  // Eight rows per sweep of the accumulator: measured 4-6% faster than four on every bench
  // shape (B = 8 to 64), from fewer accumulator loads/stores and more loads in flight.
  constexpr int kRows = 8;
  const scalar_t* rows[kRows];
  float c[kRows];
  int m = 0;
  for (int64_t i = 0; i < B; ++i) {
    const float wi = w[i * w_stride];
    // Skipped, not multiplied: a dropped sample may hold NaN/Inf, and 0 * NaN is NaN.
    if (wi == 0.f) continue;
    rows[m] = bases[0] + i * numel + begin;
    c[m] = wi;
    if (++m == kRows) {
      axpy_rows<kRows>(acc, rows, c, n);
      m = 0;
    }
  }
  // The last m < 8 rows, in sweeps of 4, 2 and 1.
  int q = 0;
  if (m - q >= 4) {
    axpy_rows<4>(acc, rows + q, c + q, n);
    q += 4;
  }
  if (m - q >= 2) {
    axpy_rows<2>(acc, rows + q, c + q, n);
    q += 2;
  }
  if (m - q >= 1) axpy_rows<1>(acc, rows + q, c + q, n);
  ep.finish(l, begin, n, acc, out);
}

// The sum pass over inputs already checked into lay, with the epilogue ep.
std::vector<at::Tensor> sum_pass(at::TensorList grads, at::ArrayRef<double> coeffs, const at::Tensor& weights,
                                 SumEpilogue ep, const ClipLayout& lay) {
  DPK_CHECK(weights.device().is_cpu() && weights.scalar_type() == at::kFloat && weights.is_contiguous() &&
                weights.dim() == 2 && weights.size(0) == lay.B && weights.size(1) == lay.L,
            "weights must be a contiguous float32 CPU tensor [B=", lay.B, ", L=", lay.L, "], got ",
            weights.sizes(), " ", weights.scalar_type());
  std::vector<at::IntArrayRef> shapes;
  std::vector<SumTask> tasks;
  std::vector<int64_t> cost;
  int64_t offset = 0, streamed = 0;
  for (int64_t l = 0; l < lay.L; ++l) {
    shapes.push_back(grads[l].sizes().slice(1));
    ep.offset.push_back(offset);
    offset += lay.numel[l];
    streamed += lay.numel[l] * lay.B * lay.k * static_cast<int64_t>(grads[l].element_size());
    for (int64_t b = 0; b < lay.numel[l]; b += kSumChunk) {
      tasks.push_back({l, b, std::min(b + kSumChunk, lay.numel[l])});
      cost.push_back((tasks.back().end - b) * lay.B * lay.k + 64);
    }
  }
  ep.store = cpu::OutputStore(streamed);
  std::vector<at::Tensor> out = new_outputs(shapes, at::dtype(at::kFloat));
  const float* w = weights.const_data_ptr<float>();
  cpu::parallel_over_tasks(cost, [&](int64_t t0, int64_t t1) {
    std::vector<const void*> bases(lay.k);
    for (int64_t t = t0; t < t1; ++t) {
      const SumTask& task = tasks[t];
      DPK_DISPATCH_GRAD_TYPES(grads[task.l].scalar_type(), "weighted_sum", [&] {
        for (int64_t j = 0; j < lay.k; ++j) bases[j] = grads[j * lay.L + task.l].const_data_ptr<scalar_t>();
        weighted_sum_range<scalar_t>(reinterpret_cast<const scalar_t* const*>(bases.data()),
                                     lay.numel[task.l], lay.B, lay.k, coeffs.data(), w + task.l, lay.L,
                                     out[task.l].data_ptr<float>(), task.l, task.begin, task.end, ep);
      });
    }
    ep.store.fence();
  });
  return out;
}

}  // namespace

std::vector<at::Tensor> weighted_sum_cpu(at::TensorList grads, at::ArrayRef<double> coeffs,
                                         const at::Tensor& weights) {
  return sum_pass(grads, coeffs, weights, SumEpilogue{},
                  check_clip_inputs(grads, coeffs, {}, {}, c10::DeviceType::CPU));
}

namespace {

// ---------------------------------------------------------------------------------------------
// clip_pipeline: the three stages in one call (clip_and_accumulate, privatize and the optimizers'
// clipped sums), so that a list of hundreds of small tensors crosses the Python/dispatcher
// boundary once (docs/ALGORITHMS.md, "Per-sample clipping").
// ---------------------------------------------------------------------------------------------

// The sum pass's epilogue for a pipeline call: pre-drawn noise, Philox or ChaCha20 noise of std
// noise_std, or none; then out_scale.
SumEpilogue pipeline_epilogue(const NoiseSpec& spec, at::TensorList noise, const ClipLayout& lay,
                              at::TensorList grads) {
  SumEpilogue ep;
  ep.std = static_cast<float>(spec.noise_std);
  ep.scale = static_cast<float>(spec.out_scale);
  if (!noise.empty()) {
    check_noise_list(noise, grads, lay);
    for (const at::Tensor& z : noise) ep.noise.push_back(z.const_data_ptr<float>());
  } else if (spec.rng == NoiseRng::kPhilox) {
    ep.philox = true;
    ep.key = make_key(spec.key[0], spec.step, spec.stream);
  } else if (spec.rng == NoiseRng::kChacha20) {
    ep.chacha = true;
    ep.std64 = spec.noise_std;
    ep.chacha_key = make_chacha_key(spec.key, spec.step, spec.stream);
  }
  return ep;
}

}  // namespace

std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor> clip_pipeline_cpu(
    at::TensorList grads, at::ArrayRef<double> coeffs, at::ArrayRef<double> max_grad_norm,
    c10::string_view mode, double r, at::TensorList shift, at::TensorList scale, bool per_layer,
    bool drop_nonfinite, double norm_scale, c10::string_view rng, double noise_std, at::IntArrayRef key,
    int64_t step, int64_t stream, double out_scale, at::TensorList noise) {
  const ClipLayout lay = check_clip_inputs(grads, coeffs, shift, scale, c10::DeviceType::CPU);
  const ClipMode m = parse_clip_mode(mode);
  const std::vector<double> bounds = pipeline_bounds(max_grad_norm, per_layer, lay.L);
  const NoiseSpec spec = parse_noise_spec(rng, noise_std, key, step, stream, out_scale);
  const at::Tensor sumsq = sumsq_pass(grads, coeffs, shift, scale, lay);
  const auto opts = at::dtype(at::kFloat);
  auto weights = new_output({lay.B, lay.L}, opts);
  auto norms = per_layer ? new_output({lay.B, lay.L}, opts) : new_output({lay.B}, opts);
  std::vector<uint8_t> finite(lay.B);
  for (int64_t i = 0; i < lay.B; ++i) {
    finite[i] =
        clip_sample_weights(sumsq.const_data_ptr<double>() + i * lay.L, static_cast<int>(lay.L), per_layer, m,
                            bounds.data(), r, norm_scale, weights.data_ptr<float>() + i * lay.L,
                            norms.data_ptr<float>() + i * (per_layer ? lay.L : 1));
  }
  if (!drop_nonfinite) check_nonfinite(finite.data(), lay.B);
  return {sum_pass(grads, coeffs, weights, pipeline_epilogue(spec, noise, lay, grads), lay), norms, weights};
}

}  // namespace dpkernels

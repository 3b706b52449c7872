// CPU kernel of linear_filter_ (math: filter.h; semantics: dpkernels/reference/filter.py).
//
// Each tensor is cut into chunks of kChunk elements (whole Philox runs of the global index, so a
// chunk's noise comes from cpu::normals without waste). A chunk forms its inputs x in a small fp32
// array (input + std * z), then runs filter_step() on at::vec::Vectorized<float> lanes, the state
// buffers being read and written in place; the chunk stays in L1 across the K buffers.
//
// Products and sums are rounded separately, as in the reference and the CUDA kernel (__fmul_rn /
// __fadd_rn there): GCC would otherwise contract the at::vec multiply and add into an FMA.
#pragma GCC optimize("fp-contract=off")
#include "dpkernels/filter.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "dpkernels/dispatch.h"
#include "dpkernels/filter_layout.h"
#include "dpkernels/macros.h"
#include "dpkernels/noise_key.h"
#include "noise_cpu.h"

namespace dpkernels {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kChunk = 512;  // elements per chunk; a multiple of cpu::kRun and of Vec::size()
static_assert(kChunk % cpu::kRun == 0 && kChunk % Vec::size() == 0);

// Tensor l: n elements from global index e0; in/out may be null (no inputs / no output).
template <typename scalar_t>
void filter_tensor(const FilterCoeffs& fc, const scalar_t* in, scalar_t* out, bool accumulate,
                   float* const* bufs, int64_t n, int64_t e0, bool noise, const NoiseKey& key, float s) {
  at::parallel_for(0, (n + kChunk - 1) / kChunk, 1, [&](int64_t c0, int64_t c1) {
    alignas(64) float x[kChunk];
    alignas(64) float y[kChunk];
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t i0 = c * kChunk, m = std::min(kChunk, n - i0);
      if (noise) {
        cpu::normals(e0 + i0, m, key, x);
        for (int64_t i = 0; i < m; ++i) x[i] = s * x[i];
        if (in != nullptr) {
          for (int64_t i = 0; i < m; ++i) x[i] = static_cast<float>(in[i0 + i]) + x[i];
        }
      } else if (in != nullptr) {
        for (int64_t i = 0; i < m; ++i) x[i] = static_cast<float>(in[i0 + i]);
      } else {
        std::fill(x, x + m, 0.f);
      }
      for (int64_t i = 0; i < m; i += Vec::size()) {
        const int w = static_cast<int>(std::min<int64_t>(Vec::size(), m - i));
        const auto load = [&](int k) { return Vec::loadu(bufs[k] + i0 + i, w); };
        const auto store = [&](int k, Vec v) { v.store(bufs[k] + i0 + i, w); };
        filter_step(fc, Vec::loadu(x + i, w), load, store).store(y + i, w);
      }
      if (out != nullptr) {
        scalar_t* o = out + i0;
        for (int64_t i = 0; i < m; ++i) {
          o[i] = static_cast<scalar_t>(accumulate ? static_cast<float>(o[i]) + y[i] : y[i]);
        }
      }
    }
  });
}

void linear_filter_cpu(at::TensorList inputs, at::TensorList state, at::TensorList out,
                       at::ArrayRef<double> coeffs, bool accumulate, double noise_std, int64_t seed,
                       int64_t step, int64_t stream, int64_t offset) {
  const FilterLayout lay = check_filter_inputs(inputs, state, out, coeffs, noise_std, c10::DeviceType::CPU);
  const NoiseKey key = make_key(seed, step, stream);
  DPK_CHECK(offset >= 0, "offset must be >= 0, got ", offset);
  const bool noise = noise_std > 0;
  const float s = static_cast<float>(noise_std);
  const int K = lay.fc.K;
  int64_t base = offset;
  for (int64_t l = 0; l < lay.L; ++l) {
    std::vector<float*> bufs(std::max(K, 1));
    for (int k = 0; k < K; ++k) bufs[k] = state[k * lay.L + l].data_ptr<float>();
    const at::ScalarType type =
        !out.empty() ? out[l].scalar_type() : (!inputs.empty() ? inputs[l].scalar_type() : at::kFloat);
    DPK_DISPATCH_GRAD_TYPES(type, "linear_filter_", [&] {
      const scalar_t* in = inputs.empty() ? nullptr : inputs[l].data_ptr<scalar_t>();
      scalar_t* o = out.empty() ? nullptr : out[l].data_ptr<scalar_t>();
      filter_tensor<scalar_t>(lay.fc, in, o, accumulate, bufs.data(), lay.numel[l], base, noise, key, s);
    });
    base += lay.numel[l];
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(dpkernels_C, CPU, m) { m.impl("linear_filter_", &linear_filter_cpu); }

}  // namespace dpkernels

// CPU kernel of linear_filter_ (math: filter.h; semantics: dpkernels/reference/filter.py).
//
// One pass over the whole tensor list with the streaming skeleton of stream_cpu.h: a chunk forms
// its inputs x in a small fp32 array (input + std * z, z from cpu::normals of whole Philox runs),
// then runs filter_step() over it term by term (cpu::filter_chunk), the state buffers being read
// and written in place; the chunk stays in L1 across the K buffers.
//
// Products and sums are rounded separately, as in the reference and the CUDA kernel (__fmul_rn /
// __fadd_rn there): the build's -ffp-contract=off keeps GCC from fusing them into FMAs.
#include "dpkernels/filter.h"

#include <ATen/core/Tensor.h>

#include <algorithm>

#include "dpkernels/dispatch.h"
#include "dpkernels/filter_layout.h"
#include "dpkernels/kernels.h"
#include "dpkernels/macros.h"
#include "dpkernels/noise_key.h"
#include "noise_cpu.h"
#include "stream_cpu.h"

namespace dpkernels {
namespace {

using cpu::kChunk;

}  // namespace

void linear_filter_cpu(at::TensorList inputs, at::TensorList state, at::TensorList out,
                       at::ArrayRef<double> coeffs, bool accumulate, double noise_std, int64_t seed,
                       int64_t step, int64_t stream, int64_t offset) {
  const FilterLayout lay = check_filter_inputs(inputs, state, out, coeffs, noise_std, c10::DeviceType::CPU);
  const NoiseKey key = make_key(seed, step, stream);
  DPK_CHECK(offset >= 0, "offset must be >= 0, got ", offset);
  const bool noise = noise_std > 0;
  const float s = static_cast<float>(noise_std);
  const cpu::BufferTable bufs(state, lay.L);
  const cpu::StreamPlan plan(lay.numel, offset);
  plan.parallel([&](int64_t, const cpu::StreamTask& task) {
    const int64_t l = task.l;
    const at::ScalarType type =
        !out.empty() ? out[l].scalar_type() : (!inputs.empty() ? inputs[l].scalar_type() : at::kFloat);
    DPK_DISPATCH_GRAD_TYPES(type, "linear_filter_", [&] {
      const scalar_t* in = inputs.empty() ? nullptr : inputs[l].const_data_ptr<scalar_t>();
      scalar_t* o = out.empty() ? nullptr : out[l].data_ptr<scalar_t>();
      alignas(64) float x[kChunk];
      alignas(64) float y_buf[kChunk];
      const auto arrays = [&](int64_t i0, int64_t m, cpu::ChunkLines& lines) {
        if (in != nullptr) lines.add(in + i0, m);
        if (o != nullptr) lines.add(o + i0, m);
        bufs.add_lines(l, i0, m, lines);
      };
      cpu::ChunkPrefetch prefetch(task, arrays);
      plan.chunks(task, [&](int64_t i0, int64_t m, int64_t e0) {
        if (noise) {
          cpu::normals(e0, m, key, x, prefetch.begin_chunk(i0, m));
          // One loop, not a scaling loop and then an addition loop: a pass over the chunk less.
          if (in != nullptr) {
            for (int64_t i = 0; i < m; ++i) x[i] = static_cast<float>(in[i0 + i]) + s * x[i];
          } else {
            for (int64_t i = 0; i < m; ++i) x[i] = s * x[i];
          }
        } else if (in != nullptr) {
          for (int64_t i = 0; i < m; ++i) x[i] = static_cast<float>(in[i0 + i]);
        } else {
          std::fill(x, x + m, 0.f);
        }
        const float* y = cpu::filter_chunk(lay.fc, x, y_buf, m, bufs, l, i0);
        if (o != nullptr) {
          scalar_t* oc = o + i0;
          for (int64_t i = 0; i < m; ++i) {
            oc[i] = static_cast<scalar_t>(accumulate ? static_cast<float>(oc[i]) + y[i] : y[i]);
          }
        }
      });
    });
  });
}

}  // namespace dpkernels

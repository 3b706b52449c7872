// CPU kernels of dpkernels' counter-based noise (spec: docs/RNG.md; math: philox.h, chacha20.h).
//
// Work is cut into runs of kBatch Philox blocks (noise_cpu.h): each run computes its blocks' words
// lane-parallel (one SIMD lane per block) and, for Gaussians, the Box-Muller transform in SIMD,
// then writes or adds the 4 * kBatch values in element order.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "dpkernels/chacha20.h"
#include "dpkernels/dispatch.h"
#include "dpkernels/kernels.h"
#include "dpkernels/macros.h"
#include "dpkernels/philox.h"
#include "noise_cpu.h"
#include "stream_cpu.h"

namespace dpkernels {
namespace {

using namespace cpu;                 // NOLINT: kernels of this file are the cpu:: building blocks
constexpr int64_t kGrain = 1 << 14;  // elements per parallel task

// Calls sink(first_element, values, count) over element range [e0, e1) of the global stream,
// in parallel; gen(run, values) fills the kLen values of run `run` (elements run * kLen ..), and
// values[i] passed to sink belongs to element first_element + i.
template <typename T, int64_t kLen, typename Gen, typename Sink>
void for_each_run(int64_t e0, int64_t e1, const Gen& gen, const Sink& sink) {
  if (e1 <= e0) return;
  const int64_t r0 = e0 / kLen, r1 = (e1 + kLen - 1) / kLen;  // runs are aligned to kLen elements
  at::parallel_for(r0, r1, std::max<int64_t>(1, kGrain / kLen), [&](int64_t a, int64_t b) {
    alignas(64) T vals[kLen];
    for (int64_t run = a; run < b; ++run) {
      gen(static_cast<uint64_t>(run), vals);
      const int64_t lo = std::max(e0, run * kLen), hi = std::min(e1, (run + 1) * kLen);
      sink(lo, vals + (lo - run * kLen), hi - lo);
    }
  });
}

// out[i] = the uint32 word of element offset + i, as int64; gen(run, words) writes run `run`'s kLen
// words.
template <int64_t kLen, typename Gen>
void words_cpu(at::Tensor& out, int64_t offset, const Gen& gen) {
  DPK_CHECK(out.device().is_cpu() && out.scalar_type() == at::kLong && out.is_contiguous(),
            "out must be a contiguous int64 CPU tensor");
  DPK_CHECK(offset >= 0, "offset must be >= 0, got ", offset);
  int64_t* o = out.data_ptr<int64_t>();
  for_each_run<uint32_t, kLen>(
      offset, offset + out.numel(), gen,
      [&](int64_t e, const uint32_t* w, int64_t n) { std::copy(w, w + n, o + (e - offset)); });
}

// For each tensor of the list, store(dst, z, n) over its elements, where z holds the normals (type
// T; gen(run, z) writes run `run`'s kLen of them) of dst's elements: the global index runs across
// the list from offset. (The public op is gaussian_noise, with either generator.) The lines kAhead
// runs ahead of each store are requested first: on the AVX2 path a fill after a cache flush
// otherwise waits for its half-line stores' reads for ownership (3.41-3.45 against 3.17-3.23 ms
// for 4.5 M normals; AVX-512 unchanged; docs/BENCHMARKS.md).
template <typename T, int64_t kLen, typename Gen, typename Store>
void normals_cpu(at::TensorList tensors, int64_t offset, const Gen& gen, const Store& store) {
  constexpr int64_t kAhead = 8 * kLen;
  DPK_CHECK(offset >= 0, "offset must be >= 0, got ", offset);
  int64_t base = offset;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const at::Tensor& x = tensors[t];
    DPK_CHECK(x.device().is_cpu() && x.is_contiguous(), "tensors[", t, "] must be a contiguous CPU tensor");
    DPK_DISPATCH_GRAD_TYPES(x.scalar_type(), "gaussian_noise", [&] {
      scalar_t* p = x.data_ptr<scalar_t>();
      const int64_t numel = x.numel();
      for_each_run<T, kLen>(base, base + numel, gen, [&](int64_t e, const T* z, int64_t n) {
        const int64_t ahead = std::min(e - base + kAhead, numel);
        cpu::prefetch(p + ahead, std::min(n, numel - ahead));
        store(p + (e - base), z, n);
      });
    });
    base += x.numel();
  }
}

// out[i] (+)= std * z(offset + i) for each tensor, offsets running across the list.
void gaussian_cpu(at::TensorList tensors, double std, int64_t seed, int64_t step, int64_t stream,
                  int64_t offset, bool accumulate) {
  const PhiloxKeySchedule key(make_key(seed, step, stream));
  const float s = static_cast<float>(std);
  normals_cpu<float, kRun>(
      tensors, offset, [&](uint64_t run, float* z) { normal_run(run * kBatch, key, z); },
      [&](auto* dst, const float* z, int64_t n) {
        using S = std::remove_pointer_t<decltype(dst)>;
        for (int64_t i = 0; i < n; ++i) {
          const float v = s * z[i];
          dst[i] = static_cast<S>(accumulate ? static_cast<float>(dst[i]) + v : v);
        }
      });
}

// The same with ChaCha20's float64 normals (secure mode): std * z (plus the element) is formed in
// float64 and rounded once to the storage dtype.
void chacha20_gaussian_cpu(at::TensorList tensors, double std, at::IntArrayRef key, int64_t step,
                           int64_t stream, int64_t offset, bool accumulate) {
  const ChachaKey k = make_chacha_key(key, step, stream);
  normals_cpu<double, kChachaNormalRun>(
      tensors, offset, [&](uint64_t run, double* z) { chacha_normal_run(run * kBatch, k, z); },
      [&](auto* dst, const double* z, int64_t n) {
        using S = std::remove_pointer_t<decltype(dst)>;
        for (int64_t i = 0; i < n; ++i) {
          const double v = std * z[i];
          dst[i] = round_once<S>(accumulate ? static_cast<double>(dst[i]) + v : v);
        }
      });
}

}  // namespace

void philox_uint32_cpu(at::Tensor& out, int64_t seed, int64_t step, int64_t stream, int64_t offset) {
  const PhiloxKeySchedule key(make_key(seed, step, stream));
  words_cpu<kRun>(out, offset, [&](uint64_t run, uint32_t* w) { philox_run(run * kBatch, key, w); });
}

void gaussian_fill_cpu(at::Tensor& out, double std, int64_t seed, int64_t step, int64_t stream,
                       int64_t offset) {
  gaussian_cpu({out}, std, seed, step, stream, offset, /*accumulate=*/false);
}

void add_gaussian_noise_cpu(at::TensorList tensors, double std, int64_t seed, int64_t step, int64_t stream,
                            int64_t offset) {
  gaussian_cpu(tensors, std, seed, step, stream, offset, /*accumulate=*/true);
}

// Secure mode (docs/RNG.md §6): ChaCha20 words, and float64 normals whose value std * z (plus the
// element, when accumulating) is formed in float64 and rounded once to the storage dtype.
void chacha20_uint32_cpu(at::Tensor& out, at::IntArrayRef key, int64_t step, int64_t stream, int64_t offset) {
  const ChachaKey k = make_chacha_key(key, step, stream);
  words_cpu<kChachaWordRun>(out, offset, [&](uint64_t run, uint32_t* w) { chacha_run(run * kBatch, k, w); });
}

void chacha20_gaussian_fill_cpu(at::Tensor& out, double std, at::IntArrayRef key, int64_t step,
                                int64_t stream, int64_t offset) {
  chacha20_gaussian_cpu({out}, std, key, step, stream, offset, /*accumulate=*/false);
}

void chacha20_add_gaussian_noise_cpu(at::TensorList tensors, double std, at::IntArrayRef key, int64_t step,
                                     int64_t stream, int64_t offset) {
  chacha20_gaussian_cpu(tensors, std, key, step, stream, offset, /*accumulate=*/true);
}

}  // namespace dpkernels

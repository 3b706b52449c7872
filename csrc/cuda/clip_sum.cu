// The sum pass of the CUDA clipping ops (see clip.cuh): weighted_sum, and the last stage of
// clip_pipeline, whose private epilogue adds the noise as the sum is written.
//
// [note: private epilogue]
// clip_pipeline's sum pass is weighted_sum with an epilogue on the value each thread writes: out = (S + ν) *
// scale, ν = std * z(g) for the global flat index g of the element over the parameter list (docs/RNG.md), or
// the pre-drawn noise tensor's element. The same kernel template serves both ops: its kPrivate = false
// instantiation is the plain weighted sum, which never reads the epilogue. Philox mode generates the
// noise in registers as the result is written, so it never exists in memory (DESIGN.md §3). Secure mode
// (kChacha, docs/RNG.md §6) is its own instantiation, so that the Philox and plain variants carry none of
// its registers: out = float(double(S) + std * z) * scale with the float64 ChaCha20 normal z.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "clip.cuh"
#include "dpkernels/chacha20.h"
#include "dpkernels/clip_layout.h"
#include "dpkernels/kernels.h"
#include "dpkernels/macros.h"
#include "dpkernels/philox.h"
#include "multi_tensor.cuh"

namespace dpkernels {
namespace {

using cuda_clip::SumEpilogue;
using cuda_clip::SumMode;

// weighted_sum: one block owns kWsumThreads vectors of columns and walks all B rows. Small blocks,
// so that a model of a few million parameters still yields enough blocks to fill the GPU.
constexpr int kWsumThreads = 128;
// Rows in flight per thread, 16 bytes each.
constexpr int kWsumRows = 4;
// Resident blocks per SM that the register budget must allow (<= 64 registers): 1024 threads x 64
// bytes in flight.
constexpr int kWsumMinBlocks = 8;
// One block per chunk, on gridDim.x.
constexpr int64_t kMaxGridX = std::numeric_limits<int32_t>::max();

template <typename T>
using WsumChunks = Chunking<int64_t{kWsumThreads} * ilp(sizeof(T))>;

// weighted_sum_kernel's scalar arguments: weights, B, L and the epilogue.
static_assert(3 * sizeof(int64_t) + sizeof(SumEpilogue) <= kScalarArgBytes);

// Compacts the samples i0 .. i0 + kThreads - 1 whose weight in column l is nonzero into
// (row[m], w[m]), m < returned count, in sample order. Skipping a zero weight instead of multiplying
// by it keeps a dropped non-finite sample out of the sum; a NaN weight is kept, as in the reference.
// The next call may come right after the caller's last read of row/w: its first barrier waits for
// every thread, and nothing before that barrier writes row or w.
template <int kThreads>
__device__ __forceinline__ int compact_nonzero(const float* __restrict__ weights, int64_t L, int l,
                                               int64_t i0, int64_t B, int* row, float* w, int* warp_counts) {
  constexpr int kWarps = kThreads / kWarp;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t i = i0 + threadIdx.x;
  const float wi = i < B ? weights[i * L + l] : 0.f;
  const bool keep = wi != 0.f;
  const unsigned ballot = __ballot_sync(kFullMask, keep);
  if (lane == 0) warp_counts[warp] = __popc(ballot);
  __syncthreads();
  int before = 0, total = 0;
#pragma unroll
  for (int q = 0; q < kWarps; ++q) {
    const int c = warp_counts[q];
    before += q < warp ? c : 0;
    total += c;
  }
  if (keep) {
    const int pos = before + __popc(ballot & ((1u << lane) - 1u));
    row[pos] = static_cast<int>(threadIdx.x);
    w[pos] = wi;
  }
  __syncthreads();
  return total;
}

// acc += Σ_u w[m_u] g[i0 + row[m_u], start + this thread's offsets] over the next U samples m_u of
// the compacted list (one gradient set with coefficient 1); advances m past them. This is the order
// and rounding of the CPU kernel's FMA loop, so the two backends agree bitwise there. All U rows
// are loaded before the first is used: U loads per thread in flight.
template <typename T, bool kVec, int U>
__device__ __forceinline__ void wsum_rows(const ClipTable& tab, int s, int64_t n, int64_t start, int col,
                                          int len, int64_t i0, const int* row, const float* w, int& m,
                                          float (&acc)[ilp(sizeof(T))]) {
  constexpr int N = ilp(sizeof(T));
  constexpr int kStride = kVec ? 1 : kWsumThreads;
  const T* p[U];
  float c[U];
#pragma unroll
  for (int u = 0; u < U; ++u, ++m) {
    p[u] = grad_row<T>(tab, s, 0, (i0 + row[m]) * n + start);
    c[u] = w[m];
  }
  float x[U][N];
#pragma unroll
  for (int u = 0; u < U; ++u) load_elems<N, kVec, kStride>(p[u], col, len, x[u]);
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int e = 0; e < N; ++e) acc[e] = fmaf(c[u], x[u][e], acc[e]);
  }
}

// acc += w[m] · v_m for m < count, with v_m = Σ_j α_j g_j[i0 + row[m], ...] formed first with the
// norm pass's roundings (α_0·g_0, then one fmaf per set): folding w[m] into the coefficients would
// round w[m]·α_j (doubling a subnormal product) and recombine the sets differently from the norm
// that bounds v_m, so under cancellation the added vector could exceed the clip bound. The CPU
// kernel's weighted_sum_combined, with the same roundings.
template <typename T, bool kVec>
__device__ __forceinline__ void wsum_combined(const ClipTable& tab, const SetCoeffs& sets, int s, int64_t n,
                                              int64_t start, int col, int len, int64_t i0, const int* row,
                                              const float* w, int count, float (&acc)[ilp(sizeof(T))]) {
  constexpr int N = ilp(sizeof(T));
  constexpr int kStride = kVec ? 1 : kWsumThreads;
#pragma unroll 1
  for (int m = 0; m < count; ++m) {
    const int64_t off = (i0 + row[m]) * n + start;
    float v[N];
    load_elems<N, kVec, kStride>(grad_row<T>(tab, s, 0, off), col, len, v);
#pragma unroll
    for (int e = 0; e < N; ++e) v[e] *= sets.alpha[0];
#pragma unroll 1
    for (int j = 1; j < sets.k; ++j) {
      float x[N];
      load_elems<N, kVec, kStride>(grad_row<T>(tab, s, j, off), col, len, x);
      const float aj = sets.alpha[j];
#pragma unroll
      for (int e = 0; e < N; ++e) v[e] = fmaf(aj, x[e], v[e]);
    }
#pragma unroll
    for (int e = 0; e < N; ++e) acc[e] = fmaf(w[m], v[e], acc[e]);
  }
}

// acc += Σ_{m < count} w[m] Σ_j α_j g_j[i0 + row[m], ...], U rows at a time.
template <typename T, bool kVec>
__device__ __forceinline__ void wsum_tile(const ClipTable& tab, const SetCoeffs& sets, int s, int64_t n,
                                          int64_t start, int col, int len, int64_t i0, const int* row,
                                          const float* w, int count, float (&acc)[ilp(sizeof(T))]) {
  if (sets.k != 1 || sets.alpha[0] != 1.f) {
    wsum_combined<T, kVec>(tab, sets, s, n, start, col, len, i0, row, w, count, acc);
    return;
  }
  // The scalar path issues N loads per row; fewer rows keep it within the same registers.
  constexpr int U = kVec ? kWsumRows : kWsumRows / 2;
  int m = 0;
  while (m + U <= count) wsum_rows<T, kVec, U>(tab, s, n, start, col, len, i0, row, w, m, acc);
  while (m < count) wsum_rows<T, kVec, 1>(tab, s, n, start, col, len, i0, row, w, m, acc);
}

// z(g): the standard normal of global element g alone. Its block's Philox words, then Box-Muller on
// the word pair that holds word g % 4: (x0, x1) gives elements 0 and 1 of the block, (x2, x3)
// elements 2 and 3; the first of a pair takes the cosine, the second the sine.
__device__ __forceinline__ float normal_at(uint64_t g, const SumEpilogue& ep) {
  const Philox4 x = philox4x32_10(g >> 2, ep.step, ep.stream, ep.seed);
  const bool second_pair = (g & 2) != 0;
  float z_first, z_second;
  box_muller(second_pair ? x.x[2] : x.x[0], second_pair ? x.x[3] : x.x[1], z_first, z_second);
  return (g & 1) != 0 ? z_second : z_first;
}

// z(g) of secure mode: the float64 normal of global element g alone, from its ChaCha20 block g / 8 and
// Box-Muller pair (g % 8) / 2 (selected without indexing the word array, which would put it in local
// memory); the first of a pair takes the cosine.
__device__ __forceinline__ double chacha_normal_at(uint64_t g, const ChachaKey& key) {
  uint32_t w[16];
  chacha20_block(g >> 3, key, w);
  const int pair = static_cast<int>((g >> 1) & 3);
  uint32_t a_lo = w[0], a_hi = w[1], b_lo = w[2], b_hi = w[3];
#pragma unroll
  for (int k = 1; k < 4; ++k) {
    if (pair == k) {
      a_lo = w[4 * k];
      a_hi = w[4 * k + 1];
      b_lo = w[4 * k + 2];
      b_hi = w[4 * k + 3];
    }
  }
  double z_first, z_second;
  box_muller64(uniform53(a_lo, a_hi), uniform53(b_lo, b_hi), z_first, z_second);
  return (g & 1) != 0 ? z_second : z_first;
}

// Secure-mode epilogue: acc[e] = float(double(acc[e]) + std * z) * scale (the product and sum in float64,
// no FMA, rounded once), same elements as private_epilogue.
template <int N, bool kVec>
__device__ __forceinline__ void chacha_epilogue(const ClipTable& tab, const SumEpilogue& ep, int s,
                                                int64_t start, int col, int len, float (&acc)[N]) {
  constexpr int kStride = kVec ? 1 : kWsumThreads;
  ChachaKey key;
#pragma unroll
  for (int i = 0; i < 8; ++i) key.k[i] = __ldg(ep.chacha + i);
  key.step = __ldg(ep.chacha + 8);
  key.stream = __ldg(ep.chacha + 9);
  const double std64 =
      __hiloint2double(static_cast<int>(__ldg(ep.chacha + 11)), static_cast<int>(__ldg(ep.chacha + 10)));
  const uint64_t g0 = static_cast<uint64_t>(tab.elem0[s] + start + col);
  const auto finish = [&](float& x, double z) {
    x = __fmul_rn(round_once<float>(__dadd_rn(static_cast<double>(x), __dmul_rn(std64, z))), ep.scale);
  };
  if constexpr (kVec) {
    // Groups of 4 consecutive elements; one starting at a multiple of 4 is half of one ChaCha20 block
    // (pairs (g % 8) / 2 and the next), else each element takes its own block (see private_epilogue).
#pragma unroll
    for (int q = 0; q < N / 4; ++q) {
      const uint64_t g = g0 + 4 * q;
      double z[4];
      if ((g & 3) == 0) {
        uint32_t w[16];
        chacha20_block(g >> 3, key, w);
        const bool upper = (g & 4) != 0;
        uint32_t v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = upper ? w[8 + i] : w[i];
        box_muller64(uniform53(v[0], v[1]), uniform53(v[2], v[3]), z[0], z[1]);
        box_muller64(uniform53(v[4], v[5]), uniform53(v[6], v[7]), z[2], z[3]);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) z[e] = chacha_normal_at(g + e, key);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) finish(acc[4 * q + e], z[e]);
    }
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) {
      if (col + e * kStride < len)
        finish(acc[e], chacha_normal_at(g0 + static_cast<uint64_t>(e * kStride), key));
    }
  }
}

// acc[e] = (acc[e] + ν_e) * scale for the N elements this thread owns in the chunk at `start` of slot s
// (offsets col .. col + N - 1 on the vector path, else col, col + kWsumThreads, ...; see
// weighted_sum_kernel). The noise term std * z is rounded before the add, as in the reference (no FMA
// contraction), so that the result is (S + round(std * z)) * scale on every backend.
template <int N, bool kVec>
__device__ __forceinline__ void private_epilogue(const ClipTable& tab, const SumEpilogue& ep, int s,
                                                 int64_t start, int col, int len, float (&acc)[N]) {
  constexpr int kStride = kVec ? 1 : kWsumThreads;
  if (ep.mode == SumMode::kPhilox) {
    // Global index of the thread's first element.
    const uint64_t g0 = static_cast<uint64_t>(tab.elem0[s] + start + col);
    if constexpr (kVec) {
      // Groups of 4 consecutive elements. A group whose first index is a multiple of 4 is exactly one
      // Philox block: one call and two Box-Muller pairs give its 4 normals. Otherwise (the parameter's
      // global offset is not a multiple of 4, e.g. after a parameter of odd size) the group straddles
      // two blocks and each element takes its own Philox call: correct, 4x the Philox work and 2x the
      // Box-Muller work. The branch is uniform over the launch's blocks of one slot (start and col are
      // multiples of 4 here), so it does not diverge.
#pragma unroll
      for (int q = 0; q < N / 4; ++q) {
        const uint64_t g = g0 + 4 * q;
        float z[4];
        if ((g & 3) == 0) {
          const Philox4 x = philox4x32_10(g >> 2, ep.step, ep.stream, ep.seed);
          box_muller(x.x[0], x.x[1], z[0], z[1]);
          box_muller(x.x[2], x.x[3], z[2], z[3]);
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e) z[e] = normal_at(g + e, ep);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[4 * q + e] = (acc[4 * q + e] + __fmul_rn(ep.std, z[e])) * ep.scale;
      }
    } else {
      // Elements kWsumThreads apart: one Philox call each.
#pragma unroll
      for (int e = 0; e < N; ++e) {
        if (col + e * kStride < len) {
          const float z = normal_at(g0 + static_cast<uint64_t>(e * kStride), ep);
          acc[e] = (acc[e] + __fmul_rn(ep.std, z)) * ep.scale;
        }
      }
    }
  } else if (ep.mode == SumMode::kNoise) {
    // Same offsets as the gradients; on the vector path the noise rows are 16-byte aligned too.
    float nu[N];
    load_elems<N, kVec, kStride>(tab.tensor<const float>(s, kExtraB) + start, col, len, nu);
#pragma unroll
    for (int e = 0; e < N; ++e) acc[e] = (acc[e] + nu[e]) * ep.scale;
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) acc[e] *= ep.scale;
  }
}

// S_l[c] = Σ_{i : w[i, l] != 0} Σ_j (w[i, l] α_j) g_j[i, c] for the columns c of launch chunk b =
// blockIdx.x, accumulated in fp32 in (sample, set) order and written once. Grid (chunks).
// kPrivate: written through the epilogue ep instead (see [note: private epilogue]); without it ep is
// not read and the kernel is the plain weighted sum.
template <typename T, bool kPrivate, bool kChacha = false>
__global__ void __launch_bounds__(kWsumThreads, kWsumMinBlocks)
    weighted_sum_kernel(const __grid_constant__ ClipTable tab, const __grid_constant__ SetCoeffs sets,
                        const float* __restrict__ weights, int64_t B, int64_t L, const SumEpilogue ep) {
  constexpr int N = ilp(sizeof(T));
  constexpr int64_t kChunk = WsumChunks<T>::kElems;
  __shared__ int row[kWsumThreads];
  __shared__ float w[kWsumThreads];
  __shared__ int warp_counts[kWsumThreads / kWarp];
  const ChunkRef ch = WsumChunks<T>::locate(tab, blockIdx.x);
  const int s = ch.slot;
  const int64_t n = ch.numel, start = WsumChunks<T>::start(ch);
  const int l = tab.index[s];
  const bool vec = ch.width != 1;
  const int len = static_cast<int>(std::min(kChunk, n - start));
  // Offsets in the chunk: col .. col + N - 1 on the vector path, else col, col + kWsumThreads, ...
  const int col = vec ? static_cast<int>(threadIdx.x) * N : static_cast<int>(threadIdx.x);
  float acc[N];
#pragma unroll
  for (int e = 0; e < N; ++e) acc[e] = 0.f;
  for (int64_t i0 = 0; i0 < B; i0 += kWsumThreads) {
    // Every thread takes part in the compaction, even one whose columns are all past the end.
    const int count = compact_nonzero<kWsumThreads>(weights, L, l, i0, B, row, w, warp_counts);
    if (col < len) {
      if (vec) {
        wsum_tile<T, true>(tab, sets, s, n, start, col, len, i0, row, w, count, acc);
      } else {
        wsum_tile<T, false>(tab, sets, s, n, start, col, len, i0, row, w, count, acc);
      }
    }
  }
  if constexpr (kChacha) {
    if (col < len) {
      if (vec) {
        chacha_epilogue<N, true>(tab, ep, s, start, col, len, acc);
      } else {
        chacha_epilogue<N, false>(tab, ep, s, start, col, len, acc);
      }
    }
  } else if constexpr (kPrivate) {
    if (col < len) {
      if (vec) {
        private_epilogue<N, true>(tab, ep, s, start, col, len, acc);
      } else {
        private_epilogue<N, false>(tab, ep, s, start, col, len, acc);
      }
    }
  }
  float* out = tab.tensor<float>(s, kExtraA) + start;
  if (vec) {
    if (col < len) store_vec<4>(out + col, acc);
  } else {
    store_tail<N, kWsumThreads, false>(out, col, len, acc);
  }
}

}  // namespace

std::vector<at::Tensor> weighted_sum_cuda(at::TensorList grads, at::ArrayRef<double> coeffs,
                                          const at::Tensor& weights) {
  return cuda_clip::sum_pass(grads, coeffs, weights, SumEpilogue{}, {},
                             check_cuda_inputs(grads, coeffs, {}, {}));
}

std::vector<at::Tensor> cuda_clip::sum_pass(at::TensorList grads, at::ArrayRef<double> coeffs,
                                            const at::Tensor& weights, const SumEpilogue& ep,
                                            at::TensorList noise, const ClipLayout& lay) {
  DPK_CHECK(weights.device() == grads[0].device() && weights.scalar_type() == at::kFloat &&
                weights.is_contiguous() && weights.dim() == 2 && weights.size(0) == lay.B &&
                weights.size(1) == lay.L,
            "weights must be a contiguous float32 tensor [B=", lay.B, ", L=", lay.L, "] on ",
            grads[0].device(), ", got ", weights.sizes(), " ", weights.scalar_type(), " on ",
            weights.device());
  const bool is_private = ep.mode != SumMode::kNone;
  TORCH_INTERNAL_ASSERT(noise.empty() == (ep.mode != SumMode::kNoise));
  const c10::cuda::CUDAGuard guard(grads[0].device());
  const auto opts = grads[0].options().dtype(at::kFloat);
  std::vector<at::Tensor> out;
  out.reserve(lay.L);
  for (int64_t l = 0; l < lay.L; ++l) {
    const auto shape = grads[l].sizes().slice(1);
    // An empty batch sums to zero; otherwise the kernel writes every element. The private op always
    // runs the kernel: its epilogue applies to an empty sum too.
    out.push_back(lay.B == 0 && !is_private ? at::zeros(shape, opts) : new_output(shape, opts));
  }
  if (lay.B == 0 && !is_private) return out;

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const SetCoeffs sets = set_coeffs(coeffs);
  // A slot's elem0 is the global flat index of its parameter's first element, in parameter order
  // (docs/RNG.md §1), whatever order the dtype groups are launched in.
  for_each_type(param_groups(grads, lay), [&](auto tag, const std::vector<TensorRef>& refs) {
    using T = typename decltype(tag)::type;
    const auto fill = [&](const void** row, const TensorRef& t) {
      return clip_row(row, grads, lay, t.index, out[t.index].data_ptr(),
                      noise.empty() ? nullptr : noise[t.index].const_data_ptr());
    };
    for_each_table<WsumChunks<T>, ClipTable>(
        refs, kGradList + static_cast<int>(lay.k), kMaxGridX, fill,
        [&](const ClipTable& tab, int64_t chunks, int64_t) {
          const auto blocks = static_cast<unsigned>(chunks);
          const float* const w = weights.const_data_ptr<float>();
          if (ep.mode == SumMode::kChacha) {
            weighted_sum_kernel<T, true, true>
                <<<blocks, kWsumThreads, 0, stream>>>(tab, sets, w, lay.B, lay.L, ep);
          } else if (is_private) {
            weighted_sum_kernel<T, true><<<blocks, kWsumThreads, 0, stream>>>(tab, sets, w, lay.B, lay.L, ep);
          } else {
            weighted_sum_kernel<T, false>
                <<<blocks, kWsumThreads, 0, stream>>>(tab, sets, w, lay.B, lay.L, ep);
          }
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
  });
  return out;
}

}  // namespace dpkernels

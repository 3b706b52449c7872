// CUDA kernel of dpkernels_C::linear_sumsq_tiled (schema in csrc/ops.cpp, math and checks in
// layers.h): per-sample ‖scale ⊙ (g_iᵀ a_i − shift)‖² without materialising g_iᵀ a_i.
//
// linear_sumsq_tile_kernel: one block per (sample i, kTileO × kTileK tile of the [d_out, d_in]
// product). The block walks T in chunks of kChunkT positions: each thread loads its share of the
// chunk's a and g columns (128-bit loads on the aligned path), widens it to fp32 and stores it in
// shared memory, and every thread then accumulates its kTR × kTC register tile of P_i with FMAs;
// the next chunk's loads are issued before the current chunk is multiplied. The epilogue applies
// shift and scale, sums the thread's squares in fp32, and a fixed shuffle tree sums the block's
// threads in fp64 into one partial per (sample, tile). linear_sumsq_reduce_kernel sums each
// sample's partials in a fixed order (one warp per sample) and rounds to fp32. No atomics: results
// are bitwise reproducible from run to run.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>

#include "dpkernels/dispatch.h"
#include "dpkernels/layers.h"
#include "dpkernels/macros.h"

namespace dpkernels {
namespace {

// Tile of the product per block, and of it per thread: 16 × 16 threads of 4 × 4.
constexpr int kTileO = 64;
constexpr int kTileK = 64;
constexpr int kTR = 4;
constexpr int kTC = 4;
constexpr int kThreads = (kTileO / kTR) * (kTileK / kTC);
static_assert(kThreads == 256 && kTR == 4 && kTC == 4, "the fragments are read as float4");
// Positions per staged chunk; the fp32 stage holds the chunk's a columns, then its g columns (8 KiB).
constexpr int kChunkT = 16;
constexpr int kStageA = kChunkT * kTileK;
constexpr int kStageG = kChunkT * kTileO;
constexpr int kStage = kStageA + kStageG;
// Stage elements that each thread loads per chunk.
constexpr int kPerThread = kStage / kThreads;
static_assert(kStage % kThreads == 0 && kStageA % (kThreads * 4) == 0);
constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kReduceThreads = 256;

// Elements per 128-bit load.
template <typename T>
constexpr int kVecWidth = static_cast<int>(16 / sizeof(T));

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct TileArgs {
  int64_t T, d_in, d_out;
  int32_t tiles_k;  // tiles along d_in
  int32_t tiles;    // tiles per sample
};

// Fixed shuffle tree, so the rounding of the sum does not depend on timing.
__device__ __forceinline__ double warp_sum(double x) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off /= 2) x += __shfl_down_sync(kFullMask, x, off);
  return x;
}

// The stage element e of chunk t0 (a's columns [k0, k0 + kTileK), then g's [o0, o0 + kTileO)):
// its row (position t0 + t) and its column, and the global row and column bounds.
struct StageRef {
  int64_t offset;  // element offset in a_i or g_i
  bool in_range;
  bool is_a;
};

__device__ __forceinline__ StageRef stage_ref(int e, int64_t t0, int64_t k0, int64_t o0, const TileArgs& p) {
  const bool is_a = e < kStageA;
  const int local = is_a ? e : e - kStageA;
  const int width = is_a ? kTileK : kTileO;
  const int64_t t = t0 + local / width;
  const int64_t col = (is_a ? k0 : o0) + local % width;
  const int64_t ld = is_a ? p.d_in : p.d_out;
  return {t * ld + col, t < p.T && col < ld, is_a};
}

// Loads this thread's kPerThread stage elements of chunk t0 as fp32 (0 outside the tensors).
// kVec: groups of kVecWidth<T> consecutive elements as 128-bit loads (rows 16-byte aligned and
// d_in, d_out multiples of the width, so a group is wholly inside or wholly outside); otherwise
// element e = j * kThreads + tid, consecutive across the block.
template <typename T, bool kVec>
__device__ __forceinline__ void load_stage(const T* __restrict__ a, const T* __restrict__ g, int64_t t0,
                                           int64_t k0, int64_t o0, const TileArgs& p,
                                           float (&x)[kPerThread]) {
  if constexpr (kVec) {
    constexpr int W = kVecWidth<T>;
#pragma unroll
    for (int j = 0; j < kPerThread / W; ++j) {
      const int e = (j * kThreads + static_cast<int>(threadIdx.x)) * W;
      const StageRef r = stage_ref(e, t0, k0, o0, p);
      if (r.in_range) {
        const uint4 raw = *reinterpret_cast<const uint4*>((r.is_a ? a : g) + r.offset);
        T v[W];
        memcpy(v, &raw, sizeof(raw));
#pragma unroll
        for (int u = 0; u < W; ++u) x[j * W + u] = bk_to_float(v[u]);
      } else {
#pragma unroll
        for (int u = 0; u < W; ++u) x[j * W + u] = 0.f;
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const StageRef r = stage_ref(j * kThreads + static_cast<int>(threadIdx.x), t0, k0, o0, p);
      x[j] = r.in_range ? bk_to_float((r.is_a ? a : g)[r.offset]) : 0.f;
    }
  }
}

// Stores what load_stage loaded at the same stage positions.
template <typename T, bool kVec>
__device__ __forceinline__ void store_stage(float* stage, const float (&x)[kPerThread]) {
  if constexpr (kVec) {
    constexpr int W = kVecWidth<T>;
#pragma unroll
    for (int j = 0; j < kPerThread / W; ++j) {
      const int e = (j * kThreads + static_cast<int>(threadIdx.x)) * W;
#pragma unroll
      for (int u = 0; u < W; u += 4) {
        *reinterpret_cast<float4*>(stage + e + u) =
            make_float4(x[j * W + u], x[j * W + u + 1], x[j * W + u + 2], x[j * W + u + 3]);
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) stage[j * kThreads + threadIdx.x] = x[j];
  }
}

// acc[r][c] += Σ_{t < n} g[t][row + r] a[t][col + c] from the stage.
template <int N>
__device__ __forceinline__ void multiply_chunk(const float* stage, int n, int row, int col,
                                               float (&acc)[kTR][kTC]) {
#pragma unroll(N)
  for (int t = 0; t < n; ++t) {
    const float4 av = *reinterpret_cast<const float4*>(stage + t * kTileK + col);
    const float4 gv = *reinterpret_cast<const float4*>(stage + kStageA + t * kTileO + row);
    const float ar[kTC] = {av.x, av.y, av.z, av.w};
    const float gr[kTR] = {gv.x, gv.y, gv.z, gv.w};
#pragma unroll
    for (int r = 0; r < kTR; ++r) {
#pragma unroll
      for (int c = 0; c < kTC; ++c) acc[r][c] = fmaf(gr[r], ar[c], acc[r][c]);
    }
  }
}

// partial[i * tiles + tile] = Σ over the tile of (scale (P_i − shift))² for block i * tiles + tile:
// the squares of a thread's kTR × kTC elements in fp32, the block's threads combined in fp64.
template <typename T, bool kShift, bool kScale, bool kVec>
__global__ void __launch_bounds__(kThreads, 2)
    linear_sumsq_tile_kernel(const T* __restrict__ a, const T* __restrict__ g,
                             const float* __restrict__ shift, const float* __restrict__ scale,
                             const TileArgs p, double* __restrict__ partial) {
  __shared__ __align__(16) float stage[kStage];
  __shared__ double warp_sums[kThreads / kWarp];
  const int64_t i = blockIdx.x / p.tiles;
  const int tile = static_cast<int>(blockIdx.x - i * p.tiles);
  const int64_t o0 = int64_t{tile / p.tiles_k} * kTileO, k0 = int64_t{tile % p.tiles_k} * kTileK;
  const T* ai = a + i * p.T * p.d_in;
  const T* gi = g + i * p.T * p.d_out;
  const int row = (static_cast<int>(threadIdx.x) / (kTileK / kTC)) * kTR;
  const int col = (static_cast<int>(threadIdx.x) % (kTileK / kTC)) * kTC;

  float acc[kTR][kTC];
#pragma unroll
  for (int r = 0; r < kTR; ++r) {
#pragma unroll
    for (int c = 0; c < kTC; ++c) acc[r][c] = 0.f;
  }
  float x[kPerThread];
  if (p.T > 0) load_stage<T, kVec>(ai, gi, 0, k0, o0, p, x);
#pragma unroll 1
  for (int64_t t0 = 0; t0 < p.T; t0 += kChunkT) {
    __syncthreads();  // the previous chunk has been multiplied
    store_stage<T, kVec>(stage, x);
    __syncthreads();
    if (t0 + kChunkT < p.T) load_stage<T, kVec>(ai, gi, t0 + kChunkT, k0, o0, p, x);
    const int64_t n = p.T - t0;
    if (n >= kChunkT) {
      multiply_chunk<kChunkT>(stage, kChunkT, row, col, acc);
    } else {
      multiply_chunk<1>(stage, static_cast<int>(n), row, col, acc);
    }
  }

  // Epilogue: elements past d_out or d_in (padding, which may hold 0 · inf) are skipped.
  float s = 0.f;
#pragma unroll
  for (int r = 0; r < kTR; ++r) {
    const int64_t o = o0 + row + r;
    const int64_t k = k0 + col;
    if (o >= p.d_out) continue;
    const int64_t off = o * p.d_in + k;
    if (kVec && k + kTC <= p.d_in) {
      float sh[kTC] = {0.f, 0.f, 0.f, 0.f}, sc[kTC] = {1.f, 1.f, 1.f, 1.f};
      if constexpr (kShift) {
        const float4 v = *reinterpret_cast<const float4*>(shift + off);
        sh[0] = v.x, sh[1] = v.y, sh[2] = v.z, sh[3] = v.w;
      }
      if constexpr (kScale) {
        const float4 v = *reinterpret_cast<const float4*>(scale + off);
        sc[0] = v.x, sc[1] = v.y, sc[2] = v.z, sc[3] = v.w;
      }
#pragma unroll
      for (int c = 0; c < kTC; ++c) {
        const float y = bk_shift_scale<kShift, kScale>(acc[r][c], sh[c], sc[c]);
        s = fmaf(y, y, s);
      }
    } else {
#pragma unroll
      for (int c = 0; c < kTC; ++c) {
        if (k + c < p.d_in) {
          const float y = bk_shift_scale<kShift, kScale>(acc[r][c], kShift ? shift[off + c] : 0.f,
                                                         kScale ? scale[off + c] : 1.f);
          s = fmaf(y, y, s);
        }
      }
    }
  }

  double v = warp_sum(static_cast<double>(s));
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = warp_sum(lane < kThreads / kWarp ? warp_sums[lane] : 0.0);
    if (lane == 0) partial[blockIdx.x] = v;
  }
}

// out[i] = float(Σ_{c < tiles} partial[i * tiles + c]): one warp per sample, lanes striding over
// the tiles, then the fixed shuffle tree.
__global__ void __launch_bounds__(kReduceThreads)
    linear_sumsq_reduce_kernel(const double* __restrict__ partial, int64_t B, int32_t tiles,
                               float* __restrict__ out) {
  const int64_t w = (int64_t{blockIdx.x} * kReduceThreads + threadIdx.x) / kWarp;
  if (w >= B) return;  // whole warps leave, so the shuffles below see full warps
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const double* q = partial + w * tiles;
  double acc = 0.0;
  for (int c = lane; c < tiles; c += kWarp) acc += q[c];
  acc = warp_sum(acc);
  if (lane == 0) out[w] = static_cast<float>(acc);
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <typename F>
void dispatch_flags(bool has_shift, bool has_scale, bool vec, const F& f) {
  using Y = std::true_type;
  using N = std::false_type;
  const auto with_vec = [&](auto s, auto c) { vec ? f(s, c, Y{}) : f(s, c, N{}); };
  if (has_shift) {
    has_scale ? with_vec(Y{}, Y{}) : with_vec(Y{}, N{});
  } else {
    has_scale ? with_vec(N{}, Y{}) : with_vec(N{}, N{});
  }
}

at::Tensor linear_sumsq_tiled_cuda(const at::Tensor& a, const at::Tensor& g,
                                   const std::optional<at::Tensor>& scale,
                                   const std::optional<at::Tensor>& shift) {
  const LinearShape s = check_linear_sumsq_inputs(a, g, scale, shift, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(a.device());
  auto out = at::empty({s.B}, a.options().dtype(at::kFloat));
  if (s.B == 0) return out;
  if (s.d_in == 0 || s.d_out == 0) return out.zero_();
  const int64_t tiles_k = ceil_div(s.d_in, kTileK), tiles = ceil_div(s.d_out, kTileO) * tiles_k;
  DPK_CHECK(
      tiles <= std::numeric_limits<int32_t>::max() && s.B * tiles <= std::numeric_limits<int32_t>::max(),
      "linear_sumsq_tiled: too many tiles (B = ", s.B, ", ", tiles, " tiles of ", kTileO, " x ", kTileK,
      " per sample)");
  const TileArgs p{s.T, s.d_in, s.d_out, static_cast<int32_t>(tiles_k), static_cast<int32_t>(tiles)};
  const float* sh = shift ? shift->const_data_ptr<float>() : nullptr;
  const float* sc = scale ? scale->const_data_ptr<float>() : nullptr;
  // Written in full: one partial per block.
  auto partial = at::empty({s.B, tiles}, a.options().dtype(at::kDouble));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  DPK_DISPATCH_GRAD_TYPES(a.scalar_type(), "linear_sumsq_tiled", [&] {
    const scalar_t* pa = a.const_data_ptr<scalar_t>();
    const scalar_t* pg = g.const_data_ptr<scalar_t>();
    constexpr int W = kVecWidth<scalar_t>;
    const bool vec = aligned16(pa) && aligned16(pg) && s.d_in % W == 0 && s.d_out % W == 0 &&
                     (sh == nullptr || aligned16(sh)) && (sc == nullptr || aligned16(sc));
    dispatch_flags(shift.has_value(), scale.has_value(), vec,
                   [&](auto shift_tag, auto scale_tag, auto vec_tag) {
                     linear_sumsq_tile_kernel<scalar_t, decltype(shift_tag)::value,
                                              decltype(scale_tag)::value, decltype(vec_tag)::value>
                         <<<static_cast<unsigned>(s.B * tiles), kThreads, 0, stream>>>(
                             pa, pg, sh, sc, p, partial.data_ptr<double>());
                     C10_CUDA_KERNEL_LAUNCH_CHECK();
                   });
  });
  const int64_t blocks = ceil_div(s.B * kWarp, kReduceThreads);
  DPK_CHECK(blocks <= std::numeric_limits<int32_t>::max(), "linear_sumsq_tiled: batch too large: ", s.B);
  linear_sumsq_reduce_kernel<<<static_cast<unsigned>(blocks), kReduceThreads, 0, stream>>>(
      partial.const_data_ptr<double>(), s.B, static_cast<int32_t>(tiles), out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dpkernels_C, CUDA, m) { m.impl("linear_sumsq_tiled", &linear_sumsq_tiled_cuda); }

}  // namespace dpkernels

// CUDA kernels of dpkernels_C::linear_sumsq_tiled and dpkernels_C::conv2d_sumsq_tiled (schemas in
// csrc/ops.cpp, math and checks in layers.h): per-sample ‖scale ⊙ (g_iᵀ a_i − shift)‖² without
// materialising g_iᵀ a_i.
//
// tiled_sumsq_kernel: one block per (sample i, kTileO × kTileK tile of the [d_out, d_in] product).
// The block walks T in chunks of kChunkT positions: each thread loads its share of the chunk's a and g
// columns, widens it to fp32 and stores it in shared memory, and every thread then accumulates its
// kTR × kTC register tile of P_i with FMAs; the next chunk's loads are issued before the current chunk
// is multiplied. The epilogue applies shift and scale, sums the thread's squares in fp32, and a fixed
// shuffle tree sums the block's threads in fp64 into one partial per (sample, tile).
// tiled_sumsq_reduce_kernel sums each sample's partials in a fixed order (one warp per sample) and rounds
// to fp32. No atomics: results are bitwise reproducible from run to run.
//
// The kernel's operand layout (its template parameter) is the only part that knows the layer: it
// locates each stage element (position t, column) in memory. LinearLayout reads rows of a and g
// (128-bit loads on the aligned path). ConvLayout reads a Conv2d as the linear layer over its im2col
// patches without building them: the a values are gathered straight from x (implicit im2col, zero
// outside the image) and g is read in its own [O][T] channel planes. One launcher core serves both.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>

#include "dpkernels/clip_layout.h"
#include "dpkernels/dispatch.h"
#include "dpkernels/kernels.h"
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
  int32_t tiles_k;    // tiles along d_in
  int32_t tiles;      // tiles per sample
  bool vec_epilogue;  // shift/scale rows 16-byte aligned (d_in % 4 == 0): float4 loads
};

// Fixed shuffle tree, so the rounding of the sum does not depend on timing.
__device__ __forceinline__ double warp_sum(double x) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off /= 2) x += __shfl_down_sync(kFullMask, x, off);
  return x;
}

// ---------------------------------------------------------------------------------------------
// Operand layouts. Each gives, for one block (sample i, tile at o0, k0), a per-thread state
// (`thread`), made once, that locates the thread's share of every chunk; `load` reads the share of
// chunk t0 as fp32 into registers (0 outside the tensors) and `store` puts it in the stage, a's
// [kChunkT][kTileK] columns then g's [kChunkT][kTileO].
// ---------------------------------------------------------------------------------------------

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

// A linear layer: a_i [T, d_in] and g_i [T, d_out], contiguous rows, read along the rows: thread tid
// loads stage elements e = j * kThreads + tid, or with kVec the groups j * kThreads + tid of
// kVecWidth<T> consecutive elements as 128-bit loads (rows 16-byte aligned and d_in, d_out multiples
// of the width, so a group is wholly inside or wholly outside).
template <typename T, bool kVec>
struct LinearLayout {
  using scalar_t = T;

  struct Thread {
    const T* ai;
    const T* gi;
    int64_t k0, o0;
  };

  __device__ __forceinline__ Thread thread(const T* a, const T* g, int64_t i, int64_t k0, int64_t o0,
                                           const TileArgs& p) const {
    return {a + i * p.T * p.d_in, g + i * p.T * p.d_out, k0, o0};
  }

  __device__ __forceinline__ void load(const Thread& th, int64_t t0, const TileArgs& p,
                                       float (&x)[kPerThread]) const {
    if constexpr (kVec) {
      constexpr int W = kVecWidth<T>;
#pragma unroll
      for (int j = 0; j < kPerThread / W; ++j) {
        const int e = (j * kThreads + static_cast<int>(threadIdx.x)) * W;
        const StageRef r = stage_ref(e, t0, th.k0, th.o0, p);
        if (r.in_range) {
          const uint4 raw = *reinterpret_cast<const uint4*>((r.is_a ? th.ai : th.gi) + r.offset);
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
        const StageRef r = stage_ref(j * kThreads + static_cast<int>(threadIdx.x), t0, th.k0, th.o0, p);
        x[j] = r.in_range ? bk_to_float((r.is_a ? th.ai : th.gi)[r.offset]) : 0.f;
      }
    }
  }

  __device__ __forceinline__ void store(const Thread&, float* stage, const float (&x)[kPerThread]) const {
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
};

// A Conv2d as the linear layer over its im2col patches (layers.h, ConvShape), read in place:
// position t = (oh, ow), column k = (c, kh, kw) in weight[o].flatten() order, a value
// x[i, c, oh · sh − ph + kh · dh, ow · sw − pw + kw · dw] (0 outside the image), g value
// g[i, o, t] (each channel plane contiguous, any batch and channel strides).
//
// Both operands are contiguous along t (g's planes; x's rows when sw = 1), not along the columns, so
// the threads share a chunk out by positions and quads of columns: each thread loads one position
// of kQuad consecutive a columns and kQuad consecutive g rows and stores each quad as one float4. A
// warp takes kWarpT positions of kWarp / kWarpT quads, quads fastest: a warp load reads 8 positions
// of 4 planes of g (one or two sectors each; one position of 32 planes, as LinearLayout's order
// would read, is 32 sectors), and a quarter warp's float4 stores fall in 2 stage rows, a 2-way bank
// conflict. Scalar global loads: the values of a quad are not adjacent in memory.
constexpr int kQuad = 4;
constexpr int kWarpT = 8;
constexpr int kWarpQ = kWarp / kWarpT;
static_assert(kTileK == kTileO && kPerThread == 2 * kQuad && kChunkT % kWarpT == 0 &&
                  (kChunkT / kWarpT) * (kTileK / kQuad / kWarpQ) == kThreads / kWarp,
              "ConvLayout: one a quad and one g quad per thread and chunk");

template <typename T>
struct ConvLayout {
  using scalar_t = T;
  int64_t x_batch, x_channel, g_batch, g_channel;  // strides
  int64_t H, W, W_out;
  int64_t kk, kw;  // kh · kw, kw
  int64_t stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;

  struct Thread {
    const T* xi;
    const T* gi;
    int64_t g_row;  // offset in g_i of the thread's first g row (o0 + q)
    int tl;         // the thread's position in every chunk, t0 + tl
    int q;          // its first stage column (a) and row (g)
    int rows;       // of its kQuad g rows, those below d_out
    // Per a column u: the offset in x_i of its value at position (0, 0), which position (oh, ow)
    // moves by oh sh W + ow sw; and its image row and column there, ih_base and iw_base (a column
    // past d_in gets ih_base = H: no position brings it inside the image).
    int64_t x_off[kQuad], ih_base[kQuad], iw_base[kQuad];
  };

  __device__ __forceinline__ Thread thread(const T* x, const T* g, int64_t i, int64_t k0, int64_t o0,
                                           const TileArgs& p) const {
    Thread th;
    const int warp = static_cast<int>(threadIdx.x) / kWarp, lane = static_cast<int>(threadIdx.x) % kWarp;
    th.tl = (warp % (kChunkT / kWarpT)) * kWarpT + lane / kWarpQ;
    th.q = ((warp / (kChunkT / kWarpT)) * kWarpQ + lane % kWarpQ) * kQuad;
    th.xi = x + i * x_batch;
    th.gi = g + i * g_batch;
    const int64_t o = o0 + th.q;
    th.g_row = o * g_channel;
    th.rows = static_cast<int>(std::clamp<int64_t>(p.d_out - o, 0, kQuad));
    // Once per block: the divisions that split a column into (c, kh, kw).
#pragma unroll
    for (int u = 0; u < kQuad; ++u) {
      const int64_t k = k0 + th.q + u;
      const int64_t c = k / kk, r = k - c * kk, kh = r / kw, kwi = r - kh * kw;
      th.ih_base[u] = k < p.d_in ? kh * dilation_h - pad_h : H;
      th.iw_base[u] = kwi * dilation_w - pad_w;
      th.x_off[u] = c * x_channel + th.ih_base[u] * W + th.iw_base[u];
    }
    return th;
  }

  __device__ __forceinline__ void load(const Thread& th, int64_t t0, const TileArgs& p,
                                       float (&x)[kPerThread]) const {
    const int64_t t = t0 + th.tl;
    const bool in_t = t < p.T;
    const int64_t oh = t / W_out, ow = t - oh * W_out;
    const int64_t ih0 = oh * stride_h, iw0 = ow * stride_w, pos = ih0 * W + iw0;
#pragma unroll
    for (int u = 0; u < kQuad; ++u) {
      // Unsigned compares: a negative row or column wraps past H or W.
      const auto ih = static_cast<uint64_t>(ih0 + th.ih_base[u]),
                 iw = static_cast<uint64_t>(iw0 + th.iw_base[u]);
      const bool in = in_t && ih < static_cast<uint64_t>(H) && iw < static_cast<uint64_t>(W);
      x[u] = in ? bk_to_float(th.xi[th.x_off[u] + pos]) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kQuad; ++u) {
      x[kQuad + u] = in_t && u < th.rows ? bk_to_float(th.gi[th.g_row + u * g_channel + t]) : 0.f;
    }
  }

  __device__ __forceinline__ void store(const Thread& th, float* stage, const float (&x)[kPerThread]) const {
    *reinterpret_cast<float4*>(stage + th.tl * kTileK + th.q) = make_float4(x[0], x[1], x[2], x[3]);
    *reinterpret_cast<float4*>(stage + kStageA + th.tl * kTileO + th.q) = make_float4(x[4], x[5], x[6], x[7]);
  }
};

// ---------------------------------------------------------------------------------------------
// The kernels, one for every layout.
// ---------------------------------------------------------------------------------------------

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
// the squares of a thread's kTR × kTC elements in fp32, the block's threads combined in fp64. a and
// g are the operands as the layout reads them (for a Conv2d, x and g).
template <typename Layout, bool kShift, bool kScale>
__global__ void __launch_bounds__(kThreads, 2)
    tiled_sumsq_kernel(const typename Layout::scalar_t* __restrict__ a,
                       const typename Layout::scalar_t* __restrict__ g, const Layout layout,
                       const float* __restrict__ shift, const float* __restrict__ scale, const TileArgs p,
                       double* __restrict__ partial) {
  __shared__ __align__(16) float stage[kStage];
  __shared__ double warp_sums[kThreads / kWarp];
  const int64_t i = blockIdx.x / p.tiles;
  const int tile = static_cast<int>(blockIdx.x - i * p.tiles);
  const int64_t o0 = int64_t{tile / p.tiles_k} * kTileO, k0 = int64_t{tile % p.tiles_k} * kTileK;
  const typename Layout::Thread th = layout.thread(a, g, i, k0, o0, p);
  const int row = (static_cast<int>(threadIdx.x) / (kTileK / kTC)) * kTR;
  const int col = (static_cast<int>(threadIdx.x) % (kTileK / kTC)) * kTC;

  float acc[kTR][kTC];
#pragma unroll
  for (int r = 0; r < kTR; ++r) {
#pragma unroll
    for (int c = 0; c < kTC; ++c) acc[r][c] = 0.f;
  }
  float x[kPerThread];
  if (p.T > 0) layout.load(th, 0, p, x);
#pragma unroll 1
  for (int64_t t0 = 0; t0 < p.T; t0 += kChunkT) {
    __syncthreads();  // the previous chunk has been multiplied
    layout.store(th, stage, x);
    __syncthreads();
    if (t0 + kChunkT < p.T) layout.load(th, t0 + kChunkT, p, x);
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
    if (p.vec_epilogue && k + kTC <= p.d_in) {
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
    tiled_sumsq_reduce_kernel(const double* __restrict__ partial, int64_t B, int32_t tiles,
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

// ---------------------------------------------------------------------------------------------
// Host side.
// ---------------------------------------------------------------------------------------------

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// The launcher core of both ops, for the [B] norms of the linear problem s whose operands a and g
// (for a Conv2d, x and g) the layout reads: with_layout(pa, pg, launch) calls launch(layout) with
// the layout for those data pointers, and launch runs the tile kernel for it, then the reduction.
template <typename WithLayout>
at::Tensor tiled_sumsq_cuda(const char* op, const LinearShape& s, const at::Tensor& a, const at::Tensor& g,
                            const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& shift,
                            const WithLayout& with_layout) {
  const c10::cuda::CUDAGuard guard(a.device());
  auto out = new_output({s.B}, a.options().dtype(at::kFloat));
  if (s.B == 0) return out;
  if (s.d_in == 0 || s.d_out == 0) return out.zero_();
  const int64_t tiles_k = ceil_div(s.d_in, kTileK), tiles = ceil_div(s.d_out, kTileO) * tiles_k;
  DPK_CHECK(
      tiles <= std::numeric_limits<int32_t>::max() && s.B * tiles <= std::numeric_limits<int32_t>::max(), op,
      ": too many tiles (B = ", s.B, ", ", tiles, " tiles of ", kTileO, " x ", kTileK, " per sample)");
  const float* sh = shift ? shift->const_data_ptr<float>() : nullptr;
  const float* sc = scale ? scale->const_data_ptr<float>() : nullptr;
  TileArgs p{s.T, s.d_in, s.d_out, static_cast<int32_t>(tiles_k), static_cast<int32_t>(tiles), false};
  p.vec_epilogue = s.d_in % 4 == 0 && (sh == nullptr || aligned16(sh)) && (sc == nullptr || aligned16(sc));
  // Written in full, one partial per block (new_output poisons both under the test suite, which
  // would expose a block or sample left out).
  auto partial = new_output({s.B, tiles}, a.options().dtype(at::kDouble));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  DPK_DISPATCH_GRAD_TYPES(a.scalar_type(), "tiled_sumsq_cuda", [&] {
    const scalar_t* pa = a.const_data_ptr<scalar_t>();
    const scalar_t* pg = g.const_data_ptr<scalar_t>();
    with_layout(pa, pg, [&](const auto& layout) {
      using Layout = std::decay_t<decltype(layout)>;
      dispatch_shift_scale(shift.has_value(), scale.has_value(), [&](auto shift_tag, auto scale_tag) {
        tiled_sumsq_kernel<Layout, decltype(shift_tag)::value, decltype(scale_tag)::value>
            <<<static_cast<unsigned>(s.B * tiles), kThreads, 0, stream>>>(pa, pg, layout, sh, sc, p,
                                                                          partial.data_ptr<double>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
  const int64_t blocks = ceil_div(s.B * kWarp, kReduceThreads);
  DPK_CHECK(blocks <= std::numeric_limits<int32_t>::max(), op, ": batch too large: ", s.B);
  tiled_sumsq_reduce_kernel<<<static_cast<unsigned>(blocks), kReduceThreads, 0, stream>>>(
      partial.const_data_ptr<double>(), s.B, static_cast<int32_t>(tiles), out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

at::Tensor linear_sumsq_tiled_cuda(const at::Tensor& a, const at::Tensor& g,
                                   const std::optional<at::Tensor>& scale,
                                   const std::optional<at::Tensor>& shift) {
  const LinearShape s =
      check_linear_sumsq_inputs("linear_sumsq_tiled", a, g, scale, shift, c10::DeviceType::CUDA);
  return tiled_sumsq_cuda("linear_sumsq_tiled", s, a, g, scale, shift,
                          [&](const auto* pa, const auto* pg, const auto& launch) {
                            using T = std::remove_cv_t<std::remove_pointer_t<decltype(pa)>>;
                            constexpr int W = kVecWidth<T>;
                            if (aligned16(pa) && aligned16(pg) && s.d_in % W == 0 && s.d_out % W == 0) {
                              launch(LinearLayout<T, true>{});
                            } else {
                              launch(LinearLayout<T, false>{});
                            }
                          });
}

at::Tensor conv2d_sumsq_tiled_cuda(const at::Tensor& x, const at::Tensor& g, at::IntArrayRef kernel_size,
                                   at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                                   const std::optional<at::Tensor>& scale,
                                   const std::optional<at::Tensor>& shift) {
  const ConvShape c = check_conv2d_inputs("conv2d_sumsq_tiled", x, g, kernel_size, stride, padding, dilation,
                                          scale, shift, c10::DeviceType::CUDA);
  return tiled_sumsq_cuda(
      "conv2d_sumsq_tiled", c.linear(), x, g, scale, shift,
      [&](const auto* px, const auto*, const auto& launch) {
        using T = std::remove_cv_t<std::remove_pointer_t<decltype(px)>>;
        launch(ConvLayout<T>{c.x_batch_stride, c.x_channel_stride, c.g_batch_stride, c.g_channel_stride, c.H,
                             c.W, c.W_out, c.kh * c.kw, c.kw, c.stride_h, c.stride_w, c.pad_h, c.pad_w,
                             c.dilation_h, c.dilation_w});
      });
}

}  // namespace dpkernels

// CPU kernels of dpkernels_C::linear_sumsq_tiled and dpkernels_C::conv2d_sumsq_tiled (schemas in
// csrc/ops.cpp, math and checks in layers.h): per-sample ‖scale ⊙ (g_iᵀ a_i − shift)‖² without
// materialising g_iᵀ a_i.
//
// A GEMM blocked as in BLIS, whose output tile never leaves the registers. The [d_out, d_in]
// product is cut into blocks of kBlockO × kBlockK; for one (sample, block) the block's columns of
// a_i and g_i (a chunk of at most kChunkT positions) are converted to fp32 and packed into
// micro-panels (a: [T][kNR] per kNR columns, g: [T][kMR] per kMR rows), and a micro-kernel
// accumulates the kMR × kNR tile Σ_t g[t, o] a[t, k] in 12 SIMD registers with FMAs. The epilogue
// applies shift and scale to the tile in registers, sums its squares in fp32 and adds that sum to
// fp64 accumulators. With T > kChunkT the tiles of a block are parked in a per-thread buffer between
// chunks (the only time a product value touches memory).
//
// The packing is the only part that knows the layer: LinearOperands reads rows of a and g;
// ConvOperands gathers a Conv2d's im2col patches straight from its input (implicit im2col, zero
// outside the image) and reads g's channel planes, so neither the patches (kh · kw times the input)
// nor a transposed copy of g is ever built.
//
// Threads take (sample, block) tasks in sample-major order, or (block, group of samples) tasks when
// rereading shift/scale for every sample would cost more than rereading a and g for every block
// (see tiled_sumsq). Every (sample, block) writes its own fp64 partial and each sample's
// partials are summed in block order: the result depends neither on the thread count nor on the
// task order.
#include "dpkernels/layers.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "dpkernels/clip_layout.h"
#include "dpkernels/dispatch.h"
#include "dpkernels/macros.h"
#include "stream_cpu.h"

namespace dpkernels {
namespace {

using fVec = at::vec::Vectorized<float>;
using dVec = at::vec::Vectorized<double>;

// Micro-tile: kMR rows (o, broadcast from g) × kNR columns (k, kNV vectors of a). 6 × 16 on AVX2:
// 12 accumulators, two loads of a and one broadcast live, 15 of the 16 vector registers.
constexpr int kMR = 6;
constexpr int kNV = 2;
constexpr int kNR = kNV * fVec::size();
// Block: kPanelsO × kPanelsK micro-tiles. One packed micro-panel of a ([kChunkT][kNR] fp32, 16 KiB
// on AVX2) stays in L1 while the block's kPanelsO panels of g stream from L2.
constexpr int64_t kPanelsO = 16;
constexpr int64_t kPanelsK = 8;
constexpr int64_t kBlockO = kPanelsO * kMR;
constexpr int64_t kBlockK = kPanelsK * kNR;
// Positions per packed chunk.
constexpr int64_t kChunkT = 256;
// Fp64 lanes that one fp32 vector widens into.
constexpr int kDLanes = fVec::size() / dVec::size();

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
constexpr int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }
// Rows of one SIMD transpose (at::vec::transpose_mxn<float, 8, 8>) in the conv packing.
constexpr int64_t kTransposeRows = 8;
static_assert(kNR % kTransposeRows == 0);

// dst[0, n) = src[0, n) as fp32.
template <typename scalar_t>
inline void row_to_float(const scalar_t* src, int64_t n, float* dst) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    using sVec = at::vec::Vectorized<scalar_t>;
    static_assert(sVec::size() == 2 * fVec::size());
    int64_t e = 0;
    for (; e + sVec::size() <= n; e += sVec::size()) {
      const auto [x, y] = cpu::to_float(sVec::loadu(src + e));
      x.store(dst + e);
      y.store(dst + e + fVec::size());
    }
    for (; e < n; ++e) dst[e] = bk_to_float(src[e]);
  }
}

// Packs rows [0, rows) × columns [0, n) of src (row stride ld) as fp32 micro-panels of width W:
// dst[p][t][0, W) = src[t][p W, p W + W), zero past column n. tmp: panels * W floats.
template <int W, typename scalar_t>
void pack_panels(const scalar_t* src, int64_t ld, int64_t rows, int64_t n, int64_t panels, float* tmp,
                 float* dst) {
  std::fill(tmp + n, tmp + panels * W, 0.f);
  for (int64_t t = 0; t < rows; ++t) {
    row_to_float(src + t * ld, n, tmp);
    for (int64_t p = 0; p < panels; ++p)
      std::memcpy(dst + (p * rows + t) * W, tmp + p * W, W * sizeof(float));
  }
}

// Zeroes the columns [n, panels · W) of the packed chunk (tc rows): the last panel's padding.
template <int W>
void zero_panel_tail(float* dst, int64_t tc, int64_t n) {
  if (n % W == 0) return;
  float* last = dst + (n / W) * tc * W;
  for (int64_t t = 0; t < tc; ++t) std::fill(last + t * W + n % W, last + (t + 1) * W, 0.f);
}

using Tile = fVec[kMR][kNV];

// acc[r][v] += Σ_{t < tc} g[t][r] · a[t][v-th vector], g and a packed micro-panels.
inline void micro_kernel(const float* __restrict__ g, const float* __restrict__ a, int64_t tc, Tile& acc) {
  for (int64_t t = 0; t < tc; ++t, g += kMR, a += kNR) {
    fVec x[kNV];
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) x[v] = fVec::loadu(a + v * fVec::size());
#pragma GCC unroll 8
    for (int r = 0; r < kMR; ++r) {
      const fVec b(g[r]);
#pragma GCC unroll 4
      for (int v = 0; v < kNV; ++v) acc[r][v] = at::vec::fmadd(b, x[v], acc[r][v]);
    }
  }
}

// Σ y² over a whole tile in fp32, y = bk_shift_scale(acc, shift, scale); sh/sc point at the tile's
// first element of the [d_out, d_in] shift/scale (row stride ld).
template <bool kShift, bool kScale>
inline fVec tile_sumsq(const Tile& acc, const float* sh, const float* sc, int64_t ld) {
  fVec s[kNV];
  for (auto& x : s) x = fVec(0.f);
#pragma GCC unroll 8
  for (int r = 0; r < kMR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) {
      const int64_t off = r * ld + v * fVec::size();
      fVec shift(0.f), scale(1.f);
      if constexpr (kShift) shift = fVec::loadu(sh + off);
      if constexpr (kScale) scale = fVec::loadu(sc + off);
      const fVec y = bk_shift_scale<kShift, kScale>(acc[r][v], shift, scale);
      s[v] = at::vec::fmadd(y, y, s[v]);
    }
  }
  for (int v = 1; v < kNV; ++v) s[0] = s[0] + s[v];
  return s[0];
}

// The same for the rows [0, rows) × columns [0, cols) of a tile on the block's edge (the others
// hold padding): in fp32, then widened.
template <bool kShift, bool kScale>
double edge_sumsq(const Tile& acc, const float* sh, const float* sc, int64_t ld, int64_t rows, int64_t cols) {
  alignas(64) float p[kMR][kNR];
  for (int r = 0; r < kMR; ++r) {
    for (int v = 0; v < kNV; ++v) acc[r][v].store(&p[r][v * fVec::size()]);
  }
  float s = 0.f;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t off = r * ld + c;
      s += bk_square<kShift, kScale>(p[r][c], kShift ? sh[off] : 0.f, kScale ? sc[off] : 1.f);
    }
  }
  return s;
}

// Per-thread buffers, allocated once per run of tasks.
struct Scratch {
  std::vector<float> a, g, tile, tmp, cols;
  // The g panels in `g` are those of (sample, first row, first position) `g_key`: a sample's blocks
  // along d_in share them (sample-major tasks run them in a row).
  std::array<int64_t, 3> g_key{-1, -1, -1};
  explicit Scratch(int64_t tc)
      : a(kPanelsK * kNR * tc),
        g(kPanelsO * kMR * tc),
        tile(kPanelsO * kPanelsK * kMR * kNR),
        tmp(kBlockK),
        cols(kBlockK * round_up(tc, kTransposeRows)) {}
};

// The operands of a linear layer: sample i's rows are a_i [T, d_in] and g_i [T, d_out], contiguous.
// pack_a / pack_g pack the chunk of positions [t0, t0 + tc) × columns [c0, c0 + n) as micro-panels.
template <typename scalar_t>
struct LinearOperands {
  const scalar_t* a;
  const scalar_t* g;
  LinearShape s;

  void pack_a(int64_t i, int64_t t0, int64_t tc, int64_t k0, int64_t n, Scratch& w) const {
    pack_panels<kNR>(a + (i * s.T + t0) * s.d_in + k0, s.d_in, tc, n, ceil_div(n, kNR), w.tmp.data(),
                     w.a.data());
  }
  void pack_g(int64_t i, int64_t t0, int64_t tc, int64_t o0, int64_t n, Scratch& w) const {
    pack_panels<kMR>(g + (i * s.T + t0) * s.d_out + o0, s.d_out, tc, n, ceil_div(n, kMR), w.tmp.data(),
                     w.g.data());
  }
};

// The operands of a Conv2d as the linear layer over its im2col patches, without building them:
// position t = (oh, ow) of the output, column k = (c, kh, kw) of the weight (weight[o].flatten()
// order). pack_a gathers the patch values from x (implicit im2col: zero outside the image), pack_g
// reads g's channel rows, in which positions are contiguous.
template <typename scalar_t>
struct ConvOperands {
  const scalar_t* x;
  const scalar_t* g;
  ConvShape c;

  // Two steps: the block's patch columns gathered k-major into w.cols ([column][position], each
  // output row of a column one contiguous run of the input row, zero outside the image), then
  // transposed 8 × 8 at a time into the [position][kNR] panels.
  void pack_a(int64_t i, int64_t t0, int64_t tc, int64_t k0, int64_t n, Scratch& w) const {
    const int64_t ld = round_up(tc, kTransposeRows), panels = ceil_div(n, kNR);
    float* cols = w.cols.data();
    const int64_t kk = c.kh * c.kw;
    const scalar_t* xi = x + i * c.x_batch_stride;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t k = k0 + j, ch = k / kk, r = k % kk;
      const int64_t dh = (r / c.kw) * c.dilation_h - c.pad_h, dw = (r % c.kw) * c.dilation_w - c.pad_w;
      // Output columns whose input column lies inside the image: [lo, hi).
      const int64_t lo = std::min(dw >= 0 ? 0 : ceil_div(-dw, c.stride_w), c.W_out);
      const int64_t hi = std::clamp<int64_t>(c.W > dw ? ceil_div(c.W - dw, c.stride_w) : 0, lo, c.W_out);
      const scalar_t* xc = xi + ch * c.x_channel_stride;
      float* out = cols + j * ld;
      int64_t oh = t0 / c.W_out, ow = t0 % c.W_out;
      for (int64_t t = 0; t < tc;) {
        const int64_t run = std::min(tc - t, c.W_out - ow);  // positions left in this output row
        const int64_t ih = oh * c.stride_h + dh;
        // [ow, ow + run) = zeros before lo, the image's values in [lo, hi), zeros after hi.
        const bool inside = ih >= 0 && ih < c.H;
        const int64_t a0 = inside ? std::clamp(lo, ow, ow + run) : ow + run;
        const int64_t a1 = inside ? std::clamp(hi, a0, ow + run) : ow + run;
        std::fill(out + t, out + t + (a0 - ow), 0.f);
        const scalar_t* src = xc + ih * c.W + dw + a0 * c.stride_w;
        float* o = out + t + (a0 - ow);
        if (c.stride_w == 1) {
          row_to_float(src, a1 - a0, o);
        } else {
          for (int64_t q = 0; q < a1 - a0; ++q) o[q] = bk_to_float(src[q * c.stride_w]);
        }
        std::fill(o + (a1 - a0), out + t + run, 0.f);
        t += run;
        ow = 0;
        ++oh;
      }
      std::fill(out + tc, out + ld, 0.f);
    }
    std::fill(cols + n * ld, cols + panels * kNR * ld, 0.f);  // the last panel's padding columns
    float* dst = w.a.data();
    for (int64_t p = 0; p < panels; ++p) {
      for (int64_t t = 0; t < tc; t += kTransposeRows) {
        for (int64_t v = 0; v < kNR; v += kTransposeRows) {
          const float* src = cols + (p * kNR + v) * ld + t;
          float* to = dst + (p * tc + t) * kNR + v;
          if (t + kTransposeRows <= tc) {
            at::vec::transpose_mxn<float, kTransposeRows, kTransposeRows>(src, ld, to, kNR);
          } else {
            at::vec::transpose_mxn<float>(src, ld, to, kNR, kTransposeRows, tc - t);
          }
        }
      }
    }
  }

  void pack_g(int64_t i, int64_t t0, int64_t tc, int64_t o0, int64_t n, Scratch& w) const {
    float* dst = w.g.data();
    const scalar_t* gi = g + i * c.g_batch_stride + t0;
    for (int64_t j = 0; j < n; ++j) {
      const scalar_t* src = gi + (o0 + j) * c.g_channel_stride;
      float* out = dst + (j / kMR) * tc * kMR + j % kMR;
      for (int64_t t = 0; t < tc; ++t) out[t * kMR] = bk_to_float(src[t]);
    }
    zero_panel_tail<kMR>(dst, tc, n);
  }
};

struct Epilogue {
  const float* shift;
  const float* scale;
};

// Σ over block [o0, o0 + bo) × [k0, k0 + bk) of (scale (P_i − shift))² for sample i of `ops`.
template <bool kShift, bool kScale, typename Ops>
double block_sumsq(const Ops& ops, const LinearShape& s, const Epilogue& ep, int64_t i, int64_t o0,
                   int64_t bo, int64_t k0, int64_t bk, Scratch& w) {
  const int64_t np = ceil_div(bo, kMR), nq = ceil_div(bk, kNR);
  const int64_t chunks = std::max<int64_t>(1, ceil_div(s.T, kChunkT));
  dVec dacc[kDLanes];
  for (auto& d : dacc) d = dVec(0.0);
  double edge = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t t0 = c * kChunkT, tc = std::min(kChunkT, s.T - t0);
    const bool first = c == 0, last = c == chunks - 1;
    ops.pack_a(i, t0, tc, k0, bk, w);
    if (w.g_key != std::array<int64_t, 3>{i, o0, t0}) {
      ops.pack_g(i, t0, tc, o0, bo, w);
      w.g_key = {i, o0, t0};
    }
    for (int64_t q = 0; q < nq; ++q) {
      const float* ap = w.a.data() + q * tc * kNR;
      for (int64_t p = 0; p < np; ++p) {
        float* parked = w.tile.data() + (q * np + p) * (kMR * kNR);
        Tile acc;
        for (int r = 0; r < kMR; ++r) {
          for (int v = 0; v < kNV; ++v) {
            acc[r][v] = first ? fVec(0.f) : fVec::loadu(parked + r * kNR + v * fVec::size());
          }
        }
        const int64_t rows = std::min<int64_t>(kMR, bo - p * kMR),
                      cols = std::min<int64_t>(kNR, bk - q * kNR);
        const int64_t off = (o0 + p * kMR) * s.d_in + k0 + q * kNR;
        const float* sh = kShift ? ep.shift + off : nullptr;
        const float* sc = kScale ? ep.scale + off : nullptr;
        if (last) {
          // The epilogue's shift/scale rows (in L2 or farther: they are reread for every sample)
          // are on their way while the tile is multiplied.
          for (int64_t r = 0; r < rows; ++r) {
            if constexpr (kShift) __builtin_prefetch(sh + r * s.d_in, 0, 3);
            if constexpr (kScale) __builtin_prefetch(sc + r * s.d_in, 0, 3);
          }
        }
        micro_kernel(w.g.data() + p * tc * kMR, ap, tc, acc);
        if (!last) {
          for (int r = 0; r < kMR; ++r) {
            for (int v = 0; v < kNV; ++v) acc[r][v].store(parked + r * kNR + v * fVec::size());
          }
          continue;
        }
        if (rows == kMR && cols == kNR) {
          cpu::widen_add(tile_sumsq<kShift, kScale>(acc, sh, sc, s.d_in), dacc);
        } else {
          edge += edge_sumsq<kShift, kScale>(acc, sh, sc, s.d_in, rows, cols);
        }
      }
    }
  }
  alignas(64) double lanes[fVec::size()];
  for (int q = 0; q < kDLanes; ++q) dacc[q].store(lanes + q * dVec::size());
  double total = 0.0;
  for (int q = 0; q < fVec::size(); ++q) total += lanes[q];
  return total + edge;
}

// out[i] = Σ over sample i's blocks of block_sumsq, for the operands make_ops(scalar_t{}) gives.
template <typename MakeOps>
at::Tensor tiled_sumsq(const LinearShape& s, at::ScalarType dtype, int64_t element_size,
                       const at::TensorOptions& options, const std::optional<at::Tensor>& scale,
                       const std::optional<at::Tensor>& shift, const MakeOps& make_ops) {
  auto out = new_output({s.B}, options.dtype(at::kFloat));
  if (s.B == 0) return out;
  if (s.d_in == 0 || s.d_out == 0) return out.zero_();
  const Epilogue ep{shift ? shift->const_data_ptr<float>() : nullptr,
                    scale ? scale->const_data_ptr<float>() : nullptr};
  const int64_t nbo = ceil_div(s.d_out, kBlockO), nbk = ceil_div(s.d_in, kBlockK), blocks = nbo * nbk;
  // Task order. Sample-major (a task: one block of one sample, a sample's blocks in a row) finds a_i
  // and g_i in cache for every block after the first but rereads all of shift/scale for every
  // sample; block-major (a task: one block for a group of samples) reads a block's shift/scale once
  // per group but every sample's columns of a and g once per block. The order that rereads fewer
  // bytes from far memory, a and g counted twice (their panel reads are strided). Measured on an AMD
  // EPYC (Zen 3), B = 32, shift and scale: T = 128, d_in = d_out = 1024, sample-major 10% faster;
  // T = 16, d = 2048, block-major 10% faster; T = 16, d = 1024 (near the threshold), even.
  const int64_t rereads_ss = (shift.has_value() + scale.has_value()) * int64_t{4} * s.d_out * s.d_in;
  const int64_t rereads_ag = s.T * (s.d_in * nbo + s.d_out * nbk) * element_size;
  const bool block_major = rereads_ss > 2 * rereads_ag;
  // Samples per block-major task: as many as still gives each thread about 8 tasks to balance with.
  const int64_t threads = at::get_num_threads();
  const int64_t per =
      block_major ? ceil_div(s.B, std::clamp<int64_t>(ceil_div(8 * threads, blocks), 1, s.B)) : 1;
  const int64_t groups = ceil_div(s.B, per);
  // Task t: its block, the first of its samples (per of them, fewer in the last group).
  const auto task_block = [&](int64_t t, int64_t& i0, int64_t& o0, int64_t& bo, int64_t& k0, int64_t& bk) {
    const int64_t blk = block_major ? t / groups : t % blocks;
    i0 = (block_major ? t % groups : t / blocks) * per;
    o0 = (blk / nbk) * kBlockO;
    k0 = (blk % nbk) * kBlockK;
    bo = std::min(kBlockO, s.d_out - o0);
    bk = std::min(kBlockK, s.d_in - k0);
    return blk;
  };
  std::vector<int64_t> cost(blocks * groups);
  for (int64_t t = 0; t < blocks * groups; ++t) {
    int64_t i0, o0, bo, k0, bk;
    task_block(t, i0, o0, bo, k0, bk);
    cost[t] = std::min(per, s.B - i0) * (std::max<int64_t>(s.T, 1) + 1) * bo * bk;
  }
  // NaN until written: a block a task missed would poison its sample's norm, never read as 0.
  std::vector<double> partial(s.B * blocks, std::numeric_limits<double>::quiet_NaN());
  const bool has_shift = shift.has_value(), has_scale = scale.has_value();
  DPK_DISPATCH_GRAD_TYPES(dtype, "tiled_sumsq", [&] {
    const auto ops = make_ops(scalar_t{});
    const auto run = [&](auto shift_tag, auto scale_tag) {
      constexpr bool kShift = decltype(shift_tag)::value, kScale = decltype(scale_tag)::value;
      cpu::parallel_over_tasks(cost, [&](int64_t t0, int64_t t1) {
        Scratch w(std::clamp<int64_t>(s.T, 1, kChunkT));
        for (int64_t t = t0; t < t1; ++t) {
          int64_t i0, o0, bo, k0, bk;
          const int64_t blk = task_block(t, i0, o0, bo, k0, bk);
          for (int64_t i = i0; i < std::min(i0 + per, s.B); ++i) {
            partial[i * blocks + blk] = block_sumsq<kShift, kScale>(ops, s, ep, i, o0, bo, k0, bk, w);
          }
        }
      });
    };
    dispatch_shift_scale(has_shift, has_scale, run);
  });
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < s.B; ++i) {
    double total = 0.0;
    for (int64_t blk = 0; blk < blocks; ++blk) total += partial[i * blocks + blk];
    o[i] = static_cast<float>(total);
  }
  return out;
}

at::Tensor linear_sumsq_tiled_cpu(const at::Tensor& a, const at::Tensor& g,
                                  const std::optional<at::Tensor>& scale,
                                  const std::optional<at::Tensor>& shift) {
  const LinearShape s = check_linear_sumsq_inputs(a, g, scale, shift, c10::DeviceType::CPU);
  return tiled_sumsq(s, a.scalar_type(), a.element_size(), a.options(), scale, shift, [&](auto tag) {
    using scalar_t = decltype(tag);
    return LinearOperands<scalar_t>{a.const_data_ptr<scalar_t>(), g.const_data_ptr<scalar_t>(), s};
  });
}

at::Tensor conv2d_sumsq_tiled_cpu(const at::Tensor& x, const at::Tensor& g, at::IntArrayRef kernel_size,
                                  at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                                  const std::optional<at::Tensor>& scale,
                                  const std::optional<at::Tensor>& shift) {
  const ConvShape c = check_conv2d_sumsq_inputs(x, g, kernel_size, stride, padding, dilation, scale, shift,
                                                c10::DeviceType::CPU);
  return tiled_sumsq(c.linear(), x.scalar_type(), x.element_size(), x.options(), scale, shift, [&](auto tag) {
    using scalar_t = decltype(tag);
    return ConvOperands<scalar_t>{x.const_data_ptr<scalar_t>(), g.const_data_ptr<scalar_t>(), c};
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(dpkernels_C, CPU, m) {
  m.impl("linear_sumsq_tiled", &linear_sumsq_tiled_cpu);
  m.impl("conv2d_sumsq_tiled", &conv2d_sumsq_tiled_cpu);
}

}  // namespace dpkernels

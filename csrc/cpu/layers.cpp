// CPU kernels of dpkernels_C::linear_sumsq_tiled, dpkernels_C::linear_sumsq_gram,
// dpkernels_C::linear_sumsq_t1 (the T = 1 norm under a dense scale as one GEMM for the batch, or
// with a shift element by element), dpkernels_C::conv2d_sumsq_tiled, dpkernels_C::conv2d_sumsq_grad_sample
// and dpkernels_C::conv2d_weighted_sum (schemas in csrc/ops.cpp, math and checks in layers.h): per-sample
// ‖scale ⊙ (g_iᵀ a_i − shift)‖² without materialising g_iᵀ a_i (GramKernel: the same norm without
// scale or shift as ⟨A_i A_iᵀ, G_i G_iᵀ⟩, neither Gram stored). Both are GEMMs blocked as in BLIS
// whose output tile never leaves the registers: the epilogue applies shift and scale to the tile,
// sums its squares in fp32 and adds that sum to fp64 accumulators. With more positions than one
// chunk holds, the tiles of a block are parked in a per-thread buffer between chunks (the only time
// a product value touches memory).
//
// Linear (LinearKernel). The [d_out, d_in] product is cut into blocks of kBlockO × kBlockK; for
// one (sample, block) the block's columns of a_i and g_i (a chunk of at most kChunkT positions) are
// converted to fp32 and packed into micro-panels (a: [T][kNR] per kNR columns, g: [T][kMR] per kMR
// rows), and a micro-kernel accumulates the kMR × kNR tile Σ_t g[t, o] a[t, k] with FMAs.
//
// Conv2d (DirectConvKernel): the same product over the im2col patches with the roles turned, so
// that no patch is ever built or gathered. The vectors run along the output channels o (g packed
// once per chunk as [t][kNR] panels, a transpose of g's [o][t] planes) and a tile's kConvMR weight
// columns are broadcast straight from a channels-last, zero-padded fp32 copy of the input rows the
// chunk reads (xs[h][w][c]): column (c, r, s) at position (oh, ow) is xs[oh·sh + r·dh][ow·sw +
// s·dw][c], so for a fixed kernel row and dilation_w = 1 the kw·C columns (s, c) are one
// contiguous run and a tile's broadcasts are kConvMR consecutive floats, one pointer per position.
// Packing patches into panels instead gathers and transposes every patch value (kh·kw times the
// input) once per block: 2.2x the time on a 32 -> 32 channel 3x3 layer at 16x16, B = 32
// (docs/BENCHMARKS.md, "Book-keeping"). The epilogue reads shift and scale permuted once per call
// into the tile's [column][o] order.
//
// Threads take (sample, block) tasks in sample-major order, or for the linear kernel (block, group
// of samples) tasks when rereading shift/scale for every sample would cost more than rereading a
// and g for every block (LinearKernel::block_major). Every (sample, block) writes its own fp64
// partial and each sample's partials are summed in block order: the result depends neither on the
// thread count nor on the task order.
//
// dpkernels_C::conv2d_weighted_sum, the conv's clipped sum Σ_i w_i g_iᵀ a_i, runs the same direct
// kernel with w_i folded into the packed g panels and the tiles accumulated over the samples as
// well (weighted_sum_groups). ATen's weight gradient (oneDNN) costs ~100 µs more a call on a small
// layer; on the bench CNN's layers the two are on a par (docs/BENCHMARKS.md, "Book-keeping").
//
// dpkernels_C::conv2d_sumsq_grad_sample is the norm whose epilogue also stores each tile of P_i:
// where B·|W| floats fit in memory (the BK engine decides), the clipped sum is then a weighted sum
// over B instead of a second product over B·T positions (2·T flops per kept element).
#include "dpkernels/layers.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>

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
#include "dpkernels/kernels.h"
#include "dpkernels/macros.h"
#include "stream_cpu.h"
#include "vec_cpu.h"

namespace dpkernels {
namespace {

using cpu::Vec;

// Micro-tile: kMR rows (o, broadcast from g) × kNR columns (k, kNV vectors of a). 6 × 16 on AVX2:
// 12 accumulators, two loads of a and one broadcast live, 15 of the 16 vector registers.
constexpr int kMR = 6;
constexpr int kNV = 2;
constexpr int kNR = kNV * Vec::size();
// Block: kPanelsO × kPanelsK micro-tiles. One packed micro-panel of a ([kChunkT][kNR] fp32, 16 KiB
// on AVX2) stays in L1 while the block's kPanelsO panels of g stream from L2.
constexpr int64_t kPanelsO = 16;
constexpr int64_t kPanelsK = 8;
constexpr int64_t kBlockO = kPanelsO * kMR;
constexpr int64_t kBlockK = kPanelsK * kNR;
// Positions per packed chunk.
constexpr int64_t kChunkT = 256;

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
constexpr int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// A [rows, cols] range cut into blocks of BR × BC, row-block major: block blk covers rows [r0, r0 +
// nr) and columns [c0, c0 + nc).
template <int64_t BR, int64_t BC>
struct BlockGrid {
  int64_t rows, cols;
  int64_t nbr = ceil_div(rows, BR), nbc = ceil_div(cols, BC);

  int64_t count() const { return nbr * nbc; }
  void at(int64_t blk, int64_t& r0, int64_t& nr, int64_t& c0, int64_t& nc) const {
    r0 = (blk / nbc) * BR;
    c0 = (blk % nbc) * BC;
    nr = std::min(BR, rows - r0);
    nc = std::min(BC, cols - c0);
  }
  int64_t area(int64_t blk) const {
    int64_t r0, nr, c0, nc;
    at(blk, r0, nr, c0, nc);
    return nr * nc;
  }
};

// Packs rows [0, rows) × columns [0, n) of src (row stride ld) as fp32 micro-panels of width W:
// dst[p][t][0, W) = src[t][p W, p W + W), zero past column n. tmp: panels * W floats.
template <int W, typename scalar_t>
void pack_panels(const scalar_t* src, int64_t ld, int64_t rows, int64_t n, int64_t panels, float* tmp,
                 float* dst) {
  std::fill(tmp + n, tmp + panels * W, 0.f);
  for (int64_t t = 0; t < rows; ++t) {
    cpu::widen_to_float(src + t * ld, n, tmp);
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

using Tile = Vec[kMR][kNV];

// acc[r][v] += Σ over nr rows of len steps of b[r] · y[v-th vector]: b (the broadcast operand)
// advances b_step floats per step and starts each row row_step floats after the last; y (packed,
// kNR per step) advances kNR. The linear kernel's panels are one row of b_step = kMR; the direct
// conv kernel's rows are the output rows of a chunk.
template <int MR>
inline void fma_tile(const float* __restrict__ b, const float* __restrict__ y, int64_t nr, int64_t len,
                     int64_t row_step, int64_t b_step, Vec (&acc)[MR][kNV]) {
  for (int64_t row = 0; row < nr; ++row) {
    const float* bp = b + row * row_step;
    for (int64_t t = 0; t < len; ++t, bp += b_step, y += kNR) {
      Vec x[kNV];
#pragma GCC unroll 4
      for (int v = 0; v < kNV; ++v) x[v] = Vec::loadu(y + v * Vec::size());
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const Vec bc(bp[r]);
#pragma GCC unroll 4
        for (int v = 0; v < kNV; ++v) acc[r][v] = cpu::fmadd(bc, x[v], acc[r][v]);
      }
    }
  }
}

// A tile's accumulators across chunks of positions: zero before the first chunk, else parked in
// memory (MR rows of kNR floats) between chunks.
template <int MR>
inline void unpark(Vec (&acc)[MR][kNV], const float* parked, bool first) {
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < kNV; ++v)
      acc[r][v] = first ? Vec(0.f) : Vec::loadu(parked + r * kNR + v * Vec::size());
  }
}

template <int MR>
inline void park(const Vec (&acc)[MR][kNV], float* parked) {
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < kNV; ++v) acc[r][v].store(parked + r * kNR + v * Vec::size());
  }
}

// Σ y² over the first `rows` rows of a tile in fp32, y = bk_shift_scale(acc, shift, scale); sh/sc
// point at the tile's first element of a shift/scale laid out like the tile (row stride ld): the
// linear kernel's [d_out, d_in], the direct conv kernel's permuted [column][O_p].
template <bool kShift, bool kScale, int MR>
inline Vec tile_sumsq(const Vec (&acc)[MR][kNV], const float* sh, const float* sc, int64_t ld,
                      int64_t rows = MR) {
  Vec s[kNV];
  for (auto& x : s) x = Vec(0.f);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    if (r >= rows) break;
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) {
      const int64_t off = r * ld + v * Vec::size();
      Vec shift(0.f), scale(1.f);
      if constexpr (kShift) shift = Vec::loadu(sh + off);
      if constexpr (kScale) scale = Vec::loadu(sc + off);
      const Vec y = bk_shift_scale<kShift, kScale>(acc[r][v], shift, scale);
      s[v] = cpu::fmadd(y, y, s[v]);
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
    for (int v = 0; v < kNV; ++v) acc[r][v].store(&p[r][v * Vec::size()]);
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

// Rows [0, rows) × columns [0, cols) of a tile into dst (row stride ld). Constant indices (unrolled,
// with a break): a runtime index into acc would keep it in memory.
template <int MR>
inline void store_tile(const Vec (&acc)[MR][kNV], float* dst, int64_t ld, int64_t rows, int64_t cols) {
  if (cols == kNR) {
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      if (r >= rows) break;
#pragma GCC unroll 4
      for (int v = 0; v < kNV; ++v) acc[r][v].store(dst + r * ld + v * Vec::size());
    }
    return;
  }
  alignas(64) float row[kNR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    if (r >= rows) break;
#pragma GCC unroll 4
    for (int v = 0; v < kNV; ++v) acc[r][v].store(row + v * Vec::size());
    std::memcpy(dst + r * ld, row, cols * sizeof(float));
  }
}

struct Epilogue {
  const float* shift;
  const float* scale;
};

// out[i] = Σ_blk partial[i · blocks + blk], added in block order (so the same on any thread count),
// rounded once to fp32.
inline void totals_in_block_order(const std::vector<double>& partial, int64_t B, int64_t blocks, float* out) {
  for (int64_t i = 0; i < B; ++i) {
    double total = 0.0;
    for (int64_t blk = 0; blk < blocks; ++blk) total += partial[i * blocks + blk];
    out[i] = static_cast<float>(total);
  }
}

// out[i] = Σ over sample i's blocks of kernel.block_sumsq<kShift, kScale>(i, block, scratch), in
// block order. Tasks: one block of one sample (sample-major: a sample's blocks in a row, so its
// operands stay in cache), or with `block_major` one block for a group of samples; spread over the
// threads by kernel.cost(block).
template <typename Kernel>
void sum_blocks(const Kernel& kernel, int64_t B, int64_t blocks, bool block_major, bool has_shift,
                bool has_scale, float* out) {
  // Samples per block-major task: as many as still gives each thread about 8 tasks to balance with.
  const int64_t threads = at::get_num_threads();
  const int64_t per = block_major ? ceil_div(B, std::clamp<int64_t>(ceil_div(8 * threads, blocks), 1, B)) : 1;
  const int64_t groups = ceil_div(B, per);
  // Task t: its block, and the first of its samples (per of them, fewer in the last group).
  const auto task = [&](int64_t t, int64_t& i0) {
    i0 = (block_major ? t % groups : t / blocks) * per;
    return block_major ? t / groups : t % blocks;
  };
  std::vector<int64_t> cost(blocks * groups);
  for (int64_t t = 0; t < blocks * groups; ++t) {
    int64_t i0;
    const int64_t blk = task(t, i0);
    cost[t] = std::min(per, B - i0) * kernel.cost(blk);
  }
  // NaN until written: a block a task missed would poison its sample's norm, never read as 0.
  std::vector<double> partial(B * blocks, std::numeric_limits<double>::quiet_NaN());
  dispatch_shift_scale(has_shift, has_scale, [&](auto shift_tag, auto scale_tag) {
    constexpr bool kShift = decltype(shift_tag)::value, kScale = decltype(scale_tag)::value;
    cpu::parallel_over_tasks(cost, [&](int64_t t0, int64_t t1) {
      auto w = kernel.scratch();
      for (int64_t t = t0; t < t1; ++t) {
        int64_t i0;
        const int64_t blk = task(t, i0);
        for (int64_t i = i0; i < std::min(i0 + per, B); ++i) {
          partial[i * blocks + blk] = kernel.template block_sumsq<kShift, kScale>(i, blk, w);
        }
      }
    });
  });
  totals_in_block_order(partial, B, blocks, out);
}

// ---------------------------------------------------------------------------------------------
// Linear: packed micro-panels.
// ---------------------------------------------------------------------------------------------

// Per-thread buffers of LinearKernel, allocated once per run of tasks.
struct PanelScratch {
  std::vector<float> a, g, tile, tmp;
  // The g panels in `g` are those of (sample, first row, first position) `g_key`: a sample's blocks
  // along d_in share them (sample-major tasks run them in a row).
  std::array<int64_t, 3> g_key{-1, -1, -1};
  explicit PanelScratch(int64_t tc)
      : a(kPanelsK * kNR * tc),
        g(kPanelsO * kMR * tc),
        tile(kPanelsO * kPanelsK * kMR * kNR),
        tmp(std::max(kBlockK, kBlockO)) {}
};

// a_i [T, d_in] and g_i [T, d_out], contiguous; blocks of kBlockO rows × kBlockK columns of the
// product, row-block major.
template <typename scalar_t>
struct LinearKernel {
  const scalar_t* a;
  const scalar_t* g;
  LinearShape s;
  Epilogue ep;
  BlockGrid<kBlockO, kBlockK> grid{s.d_out, s.d_in};

  int64_t blocks() const { return grid.count(); }
  // Sample-major finds a_i and g_i in cache for every block after the first but rereads all of
  // shift/scale for every sample; block-major reads a block's shift/scale once per group but every
  // sample's columns of a and g once per block. The order that rereads fewer bytes from far memory,
  // a and g counted twice (their panel reads are strided). Measured on an AMD EPYC (Zen 3), B = 32,
  // shift and scale: T = 128, d_in = d_out = 1024, sample-major 10% faster; T = 16, d = 2048,
  // block-major 10% faster; T = 16, d = 1024 (near the threshold), even.
  bool block_major(int64_t element_size) const {
    const int64_t rereads_ss =
        ((ep.shift != nullptr) + (ep.scale != nullptr)) * int64_t{4} * s.d_out * s.d_in;
    const int64_t rereads_ag = s.T * (s.d_in * grid.nbr + s.d_out * grid.nbc) * element_size;
    return rereads_ss > 2 * rereads_ag;
  }
  int64_t cost(int64_t blk) const { return (std::max<int64_t>(s.T, 1) + 1) * grid.area(blk); }
  PanelScratch scratch() const { return PanelScratch(std::clamp<int64_t>(s.T, 1, kChunkT)); }

  // Σ over block blk of (scale (P_i − shift))² for sample i.
  template <bool kShift, bool kScale>
  double block_sumsq(int64_t i, int64_t blk, PanelScratch& w) const {
    int64_t o0, bo, k0, bk;
    grid.at(blk, o0, bo, k0, bk);
    const int64_t np = ceil_div(bo, kMR), nq = ceil_div(bk, kNR);
    const int64_t chunks = std::max<int64_t>(1, ceil_div(s.T, kChunkT));
    cpu::WideSum wide;
    double edge = 0.0;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t t0 = c * kChunkT, tc = std::min(kChunkT, s.T - t0);
      const bool first = c == 0, last = c == chunks - 1;
      pack_panels<kNR>(a + (i * s.T + t0) * s.d_in + k0, s.d_in, tc, bk, nq, w.tmp.data(), w.a.data());
      if (w.g_key != std::array<int64_t, 3>{i, o0, t0}) {
        pack_panels<kMR>(g + (i * s.T + t0) * s.d_out + o0, s.d_out, tc, bo, np, w.tmp.data(), w.g.data());
        w.g_key = {i, o0, t0};
      }
      for (int64_t q = 0; q < nq; ++q) {
        const float* ap = w.a.data() + q * tc * kNR;
        for (int64_t p = 0; p < np; ++p) {
          float* parked = w.tile.data() + (q * np + p) * (kMR * kNR);
          Tile acc;
          unpark(acc, parked, first);
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
          fma_tile(w.g.data() + p * tc * kMR, ap, 1, tc, 0, kMR, acc);
          if (!last) {
            park(acc, parked);
            continue;
          }
          if (rows == kMR && cols == kNR) {
            wide.add(tile_sumsq<kShift, kScale>(acc, sh, sc, s.d_in));
          } else {
            edge += edge_sumsq<kShift, kScale>(acc, sh, sc, s.d_in, rows, cols);
          }
        }
      }
    }
    return wide.total() + edge;
  }
};

// ---------------------------------------------------------------------------------------------
// Linear, Gram form: ⟨A_i A_iᵀ, G_i G_iᵀ⟩ over the upper triangle of position pairs (s, t).
// ---------------------------------------------------------------------------------------------

// Gram tile: kGramMR positions s (broadcast) × kNR positions t (kNV vectors). kGramMR divides kNR,
// so that a tile's rows are consecutive lanes of one packed position panel. 8 × 16 where the
// module has AVX-512's 32 registers (16 accumulators, two loads and a broadcast), else 4 × 16.
#if defined(__AVX512F__)
constexpr int kGramMR = 8;
#else
constexpr int kGramMR = 4;
#endif
static_assert(kNR % kGramMR == 0);
using GramTile = Vec[kGramMR][kNV];

// The 4 × 4 block at src (row stride ld) transposed into dst (row stride ld_dst): four loads, eight
// shuffles, four stores (GCC vectors: SSE on every x86-64 module).
using Float4 = float __attribute__((vector_size(16)));
inline void transpose_4x4(const float* src, int64_t ld, float* dst, int64_t ld_dst) {
  Float4 r[4];
  for (int j = 0; j < 4; ++j) std::memcpy(&r[j], src + j * ld, sizeof(Float4));
  const Float4 lo01 = __builtin_shufflevector(r[0], r[1], 0, 4, 1, 5),
               hi01 = __builtin_shufflevector(r[0], r[1], 2, 6, 3, 7),
               lo23 = __builtin_shufflevector(r[2], r[3], 0, 4, 1, 5),
               hi23 = __builtin_shufflevector(r[2], r[3], 2, 6, 3, 7);
  const Float4 c[4] = {
      __builtin_shufflevector(lo01, lo23, 0, 1, 4, 5), __builtin_shufflevector(lo01, lo23, 2, 3, 6, 7),
      __builtin_shufflevector(hi01, hi23, 0, 1, 4, 5), __builtin_shufflevector(hi01, hi23, 2, 3, 6, 7)};
  for (int j = 0; j < 4; ++j) std::memcpy(dst + j * ld_dst, &c[j], sizeof(Float4));
}

// Packs src [T, d] (row-major) as fp32 position panels dst[q][k][lane] = src[q kNR + lane][k], zero
// past T: a panel's column k is one vector operand, its lanes a tile's broadcast rows. Four rows at
// a time, transposed by 4 × 4 blocks: read in place when they are fp32 rows of src, else widened
// (or zero-filled past T) into rows [4][d] first.
template <typename scalar_t>
void pack_positions(const scalar_t* src, int64_t T, int64_t d, int64_t panels, float* rows, float* dst) {
  for (int64_t t0 = 0; t0 < panels * kNR; t0 += 4) {
    const float* four = rows;
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (t0 + 4 <= T) four = src + t0 * d;
    }
    if (four == rows) {
      for (int64_t j = 0; j < 4; ++j) {
        if (t0 + j < T) {
          cpu::widen_to_float(src + (t0 + j) * d, d, rows + j * d);
        } else {
          std::fill(rows + j * d, rows + (j + 1) * d, 0.f);
        }
      }
    }
    float* out = dst + (t0 / kNR) * d * kNR + t0 % kNR;
    int64_t k = 0;
    for (; k + 4 <= d; k += 4) transpose_4x4(four + k, d, out + k * kNR, kNR);
    for (; k < d; ++k) {
      for (int64_t j = 0; j < 4; ++j) out[k * kNR + j] = four[j * d + k];
    }
  }
}

// Per-thread buffers of GramKernel: one sample's A_i and G_i as position panels (`sample`: which).
struct GramScratch {
  std::vector<float> a, g, rows;
  int64_t sample = -1;
};

// a_i [T, d_in] and g_i [T, d_out], contiguous. "Block" q of a sample: the rows s of position
// panel q against the columns t of panels q and after (the upper triangle, its diagonal panel
// whole): Σ_{s in q, t >= s} w_st (A_i A_iᵀ)_st (G_i G_iᵀ)_st with w = 2 off the diagonal, 1 on it.
// Per tile, both Grams over all of d_in and d_out in fp32 (as a GEMM would), their products summed
// in fp32 and the tiles in fp64. Half the flops of the two whole Grams for large T (5/8 at T = 64),
// and neither Gram reaches memory.
template <typename scalar_t>
struct GramKernel {
  const scalar_t* a;
  const scalar_t* g;
  LinearShape s;
  int64_t nq = ceil_div(s.T, kNR);

  int64_t blocks() const { return nq; }
  int64_t cost(int64_t q) const { return (nq - q) * (s.d_in + s.d_out) + s.d_in + s.d_out; }
  GramScratch scratch() const {
    return GramScratch{std::vector<float>(nq * kNR * s.d_in), std::vector<float>(nq * kNR * s.d_out),
                       std::vector<float>(4 * std::max(s.d_in, s.d_out))};
  }

  // The shift/scale flags of sum_blocks' interface: the Gram form takes neither (the caller scales
  // A and G by a rank-one scale, and adds a shift's terms itself).
  template <bool, bool>
  double block_sumsq(int64_t i, int64_t q, GramScratch& w) const {
    if (w.sample != i) {
      pack_positions(a + i * s.T * s.d_in, s.T, s.d_in, nq, w.rows.data(), w.a.data());
      pack_positions(g + i * s.T * s.d_out, s.T, s.d_out, nq, w.rows.data(), w.g.data());
      w.sample = i;
    }
    // acc = the Gram tile of rows r0.. of panel q against panel p, over the d columns of `packed`.
    const auto gram_tile = [&](const float* packed, int64_t d, int64_t r0, int64_t p, GramTile& acc) {
      unpark(acc, nullptr, true);  // zero
      fma_tile(packed + q * d * kNR + r0, packed + p * d * kNR, 1, d, 0, kNR, acc);
    };
    cpu::WideSum wide;
    double diagonal = 0.0;
    alignas(64) float ga[kGramMR][kNR];
    for (int64_t r0 = 0; r0 < kNR && q * kNR + r0 < s.T; r0 += kGramMR) {
      for (int64_t p = q; p < nq; ++p) {
        GramTile acc;
        gram_tile(w.a.data(), s.d_in, r0, p, acc);
        park(acc, &ga[0][0]);
        gram_tile(w.g.data(), s.d_out, r0, p, acc);
        if (p > q) {  // every t after every s
          Vec sum(0.f);
#pragma GCC unroll 16
          for (int r = 0; r < kGramMR; ++r) {
#pragma GCC unroll 4
            for (int v = 0; v < kNV; ++v)
              sum = cpu::fmadd(acc[r][v], Vec::loadu(&ga[r][v * Vec::size()]), sum);
          }
          wide.add(sum + sum);
          continue;
        }
        alignas(64) float gg[kGramMR][kNR];
        park(acc, &gg[0][0]);
        float d = 0.f;
        for (int64_t r = 0; r < kGramMR; ++r) {
          for (int64_t lane = r0 + r; lane < kNR; ++lane) {
            d += (lane == r0 + r ? 1.f : 2.f) * ga[r][lane] * gg[r][lane];
          }
        }
        diagonal += d;
      }
    }
    return wide.total() + diagonal;
  }
};

// ---------------------------------------------------------------------------------------------
// Linear, T = 1 (one position per sample, P_i = g_i a_iᵀ): dpkernels_C::linear_sumsq_t1.
// ---------------------------------------------------------------------------------------------
//
// Both forms run over blocks of kT1BlockO rows o × kT1BlockK columns k of the [d_out, d_in]
// product; a task packs its block of the scale (and shift) into kNR-column micro-panels, which
// stay in L2 while every sample passes through them, and each sample's fp64 sum over the block is
// kept in the task's scratch. Per-(block, sample) partials are summed in block order.
// - T1SquaresKernel (a dense scale, no shift): Σ_k a_ik² Σ_o g_io² S_ok², one GEMM of g∘g by S∘S
//   for the batch; S∘S is formed as the block is packed, so neither it nor the [B, d_in] product
//   reaches memory (ATen's (g∘g)(S∘S) costs an S∘S pass and a GEMM; docs/BENCHMARKS.md,
//   "Book-keeping"). Every term is non-negative: no cancellation.
// - T1ShiftKernel (a shift, with or without a dense scale): every element y = S_ok a_ik g_io −
//   S_ok M_ok formed and squared in registers, one fused multiply-add from the packed S and −S⊙M.
//   The expansion ‖S⊙P_i‖² − 2⟨S²⊙M, P_i⟩ + ‖S⊙M‖² would cost one GEMM less but subtracts terms
//   as large as ‖S⊙P_i‖²: with P_i near M its error, relative to those terms, swamps the norm, and
//   an underestimated norm lets the sample's contribution exceed the clip bound.
constexpr int64_t kT1BlockO = 256;
constexpr int64_t kT1BlockK = 128;
// A block's rows are 512-byte runs a page apart, too short for the hardware prefetcher to follow:
// the pack fetches each run kT1PrefetchRows rows ahead into L2 (1.29 -> 0.90 ms for B = 64,
// d = 1024 on two Zen 4 cores, the scale read from memory).
constexpr int64_t kT1PrefetchRows = 8;
constexpr int64_t kCacheLineFloats = 16;
// Samples per T1ShiftKernel tile: their a columns, the accumulators, S and −S⊙M take 4·R + 4
// vectors, so 4 where the module has 32 registers (2 samples took 1.15-1.25x the time, 6 no less
// than 4: B = 32 and 64, d = 1024, Zen 4), else 2.
#if defined(__AVX512F__)
constexpr int kT1ShiftR = 4;
#else
constexpr int kT1ShiftR = 2;
#endif

// Per-thread buffers of the T = 1 kernels: one block's packed panels (up to two matrices), and each
// sample's fp64 sum over the block.
struct T1Scratch {
  std::vector<float> panels;
  std::vector<cpu::WideSum> sums;
};

// Blocks of the [d_out, d_in] product, row-block major.
struct T1Blocks {
  LinearShape s;
  BlockGrid<kT1BlockO, kT1BlockK> grid{s.d_out, s.d_in};

  int64_t cost(int64_t blk) const { return (s.B + 1) * grid.area(blk); }
  T1Scratch scratch(int matrices) const {
    return T1Scratch{std::vector<float>(matrices * kT1BlockO * kT1BlockK), std::vector<cpu::WideSum>(s.B)};
  }
};

// dst[q][o][lane] = f(src[0], ..., src[N − 1]) at row o0 + o, column k0 + q·kNR + lane of the
// [·, ld] fp32 matrices src, for the block's bo rows and bk columns (zero past bk).
template <int N, typename F>
void pack_t1_block(const std::array<const float*, N>& src, int64_t ld, int64_t o0, int64_t bo, int64_t k0,
                   int64_t bk, float* dst, const F& f) {
  const int64_t nq = ceil_div(bk, kNR);
  for (int64_t o = 0; o < bo; ++o) {
    std::array<const float*, N> row;
    for (int j = 0; j < N; ++j) {
      row[j] = src[j] + (o0 + o) * ld + k0;
      if (o + kT1PrefetchRows < bo) {
        for (int64_t c = 0; c < bk; c += kCacheLineFloats)
          __builtin_prefetch(row[j] + kT1PrefetchRows * ld + c, 0, 2);
      }
    }
    for (int64_t q = 0; q < nq; ++q) {
      for (int v = 0; v < kNV; ++v) {
        const int64_t col = q * kNR + v * Vec::size(), n = std::clamp<int64_t>(bk - col, 0, Vec::size());
        std::array<Vec, N> x;
        for (int j = 0; j < N; ++j)
          x[j] = n == Vec::size() ? Vec::loadu(row[j] + col) : Vec::loadu(row[j] + col, n);
        f(x).store(dst + (q * bo + o) * kNR + v * Vec::size());
      }
    }
  }
}

// The rows of a [B, d] input as fp32, optionally squared: as panels of R samples, dst[p][c][r] =
// src[p R + r][c] (the tiles' broadcast operand; zero past B), or with R = 0 as rows padded to
// whole kNR-column panels, dst[i][c] (zero past d).
template <int R, typename scalar_t>
void pack_t1_rows(const scalar_t* src, int64_t B, int64_t d, bool square, float* dst) {
  const int64_t per = std::max(R, 1), d_p = round_up(d, kNR);
  at::parallel_for(0, ceil_div(B, per), 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> row(d_p);
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t r = 0; r < per; ++r) {
        const int64_t i = p * per + r;
        if (i < B) {
          cpu::widen_to_float(src + i * d, d, row.data());
          if (square) {
            for (int64_t c = 0; c < d; ++c) row[c] *= row[c];
          }
        } else {
          std::fill(row.begin(), row.begin() + d, 0.f);
        }
        if constexpr (R == 0) {
          std::copy(row.begin(), row.begin() + d, dst + i * d_p);
          std::fill(dst + i * d_p + d, dst + (i + 1) * d_p, 0.f);
        } else {
          for (int64_t c = 0; c < d; ++c) dst[(p * d + c) * R + r] = row[c];
        }
      }
    }
  });
}

// out[i] = Σ_k a2[i][k] Σ_o g2[i][o] S_ok²: tiles of kMR samples × kNR columns summed over the
// block's rows in registers, the epilogue dotting each tile row with a_i∘a_i.
struct T1SquaresKernel {
  T1Blocks geo;
  const float* scale;
  const float* a2;  // pack_t1_rows<0>, squared
  const float* g2;  // pack_t1_rows<kMR>, squared
  static constexpr int kMatrices = 1;

  void block_sums(int64_t blk, T1Scratch& w) const {
    const LinearShape& s = geo.s;
    int64_t o0, bo, k0, bk;
    geo.grid.at(blk, o0, bo, k0, bk);
    pack_t1_block<1>({scale}, s.d_in, o0, bo, k0, bk, w.panels.data(),
                     [](const auto& x) { return x[0] * x[0]; });
    const int64_t d_in_p = round_up(s.d_in, kNR);
    for (int64_t q = 0; q < ceil_div(bk, kNR); ++q) {
      const float* sq = w.panels.data() + q * bo * kNR;
      for (int64_t p = 0; p < ceil_div(s.B, kMR); ++p) {
        Tile acc;
        unpark(acc, nullptr, true);  // zero
        fma_tile(g2 + (p * s.d_out + o0) * kMR, sq, 1, bo, 0, kMR, acc);
        const int64_t rows = std::min<int64_t>(kMR, s.B - p * kMR);
#pragma GCC unroll 16
        for (int r = 0; r < kMR; ++r) {
          if (r >= rows) break;
          const float* ai = a2 + (p * kMR + r) * d_in_p + k0 + q * kNR;
          Vec t = acc[r][0] * Vec::loadu(ai);
#pragma GCC unroll 4
          for (int v = 1; v < kNV; ++v) t = cpu::fmadd(acc[r][v], Vec::loadu(ai + v * Vec::size()), t);
          w.sums[p * kMR + r].add(t);
        }
      }
    }
  }
};

// out[i] = Σ_{o,k} (S_ok a_ik g_io − S_ok M_ok)² (S = 1 without kScale): tiles of kT1ShiftR
// samples × kNR columns whose a columns stay in registers while the block's rows pass.
template <bool kScale>
struct T1ShiftKernel {
  T1Blocks geo;
  const float* scale;  // null without kScale
  const float* shift;
  const float* a;  // pack_t1_rows<0>
  const float* g;  // pack_t1_rows<kT1ShiftR>
  static constexpr int kMatrices = 2;

  void block_sums(int64_t blk, T1Scratch& w) const {
    constexpr int R = kT1ShiftR;
    const LinearShape& s = geo.s;
    int64_t o0, bo, k0, bk;
    geo.grid.at(blk, o0, bo, k0, bk);
    // sp: S (unused without kScale); mp: −S⊙M.
    float* sp = w.panels.data();
    float* mp = sp + kT1BlockO * kT1BlockK;
    if constexpr (kScale) {
      pack_t1_block<1>({scale}, s.d_in, o0, bo, k0, bk, sp, [](const auto& x) { return x[0]; });
      pack_t1_block<2>({scale, shift}, s.d_in, o0, bo, k0, bk, mp,
                       [](const auto& x) { return Vec(0.f) - x[0] * x[1]; });
    } else {
      pack_t1_block<1>({shift}, s.d_in, o0, bo, k0, bk, mp, [](const auto& x) { return Vec(0.f) - x[0]; });
    }
    const int64_t d_in_p = round_up(s.d_in, kNR);
    for (int64_t q = 0; q < ceil_div(bk, kNR); ++q) {
      for (int64_t p = 0; p < ceil_div(s.B, R); ++p) {
        const int64_t rows = std::min<int64_t>(R, s.B - p * R);
        Vec av[R][kNV], acc[R][kNV];
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const float* ai = a + std::min<int64_t>(p * R + r, s.B - 1) * d_in_p + k0 + q * kNR;
#pragma GCC unroll 4
          for (int v = 0; v < kNV; ++v) {
            av[r][v] = Vec::loadu(ai + v * Vec::size());
            acc[r][v] = Vec(0.f);
          }
        }
        const float* gp = g + (p * s.d_out + o0) * R;
        const float* sq = sp + q * bo * kNR;
        const float* mq = mp + q * bo * kNR;
        for (int64_t o = 0; o < bo; ++o, gp += R, sq += kNR, mq += kNR) {
          Vec sv[kNV], mv[kNV];
#pragma GCC unroll 4
          for (int v = 0; v < kNV; ++v) {
            if constexpr (kScale) sv[v] = Vec::loadu(sq + v * Vec::size());
            mv[v] = Vec::loadu(mq + v * Vec::size());
          }
#pragma GCC unroll 16
          for (int r = 0; r < R; ++r) {
            const Vec gb(gp[r]);
#pragma GCC unroll 4
            for (int v = 0; v < kNV; ++v) {
              Vec u = av[r][v];
              if constexpr (kScale) u = sv[v] * u;
              const Vec y = cpu::fmadd(u, gb, mv[v]);
              acc[r][v] = cpu::fmadd(y, y, acc[r][v]);
            }
          }
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          if (r >= rows) break;
          Vec t = acc[r][0];
#pragma GCC unroll 4
          for (int v = 1; v < kNV; ++v) t = t + acc[r][v];
          w.sums[p * R + r].add(t);
        }
      }
    }
  }
};

// out[i] = Σ over the kernel's blocks of sample i's partials, in block order.
template <typename Kernel>
void t1_sums(const Kernel& kernel, float* out) {
  const int64_t B = kernel.geo.s.B, blocks = kernel.geo.grid.count();
  std::vector<int64_t> cost(blocks);
  for (int64_t blk = 0; blk < blocks; ++blk) cost[blk] = kernel.geo.cost(blk);
  // NaN until written: a block a task missed would poison the norms, never read as 0.
  std::vector<double> partial(blocks * B, std::numeric_limits<double>::quiet_NaN());
  cpu::parallel_over_tasks(cost, [&](int64_t b0, int64_t b1) {
    auto w = kernel.geo.scratch(Kernel::kMatrices);
    for (int64_t blk = b0; blk < b1; ++blk) {
      for (auto& x : w.sums) x = cpu::WideSum();
      kernel.block_sums(blk, w);
      for (int64_t i = 0; i < B; ++i) partial[i * blocks + blk] = w.sums[i].total();
    }
  });
  totals_in_block_order(partial, B, blocks, out);
}

// ---------------------------------------------------------------------------------------------
// Conv2d: the direct kernel (no patches).
// ---------------------------------------------------------------------------------------------

// Micro-tile: kConvMR weight columns (broadcast from the input) × kNR output channels (kNV vectors
// of g). 14 × 16 where the module has AVX-512's 32 vector registers (its 256-bit vectors use them
// too): 28 accumulators, two loads of g and a broadcast, 7-13% less time for the bench CNN's five
// norms than 6 × 16 on a Zen 4 (docs/BENCHMARKS.md, "Book-keeping"); 6 × 16 with 16 registers (15
// of them).
#if defined(__AVX512F__)
constexpr int kConvMR = 14;
#else
constexpr int kConvMR = 6;
#endif
using ConvTile = Vec[kConvMR][kNV];
// Block: kConvPanelsO o-panels × kConvPanelsK column tiles.
constexpr int64_t kConvPanelsO = 4;
constexpr int64_t kConvPanelsK = 16;

// Per-thread buffers of DirectConvKernel.
struct ConvScratch {
  std::vector<float> x, g, tile;
  // xs holds (sample, first output row) x_key, the g panels (sample, first output row, first panel)
  // g_key: a sample's blocks run in a row and share them.
  std::array<int64_t, 2> x_key{-1, -1};
  std::array<int64_t, 3> g_key{-1, -1, -1};
  ConvScratch(int64_t x_floats, int64_t g_floats, int64_t blocks)
      : x(x_floats), g(g_floats), tile(blocks * kConvPanelsO * kConvPanelsK * kConvMR * kNR) {}
};

// The columns of the product are cut into segments: a kernel row's kw·C columns (s, c) when
// dilation_w = 1 (contiguous in xs), else a kernel tap's C columns. Segment j's column u is weight
// column (c, r, s) with j · seg_len + u = (r · kw + s) · C + c either way, the order of the
// permuted shift/scale ([kh][kw][C][O_p], see conv2d_sumsq_tiled_cpu). Column tiles never straddle
// segments; blocks are kConvPanelsO o-panels × kConvPanelsK column tiles.
template <typename scalar_t>
struct DirectConvKernel {
  const scalar_t* x;
  const scalar_t* g;
  ConvShape c;
  Epilogue ep;  // permuted: [nseg · seg_len][O_p]
  // Where block_sumsq also stores the products P_i it squares, [B][(r, s, c)][O] (null: nowhere).
  float* kept = nullptr;
  bool whole_rows = c.dilation_w == 1;
  int64_t nseg = whole_rows ? c.kh : c.kh * c.kw, seg_len = whole_rows ? c.kw * c.C : c.C;
  int64_t seg_tiles = ceil_div(seg_len, kConvMR), tiles = nseg * seg_tiles;
  int64_t np = ceil_div(c.O, kNR), O_p = np * kNR;
  BlockGrid<kConvPanelsO, kConvPanelsK> grid{np, tiles};
  int64_t Wp = c.W + 2 * c.pad_w;
  // Output rows per chunk (at least one whole row), and the input rows they read.
  int64_t rows_per_chunk = std::clamp<int64_t>(kChunkT / c.W_out, 1, c.H_out);
  int64_t span = (rows_per_chunk - 1) * c.stride_h + (c.kh - 1) * c.dilation_h + 1;

  int64_t blocks() const { return grid.count(); }
  // Elements of a weighted sum in the permuted layout [(r, s, c)][O_p].
  int64_t sum_size() const { return nseg * seg_len * O_p; }
  int64_t cost(int64_t blk) const { return (c.H_out * c.W_out + 1) * grid.area(blk); }
  // Buffers for runs of `blocks` blocks at once.
  ConvScratch scratch(int64_t blocks = 1) const {
    // xs plus kConvMR floats of slack: the last tile of a segment reads up to kConvMR - 1 floats
    // past it (rows the epilogue skips).
    return ConvScratch(span * Wp * c.C + kConvMR, kConvPanelsO * rows_per_chunk * c.W_out * kNR, blocks);
  }

  // xs[j][w][ch] = x_i[ch][oh0·sh + j − pad_h][w − pad_w] as fp32 (zero outside the image) for the
  // input rows j < nspan that output rows from oh0 read.
  void pack_x(int64_t i, int64_t oh0, int64_t nspan, float* xs) const {
    const scalar_t* xi = x + i * c.x_batch_stride;
    for (int64_t j = 0; j < nspan; ++j) {
      float* row = xs + j * Wp * c.C;
      const int64_t h = oh0 * c.stride_h + j - c.pad_h;
      if (h < 0 || h >= c.H) {
        std::fill(row, row + Wp * c.C, 0.f);
        continue;
      }
      std::fill(row, row + c.pad_w * c.C, 0.f);
      std::fill(row + (c.pad_w + c.W) * c.C, row + Wp * c.C, 0.f);
      for (int64_t ch = 0; ch < c.C; ++ch) {
        const scalar_t* src = xi + ch * c.x_channel_stride + h * c.W;
        float* dst = row + c.pad_w * c.C + ch;
        for (int64_t q = 0; q < c.W; ++q) dst[q * c.C] = bk_to_float(src[q]);
      }
    }
    std::fill(xs + nspan * Wp * c.C, xs + nspan * Wp * c.C + kConvMR, 0.f);
  }

  // gp[p][t][lane] = factor · g_i[(p0 + p) kNR + lane][t0 + t] as fp32 (zero past O) for the
  // chunk's tc positions from t0 and panels p < npb.
  void pack_g(int64_t i, int64_t t0, int64_t tc, int64_t p0, int64_t npb, float factor, float* gp) const {
    const scalar_t* gi = g + i * c.g_batch_stride + t0;
    for (int64_t p = 0; p < npb; ++p) {
      float* panel = gp + p * tc * kNR;
      for (int64_t lane = 0; lane < kNR; ++lane) {
        const int64_t o = (p0 + p) * kNR + lane;
        if (o >= c.O) {
          for (int64_t t = 0; t < tc; ++t) panel[t * kNR + lane] = 0.f;
          continue;
        }
        const scalar_t* src = gi + o * c.g_channel_stride;
        for (int64_t t = 0; t < tc; ++t) panel[t * kNR + lane] = factor * bk_to_float(src[t]);
      }
    }
  }

  // The tiles of blocks [b0, b1) of Σ_{i ∈ [i0, i1)} w_i g_iᵀ a_i (w null: all 1), accumulated over
  // the samples' chunks of positions (sample by sample, each packed once, the tiles parked in
  // ws.tile between them); epilogue(acc, seg, col0, p) takes each tile after the last chunk of
  // sample i1 - 1: segment seg's columns from col0, o-panel p.
  template <typename TileFn>
  void run_tiles(int64_t i0, int64_t i1, int64_t b0, int64_t b1, const float* w, ConvScratch& ws,
                 const TileFn& epilogue) const {
    const int64_t chunks = ceil_div(c.H_out, rows_per_chunk);
    const int64_t row_step = c.stride_h * Wp * c.C, col_step = c.stride_w * c.C;
    for (int64_t i = i0; i < i1; ++i) {
      for (int64_t ch = 0; ch < chunks; ++ch) {
        const int64_t oh0 = ch * rows_per_chunk, nr = std::min(rows_per_chunk, c.H_out - oh0);
        const int64_t t0 = oh0 * c.W_out, tc = nr * c.W_out;
        const bool first = i == i0 && ch == 0, last = i == i1 - 1 && ch == chunks - 1;
        if (ws.x_key != std::array<int64_t, 2>{i, oh0}) {
          pack_x(i, oh0, (nr - 1) * c.stride_h + (c.kh - 1) * c.dilation_h + 1, ws.x.data());
          ws.x_key = {i, oh0};
        }
        for (int64_t blk = b0; blk < b1; ++blk) {
          int64_t p0, npb, u0, nub;
          grid.at(blk, p0, npb, u0, nub);
          if (ws.g_key != std::array<int64_t, 3>{i, oh0, p0}) {
            pack_g(i, t0, tc, p0, npb, w ? w[i] : 1.f, ws.g.data());
            ws.g_key = {i, oh0, p0};
          }
          for (int64_t p = 0; p < npb; ++p) {
            const float* gp = ws.g.data() + p * tc * kNR;
            for (int64_t uu = 0; uu < nub; ++uu) {
              const int64_t u = u0 + uu, seg = u / seg_tiles, col0 = (u % seg_tiles) * kConvMR;
              float* parked =
                  ws.tile.data() + (((blk - b0) * kConvPanelsO + p) * kConvPanelsK + uu) * (kConvMR * kNR);
              ConvTile acc;
              unpark(acc, parked, first);
              // Segment seg starts at kernel row r (and tap s when dilation_w > 1) of xs.
              const int64_t r = whole_rows ? seg : seg / c.kw, s = whole_rows ? 0 : seg % c.kw;
              const float* xs = ws.x.data() + (r * c.dilation_h * Wp + s * c.dilation_w) * c.C + col0;
              fma_tile(xs, gp, nr, c.W_out, row_step, col_step, acc);
              if (last) {
                epilogue(acc, seg, col0, p0 + p);
              } else {
                park(acc, parked);
              }
            }
          }
        }
      }
    }
  }

  // Rows of a tile that are columns of its segment; those past its end hold other columns' products.
  int64_t tile_rows(int64_t col0) const { return std::min<int64_t>(kConvMR, seg_len - col0); }

  // Σ over block blk of (scale (P_i − shift))² for sample i (and block blk of P_i into kept). Padding
  // channels (o >= O) hold g = 0 and shift = scale = 0: their y is 0.
  template <bool kShift, bool kScale>
  double block_sumsq(int64_t i, int64_t blk, ConvScratch& ws) const {
    cpu::WideSum wide;
    run_tiles(i, i + 1, blk, blk + 1, nullptr, ws,
              [&](const ConvTile& acc, int64_t seg, int64_t col0, int64_t p) {
                const int64_t col = seg * seg_len + col0, off = col * O_p + p * kNR, rows = tile_rows(col0);
                wide.add(tile_sumsq<kShift, kScale>(acc, kShift ? ep.shift + off : nullptr,
                                                    kScale ? ep.scale + off : nullptr, O_p, rows));
                if (kept != nullptr) {
                  store_tile(acc, kept + (i * nseg * seg_len + col) * c.O + p * kNR, c.O, rows,
                             std::min<int64_t>(kNR, c.O - p * kNR));
                }
              });
    return wide.total();
  }

  // Blocks [b0, b1) of Σ_{i ∈ [i0, i1)} w_i P_i, stored into sum ([(r, s, c)][O_p], the permuted
  // weight).
  void weighted_sum(int64_t i0, int64_t i1, int64_t b0, int64_t b1, const float* w, ConvScratch& ws,
                    float* sum) const {
    run_tiles(i0, i1, b0, b1, w, ws, [&](const ConvTile& acc, int64_t seg, int64_t col0, int64_t p) {
      store_tile(acc, sum + (seg * seg_len + col0) * O_p + p * kNR, O_p, tile_rows(col0), kNR);
    });
  }
};

// Σ_i w_i P_i of the direct conv kernel into `sum` ([(r, s, c)][O_p]). The samples are cut into
// groups fixed by the shapes alone (at most kSumGroups, and at most kSumPartialFloats floats of
// partial sums), each summed sample by sample into its own partial (the first group's is `sum`),
// and the partials are added in group order: the result depends neither on the thread count nor
// on the task order. A task is one group over a band of blocks, each of its samples packed once per
// band (packing is a sixth of a small layer's time); the bands, which do not change the result, are
// as few as give every thread a task.
template <typename Kernel>
void weighted_sum_groups(const Kernel& kernel, int64_t B, const float* w, float* sum) {
  constexpr int64_t kSumGroups = 4, kSumPartialFloats = int64_t{1} << 22;
  const int64_t size = kernel.sum_size(), blocks = kernel.blocks();
  const int64_t max_groups = std::clamp<int64_t>(kSumPartialFloats / size, 1, kSumGroups);
  const int64_t per = ceil_div(B, std::min(B, max_groups)), groups = ceil_div(B, per);
  const int64_t bands = std::clamp<int64_t>(ceil_div(at::get_num_threads(), groups), 1, blocks);
  const int64_t per_band = ceil_div(blocks, bands);
  std::vector<int64_t> cost(groups * bands);
  for (int64_t t = 0; t < groups * bands; ++t) {
    const int64_t grp = t / bands, b0 = (t % bands) * per_band;
    for (int64_t blk = b0; blk < std::min(blocks, b0 + per_band); ++blk) {
      cost[t] += std::min(per, B - grp * per) * kernel.cost(blk);
    }
  }
  // NaN until written: an element no task stored would poison the sum, never read as 0.
  std::vector<float> rest((groups - 1) * size, std::numeric_limits<float>::quiet_NaN());
  const auto partial = [&](int64_t grp) { return grp == 0 ? sum : rest.data() + (grp - 1) * size; };
  cpu::parallel_over_tasks(cost, [&](int64_t t0, int64_t t1) {
    auto ws = kernel.scratch(per_band);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t grp = t / bands, b0 = (t % bands) * per_band;
      kernel.weighted_sum(grp * per, std::min(B, (grp + 1) * per), b0, std::min(blocks, b0 + per_band), w, ws,
                          partial(grp));
    }
  });
  if (groups == 1) return;
  at::parallel_for(0, size, 4096, [&](int64_t lo, int64_t hi) {
    for (int64_t grp = 1; grp < groups; ++grp) {
      const float* src = partial(grp);
      for (int64_t k = lo; k < hi; ++k) sum[k] += src[k];
    }
  });
}

}  // namespace

at::Tensor linear_sumsq_tiled_cpu(const at::Tensor& a, const at::Tensor& g,
                                  const std::optional<at::Tensor>& scale,
                                  const std::optional<at::Tensor>& shift) {
  const LinearShape s =
      check_linear_sumsq_inputs("linear_sumsq_tiled", a, g, scale, shift, c10::DeviceType::CPU);
  auto out = new_output({s.B}, a.options().dtype(at::kFloat));
  if (s.B == 0) return out;
  if (s.d_in == 0 || s.d_out == 0) return out.zero_();
  const Epilogue ep{shift ? shift->const_data_ptr<float>() : nullptr,
                    scale ? scale->const_data_ptr<float>() : nullptr};
  DPK_DISPATCH_GRAD_TYPES(a.scalar_type(), "linear_sumsq_tiled", [&] {
    const LinearKernel<scalar_t> kernel{a.const_data_ptr<scalar_t>(), g.const_data_ptr<scalar_t>(), s, ep};
    sum_blocks(kernel, s.B, kernel.blocks(), kernel.block_major(a.element_size()), shift.has_value(),
               scale.has_value(), out.data_ptr<float>());
  });
  return out;
}

namespace {

// conv2d_sumsq_tiled's norms into out [B], and with `kept` the per-sample products too.
void conv2d_sumsq_run(const at::Tensor& x, const at::Tensor& g, const ConvShape& c,
                      const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& shift,
                      float* out, float* kept) {
  // shift/scale [O, (c, r, s)] as the kernel's segments read them: [(r, s, c)][O_p], zero past O.
  const int64_t O_p = round_up(c.O, kNR);
  const auto permuted = [&](const std::optional<at::Tensor>& t) {
    return t ? std::optional<at::Tensor>(at::constant_pad_nd(
                   t->view({c.O, c.C, c.kh, c.kw}).permute({2, 3, 1, 0}).reshape({-1, c.O}), {0, O_p - c.O}))
             : std::nullopt;
  };
  const auto shift_p = permuted(shift), scale_p = permuted(scale);
  const Epilogue ep{shift_p ? shift_p->const_data_ptr<float>() : nullptr,
                    scale_p ? scale_p->const_data_ptr<float>() : nullptr};
  DPK_DISPATCH_GRAD_TYPES(x.scalar_type(), "conv2d_sumsq", [&] {
    const DirectConvKernel<scalar_t> kernel{x.const_data_ptr<scalar_t>(), g.const_data_ptr<scalar_t>(), c, ep,
                                            kept};
    sum_blocks(kernel, c.B, kernel.blocks(), false, shift.has_value(), scale.has_value(), out);
  });
}

}  // namespace

at::Tensor linear_sumsq_gram_cpu(const at::Tensor& a, const at::Tensor& g) {
  const LinearShape s =
      check_linear_sumsq_inputs("linear_sumsq_gram", a, g, std::nullopt, std::nullopt, c10::DeviceType::CPU);
  auto out = new_output({s.B}, a.options().dtype(at::kFloat));
  if (s.B == 0) return out;
  if (s.T == 0 || s.d_in == 0 || s.d_out == 0) return out.zero_();
  DPK_DISPATCH_GRAD_TYPES(a.scalar_type(), "linear_sumsq_gram", [&] {
    const GramKernel<scalar_t> kernel{a.const_data_ptr<scalar_t>(), g.const_data_ptr<scalar_t>(), s};
    sum_blocks(kernel, s.B, kernel.blocks(), false, false, false, out.data_ptr<float>());
  });
  return out;
}

at::Tensor linear_sumsq_t1_cpu(const at::Tensor& a, const at::Tensor& g,
                               const std::optional<at::Tensor>& scale,
                               const std::optional<at::Tensor>& shift) {
  constexpr const char* op = "linear_sumsq_t1";
  DPK_CHECK(a.dim() == 2, op, ": a must be 2-D [B, d_in], got ", a.dim(), "-D ", a.sizes());
  DPK_CHECK(g.dim() == 2, op, ": g must be 2-D [B, d_out], got ", g.dim(), "-D ", g.sizes());
  DPK_CHECK(scale.has_value() || shift.has_value(), op,
            ": takes a dense scale, a shift or both (without either the norm is ‖a_i‖²‖g_i‖²)");
  const LinearShape s =
      check_linear_sumsq_inputs(op, a.unsqueeze(1), g.unsqueeze(1), scale, shift, c10::DeviceType::CPU);
  auto out = new_output({s.B}, a.options().dtype(at::kFloat));
  if (s.B == 0) return out;
  if (s.d_in == 0 || s.d_out == 0) return out.zero_();
  const T1Blocks geo{s};
  const float* sc = scale ? scale->const_data_ptr<float>() : nullptr;
  std::vector<float> a_rows(s.B * round_up(s.d_in, kNR));
  if (!shift) {
    std::vector<float> g_panels(round_up(s.B, kMR) * s.d_out);
    DPK_DISPATCH_GRAD_TYPES(a.scalar_type(), op, [&] {
      pack_t1_rows<0>(a.const_data_ptr<scalar_t>(), s.B, s.d_in, true, a_rows.data());
      pack_t1_rows<kMR>(g.const_data_ptr<scalar_t>(), s.B, s.d_out, true, g_panels.data());
    });
    t1_sums(T1SquaresKernel{geo, sc, a_rows.data(), g_panels.data()}, out.data_ptr<float>());
    return out;
  }
  std::vector<float> g_panels(round_up(s.B, kT1ShiftR) * s.d_out);
  DPK_DISPATCH_GRAD_TYPES(a.scalar_type(), op, [&] {
    pack_t1_rows<0>(a.const_data_ptr<scalar_t>(), s.B, s.d_in, false, a_rows.data());
    pack_t1_rows<kT1ShiftR>(g.const_data_ptr<scalar_t>(), s.B, s.d_out, false, g_panels.data());
  });
  const float* sh = shift->const_data_ptr<float>();
  if (scale) {
    t1_sums(T1ShiftKernel<true>{geo, sc, sh, a_rows.data(), g_panels.data()}, out.data_ptr<float>());
  } else {
    t1_sums(T1ShiftKernel<false>{geo, nullptr, sh, a_rows.data(), g_panels.data()}, out.data_ptr<float>());
  }
  return out;
}

at::Tensor conv2d_sumsq_tiled_cpu(const at::Tensor& x, const at::Tensor& g, at::IntArrayRef kernel_size,
                                  at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                                  const std::optional<at::Tensor>& scale,
                                  const std::optional<at::Tensor>& shift) {
  const ConvShape c = check_conv2d_inputs("conv2d_sumsq_tiled", x, g, kernel_size, stride, padding, dilation,
                                          scale, shift, c10::DeviceType::CPU);
  auto out = new_output({c.B}, x.options().dtype(at::kFloat));
  if (c.B == 0) return out;
  if (c.C == 0 || c.O == 0) return out.zero_();
  conv2d_sumsq_run(x, g, c, scale, shift, out.data_ptr<float>(), nullptr);
  return out;
}

TensorPair conv2d_sumsq_grad_sample_cpu(const at::Tensor& x, const at::Tensor& g, at::IntArrayRef kernel_size,
                                        at::IntArrayRef stride, at::IntArrayRef padding,
                                        at::IntArrayRef dilation, const std::optional<at::Tensor>& scale,
                                        const std::optional<at::Tensor>& shift) {
  const ConvShape c = check_conv2d_inputs("conv2d_sumsq_grad_sample", x, g, kernel_size, stride, padding,
                                          dilation, scale, shift, c10::DeviceType::CPU);
  auto out = new_output({c.B}, x.options().dtype(at::kFloat));
  // Stored [B, kh, kw, C, O], the layout of the kernel's tiles; returned as [B, O, C, kh, kw].
  auto kept = new_output({c.B, c.kh, c.kw, c.C, c.O}, out.options());
  if (c.B == 0 || c.C == 0 || c.O == 0) {
    out.zero_();
    kept.zero_();
  } else {
    conv2d_sumsq_run(x, g, c, scale, shift, out.data_ptr<float>(), kept.data_ptr<float>());
  }
  return {out, kept.permute({0, 4, 3, 1, 2})};
}

at::Tensor conv2d_weighted_sum_cpu(const at::Tensor& x, const at::Tensor& g, const at::Tensor& weights,
                                   at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                   at::IntArrayRef padding, at::IntArrayRef dilation) {
  const ConvShape c = check_conv2d_inputs("conv2d_weighted_sum", x, g, kernel_size, stride, padding, dilation,
                                          std::nullopt, std::nullopt, c10::DeviceType::CPU);
  check_sample_weights("conv2d_weighted_sum", weights, x);
  auto out = new_output({c.O, c.C, c.kh, c.kw}, x.options().dtype(at::kFloat));
  if (out.numel() == 0) return out;
  if (c.B == 0) return out.zero_();
  const int64_t O_p = round_up(c.O, kNR);
  auto sum = new_output({c.kh, c.kw, c.C, O_p}, out.options());
  DPK_DISPATCH_GRAD_TYPES(x.scalar_type(), "conv2d_weighted_sum", [&] {
    const DirectConvKernel<scalar_t> kernel{
        x.const_data_ptr<scalar_t>(), g.const_data_ptr<scalar_t>(), c, {}};
    weighted_sum_groups(kernel, c.B, weights.const_data_ptr<float>(), sum.data_ptr<float>());
  });
  // [kh, kw, C, O_p] -> the weight's [O, C, kh, kw].
  out.copy_(sum.narrow(3, 0, c.O).permute({3, 2, 0, 1}));
  return out;
}

}  // namespace dpkernels

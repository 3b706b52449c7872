// CUDA kernels of the per-sample clipping ops (schemas in csrc/ops.cpp, element math in clip_math.h,
// semantics in dpkernels/reference/clip.py).
//
// [note: multi-tensor launches]
// The two streaming ops cut every parameter of one storage dtype into fixed-size chunks and cover all
// of them with one launch, as apex's multi_tensor_apply and ATen's fused optimizers do. The tensor
// metadata travels by value in the kernel arguments (a __grid_constant__ struct, read through the
// constant cache): no host-to-device copy, no host sync, and the launches can be captured in a CUDA
// graph. When a table fills up the launcher flushes it and starts another, so a parameter may straddle
// two launches; that is why each slot records the chunk of its parameter that it starts at.
//
// [note: determinism]
// per_sample_sumsq writes one fp64 partial per (sample, chunk) into a [B, num_chunks] buffer, and a
// second kernel sums the contiguous chunk range of each parameter in a fixed order. weighted_sum gives
// every output element to one thread, which walks the samples in order. No atomics anywhere, so both
// results are bitwise reproducible from run to run.
//
// [note: private epilogue]
// clip_pipeline's sum pass is weighted_sum with an epilogue on the value each thread writes: out = (S + ν) *
// scale, ν = std * z(g) for the global flat index g of the element over the parameter list (docs/RNG.md), or
// the pre-drawn noise tensor's element. The same kernel template serves both ops: its kPrivate = false
// instantiation is the plain weighted sum, which never reads the epilogue. Philox mode generates the
// noise in registers as the result is written, so it never exists in memory (DESIGN.md §3). Secure mode
// (kChacha, docs/RNG.md §6) is its own instantiation, so that the Philox and plain variants carry none of
// its registers: out = float(double(S) + std * z) * scale with the float64 ChaCha20 normal z.
//
// [note: alignment]
// A parameter takes the 128-bit path when every row of every gradient set (and shift/scale) starts on
// a 16-byte boundary: 16-byte aligned base pointers and a per-sample numel that is a multiple of the
// vector width. Chunk starts are multiples of the vector width too, so on that path a thread's vector
// is either entirely inside the parameter or entirely past its end, and no tail loop is needed. Any
// other parameter takes a scalar path in which thread t reads elements t, t + blockDim, ..., which is
// just as coalesced, only with 4-byte or 2-byte transactions per thread.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "dpkernels/chacha20.h"
#include "dpkernels/clip_layout.h"
#include "dpkernels/clip_math.h"
#include "dpkernels/dispatch.h"
#include "dpkernels/noise_key.h"
#include "dpkernels/philox.h"
#include "launch_args.cuh"

namespace dpkernels {
namespace {

constexpr int kMaxSlots = kLargeKernelArgs ? 320 : 40;     // parameter slices per launch
constexpr int kMaxPtrs = kLargeKernelArgs ? 640 : 80;      // gradient pointers per launch (k per slot)
constexpr int kMaxBlocks = kLargeKernelArgs ? 4096 : 512;  // chunks per launch
constexpr int kMaxRanges =
    kLargeKernelArgs ? 3072 : 448;  // parameters per reduction launch; also clip bounds
// Gradient sets (DP-PMLF's k) per call; their coefficients ride in every launch's arguments.
constexpr int kMaxSets = 64;

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// per_sample_sumsq: one block reduces a chunk of kSumsqSteps block-wide 128-bit steps (16 KiB of a
// row) for kSumsqSamples samples at once. The samples of a block share every shift/scale load, and
// their rows are the loads a thread keeps in flight.
constexpr int kSumsqThreads = 256;
constexpr int kSumsqSteps = 4;
constexpr int kSumsqSamples = 4;
// Resident blocks per SM that the register budget must allow (<= 85 registers). By Little's law an
// SM needs about 20 KiB of loads in flight to stream at full HBM bandwidth on H100 (3.35 TB/s x
// ~0.8 us / 132 SMs); 768 threads x 64 bytes is 48 KiB. An estimate, not a measurement.
constexpr int kSumsqMinBlocks = 3;
// weighted_sum: one block owns kWsumThreads vectors of columns and walks all B rows. Small blocks,
// so that a model of a few million parameters still yields enough blocks to fill the GPU.
constexpr int kWsumThreads = 128;
// Rows in flight per thread, 16 bytes each.
constexpr int kWsumRows = 4;
// Resident blocks per SM that the register budget must allow (<= 64 registers): 1024 threads x 64
// bytes in flight.
constexpr int kWsumMinBlocks = 8;
constexpr int kReduceThreads = 256;
constexpr int kClipThreads = 256;

// Elements per 128-bit load.
constexpr int ilp(int64_t itemsize) { return static_cast<int>(16 / itemsize); }
constexpr int64_t sumsq_chunk(int64_t itemsize) {
  return int64_t{kSumsqThreads} * ilp(itemsize) * kSumsqSteps;
}
constexpr int64_t wsum_chunk(int64_t itemsize) { return int64_t{kWsumThreads} * ilp(itemsize); }

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------------------------
// Kernel argument tables (see [note: multi-tensor launches]).
// ---------------------------------------------------------------------------------------------

// Launch-wide chunk table shared by the two streaming kernels. Chunk b of a launch (blockIdx.y of
// per_sample_sumsq, blockIdx.x of weighted_sum) is chunk first_chunk[s] + (b - first_block[s]) of the
// parameter in slot s = block_slot[b].
struct SlotTable {
  const void* grads[kMaxPtrs];      // slot s, gradient set j at [s * k + j]; [B, numel] each
  int64_t numel[kMaxSlots];         // elements per sample
  int32_t param[kMaxSlots];         // parameter index l: column of the outputs and of weights
  int32_t first_block[kMaxSlots];   // first chunk b of the launch that belongs to the slot
  int32_t first_chunk[kMaxSlots];   // chunk of the parameter that first_block covers
  uint8_t vec_ok[kMaxSlots];        // see [note: alignment]
  uint16_t block_slot[kMaxBlocks];  // slot of each chunk b of the launch
  float alpha[kMaxSets];            // coefficients of the gradient sets, in fp32 like the math
  int32_t k;
};
static_assert(kMaxSlots <= std::numeric_limits<uint16_t>::max() && kMaxPtrs >= kMaxSets);
// per_sample_sumsq puts the chunks of a launch on gridDim.y.
static_assert(kMaxBlocks <= 65535);

struct SumsqArgs {
  SlotTable tab;
  const float* shift[kMaxSlots];  // null unless the kernel is instantiated with kShift
  const float* scale[kMaxSlots];
  int64_t chunk_base;  // column of the partial buffer that chunk b = 0 of the launch writes
};

struct WsumArgs {
  SlotTable tab;
  float* out[kMaxSlots];
  // Read by the private epilogue only (see [note: private epilogue]).
  int64_t offset[kMaxSlots];      // global flat index of the parameter's first element
  const float* noise[kMaxSlots];  // pre-drawn noise of the parameter, or null
};

// What weighted_sum_kernel does with a finished accumulator, by value in the kernel arguments; the
// CUDA twin of SumEpilogue in csrc/cpu/clip.cpp. kNone is the plain weighted sum.
enum class SumMode : int32_t { kNone, kScale, kNoise, kPhilox, kChacha };
struct SumEpilogue {
  uint64_t seed = 0;              // Philox key
  float std = 0.f;                // kPhilox: ν = std * z(global index)
  float scale = 1.f;              // out = (S + ν) * scale
  uint32_t step = 0, stream = 0;  // Philox counter words 2 and 3
  SumMode mode = SumMode::kNone;
  // kChacha: device array of the 8 key words, step, stream and the float64 std (low, high word); in
  // memory because the key does not fit the scalar argument budget.
  const uint32_t* chacha = nullptr;
};

// Parameters first_param .. first_param + count - 1; the chunks of parameter first_param + e are
// columns begin[e] .. begin[e] + len[e] - 1 of the partial buffer.
struct RangeArgs {
  int32_t begin[kMaxRanges];
  int32_t len[kMaxRanges];
  int32_t first_param;
  int32_t count;
};

// Clip bounds of columns first .. first + count - 1.
struct BoundArgs {
  double bound[kMaxRanges];
  int32_t first;
  int32_t count;
};

static_assert(sizeof(SumsqArgs) + kScalarArgBytes <= kArgBytes);
static_assert(sizeof(WsumArgs) + kScalarArgBytes <= kArgBytes);
// weighted_sum_kernel's scalar arguments: weights, B, L and the epilogue.
static_assert(3 * sizeof(int64_t) + sizeof(SumEpilogue) <= kScalarArgBytes);
static_assert(sizeof(RangeArgs) + kScalarArgBytes <= kArgBytes);
static_assert(sizeof(BoundArgs) + kScalarArgBytes <= kArgBytes);

// ---------------------------------------------------------------------------------------------
// Device helpers.
// ---------------------------------------------------------------------------------------------

template <typename T>
struct alignas(16) Vec16 {
  T v[16 / sizeof(T)];
};

// Loads the N elements that a thread owns from offset c of p (a chunk), widened to fp32. kVec: N
// consecutive elements as 128-bit loads (p + c aligned, and c < len implies c + N <= len). Otherwise
// elements c, c + kStride, ..., so that a warp reads consecutive addresses. Offsets at or past len
// read as 0. Offsets are 32-bit (a chunk is small); the 64-bit part of the address is in p.
template <int N, bool kVec, int kStride, typename T>
__device__ __forceinline__ void load_elems(const T* p, int c, int len, float (&x)[N]) {
  if constexpr (kVec) {
    constexpr int kPer = 16 / sizeof(T);
    static_assert(N % kPer == 0);
    if (c < len) {
#pragma unroll
      for (int q = 0; q < N / kPer; ++q) {
        const Vec16<T> raw = *reinterpret_cast<const Vec16<T>*>(p + c + q * kPer);
#pragma unroll
        for (int e = 0; e < kPer; ++e) x[q * kPer + e] = static_cast<float>(raw.v[e]);
      }
    } else {
#pragma unroll
      for (int e = 0; e < N; ++e) x[e] = 0.f;
    }
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) x[e] = c + e * kStride < len ? static_cast<float>(p[c + e * kStride]) : 0.f;
  }
}

// Whether element e of the group that load_elems read from offset c lies before len.
template <bool kVec, int kStride>
__device__ __forceinline__ bool in_range(int c, int e, int len) {
  return kVec ? c < len : c + e * kStride < len;
}

template <typename T>
__device__ __forceinline__ const T* grad_row(const SlotTable& tab, int s, int j, int64_t row_offset) {
  return static_cast<const T*>(tab.grads[s * tab.k + j]) + row_offset;
}

// Fixed shuffle tree, so the rounding of the sum does not depend on timing.
__device__ __forceinline__ double warp_sum(double x) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off /= 2) x += __shfl_down_sync(kFullMask, x, off);
  return x;
}

// ---------------------------------------------------------------------------------------------
// per_sample_sumsq
// ---------------------------------------------------------------------------------------------

// Block-wide sums of x[0 .. S-1], valid in thread 0.
template <int kThreads, int S>
__device__ __forceinline__ void block_sums(double (&x)[S]) {
  constexpr int kWarps = kThreads / kWarp;
  __shared__ double warp_sums[S][kWarps];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
  for (int q = 0; q < S; ++q) {
    x[q] = warp_sum(x[q]);
    if (lane == 0) warp_sums[q][warp] = x[q];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int q = 0; q < S; ++q) x[q] = warp_sum(lane < kWarps ? warp_sums[q][lane] : 0.0);
  }
}

// acc[q] = Σ over the elements this thread owns in the chunk [start, start + len[q]) of row
// i0 + q of slot s, of shift_scale(Σ_j α_j g_j)². len[q] is 0 for a row past the batch. Combination
// and shift/scale in fp32, as on every backend. The square is taken in fp64: the square of an fp32
// value is exact there and cannot overflow, and it costs the same one conversion and one fp64
// instruction per element as squaring in fp32 and adding in fp64.
template <typename T, bool kShift, bool kScale, bool kVec>
__device__ __forceinline__ void sumsq_thread(const SumsqArgs& a, int s, int64_t n, int64_t start, int64_t i0,
                                             const int (&len)[kSumsqSamples], double (&acc)[kSumsqSamples]) {
  // Elements per thread and step: one 128-bit vector, or on the scalar path half as many single
  // loads, so that S rows of them fit in the same registers.
  constexpr int N = kVec ? ilp(sizeof(T)) : ilp(sizeof(T)) / 2;
  constexpr int S = kSumsqSamples;
  constexpr int kStride = kVec ? 1 : kSumsqThreads;
  constexpr int kStep = kSumsqThreads * N;
  const int k = a.tab.k;
  const float alpha0 = a.tab.alpha[0];
  int64_t offset[S];
#pragma unroll
  for (int q = 0; q < S; ++q) offset[q] = (i0 + q) * n + start;
  const float* shift = kShift ? a.shift[s] + start : nullptr;
  const float* scale = kScale ? a.scale[s] + start : nullptr;
  const int first = kVec ? static_cast<int>(threadIdx.x) * N : static_cast<int>(threadIdx.x);
  // Block-uniform trip count: a short chunk stops after the steps it needs. Not unrolled: the S
  // rows already keep S loads per thread in flight, and unrolling would multiply the registers.
#pragma unroll 1
  for (int c = first; c - first < len[0]; c += kStep) {
    float v[S][N];
#pragma unroll
    for (int q = 0; q < S; ++q) {
      load_elems<N, kVec, kStride>(grad_row<T>(a.tab, s, 0, offset[q]), c, len[q], v[q]);
#pragma unroll
      for (int e = 0; e < N; ++e) v[q][e] *= alpha0;
    }
#pragma unroll 1
    for (int j = 1; j < k; ++j) {
      const float aj = a.tab.alpha[j];
#pragma unroll
      for (int q = 0; q < S; ++q) {
        float x[N];
        load_elems<N, kVec, kStride>(grad_row<T>(a.tab, s, j, offset[q]), c, len[q], x);
#pragma unroll
        for (int e = 0; e < N; ++e) v[q][e] = fmaf(aj, x[e], v[q][e]);
      }
    }
    float sh[N], sc[N];
    if constexpr (kShift) load_elems<N, kVec, kStride>(shift, c, len[0], sh);
    if constexpr (kScale) load_elems<N, kVec, kStride>(scale, c, len[0], sc);
#pragma unroll
    for (int q = 0; q < S; ++q) {
#pragma unroll
      for (int e = 0; e < N; ++e) {
        // Out-of-range lanes hold 0, but (0 - shift) * scale need not be 0.
        if (in_range<kVec, kStride>(c, e, len[q])) {
          const double y = shift_scale<kShift, kScale>(v[q][e], kShift ? sh[e] : 0.f, kScale ? sc[e] : 1.f);
          acc[q] = fma(y, y, acc[q]);
        }
      }
    }
  }
}

// partial[i, chunk_base + b] = Σ_{e in chunk b} shift_scale(Σ_j α_j g_j[i, e], shift[e], scale[e])²
// in fp64, for chunk b = blockIdx.y and the kSumsqSamples samples i of blockIdx.x. Samples vary
// fastest over the grid, so the blocks that reread one chunk of shift/scale run close together
// and find it in L2.
template <typename T, bool kShift, bool kScale>
__global__ void __launch_bounds__(kSumsqThreads, kSumsqMinBlocks)
    per_sample_sumsq_kernel(const __grid_constant__ SumsqArgs a, int64_t B, int64_t num_chunks,
                            double* __restrict__ partial) {
  constexpr int64_t kChunk = sumsq_chunk(sizeof(T));
  constexpr int S = kSumsqSamples;
  const int s = a.tab.block_slot[blockIdx.y];
  const int64_t n = a.tab.numel[s];
  const int64_t start =
      int64_t{a.tab.first_chunk[s] + static_cast<int32_t>(blockIdx.y) - a.tab.first_block[s]} * kChunk;
  const int64_t i0 = int64_t{blockIdx.x} * S;
  int len[S];
#pragma unroll
  for (int q = 0; q < S; ++q) len[q] = i0 + q < B ? static_cast<int>(std::min(kChunk, n - start)) : 0;
  double acc[S];
#pragma unroll
  for (int q = 0; q < S; ++q) acc[q] = 0.0;
  if (a.tab.vec_ok[s]) {
    sumsq_thread<T, kShift, kScale, true>(a, s, n, start, i0, len, acc);
  } else {
    sumsq_thread<T, kShift, kScale, false>(a, s, n, start, i0, len, acc);
  }
  block_sums<kSumsqThreads>(acc);
  if (threadIdx.x == 0) {
    double* out = partial + i0 * num_chunks + a.chunk_base + blockIdx.y;
#pragma unroll
    for (int q = 0; q < S; ++q) {
      if (len[q] > 0) out[q * num_chunks] = acc[q];
    }
  }
}

// out[i, l] = Σ_{c < len} partial[i, begin + c] for l = first_param + e: one warp per (i, e), lanes
// striding over the chunks, then a fixed shuffle tree.
__global__ void __launch_bounds__(kReduceThreads)
    sumsq_reduce_kernel(const __grid_constant__ RangeArgs a, int64_t B, int64_t L, int64_t num_chunks,
                        const double* __restrict__ partial, double* __restrict__ out) {
  const int64_t w = (int64_t{blockIdx.x} * kReduceThreads + threadIdx.x) / kWarp;
  if (w >= B * a.count) return;  // whole warps leave, so the shuffles below see full warps
  const int lane = threadIdx.x % kWarp;
  const int64_t i = w / a.count;
  const int e = static_cast<int>(w - i * a.count);
  const double* p = partial + i * num_chunks + a.begin[e];
  double acc = 0.0;
  for (int c = lane; c < a.len[e]; c += kWarp) acc += p[c];
  acc = warp_sum(acc);
  if (lane == 0) out[i * L + a.first_param + e] = acc;
}

// ---------------------------------------------------------------------------------------------
// weighted_sum
// ---------------------------------------------------------------------------------------------

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
__device__ __forceinline__ void wsum_rows(const SlotTable& tab, int s, int64_t n, int64_t start, int col,
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
__device__ __forceinline__ void wsum_combined(const SlotTable& tab, int s, int64_t n, int64_t start, int col,
                                              int len, int64_t i0, const int* row, const float* w, int count,
                                              float (&acc)[ilp(sizeof(T))]) {
  constexpr int N = ilp(sizeof(T));
  constexpr int kStride = kVec ? 1 : kWsumThreads;
#pragma unroll 1
  for (int m = 0; m < count; ++m) {
    const int64_t off = (i0 + row[m]) * n + start;
    float v[N];
    load_elems<N, kVec, kStride>(grad_row<T>(tab, s, 0, off), col, len, v);
#pragma unroll
    for (int e = 0; e < N; ++e) v[e] *= tab.alpha[0];
#pragma unroll 1
    for (int j = 1; j < tab.k; ++j) {
      float x[N];
      load_elems<N, kVec, kStride>(grad_row<T>(tab, s, j, off), col, len, x);
      const float aj = tab.alpha[j];
#pragma unroll
      for (int e = 0; e < N; ++e) v[e] = fmaf(aj, x[e], v[e]);
    }
#pragma unroll
    for (int e = 0; e < N; ++e) acc[e] = fmaf(w[m], v[e], acc[e]);
  }
}

// acc += Σ_{m < count} w[m] Σ_j α_j g_j[i0 + row[m], ...], U rows at a time.
template <typename T, bool kVec>
__device__ __forceinline__ void wsum_tile(const SlotTable& tab, int s, int64_t n, int64_t start, int col,
                                          int len, int64_t i0, const int* row, const float* w, int count,
                                          float (&acc)[ilp(sizeof(T))]) {
  if (tab.k != 1 || tab.alpha[0] != 1.f) {
    wsum_combined<T, kVec>(tab, s, n, start, col, len, i0, row, w, count, acc);
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
__device__ __forceinline__ void chacha_epilogue(const WsumArgs& a, const SumEpilogue& ep, int s,
                                                int64_t start, int col, int len, float (&acc)[N]) {
  constexpr int kStride = kVec ? 1 : kWsumThreads;
  ChachaKey key;
#pragma unroll
  for (int i = 0; i < 8; ++i) key.k[i] = __ldg(ep.chacha + i);
  key.step = __ldg(ep.chacha + 8);
  key.stream = __ldg(ep.chacha + 9);
  const double std64 =
      __hiloint2double(static_cast<int>(__ldg(ep.chacha + 11)), static_cast<int>(__ldg(ep.chacha + 10)));
  const uint64_t g0 = static_cast<uint64_t>(a.offset[s] + start + col);
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
__device__ __forceinline__ void private_epilogue(const WsumArgs& a, const SumEpilogue& ep, int s,
                                                 int64_t start, int col, int len, float (&acc)[N]) {
  constexpr int kStride = kVec ? 1 : kWsumThreads;
  if (ep.mode == SumMode::kPhilox) {
    // Global index of the thread's first element.
    const uint64_t g0 = static_cast<uint64_t>(a.offset[s] + start + col);
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
    load_elems<N, kVec, kStride>(a.noise[s] + start, col, len, nu);
#pragma unroll
    for (int e = 0; e < N; ++e) acc[e] = (acc[e] + nu[e]) * ep.scale;
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) acc[e] *= ep.scale;
  }
}

// S_l[c] = Σ_{i : w[i, l] != 0} Σ_j (w[i, l] α_j) g_j[i, c] for the columns c of chunk b =
// blockIdx.x, accumulated in fp32 in (sample, set) order and written once. Grid (chunks).
// kPrivate: written through the epilogue ep instead (see [note: private epilogue]); without it ep is
// not read and the kernel is the plain weighted sum.
template <typename T, bool kPrivate, bool kChacha = false>
__global__ void __launch_bounds__(kWsumThreads, kWsumMinBlocks)
    weighted_sum_kernel(const __grid_constant__ WsumArgs a, const float* __restrict__ weights, int64_t B,
                        int64_t L, const SumEpilogue ep) {
  constexpr int N = ilp(sizeof(T));
  constexpr int64_t kChunk = wsum_chunk(sizeof(T));
  __shared__ int row[kWsumThreads];
  __shared__ float w[kWsumThreads];
  __shared__ int warp_counts[kWsumThreads / kWarp];
  const int s = a.tab.block_slot[blockIdx.x];
  const int64_t n = a.tab.numel[s];
  const int l = a.tab.param[s];
  const bool vec = a.tab.vec_ok[s] != 0;
  const int64_t start =
      int64_t{a.tab.first_chunk[s] + static_cast<int32_t>(blockIdx.x) - a.tab.first_block[s]} * kChunk;
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
        wsum_tile<T, true>(a.tab, s, n, start, col, len, i0, row, w, count, acc);
      } else {
        wsum_tile<T, false>(a.tab, s, n, start, col, len, i0, row, w, count, acc);
      }
    }
  }
  if constexpr (kChacha) {
    if (col < len) {
      if (vec) {
        chacha_epilogue<N, true>(a, ep, s, start, col, len, acc);
      } else {
        chacha_epilogue<N, false>(a, ep, s, start, col, len, acc);
      }
    }
  } else if constexpr (kPrivate) {
    if (col < len) {
      if (vec) {
        private_epilogue<N, true>(a, ep, s, start, col, len, acc);
      } else {
        private_epilogue<N, false>(a, ep, s, start, col, len, acc);
      }
    }
  }
  float* out = a.out[s] + start;
  if (vec) {
    if (col < len) {
#pragma unroll
      for (int q = 0; q < N / 4; ++q) {
        *reinterpret_cast<float4*>(out + col + 4 * q) =
            make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]);
      }
    }
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) {
      if (col + e * kWsumThreads < len) out[col + e * kWsumThreads] = acc[e];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// clip_factors
// ---------------------------------------------------------------------------------------------

// out[i, c] = weight_of_norm(mode, norms[i, c], bound[c - first], r) over rows i and the columns
// first .. first + count - 1 of a row-major [rows, L] tensor.
template <typename T>
__global__ void __launch_bounds__(kClipThreads)
    clip_factors_kernel(const __grid_constant__ BoundArgs a, const T* __restrict__ norms, T* __restrict__ out,
                        int64_t rows, int64_t L, ClipMode mode, double r) {
  const int64_t total = rows * a.count;
  for (int64_t e = int64_t{blockIdx.x} * kClipThreads + threadIdx.x; e < total;
       e += int64_t{gridDim.x} * kClipThreads) {
    const int64_t i = e / a.count;
    const int c = static_cast<int>(e - i * a.count);
    const int64_t idx = i * L + a.first + c;
    out[idx] = weight_of_norm<T>(mode, norms[idx], a.bound[c], r);
  }
}

// Stage 2 of clip_pipeline, one thread per sample: clip_sample_weights (clip_math.h) on row i
// of the [B, L] sums of squares; ok[i] = 0 marks a sample with a non-finite gradient.
__global__ void __launch_bounds__(kClipThreads)
    sample_weights_kernel(const double* __restrict__ sumsq, int64_t B, int64_t L, bool per_layer,
                          ClipMode mode, const double* __restrict__ bounds, double r, double norm_scale,
                          float* __restrict__ w, float* __restrict__ norms, uint8_t* __restrict__ ok) {
  const int64_t i = int64_t{blockIdx.x} * kClipThreads + threadIdx.x;
  if (i >= B) return;
  ok[i] = clip_sample_weights(sumsq + i * L, static_cast<int>(L), per_layer, mode, bounds, r, norm_scale,
                              w + i * L, norms + i * (per_layer ? L : 1));
}

// ---------------------------------------------------------------------------------------------
// Host side.
// ---------------------------------------------------------------------------------------------

// The storage dtypes in the order their launches go out. The chunk numbering of per_sample_sumsq
// follows this order, so it is fixed for a given list of shapes and dtypes.
constexpr std::array<at::ScalarType, 3> kGradTypes = {at::kFloat, at::kHalf, at::kBFloat16};

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// check_clip_inputs checks the device type only; one kernel reads all tensors, so they must share
// one device.
void check_one_device(at::TensorList grads, at::TensorList shift, at::TensorList scale) {
  const c10::Device dev = grads[0].device();
  for (size_t t = 0; t < grads.size(); ++t) {
    DPK_CHECK(grads[t].device() == dev, "grads[", t, "] is on ", grads[t].device(), " but grads[0] is on ",
              dev);
  }
  for (size_t t = 0; t < shift.size(); ++t) {
    DPK_CHECK(shift[t].device() == dev, "shift[", t, "] is on ", shift[t].device(), ", expected ", dev);
  }
  for (size_t t = 0; t < scale.size(); ++t) {
    DPK_CHECK(scale[t].device() == dev, "scale[", t, "] is on ", scale[t].device(), ", expected ", dev);
  }
}

void check_num_sets(int64_t k) {
  DPK_CHECK(k <= kMaxSets, "the cuda kernels combine at most ", kMaxSets, " gradient sets, got ", k);
}

// Parameter indices of each entry of kGradTypes, in parameter order.
std::array<std::vector<int64_t>, kGradTypes.size()> group_by_dtype(at::TensorList grads, int64_t L) {
  std::array<std::vector<int64_t>, kGradTypes.size()> groups;
  for (int64_t l = 0; l < L; ++l) {
    const auto it = std::find(kGradTypes.begin(), kGradTypes.end(), grads[l].scalar_type());
    TORCH_INTERNAL_ASSERT(it != kGradTypes.end());  // check_clip_inputs admits these three only
    groups[it - kGradTypes.begin()].push_back(l);
  }
  return groups;
}

// Whether all k gradient tensors of parameter l can take the 128-bit path.
bool grads_vec_ok(at::TensorList grads, const ClipLayout& lay, int64_t l) {
  if (lay.numel[l] % ilp(grads[l].element_size()) != 0) return false;
  for (int64_t j = 0; j < lay.k; ++j) {
    if (!aligned16(grads[j * lay.L + l].const_data_ptr())) return false;
  }
  return true;
}

// Packs the chunks of params (one dtype, in order) into argument tables like ATen's
// multi_tensor_apply: fill(args, slot, l) sets what is specific to the op, launch(args, num_blocks)
// runs whenever a table is full and once at the end.
template <typename Args, typename Fill, typename Launch>
void for_each_launch(Args& args, const ClipLayout& lay, const std::vector<int64_t>& params, int64_t chunk,
                     const Fill& fill, const Launch& launch) {
  SlotTable& tab = args.tab;
  const int max_slots = static_cast<int>(std::min<int64_t>(kMaxSlots, kMaxPtrs / lay.k));
  int slots = 0, blocks = 0;
  const auto flush = [&] {
    if (blocks > 0) launch(args, blocks);
    slots = 0;
    blocks = 0;
  };
  for (const int64_t l : params) {
    const int64_t chunks = ceil_div(lay.numel[l], chunk);
    for (int64_t c = 0; c < chunks;) {
      if (slots == max_slots) flush();
      const int take = static_cast<int>(std::min<int64_t>(chunks - c, kMaxBlocks - blocks));
      fill(args, slots, l);
      tab.numel[slots] = lay.numel[l];
      tab.param[slots] = static_cast<int32_t>(l);
      tab.first_block[slots] = blocks;
      tab.first_chunk[slots] = static_cast<int32_t>(c);
      std::fill(tab.block_slot + blocks, tab.block_slot + blocks + take, static_cast<uint16_t>(slots));
      blocks += take;
      c += take;
      ++slots;
      if (blocks == kMaxBlocks) flush();
    }
  }
  flush();
}

void set_coeffs(SlotTable& tab, at::ArrayRef<double> coeffs) {
  tab.k = static_cast<int32_t>(coeffs.size());
  for (size_t j = 0; j < coeffs.size(); ++j) tab.alpha[j] = static_cast<float>(coeffs[j]);
}

template <typename F>
void dispatch_shift_scale(bool has_shift, bool has_scale, const F& f) {
  using Y = std::true_type;
  using N = std::false_type;
  if (has_shift) {
    has_scale ? f(Y{}, Y{}) : f(Y{}, N{});
  } else {
    has_scale ? f(N{}, Y{}) : f(N{}, N{});
  }
}

// Every check of the clipping ops' inputs, once per call: the layout, one device, the set count.
ClipLayout check_cuda_inputs(at::TensorList grads, at::ArrayRef<double> coeffs, at::TensorList shift,
                             at::TensorList scale) {
  ClipLayout lay = check_clip_inputs(grads, coeffs, shift, scale, c10::DeviceType::CUDA);
  check_one_device(grads, shift, scale);
  check_num_sets(lay.k);
  return lay;
}

// The norms pass over inputs already checked into lay: [B, L] float64 sums of squares.
at::Tensor sumsq_pass(at::TensorList grads, at::ArrayRef<double> coeffs, at::TensorList shift,
                      at::TensorList scale, const ClipLayout& lay) {
  const c10::cuda::CUDAGuard guard(grads[0].device());
  const auto opts = grads[0].options().dtype(at::kDouble);
  const auto groups = group_by_dtype(grads, lay.L);

  // Global chunk numbering: dtype groups in kGradTypes order, parameters in order within a group,
  // chunks in order within a parameter; for_each_launch emits them in exactly this order.
  std::vector<int64_t> chunk_begin(lay.L), chunk_len(lay.L);
  int64_t num_chunks = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    const int64_t chunk = sumsq_chunk(c10::elementSize(kGradTypes[g]));
    for (const int64_t l : groups[g]) {
      chunk_begin[l] = num_chunks;
      chunk_len[l] = ceil_div(lay.numel[l], chunk);
      num_chunks += chunk_len[l];
    }
  }
  if (lay.B == 0 || num_chunks == 0) return at::zeros({lay.B, lay.L}, opts);
  DPK_CHECK(num_chunks <= std::numeric_limits<int32_t>::max(), "too many elements per sample: ", num_chunks,
            " chunks");

  // Both are written in full (new_output poisons them under the test suite, which would expose a
  // missed partial as a NaN sum).
  auto partial = new_output({lay.B, num_chunks}, opts);
  auto out = new_output({lay.B, lay.L}, opts);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool has_shift = !shift.empty(), has_scale = !scale.empty();
  const int64_t sample_groups = ceil_div(lay.B, kSumsqSamples);
  DPK_CHECK(sample_groups <= std::numeric_limits<int32_t>::max(), "batch too large: ", lay.B);

  SumsqArgs args{};
  set_coeffs(args.tab, coeffs);
  int64_t launched = 0;  // chunks covered by the launches so far
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].empty()) continue;
    DPK_DISPATCH_GRAD_TYPES(kGradTypes[g], "per_sample_sumsq", [&] {
      dispatch_shift_scale(has_shift, has_scale, [&](auto shift_tag, auto scale_tag) {
        constexpr bool kShift = decltype(shift_tag)::value, kScale = decltype(scale_tag)::value;
        const auto fill = [&](SumsqArgs& a, int slot, int64_t l) {
          bool ok = grads_vec_ok(grads, lay, l);
          for (int64_t j = 0; j < lay.k; ++j)
            a.tab.grads[slot * lay.k + j] = grads[j * lay.L + l].const_data_ptr();
          a.shift[slot] = kShift ? shift[l].const_data_ptr<float>() : nullptr;
          a.scale[slot] = kScale ? scale[l].const_data_ptr<float>() : nullptr;
          ok = ok && (!kShift || aligned16(a.shift[slot])) && (!kScale || aligned16(a.scale[slot]));
          a.tab.vec_ok[slot] = ok;
        };
        const auto launch = [&](SumsqArgs& a, int blocks) {
          a.chunk_base = launched;
          per_sample_sumsq_kernel<scalar_t, kShift, kScale>
              <<<dim3(static_cast<unsigned>(sample_groups), blocks), kSumsqThreads, 0, stream>>>(
                  a, lay.B, num_chunks, partial.data_ptr<double>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          launched += blocks;
        };
        for_each_launch(args, lay, groups[g], sumsq_chunk(sizeof(scalar_t)), fill, launch);
      });
    });
  }
  TORCH_INTERNAL_ASSERT(launched == num_chunks);

  // Every (i, l) is written, including parameters with no elements (an empty range sums to 0).
  RangeArgs ranges{};
  for (int64_t l0 = 0; l0 < lay.L; l0 += kMaxRanges) {
    ranges.first_param = static_cast<int32_t>(l0);
    ranges.count = static_cast<int32_t>(std::min<int64_t>(kMaxRanges, lay.L - l0));
    for (int e = 0; e < ranges.count; ++e) {
      ranges.begin[e] = static_cast<int32_t>(chunk_begin[l0 + e]);
      ranges.len[e] = static_cast<int32_t>(chunk_len[l0 + e]);
    }
    const int64_t blocks = ceil_div(lay.B * ranges.count * kWarp, kReduceThreads);
    DPK_CHECK(blocks <= std::numeric_limits<int32_t>::max(), "batch too large: ", lay.B);
    sumsq_reduce_kernel<<<static_cast<unsigned>(blocks), kReduceThreads, 0, stream>>>(
        ranges, lay.B, lay.L, num_chunks, partial.const_data_ptr<double>(), out.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

at::Tensor per_sample_sumsq_cuda(at::TensorList grads, at::ArrayRef<double> coeffs, at::TensorList shift,
                                 at::TensorList scale) {
  return sumsq_pass(grads, coeffs, shift, scale, check_cuda_inputs(grads, coeffs, shift, scale));
}

at::Tensor clip_factors_cuda(const at::Tensor& norms, at::ArrayRef<double> max_grad_norm,
                             c10::string_view mode, double r) {
  DPK_CHECK(norms.is_cuda(), "norms must be a CUDA tensor for the cuda kernel, got ", norms.device());
  const std::vector<double> C = clip_bounds(max_grad_norm, norms);
  const ClipMode m = parse_clip_mode(mode);
  auto out = new_output(norms.sizes(), norms.options());
  if (norms.numel() == 0) return out;
  const c10::cuda::CUDAGuard guard(norms.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t L = static_cast<int64_t>(C.size());
  const bool uniform = std::all_of(C.begin(), C.end(), [&](double c) { return c == C[0]; });
  AT_DISPATCH_FLOATING_TYPES(norms.scalar_type(), "clip_factors", [&] {
    const auto launch = [&](const BoundArgs& a, int64_t rows, int64_t cols) {
      const int64_t blocks = std::min<int64_t>(ceil_div(rows * a.count, kClipThreads), 65535);
      clip_factors_kernel<scalar_t><<<static_cast<unsigned>(blocks), kClipThreads, 0, stream>>>(
          a, norms.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, cols, m, r);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    BoundArgs a{};
    if (uniform) {
      // One bound for every column: the tensor is a single [numel, 1] column.
      a.bound[0] = C[0];
      a.first = 0;
      a.count = 1;
      launch(a, norms.numel(), 1);
      return;
    }
    for (int64_t l0 = 0; l0 < L; l0 += kMaxRanges) {
      a.first = static_cast<int32_t>(l0);
      a.count = static_cast<int32_t>(std::min<int64_t>(kMaxRanges, L - l0));
      std::copy(C.begin() + l0, C.begin() + l0 + a.count, a.bound);
      launch(a, norms.size(0), L);
    }
  });
  return out;
}

// The sum pass over inputs already checked into lay, with the epilogue ep (mode kNone: the plain op).
// noise: empty, or the pre-drawn noise of every parameter (ep.mode == kNoise), already checked by
// clip_pipeline_cuda.
std::vector<at::Tensor> sum_pass(at::TensorList grads, at::ArrayRef<double> coeffs, const at::Tensor& weights,
                                 const SumEpilogue& ep, at::TensorList noise, const ClipLayout& lay) {
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
  // Global flat index of each parameter's first element, in parameter order (docs/RNG.md §1),
  // whatever order the dtype groups are launched in.
  std::vector<int64_t> offset(lay.L);
  int64_t total = 0;
  for (int64_t l = 0; l < lay.L; ++l) {
    const auto shape = grads[l].sizes().slice(1);
    // An empty batch sums to zero; otherwise the kernel writes every element. The private op always
    // runs the kernel: its epilogue applies to an empty sum too.
    out.push_back(lay.B == 0 && !is_private ? at::zeros(shape, opts) : new_output(shape, opts));
    offset[l] = total;
    total += lay.numel[l];
  }
  if (lay.B == 0 && !is_private) return out;

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto groups = group_by_dtype(grads, lay.L);
  WsumArgs args{};
  set_coeffs(args.tab, coeffs);
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].empty()) continue;
    DPK_DISPATCH_GRAD_TYPES(kGradTypes[g], "weighted_sum", [&] {
      const auto fill = [&](WsumArgs& a, int slot, int64_t l) {
        for (int64_t j = 0; j < lay.k; ++j)
          a.tab.grads[slot * lay.k + j] = grads[j * lay.L + l].const_data_ptr();
        a.out[slot] = out[l].data_ptr<float>();
        a.offset[slot] = offset[l];
        a.noise[slot] = noise.empty() ? nullptr : noise[l].const_data_ptr<float>();
        a.tab.vec_ok[slot] = grads_vec_ok(grads, lay, l) && aligned16(a.out[slot]) &&
                             (a.noise[slot] == nullptr || aligned16(a.noise[slot]));
      };
      const auto launch = [&](const WsumArgs& a, int blocks) {
        if (ep.mode == SumMode::kChacha) {
          weighted_sum_kernel<scalar_t, true, true>
              <<<blocks, kWsumThreads, 0, stream>>>(a, weights.const_data_ptr<float>(), lay.B, lay.L, ep);
        } else if (is_private) {
          weighted_sum_kernel<scalar_t, true>
              <<<blocks, kWsumThreads, 0, stream>>>(a, weights.const_data_ptr<float>(), lay.B, lay.L, ep);
        } else {
          weighted_sum_kernel<scalar_t, false>
              <<<blocks, kWsumThreads, 0, stream>>>(a, weights.const_data_ptr<float>(), lay.B, lay.L, ep);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      for_each_launch(args, lay, groups[g], wsum_chunk(sizeof(scalar_t)), fill, launch);
    });
  }
  return out;
}

std::vector<at::Tensor> weighted_sum_cuda(at::TensorList grads, at::ArrayRef<double> coeffs,
                                          const at::Tensor& weights) {
  return sum_pass(grads, coeffs, weights, SumEpilogue{}, {}, check_cuda_inputs(grads, coeffs, {}, {}));
}

// The sum pass's epilogue for a pipeline call (clip_layout.h NoiseSpec). The ChaCha20 key words
// travel in a device array, returned in *table: the caller keeps it alive until after the launch
// (the caching allocator then orders its reuse after the kernel on this stream).
SumEpilogue pipeline_epilogue(const NoiseSpec& spec, bool has_noise, const c10::Device& device,
                              at::Tensor* table) {
  SumEpilogue ep;
  ep.std = static_cast<float>(spec.noise_std);
  ep.scale = static_cast<float>(spec.out_scale);
  // Scale 1 and no noise is the plain weighted sum (the kernel's non-private instantiation).
  ep.mode = spec.out_scale == 1.0 ? SumMode::kNone : SumMode::kScale;
  if (has_noise) {
    ep.mode = SumMode::kNoise;
  } else if (spec.rng == NoiseRng::kPhilox) {
    const NoiseKey key = make_key(spec.key[0], spec.step, spec.stream);
    ep.mode = SumMode::kPhilox;
    ep.seed = key.seed;
    ep.step = key.step;
    ep.stream = key.stream;
  } else if (spec.rng == NoiseRng::kChacha20) {
    const ChachaKey k = make_chacha_key(spec.key, spec.step, spec.stream);
    uint64_t std_bits;
    std::memcpy(&std_bits, &spec.noise_std, sizeof(std_bits));
    std::vector<int32_t> words(k.k, k.k + 8);
    for (const uint32_t v :
         {k.step, k.stream, static_cast<uint32_t>(std_bits), static_cast<uint32_t>(std_bits >> 32)})
      words.push_back(static_cast<int32_t>(v));
    *table = at::tensor(words, at::dtype(at::kInt)).to(device);
    ep.mode = SumMode::kChacha;
    ep.chacha = reinterpret_cast<const uint32_t*>(table->const_data_ptr<int32_t>());
  }
  return ep;
}

// The three stages with the same kernels as the separate ops; the weights never leave the device.
// drop_nonfinite = false copies B flags to the host (one sync, as the reference's check does).
std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor> clip_pipeline_cuda(
    at::TensorList grads, at::ArrayRef<double> coeffs, at::ArrayRef<double> max_grad_norm,
    c10::string_view mode, double r, at::TensorList shift, at::TensorList scale, bool per_layer,
    bool drop_nonfinite, double norm_scale, c10::string_view rng, double noise_std, at::IntArrayRef key,
    int64_t step, int64_t stream, double out_scale, at::TensorList noise) {
  const ClipMode m = parse_clip_mode(mode);
  const NoiseSpec spec = parse_noise_spec(rng, noise_std, key, step, stream, out_scale);
  const ClipLayout lay = check_cuda_inputs(grads, coeffs, shift, scale);
  if (!noise.empty()) check_noise_list(noise, grads, lay);
  const at::Tensor sumsq = sumsq_pass(grads, coeffs, shift, scale, lay);
  const std::vector<double> bounds = pipeline_bounds(max_grad_norm, per_layer, lay.L);
  const c10::cuda::CUDAGuard guard(sumsq.device());
  const auto opts = sumsq.options().dtype(at::kFloat);
  auto weights = new_output({lay.B, lay.L}, opts);
  auto norms = per_layer ? new_output({lay.B, lay.L}, opts) : new_output({lay.B}, opts);
  if (lay.B > 0) {
    const at::Tensor dev_bounds = at::tensor(bounds, at::dtype(at::kDouble)).to(sumsq.device());
    const at::Tensor ok = at::empty({lay.B}, opts.dtype(at::kByte));
    sample_weights_kernel<<<static_cast<unsigned>(ceil_div(lay.B, kClipThreads)), kClipThreads, 0,
                            at::cuda::getCurrentCUDAStream()>>>(
        sumsq.const_data_ptr<double>(), lay.B, lay.L, per_layer, m, dev_bounds.const_data_ptr<double>(), r,
        norm_scale, weights.data_ptr<float>(), norms.data_ptr<float>(), ok.data_ptr<uint8_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (!drop_nonfinite) check_nonfinite(ok.cpu().const_data_ptr<uint8_t>(), lay.B);
  }
  at::Tensor table;
  const SumEpilogue ep = pipeline_epilogue(spec, !noise.empty(), sumsq.device(), &table);
  return {sum_pass(grads, coeffs, weights, ep, noise, lay), norms, weights};
}

}  // namespace

TORCH_LIBRARY_IMPL(dpkernels_C, CUDA, m) {
  m.impl("per_sample_sumsq", &per_sample_sumsq_cuda);
  m.impl("clip_factors", &clip_factors_cuda);
  m.impl("weighted_sum", &weighted_sum_cuda);
  m.impl("clip_pipeline", &clip_pipeline_cuda);
}

}  // namespace dpkernels

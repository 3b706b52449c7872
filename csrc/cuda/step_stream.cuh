// The streaming skeleton of the element-wise multi-tensor CUDA kernels that run filter.h's step on
// Philox noise: linear_filter_ (filter.cu) and the fused optimizer steps (optim.cu), on the driver of
// multi_tensor.cuh.
//
// [note: stream work items]
// As the noise kernels (see [note: noise work items] in noise.cu): one thread owns one Philox block
// of the global index, i.e. 4 consecutive elements of one tensor (a work unit of 4 elements, see
// [note: chunk grid] in multi_tensor.cuh), generates their 4 normals in registers when noise is on,
// and moves every tensor it touches as an F4 (4 fp32 lanes): one access per tensor and thread (16
// bytes for fp32, 8 for fp16/bf16) when the slot is aligned (every pointer 16-byte aligned and the
// tensor's first element on a Philox block boundary), else element by element. A tensor whose global
// elements are [e0, e0 + n) owns Philox blocks e0 / 4 .. (e0 + n + 3) / 4 - 1; the thread of block b
// handles the tensor's local elements i0 = 4b - e0 .. i0 + 3, of which those outside [0, n) belong to
// the neighbouring tensors (they read as 0 and are not written). A block shared by two tensors is
// generated once per tensor.
//
// [note: stream launches]
// All tensors of one storage dtype go in one launch through a __grid_constant__ StreamTable (see
// [note: multi-tensor launches] in multi_tensor.cuh): a slot's pointers are one tensor of each list
// (e.g. inputs, outputs, state buffer k), as many slots per launch as the table holds. The Philox
// blocks of a tensor are cut into chunks of kStreamChunk blocks (one CUDA block runs a chunk, thread t
// taking blocks t, t + kStreamThreads, ...), and the grid is one wave of resident blocks striding over
// the chunks.
//
// [note: stream rounding]
// Rn (and so F4) multiplies, divides and adds with __fmul_rn/__fdiv_rn/__fadd_rn, so nvcc does not
// contract them into FMAs: every product and sum is rounded as in the reference and the CPU kernels
// (compiled without contraction). The math headers (filter.h, optim_math.h) are called with T = F4
// (the filter) or T = Rn (the family math, one lane at a time).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dpkernels/noise_key.h"
#include "dpkernels/philox.h"
#include "multi_tensor.cuh"

namespace dpkernels {
namespace {

constexpr int kStreamThreads = 256;
constexpr int kStreamIters = 4;  // Philox blocks per thread and chunk
constexpr int64_t kStreamChunk = int64_t{kStreamThreads} * kStreamIters;
using StreamChunks = Chunking<4 * kStreamChunk, 4>;
// Tensors and pointers per launch, within the kernel-argument budget (each kernel static_asserts
// its whole parameter list).
using StreamTable = TensorTable<kLargeKernelArgs ? 256 : 24, kLargeKernelArgs ? 1536 : 144>;

// Width of a slot whose pointers are row[0 .. lists) and whose element 0 is global element e0.
inline int stream_width(const void* const* row, int lists, int64_t e0) {
  return e0 % 4 == 0 && all_aligned(row, lists, 16) ? 4 : 1;
}

// One fp32 value with separately rounded operations (see [note: stream rounding]).
struct Rn {
  float v;
  Rn() = default;
  __device__ explicit Rn(float x) : v(x) {}
  __device__ friend Rn operator+(Rn a, Rn b) { return Rn(__fadd_rn(a.v, b.v)); }
  __device__ friend Rn operator-(Rn a, Rn b) { return Rn(__fsub_rn(a.v, b.v)); }
  __device__ friend Rn operator*(Rn a, Rn b) { return Rn(__fmul_rn(a.v, b.v)); }
  __device__ friend Rn operator/(Rn a, Rn b) { return Rn(__fdiv_rn(a.v, b.v)); }
  __device__ friend bool operator<(Rn a, Rn b) { return a.v < b.v; }
  __device__ friend bool operator>(Rn a, Rn b) { return a.v > b.v; }
  __device__ friend Rn sqrt(Rn a) { return Rn(__fsqrt_rn(a.v)); }
};

// Four lanes of Rn.
struct F4 {
  Rn v[4];
  F4() = default;
  __device__ explicit F4(float s) : v{Rn(s), Rn(s), Rn(s), Rn(s)} {}
  __device__ friend F4 operator+(const F4& a, const F4& b) {
    F4 r;
#pragma unroll
    for (int j = 0; j < 4; ++j) r.v[j] = a.v[j] + b.v[j];
    return r;
  }
  __device__ friend F4 operator*(const F4& a, const F4& b) {
    F4 r;
#pragma unroll
    for (int j = 0; j < 4; ++j) r.v[j] = a.v[j] * b.v[j];
    return r;
  }
};

// 4 elements of T at p + i0 (lanes outside [0, n) read as 0 / are not written). vec: one access of
// 4 elements, p + i0 aligned to it.
template <typename T>
__device__ __forceinline__ F4 load4(const T* p, int64_t i0, int64_t n, bool vec) {
  float x[4];
  if (vec) {
    load_vec<4>(p + i0, x);
  } else {
    load_tail<4, 1, true>(p, i0, n, x);
  }
  F4 r;
#pragma unroll
  for (int j = 0; j < 4; ++j) r.v[j] = Rn(x[j]);
  return r;
}

template <typename T>
__device__ __forceinline__ void store4(T* p, int64_t i0, int64_t n, bool vec, const F4& x) {
  T v[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] = static_cast<T>(x.v[j].v);
  if (vec) {
    store_vec<4>(p + i0, v);
  } else {
    store_tail<4, 1, true>(p, i0, n, v);
  }
}

// The 4 standard normals of Philox block `block` (docs/RNG.md).
__device__ __forceinline__ F4 philox_normals(const NoiseKey& key, uint64_t block) {
  const Philox4 w = philox4x32_10(block, key.step, key.stream, key.seed);
  float z[4];
  box_muller(w.x[0], w.x[1], z[0], z[1]);
  box_muller(w.x[2], w.x[3], z[2], z[3]);
  F4 r;
#pragma unroll
  for (int j = 0; j < 4; ++j) r.v[j] = Rn(z[j]);
  return r;
}

// The 4 elements of one thread's Philox block in one slot: local indices i0 .. i0 + 3 of a tensor of
// n elements (see [note: stream work items]); list j's tensor is reached through load/store.
struct BlockRef {
  const StreamTable& tab;
  int slot;
  int64_t i0, n;
  bool vec;

  template <typename T>
  __device__ __forceinline__ F4 load(int list) const {
    return load4(tab.tensor<const T>(slot, list), i0, n, vec);
  }
  template <typename T>
  __device__ __forceinline__ void store(int list, const F4& x) const {
    store4(tab.tensor<T>(slot, list), i0, n, vec, x);
  }
  // Whether lane j is an element of this tensor.
  __device__ __forceinline__ bool owns(int j) const { return vec || in_tensor<true>(i0 + j, n); }
};

// Runs body(BlockRef, Philox block) on every Philox block of the launch, then chunk_done(c) once per
// chunk c, by every thread of the CUDA block (so it may synchronise the block).
template <typename Body, typename ChunkDone>
__device__ __forceinline__ void stream_blocks(const StreamTable& tab, int64_t num_chunks, const Body& body,
                                              const ChunkDone& chunk_done) {
  StreamChunks::for_each_chunk(tab, num_chunks, [&](int64_t c, const ChunkRef& ch) {
    const bool aligned = ch.width != 1;  // aligned slots have lead 0
    StreamChunks::for_each_unit<kStreamThreads>(ch, [&](int64_t i0, uint64_t block) {
      body(BlockRef{tab, ch.slot, i0, ch.numel, aligned && i0 + 4 <= ch.numel}, block);
    });
    chunk_done(c);
  });
}

}  // namespace
}  // namespace dpkernels

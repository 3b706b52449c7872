// The streaming skeleton of the element-wise multi-tensor CUDA kernels that run filter.h's step on
// Philox noise: linear_filter_ (filter.cu) and the fused optimizer steps (optim.cu).
//
// [note: stream work items]
// As the noise kernels (see [note: noise work items] in noise.cu): one thread owns one Philox block
// of the global index, i.e. 4 consecutive elements of one tensor, generates their 4 normals in
// registers when noise is on, and moves every tensor it touches as an F4 (4 fp32 lanes): one access
// per tensor and thread (16 bytes for fp32, 8 for fp16/bf16) when the slot is aligned (every pointer
// 16-byte aligned and the tensor's first element on a Philox block boundary), else element by
// element. A tensor whose global elements are [e0, e0 + n) owns Philox blocks e0 / 4 ..
// (e0 + n + 3) / 4 - 1; thread u of the tensor handles block e0 / 4 + u, i.e. its local elements
// i0 = 4u - e0 % 4 .. i0 + 3, of which those outside [0, n) belong to the neighbouring tensors
// (they read as 0 and are not written). A block shared by two tensors is generated once per tensor.
//
// [note: stream launches]
// All tensors of one storage dtype go in one launch through a __grid_constant__ StreamTable: the
// tensors' pointers come as lists (list j of slot s at ptr[j * count + s]: e.g. inputs, outputs,
// state buffer k), as many slots per launch as the table holds. The Philox blocks of a tensor are cut
// into chunks of kStreamChunk blocks (one CUDA block runs a chunk, thread t taking blocks t, t +
// kStreamThreads, ...); a CUDA block finds the tensor of its chunk by a binary search over the
// slots' first chunks, and the grid is one wave of resident blocks striding over the chunks.
//
// [note: stream rounding]
// Rn (and so F4) multiplies, divides and adds with __fmul_rn/__fdiv_rn/__fadd_rn, so nvcc does not
// contract them into FMAs: every product and sum is rounded as in the reference and the CPU kernels
// (compiled without contraction). The math headers (filter.h, optim_math.h) are called with T = F4
// (the filter) or T = Rn (the family math, one lane at a time).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <type_traits>
#include <vector>

#include "dpkernels/macros.h"
#include "dpkernels/noise_key.h"
#include "dpkernels/philox.h"
#include "launch_args.cuh"

namespace dpkernels {
namespace {

constexpr int kStreamThreads = 256;
constexpr int kStreamIters = 4;  // Philox blocks per thread and chunk
constexpr int64_t kStreamChunk = int64_t{kStreamThreads} * kStreamIters;
// Tensors and pointers per launch, within the kernel-argument budget (each kernel static_asserts
// its whole parameter list).
constexpr int kStreamSlots = kLargeKernelArgs ? 256 : 24;
constexpr int kStreamPtrs = kLargeKernelArgs ? 1536 : 144;

struct StreamTable {
  void* ptr[kStreamPtrs];  // list j of slot s at ptr[j * count + s]; nullptr for a list not passed
  int64_t numel[kStreamSlots];
  int64_t elem0[kStreamSlots];
  int64_t first_chunk[kStreamSlots];
  int32_t count;
  uint8_t aligned[kStreamSlots];  // slot s takes whole-vector accesses; see [note: stream work items]
};

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
// 4 elements (16 bytes for fp32, 8 for 16-bit types), p + i0 aligned to it.
template <typename T>
using Raw4 = std::conditional_t<sizeof(T) == 4, uint4, uint2>;

template <typename T>
__device__ __forceinline__ F4 load4(const T* p, int64_t i0, int64_t n, bool vec) {
  F4 x(0.f);
  if (vec) {
    const Raw4<T> r = *reinterpret_cast<const Raw4<T>*>(p + i0);
    T v[4];
    memcpy(v, &r, sizeof(r));
#pragma unroll
    for (int j = 0; j < 4; ++j) x.v[j] = Rn(static_cast<float>(v[j]));
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (i0 + j >= 0 && i0 + j < n) x.v[j] = Rn(static_cast<float>(p[i0 + j]));
    }
  }
  return x;
}

// The 4 lanes rounded to T, as the bits of one vector access.
template <typename T>
__device__ __forceinline__ Raw4<T> pack4(const F4& x) {
  if constexpr (sizeof(T) == 4) {
    return make_uint4(__float_as_uint(x.v[0].v), __float_as_uint(x.v[1].v), __float_as_uint(x.v[2].v),
                      __float_as_uint(x.v[3].v));
  } else {
    uint32_t h[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) h[j] = static_cast<T>(x.v[j].v).x;  // c10::Half / c10::BFloat16 bits
    return make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
  }
}

template <typename T>
__device__ __forceinline__ void store4(T* p, int64_t i0, int64_t n, bool vec, const F4& x) {
  if (vec) {
    // __stwb (st.global.wb, the default caching) keeps it one access: nvcc splits a plain aggregate
    // store into scalar ones when the element-wise path of the same call stores to the same place.
    __stwb(reinterpret_cast<Raw4<T>*>(p + i0), pack4<T>(x));
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (i0 + j >= 0 && i0 + j < n) p[i0 + j] = static_cast<T>(x.v[j].v);
    }
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
    return load4(static_cast<const T*>(tab.ptr[list * tab.count + slot]), i0, n, vec);
  }
  template <typename T>
  __device__ __forceinline__ void store(int list, const F4& x) const {
    store4(static_cast<T*>(tab.ptr[list * tab.count + slot]), i0, n, vec, x);
  }
  // Whether lane j is an element of this tensor.
  __device__ __forceinline__ bool owns(int j) const { return vec || (i0 + j >= 0 && i0 + j < n); }
};

// Runs body(BlockRef, Philox block) on every Philox block of the launch, then chunk_done(c) once per
// chunk c, by every thread of the CUDA block (so it may synchronise the block).
template <typename Body, typename ChunkDone>
__device__ __forceinline__ void stream_blocks(const StreamTable& tab, int64_t num_chunks, const Body& body,
                                              const ChunkDone& chunk_done) {
  for (int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const int slot = find_chunk_slot(tab.first_chunk, tab.count, c);
    const int64_t n = tab.numel[slot], e0 = tab.elem0[slot];
    const bool aligned = tab.aligned[slot] != 0;
    const uint64_t first_block = static_cast<uint64_t>(e0) / 4;
    const int64_t lead = e0 % 4;
    const int64_t u0 = (c - tab.first_chunk[slot]) * kStreamChunk + threadIdx.x;
#pragma unroll 1
    for (int it = 0; it < kStreamIters; ++it) {
      const int64_t u = u0 + int64_t{it} * kStreamThreads;
      const int64_t i0 = 4 * u - lead;
      if (i0 >= n) break;
      const bool vec = aligned && i0 + 4 <= n;  // aligned slots have lead == 0
      body(BlockRef{tab, slot, i0, n, vec}, first_block + static_cast<uint64_t>(u));
    }
    chunk_done(c);
  }
}

// ---------------------------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------------------------

// A tensor's share of the work: numel > 0 elements from global index elem0; ptrs[j] is its tensor
// of list j (nullptr when the list is not passed).
struct StreamItem {
  std::vector<void*> ptrs;
  int64_t numel, elem0;
  bool aligned;
};

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline StreamItem make_stream_item(std::vector<void*> ptrs, int64_t numel, int64_t elem0) {
  bool aligned = elem0 % 4 == 0;
  for (const void* p : ptrs) aligned = aligned && (p == nullptr || aligned16(p));
  return {std::move(ptrs), numel, elem0, aligned};
}

// Chunks of one item: its Philox blocks e0 / 4 .. (e0 + n + 3) / 4 - 1, kStreamChunk per chunk.
inline int64_t stream_chunks(const StreamItem& it) {
  const int64_t blocks = (it.elem0 + it.numel + 3) / 4 - it.elem0 / 4;
  return (blocks + kStreamChunk - 1) / kStreamChunk;
}

// Packs the items (each with `lists` pointers) into tables and calls launch(tab, num_chunks,
// chunk_base) once per table; chunk_base counts the chunks of the tables before, so the chunks of
// all launches are numbered 0 .. Σ stream_chunks(item) - 1 in item order.
template <typename Launch>
void for_each_stream_table(const std::vector<StreamItem>& items, int lists, const Launch& launch) {
  DPK_CHECK(lists <= kStreamPtrs, "too many tensor lists for one launch: ", lists);
  const int max_count = std::min(kStreamSlots, kStreamPtrs / lists);
  int64_t base = 0;
  size_t next = 0;
  while (next < items.size()) {
    const int count = static_cast<int>(std::min<size_t>(max_count, items.size() - next));
    StreamTable tab{};
    tab.count = count;
    int64_t chunks = 0;
    for (int sl = 0; sl < count; ++sl) {
      const StreamItem& it = items[next + sl];
      for (int j = 0; j < lists; ++j) tab.ptr[j * count + sl] = it.ptrs[j];
      tab.numel[sl] = it.numel;
      tab.elem0[sl] = it.elem0;
      tab.aligned[sl] = it.aligned ? 1 : 0;
      tab.first_chunk[sl] = chunks;
      chunks += stream_chunks(it);
    }
    launch(tab, chunks, base);
    base += chunks;
    next += count;
  }
}

// The storage dtypes of the streamed tensors; one launch (or table sequence) per dtype.
constexpr std::array<at::ScalarType, 3> kStreamTypes = {at::kFloat, at::kHalf, at::kBFloat16};

inline size_t stream_type_index(at::ScalarType t) {
  return static_cast<size_t>(std::find(kStreamTypes.begin(), kStreamTypes.end(), t) - kStreamTypes.begin());
}

// One wave of resident blocks of `kernel`, at most `chunks`.
template <typename Kernel>
unsigned stream_grid(Kernel kernel, int64_t chunks) {
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kStreamThreads, 0));
  const int64_t max_grid =
      int64_t{at::cuda::getCurrentDeviceProperties()->multiProcessorCount} * std::max(1, per_sm);
  return static_cast<unsigned>(std::min(chunks, max_grid));
}

// The device of the first tensor of the lists; every tensor must be on it.
inline c10::Device common_device(std::initializer_list<at::TensorList> lists) {
  const at::Tensor* first = nullptr;
  for (const at::TensorList& l : lists) {
    for (const at::Tensor& t : l) {
      if (first == nullptr) first = &t;
      DPK_CHECK(t.device() == first->device(), "all tensors must be on ", first->device(), ", got one on ",
                t.device());
    }
  }
  DPK_CHECK(first != nullptr, "no tensors");
  return first->device();
}

}  // namespace
}  // namespace dpkernels

// The multi-tensor driver of the CUDA kernels, in the spirit of apex's multi_tensor_apply: every op
// that runs over a list of tensors (the clipping passes in clip_norms.cu and clip_sum.cu, the noise of
// noise.cu, and the streaming steps of filter.cu and optim.cu through step_stream.cuh) cuts its tensors
// into chunks, packs them into kernel-argument tables and launches them through this file.
//
// [note: multi-tensor launches]
// An op covers all tensors of one storage dtype with as few launches as it can. The tensor metadata
// travels by value in the kernel arguments (a __grid_constant__ TensorTable, read through the constant
// cache): no host-to-device copy, no host sync, and the launches can be captured in a CUDA graph. A
// table row (a slot) holds one tensor of each of the op's lists (e.g. a parameter, its sum and its
// state buffers). When a table runs out of slots or pointers, or reaches the chunks one launch may
// hold (a grid dimension, for kernels that run one chunk per block), for_each_table launches it and
// starts another, so a tensor may straddle two launches; that is why each slot records which launch
// chunk is chunk 0 of its tensor. Chunks are numbered over all launches of a call in tensor order, so
// the numbering depends only on the tensors and a per-chunk result can be summed in a fixed order.
//
// [note: chunk grid]
// Chunks have a fixed number of elements and sit on a grid of kUnit-element work units aligned to the
// global element index (a unit is e.g. one Philox block of 4 elements, whose normals depend on the
// global index; kUnit = 1 where the index does not matter). A tensor whose element 0 is global element
// e0 starts lead = e0 % kUnit elements into its first unit, which it shares with the tensor before it,
// and its chunk q covers its local elements [q C - lead, (q + 1) C - lead) ∩ [0, n). A block finds the
// slot of its chunk by a binary search over the slots' first chunks, uniform across the block, so the
// table reads are broadcasts from the constant cache.
//
// [note: vector and tail paths]
// The op sets each slot's width from the alignment of its tensors: how many consecutive elements a
// thread may move with whole vector accesses (1: element by element only). On the vector path
// (load_vec / store_vec) a thread moves groups of elements that lie wholly inside the tensor with
// accesses of up to 128 bits; on the tail path (load_tail / store_tail) it moves them one by one,
// masked to [0, n), which is how a misaligned tensor and the ragged ends of a tensor are reached.
// Wide stores go through __stwb (st.global.wb, the default caching, written out): nvcc keeps its
// width, while a plain store of the same values on the tail path of the same call could be merged
// with it into scalar ones.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <vector>

#include "dpkernels/dispatch.h"
#include "dpkernels/macros.h"

namespace dpkernels {
namespace {

// ---------------------------------------------------------------------------------------------
// Kernel-argument budget.
// ---------------------------------------------------------------------------------------------

// Drivers of CUDA 12.1+ accept 32 KiB of kernel arguments on Volta and newer; like ATen
// (MultiTensorApply.cuh) we rely on it only in CUDA 13 builds and stay under 4 KiB otherwise.
#if defined(CUDART_VERSION) && CUDART_VERSION >= 13000
constexpr bool kLargeKernelArgs = true;
constexpr size_t kArgBytes = 32764;
#else
constexpr bool kLargeKernelArgs = false;
constexpr size_t kArgBytes = 4096;
#endif
// Room left for the scalar arguments that follow the tables in a kernel's parameter list.
constexpr size_t kScalarArgBytes = 64;

// ---------------------------------------------------------------------------------------------
// Tables and chunks (see [note: multi-tensor launches] and [note: chunk grid]).
// ---------------------------------------------------------------------------------------------

// Up to S slots and P pointers; a launch uses min(S, P / lists) slots. Each kernel static_asserts that
// its whole parameter list fits kArgBytes.
template <int S, int P>
struct TensorTable {
  static constexpr int kSlots = S, kPtrs = P;
  // Slot s's tensor of list j at [j * count + s]; null for a list the call does not pass.
  const void* ptr[P];
  int64_t numel[S];        // elements of the slot's tensor (all of them, when it straddles launches)
  int64_t elem0[S];        // global index of its element 0
  int64_t first_chunk[S];  // launch chunk that is its chunk 0: negative when earlier launches ran some
  int32_t index[S];        // its position in the op's lists
  uint8_t width[S];        // see [note: vector and tail paths]
  int32_t count;

  template <typename T>
  __device__ __forceinline__ T* tensor(int slot, int list) const {
    return static_cast<T*>(const_cast<void*>(ptr[list * count + slot]));
  }
  // Slot s's tensor of list first + j, for a j that varies at run time: the index is summed with the
  // run-time part last, which ptxas allocates in fewer registers.
  template <typename T>
  __device__ __forceinline__ T* tensor(int slot, int first, int j) const {
    return static_cast<T*>(const_cast<void*>(ptr[first * count + slot + j * count]));
  }
};

// The slot of launch chunk c: the last s < count with first_chunk[s] <= c. Slot 0 holds chunk 0 and
// every slot holds a chunk, so first_chunk is increasing from slot 1 on (the search never reads
// first_chunk[0], which is negative for a tensor that straddles launches).
template <int S, int P>
__device__ __forceinline__ int find_slot(const TensorTable<S, P>& tab, int64_t c) {
  if constexpr (S == 1) {
    return 0;
  } else {
    int lo = 0, hi = tab.count - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (tab.first_chunk[mid] <= c) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    return lo;
  }
}

// One chunk of a launch, as a kernel sees it.
struct ChunkRef {
  int slot;
  int64_t chunk;  // its number among the chunks of the slot's tensor
  int64_t numel;  // elements of the slot's tensor
  int64_t elem0;  // global index of the tensor's element 0
  int width;
};

// An op's chunking: kChunk elements per chunk on a grid of kUnit-element units (see [note: chunk grid]).
template <int64_t kChunk, int kUnit = 1>
struct Chunking {
  static_assert(kChunk % kUnit == 0);
  static constexpr int64_t kElems = kChunk;

  // Chunks of a tensor of n > 0 elements whose element 0 is global element e0.
  static constexpr int64_t count(int64_t n, int64_t e0) { return (e0 % kUnit + n + kChunk - 1) / kChunk; }

  template <typename Table>
  __device__ __forceinline__ static ChunkRef locate(const Table& tab, int64_t c) {
    const int s = find_slot(tab, c);
    return {s, c - tab.first_chunk[s], tab.numel[s], tab.elem0[s], tab.width[s]};
  }

  // Local index of the chunk's first element: negative (-lead) in a tensor's first chunk.
  __device__ __forceinline__ static int64_t start(const ChunkRef& ch) {
    return ch.chunk * kChunk - ch.elem0 % kUnit;
  }

  // f(c, chunk) for the launch chunks blockIdx.x, blockIdx.x + gridDim.x, ... < num_chunks (a grid of
  // one_wave blocks).
  template <typename Table, typename F>
  __device__ __forceinline__ static void for_each_chunk(const Table& tab, int64_t num_chunks, const F& f) {
    for (int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) f(c, locate(tab, c));
  }

  // f(i0, u) for the units of the chunk that this thread of kThreads owns: units t, t + kThreads, ...,
  // so that a warp reaches consecutive addresses; i0 is the local index of the unit's first element
  // (negative for a unit shared with the tensor before) and u its global unit number.
  template <int kThreads, typename F>
  __device__ __forceinline__ static void for_each_unit(const ChunkRef& ch, const F& f) {
    constexpr int64_t kUnits = kChunk / kUnit;
    static_assert(kUnits % kThreads == 0);
    // Tensor-local unit u starts at local element kUnit u - lead and is global unit first + u.
    const uint64_t first = static_cast<uint64_t>(ch.elem0) / kUnit;
    const int64_t lead = ch.elem0 % kUnit;
    const int64_t u0 = ch.chunk * kUnits + threadIdx.x;
#pragma unroll 1
    for (int it = 0; it < kUnits / kThreads; ++it) {
      const int64_t u = u0 + int64_t{it} * kThreads;
      const int64_t i0 = kUnit * u - lead;
      if (i0 >= ch.numel) break;  // u only grows with it
      f(i0, first + static_cast<uint64_t>(u));
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Element access (see [note: vector and tail paths]).
// ---------------------------------------------------------------------------------------------

template <int kBytes>
struct RawVec;
template <>
struct RawVec<16> {
  using type = uint4;
};
template <>
struct RawVec<8> {
  using type = uint2;
};
template <>
struct RawVec<4> {
  using type = unsigned int;
};

// Whether index j of a group lies in the tensor [0, n): the same test spelled two ways, because ptxas
// allocates registers differently around them. kHead (the streaming kernels, whose first unit may begin
// before element 0) compares with both bounds; otherwise (the clipping kernels) one unsigned comparison
// covers both. Either spelling costs the other kind of kernel registers.
template <bool kHead, typename I>
__device__ __forceinline__ bool in_tensor(I j, I n) {
  if constexpr (kHead) {
    return j >= 0 && j < n;
  } else {
    return static_cast<std::make_unsigned_t<I>>(j) < static_cast<std::make_unsigned_t<I>>(n);
  }
}

// x[e] = p[e], e < N, widened to float, as N / W accesses of W elements (p aligned to W elements).
template <int W, int N, typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&x)[N]) {
  static_assert(N % W == 0 && W * sizeof(T) <= 16);
  if constexpr (W == 1) {
#pragma unroll
    for (int e = 0; e < N; ++e) x[e] = static_cast<float>(p[e]);
  } else {
    using Raw = typename RawVec<W * sizeof(T)>::type;
#pragma unroll
    for (int q = 0; q < N / W; ++q) {
      const Raw r = *reinterpret_cast<const Raw*>(p + q * W);
      T v[W];
      memcpy(v, &r, sizeof(Raw));
#pragma unroll
      for (int e = 0; e < W; ++e) x[q * W + e] = static_cast<float>(v[e]);
    }
  }
}

// p[e] = v[e], e < N, as N / W accesses of W elements (p aligned to W elements).
template <int W, int N, typename T>
__device__ __forceinline__ void store_vec(T* p, const T (&v)[N]) {
  static_assert(N % W == 0 && W * sizeof(T) <= 16);
  if constexpr (W == 1) {
#pragma unroll
    for (int e = 0; e < N; ++e) p[e] = v[e];
  } else {
    using Raw = typename RawVec<W * sizeof(T)>::type;
#pragma unroll
    for (int q = 0; q < N / W; ++q) {
      Raw r;
      memcpy(&r, v + q * W, sizeof(Raw));
      __stwb(reinterpret_cast<Raw*>(p + q * W), r);
    }
  }
}

// x[e] = p[i + e * kStride] where that index lies in the tensor (in_tensor<kHead>), else 0; widened
// to float.
template <int N, int kStride, bool kHead, typename T, typename I>
__device__ __forceinline__ void load_tail(const T* p, I i, I n, float (&x)[N]) {
#pragma unroll
  for (int e = 0; e < N; ++e) {
    const I j = i + e * kStride;
    x[e] = in_tensor<kHead>(j, n) ? static_cast<float>(p[j]) : 0.f;
  }
}

// p[i + e * kStride] = v[e] where that index lies in the tensor (in_tensor<kHead>).
template <int N, int kStride, bool kHead, typename T, typename I>
__device__ __forceinline__ void store_tail(T* p, I i, I n, const T (&v)[N]) {
#pragma unroll
  for (int e = 0; e < N; ++e) {
    const I j = i + e * kStride;
    if (in_tensor<kHead>(j, n)) p[j] = v[e];
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.
// ---------------------------------------------------------------------------------------------

// One nonempty tensor of an op's lists: index (its position), numel > 0, elem0 (global index of its
// element 0).
struct TensorRef {
  int64_t index, numel, elem0;
};

// The nonempty tensors of a list in order, the global index running from offset over all of them
// (empty ones included; docs/RNG.md §1).
inline std::vector<TensorRef> tensor_refs(const std::vector<int64_t>& numel, int64_t offset) {
  std::vector<TensorRef> refs;
  for (size_t l = 0; l < numel.size(); ++l) {
    if (numel[l] > 0) refs.push_back({static_cast<int64_t>(l), numel[l], offset});
    offset += numel[l];
  }
  return refs;
}

// The storage dtypes in the order their launches go out; the chunk numbering of a call follows it.
constexpr std::array<at::ScalarType, 3> kStorageTypes = {at::kFloat, at::kHalf, at::kBFloat16};
using TypeGroups = std::array<std::vector<TensorRef>, kStorageTypes.size()>;

// refs by storage dtype (type_of(index), one of kStorageTypes), in order within each.
template <typename TypeOf>
TypeGroups group_by_type(const std::vector<TensorRef>& refs, const TypeOf& type_of) {
  TypeGroups groups;
  for (const TensorRef& t : refs) {
    const auto it = std::find(kStorageTypes.begin(), kStorageTypes.end(), type_of(t.index));
    TORCH_INTERNAL_ASSERT(it != kStorageTypes.end());  // the ops' checks admit these only
    groups[it - kStorageTypes.begin()].push_back(t);
  }
  return groups;
}

template <typename T>
struct TypeTag {
  using type = T;
};

// f(TypeTag<T>, refs) for each nonempty group in kStorageTypes order, T its storage type.
template <typename F>
void for_each_type(const TypeGroups& groups, const F& f) {
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].empty()) continue;
    DPK_DISPATCH_GRAD_TYPES(kStorageTypes[g], "multi_tensor", [&] { f(TypeTag<scalar_t>{}, groups[g]); });
  }
}

// Whether every pointer (null: a list not passed) is aligned to `bytes`.
inline bool all_aligned(const void* const* ptrs, int count, size_t bytes) {
  return std::all_of(ptrs, ptrs + count,
                     [bytes](const void* p) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; });
}

// No cap on the chunks of one launch: for kernels that stride over their chunks.
constexpr int64_t kAnyChunks = std::numeric_limits<int64_t>::max();

// Packs the chunks of tensors (in order, kChunks's chunking) into Tables with `lists` pointers per slot
// and launches them: fill(row, tensor) writes the slot's `lists` pointers to row and returns its width;
// launch(table, chunks, chunk_base) runs whenever a table is full (slots, pointers, or max_chunks
// chunks) and once at the end, chunk_base numbering its chunks after those of the launches before.
// Returns the number of chunks.
template <typename Chunks, typename Table, typename Fill, typename Launch>
int64_t for_each_table(const std::vector<TensorRef>& tensors, int lists, int64_t max_chunks, const Fill& fill,
                       const Launch& launch) {
  DPK_CHECK(lists >= 1 && lists <= Table::kPtrs, "too many tensor lists for one launch: ", lists);
  const int max_slots = std::min(Table::kSlots, Table::kPtrs / lists);
  Table tab{};
  // The rows as fill writes them, slot-major; the table is list-major (the kernels index it with a
  // list number that is mostly a constant, which ptxas handles in fewer registers).
  std::vector<const void*> rows(static_cast<size_t>(max_slots) * lists);
  int64_t base = 0, chunks = 0;
  const auto flush = [&] {
    if (chunks > 0) {
      for (int s = 0; s < tab.count; ++s) {
        for (int j = 0; j < lists; ++j) tab.ptr[j * tab.count + s] = rows[s * lists + j];
      }
      launch(static_cast<const Table&>(tab), chunks, base);
    }
    base += chunks;
    chunks = 0;
    tab.count = 0;
  };
  for (const TensorRef& t : tensors) {
    const int64_t total = Chunks::count(t.numel, t.elem0);
    for (int64_t done = 0; done < total;) {
      if (tab.count == max_slots) flush();
      const int s = tab.count++;
      const int64_t take = std::min(total - done, max_chunks - chunks);
      tab.numel[s] = t.numel;
      tab.elem0[s] = t.elem0;
      tab.first_chunk[s] = chunks - done;
      tab.index[s] = static_cast<int32_t>(t.index);
      tab.width[s] = static_cast<uint8_t>(fill(&rows[s * lists], t));
      chunks += take;
      done += take;
      if (chunks == max_chunks) flush();
    }
  }
  flush();
  return base;
}

// Grid of one wave of resident blocks of `kernel`, at most `chunks`: every block strides over the
// same number of chunks (give or take one), where a partial second wave would double the time of the
// blocks in it.
template <typename Kernel>
unsigned one_wave(Kernel kernel, int threads, int64_t chunks) {
  int per_sm = 0;
  C10_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, /*dynamicSMemSize=*/0));
  const int64_t max_grid =
      int64_t{at::cuda::getCurrentDeviceProperties()->multiProcessorCount} * std::max(1, per_sm);
  return static_cast<unsigned>(std::min(chunks, max_grid));
}

// The device of the first tensor of the lists; every tensor must be on it (one kernel reads them all).
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

// CUDA kernels of dpkernels' counter-based noise (spec: docs/RNG.md; math: philox.h; semantics:
// dpkernels/reference/noise.py; the CPU kernels of the same ops are csrc/cpu/noise.cpp).
//
// [note: noise work items]
// One thread computes one Philox block: the 4 words (philox_uint32_) or the 4 Box-Muller normals
// (gaussian_fill_, add_gaussian_noise_) of global elements 4b .. 4b + 3, and writes those of them that
// lie in its tensor. A tensor whose global elements are [e0, e0 + n) owns Philox blocks e0 / 4 ..
// (e0 + n + 3) / 4 - 1; the first and last of them may be shared with the neighbouring tensors (a
// block can even span several tensors of fewer than 4 elements). A shared block is computed once per
// tensor that holds part of it, and each computation writes its own tensor's part only, so each
// element gets the normal of its own global index whatever the tensor boundaries. That costs at
// most one extra Philox block per tensor boundary.
//
// [note: noise generators]
// The kernel is templated on the generator (PhiloxGen, ChachaGen): a "block" above is one generator
// call, a work item of elems() elements (4 for Philox; 16 ChaCha20 words or 8 float64 normals in
// secure mode, docs/RNG.md §6), handled one quad of 4 elements at a time with the same access paths.
//
// [note: noise launches]
// The Philox blocks of a tensor are cut into chunks of kNoiseChunk blocks (one CUDA block runs a
// chunk: kNoiseThreads threads, kNoiseIters blocks each, thread t taking t, t + kNoiseThreads, ...,
// so that a warp writes consecutive addresses). add_gaussian_noise_ covers all tensors of one
// storage dtype with one launch, its metadata in a __grid_constant__ table passed by value (see
// [note: multi-tensor launches] in clip.cu); the table holds each tensor's first chunk number, and
// a CUDA block finds the tensor of its chunk by a binary search over them (uniform across the
// block, so the reads are broadcasts from the constant cache). The grid is at most one wave of
// resident blocks that strides over the chunks, so any number of elements takes one launch.
// gaussian_fill_ and philox_uint32_ use the same kernel with a one-entry table.
//
// [note: noise stores]
// A thread whose 4 elements all lie in its tensor moves them with as few accesses as their address
// allows: one access of 4 elements when it is aligned to 4 elements (16 bytes for fp32, 8 for
// fp16/bf16; two 16-byte ones for int64), two of 2 elements when aligned to 2, else 4 scalar ones.
// Alignment is a property of the tensor (its base address and e0 % 4), so it is uniform over a
// tensor and the paths do not diverge inside a warp except at a tensor's first and last block.
//
// [note: noise rounding]
// As on the CPU and in the reference: std is rounded to fp32 once, std * z is rounded to fp32, the
// sum with the fp32 value of the element is rounded to fp32, and the result is rounded once to the
// storage dtype. __fmul_rn/__fadd_rn keep nvcc from contracting the product and the sum into an
// FMA (which rounds once, so it would differ from the reference in the last bit). box_muller() uses
// the precise logf/cosf/sinf/sqrtf; this file must not be built with --use_fast_math.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "dpkernels/chacha20.h"
#include "dpkernels/dispatch.h"
#include "dpkernels/macros.h"
#include "dpkernels/noise_key.h"
#include "dpkernels/philox.h"
#include "launch_args.cuh"

namespace dpkernels {
namespace {

constexpr int kMaxNoiseSlots = kLargeKernelArgs ? 960 : 120;  // tensors per add_gaussian_noise_ launch

constexpr int kNoiseThreads = 256;
// Philox blocks per thread and chunk: a chunk is kNoiseChunk Philox blocks, 4 * kNoiseChunk
// elements (16 KiB of fp32), enough to amortise the chunk's table lookup.
constexpr int kNoiseIters = 4;
constexpr int64_t kNoiseChunk = int64_t{kNoiseThreads} * kNoiseIters;

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

enum class NoiseOp { kWords, kFill, kAdd };

// Tensors of one launch (see [note: noise launches]). Slot s: ptr[s] holds numel[s] > 0 elements,
// element i being global element elem0[s] + i; its chunks are first_chunk[s] .. first_chunk[s + 1] - 1
// (the last slot's end is the kernel's num_chunks argument).
template <int kSlots>
struct NoiseTable {
  void* ptr[kSlots];
  int64_t numel[kSlots];
  int64_t elem0[kSlots];
  int64_t first_chunk[kSlots];
  int32_t count;
};
static_assert(sizeof(NoiseTable<kMaxNoiseSlots>) + kScalarArgBytes <= kArgBytes);

// ---------------------------------------------------------------------------------------------
// Device helpers.
// ---------------------------------------------------------------------------------------------

// Elements per access on the widest path: 4, at most 16 bytes.
template <typename T>
constexpr int max_width() {
  return static_cast<int>(std::min<size_t>(4, 16 / sizeof(T)));
}

// W > 1 elements of T as one access of 32-bit words.
template <int kBytes>
struct RawWords;
template <>
struct RawWords<16> {
  using type = uint4;
};
template <>
struct RawWords<8> {
  using type = uint2;
};
template <>
struct RawWords<4> {
  using type = unsigned int;
};

// p[0 .. 3] as 4 / W accesses of W elements; p is aligned to W elements. The wide accesses go
// through __ldca/__stwb (the default cache policy, written out), whose width the compiler keeps:
// plain stores of the same values on the other paths would otherwise be merged with these into
// scalar ones.
template <int W, typename T>
__device__ __forceinline__ void load4(const T* p, float (&x)[4]) {
  if constexpr (W == 1) {
#pragma unroll
    for (int j = 0; j < 4; ++j) x[j] = static_cast<float>(p[j]);
  } else {
    using Raw = typename RawWords<W * sizeof(T)>::type;
#pragma unroll
    for (int q = 0; q < 4 / W; ++q) {
      const Raw r = __ldca(reinterpret_cast<const Raw*>(p + q * W));
      T v[W];
      memcpy(v, &r, sizeof(Raw));
#pragma unroll
      for (int e = 0; e < W; ++e) x[q * W + e] = static_cast<float>(v[e]);
    }
  }
}

template <int W, typename T>
__device__ __forceinline__ void store4(T* p, const T (&v)[4]) {
  if constexpr (W == 1) {
#pragma unroll
    for (int j = 0; j < 4; ++j) p[j] = v[j];
  } else {
    using Raw = typename RawWords<W * sizeof(T)>::type;
#pragma unroll
    for (int q = 0; q < 4 / W; ++q) {
      Raw r;
      memcpy(&r, v + q * W, sizeof(Raw));
      __stwb(reinterpret_cast<Raw*>(p + q * W), r);
    }
  }
}

// How a thread reaches its 4 elements (see [note: noise stores]).
enum Access : int { kPartial = 0, kScalar = 1, kHalf = 2, kFull = 3 };

// p[i0 .. i0 + 3] for a tensor of n elements; i0 may be negative (down to -3) or near n.
template <typename T>
__device__ __forceinline__ int access_of(const T* p, int64_t i0, int64_t n) {
  constexpr int kW = max_width<T>();
  if (i0 < 0 || i0 + 4 > n) return kPartial;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p + i0);
  if (a % (kW * sizeof(T)) == 0) return kFull;
  if (kW == 4 && a % (2 * sizeof(T)) == 0) return kHalf;
  return kScalar;
}

// The slot whose chunks include chunk c: the last s < count with first_chunk[s] <= c. first_chunk is
// strictly increasing (every slot has at least one chunk) and first_chunk[0] = 0.
template <int kSlots>
__device__ __forceinline__ int find_slot(const NoiseTable<kSlots>& tab, int64_t c) {
  if constexpr (kSlots == 1) {
    return 0;
  } else {
    return find_chunk_slot(tab.first_chunk, tab.count, c);
  }
}

// The generators (see [note: noise generators]). A work item is one generator call: elems<kOp>()
// consecutive elements of the global stream, a multiple of 4. values() turns item `item` into
// the stored values v[q][j] of its elements 4q + j, given their old values x (kAdd only).
struct PhiloxGen {
  using Key = NoiseKey;
  using Scale = float;
  template <NoiseOp kOp>
  static constexpr int elems() {
    return 4;
  }
  template <typename T, NoiseOp kOp>
  __device__ __forceinline__ static void values(uint64_t item, const Key& key, Scale s,
                                                const float (&x)[1][4], T (&v)[1][4]) {
    const Philox4 w = philox4x32_10(item, key.step, key.stream, key.seed);
    if constexpr (kOp == NoiseOp::kWords) {
#pragma unroll
      for (int j = 0; j < 4; ++j) v[0][j] = static_cast<T>(w.x[j]);
    } else {
      float z[4];
      box_muller(w.x[0], w.x[1], z[0], z[1]);
      box_muller(w.x[2], w.x[3], z[2], z[3]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float y = __fmul_rn(s, z[j]);
        v[0][j] = static_cast<T>(kOp == NoiseOp::kAdd ? __fadd_rn(x[0][j], y) : y);
      }
    }
  }
};

// Secure mode (docs/RNG.md §6): element e takes word e % 16 of ChaCha20 block e / 16, or normal
// e % 8 of block e / 8; std * z (+ the element) in float64, rounded once to T.
struct ChachaGen {
  using Key = ChachaKey;
  using Scale = double;
  template <NoiseOp kOp>
  static constexpr int elems() {
    return kOp == NoiseOp::kWords ? 16 : 8;
  }
  template <typename T, NoiseOp kOp>
  __device__ __forceinline__ static void values(uint64_t item, const Key& key, Scale s,
                                                const float (&x)[elems<kOp>() / 4][4],
                                                T (&v)[elems<kOp>() / 4][4]) {
    uint32_t w[16];
    chacha20_block(item, key, w);
    if constexpr (kOp == NoiseOp::kWords) {
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i / 4][i % 4] = static_cast<T>(w[i]);
    } else {
      double z[8];
      chacha_normals(w, z);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const double y = __dmul_rn(s, z[i]);
        v[i / 4][i % 4] =
            round_once<T>(kOp == NoiseOp::kAdd ? __dadd_rn(static_cast<double>(x[i / 4][i % 4]), y) : y);
      }
    }
  }
};

// p[i0 .. i0 + 3] (some may lie outside [0, n): partial) read into x / written from v, by access `acc`.
template <typename T>
__device__ __forceinline__ void load_quad(const T* p, int64_t i0, int64_t n, int acc, float (&x)[4]) {
  constexpr int kW = max_width<T>();
  if (acc == kFull) {
    load4<kW>(p + i0, x);
  } else if (acc == kHalf) {
    if constexpr (kW == 4) load4<2>(p + i0, x);
  } else if (acc == kScalar) {
    load4<1>(p + i0, x);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (i0 + j >= 0 && i0 + j < n) x[j] = static_cast<float>(p[i0 + j]);
    }
  }
}

template <typename T>
__device__ __forceinline__ void store_quad(T* p, int64_t i0, int64_t n, int acc, const T (&v)[4]) {
  constexpr int kW = max_width<T>();
  if (acc == kFull) {
    store4<kW>(p + i0, v);
  } else if (acc == kHalf) {
    if constexpr (kW == 4) store4<2>(p + i0, v);
  } else if (acc == kScalar) {
    store4<1>(p + i0, v);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (i0 + j >= 0 && i0 + j < n) p[i0 + j] = v[j];
    }
  }
}

// Work item `item` of the stream, whose element j is element i0 + j of the n-element tensor p (see
// [note: noise work items]), one quad of 4 elements at a time. kWords: p[i] = word; kFill: p[i] =
// round(s * z); kAdd: p[i] = round(p[i] + s * z).
template <typename T, NoiseOp kOp, typename Gen>
__device__ __forceinline__ void noise_item(T* __restrict__ p, int64_t i0, int64_t n, uint64_t item,
                                           const typename Gen::Key& key, typename Gen::Scale s) {
  constexpr int kQuads = Gen::template elems<kOp>() / 4;
  int acc[kQuads];
#pragma unroll
  for (int q = 0; q < kQuads; ++q) acc[q] = access_of(p, i0 + 4 * q, n);
  // The old values are loaded before the generator runs, so that the loads are in flight meanwhile.
  float x[kQuads][4] = {};
  if constexpr (kOp == NoiseOp::kAdd) {
#pragma unroll
    for (int q = 0; q < kQuads; ++q) load_quad(p, i0 + 4 * q, n, acc[q], x[q]);
  }
  T v[kQuads][4];
  Gen::template values<T, kOp>(item, key, s, x, v);
#pragma unroll
  for (int q = 0; q < kQuads; ++q) store_quad(p, i0 + 4 * q, n, acc[q], v[q]);
}

// Chunks blockIdx.x, blockIdx.x + gridDim.x, ... < num_chunks of the table (see [note: noise
// launches]). Chunk c of slot s is the slot's work items q * kNoiseChunk .. (q + 1) * kNoiseChunk - 1
// counted from its first, elem0[s] / kE, where q = c - first_chunk[s] and kE elements make an item.
template <typename T, NoiseOp kOp, int kSlots, typename Gen>
__global__ void __launch_bounds__(kNoiseThreads)
    noise_kernel(const __grid_constant__ NoiseTable<kSlots> tab, int64_t num_chunks, typename Gen::Key key,
                 typename Gen::Scale s) {
  constexpr int64_t kE = Gen::template elems<kOp>();
  for (int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const int slot = find_slot(tab, c);
    T* const p = static_cast<T*>(tab.ptr[slot]);
    const int64_t n = tab.numel[slot], e0 = tab.elem0[slot];
    // Slot-local item u is global item e0 / kE + u and holds elements kE u - e0 % kE .. of the tensor.
    const uint64_t first_item = static_cast<uint64_t>(e0) / kE;
    const int64_t lead = e0 % kE;
    const int64_t u0 = (c - tab.first_chunk[slot]) * kNoiseChunk + threadIdx.x;
#pragma unroll 1
    for (int k = 0; k < kNoiseIters; ++k) {
      const int64_t u = u0 + int64_t{k} * kNoiseThreads;
      const int64_t i0 = kE * u - lead;
      if (i0 >= n) break;  // u only grows with k
      noise_item<T, kOp, Gen>(p, i0, n, first_item + static_cast<uint64_t>(u), key, s);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.
// ---------------------------------------------------------------------------------------------

// A tensor's share of the stream: numel > 0 elements at ptr, element i being global element elem0 + i.
struct NoiseItem {
  void* ptr;
  int64_t numel;
  int64_t elem0;
};

// Chunks of a tensor: its work items elem0 / kE .. (elem0 + numel + kE - 1) / kE - 1, kNoiseChunk at a time.
int64_t noise_chunks(const NoiseItem& it, int64_t kE) {
  const int64_t items = (it.elem0 + it.numel + kE - 1) / kE - it.elem0 / kE;
  return ceil_div(items, kNoiseChunk);
}

// Runs noise_kernel over items (any order, non-overlapping memory), kSlots tensors per launch.
template <typename T, NoiseOp kOp, int kSlots, typename Gen>
void launch_noise(const std::vector<NoiseItem>& items, const typename Gen::Key& key, typename Gen::Scale s) {
  if (items.empty()) return;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  // Exactly one wave of resident blocks: every block strides over the same number of chunks (give
  // or take one), so a partial second wave would double the time of the blocks in it.
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, noise_kernel<T, kOp, kSlots, Gen>,
                                                               kNoiseThreads, /*dynamicSMemSize=*/0));
  const int64_t max_grid = int64_t{prop->multiProcessorCount} * std::max(1, per_sm);
  NoiseTable<kSlots> tab{};
  int64_t chunks = 0;
  const auto flush = [&] {
    if (tab.count > 0) {
      const auto grid = static_cast<unsigned>(std::min(chunks, max_grid));
      noise_kernel<T, kOp, kSlots, Gen><<<grid, kNoiseThreads, 0, stream>>>(tab, chunks, key, s);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    tab.count = 0;
    chunks = 0;
  };
  for (const NoiseItem& it : items) {
    if (tab.count == kSlots) flush();
    tab.ptr[tab.count] = it.ptr;
    tab.numel[tab.count] = it.numel;
    tab.elem0[tab.count] = it.elem0;
    tab.first_chunk[tab.count] = chunks;
    chunks += noise_chunks(it, Gen::template elems<kOp>());
    ++tab.count;
  }
  flush();
}

// offset + total elements, plus the rounding up to whole work items, must not overflow int64.
void check_offset(int64_t offset, int64_t total) {
  DPK_CHECK(offset >= 0, "offset must be >= 0, got ", offset);
  DPK_CHECK(total <= std::numeric_limits<int64_t>::max() - 16 - offset, "offset + numel overflows: offset ",
            offset, ", ", total, " elements");
}

void philox_uint32_cuda(at::Tensor& out, int64_t seed, int64_t step, int64_t stream, int64_t offset) {
  DPK_CHECK(out.is_cuda() && out.scalar_type() == at::kLong && out.is_contiguous(),
            "out must be a contiguous int64 CUDA tensor, got ", out.scalar_type(), " on ", out.device());
  check_offset(offset, out.numel());
  const NoiseKey key = make_key(seed, step, stream);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  launch_noise<int64_t, NoiseOp::kWords, 1, PhiloxGen>({{out.data_ptr(), out.numel(), offset}}, key, 0.f);
}

void chacha20_uint32_cuda(at::Tensor& out, at::IntArrayRef key, int64_t step, int64_t stream,
                          int64_t offset) {
  DPK_CHECK(out.is_cuda() && out.scalar_type() == at::kLong && out.is_contiguous(),
            "out must be a contiguous int64 CUDA tensor, got ", out.scalar_type(), " on ", out.device());
  check_offset(offset, out.numel());
  const ChachaKey k = make_chacha_key(key, step, stream);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  launch_noise<int64_t, NoiseOp::kWords, 1, ChachaGen>({{out.data_ptr(), out.numel(), offset}}, k, 0.0);
}

// The storage dtypes in the order their launches go out.
constexpr std::array<at::ScalarType, 3> kNoiseTypes = {at::kFloat, at::kHalf, at::kBFloat16};

// Whether two of the tensors share memory. Then a single launch would race on it, so the tensors
// are processed one launch each, in list order, like the CPU kernel does.
bool any_overlap(at::TensorList tensors) {
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  for (const at::Tensor& x : tensors) {
    if (x.numel() == 0) continue;
    const auto a = reinterpret_cast<uintptr_t>(x.data_ptr());
    spans.emplace_back(a, a + static_cast<uintptr_t>(x.nbytes()));
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].first < spans[i - 1].second) return true;
  }
  return false;
}

// out[i] (+)= std * z(offset + i) for each tensor, offsets running across the list.
template <typename Gen>
void gaussian_cuda(at::TensorList tensors, typename Gen::Scale s, const typename Gen::Key& key,
                   int64_t offset, bool accumulate) {
  DPK_CHECK(offset >= 0, "offset must be >= 0, got ", offset);
  if (tensors.empty()) return;
  const c10::Device dev = tensors[0].device();
  int64_t total = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const at::Tensor& x = tensors[t];
    DPK_CHECK(x.is_cuda() && x.is_contiguous(), "tensors[", t, "] must be a contiguous CUDA tensor, got a ",
              x.is_contiguous() ? "contiguous" : "non-contiguous", " tensor on ", x.device());
    DPK_CHECK(x.device() == dev, "tensors[", t, "] is on ", x.device(), " but tensors[0] is on ", dev);
    DPK_CHECK(std::find(kNoiseTypes.begin(), kNoiseTypes.end(), x.scalar_type()) != kNoiseTypes.end(),
              "tensors[", t, "] has dtype ", x.scalar_type(), "; supported: float32, float16, bfloat16");
    DPK_CHECK(x.numel() <= std::numeric_limits<int64_t>::max() - total, "too many elements");
    total += x.numel();
  }
  check_offset(offset, total);
  if (total == 0) return;
  const c10::cuda::CUDAGuard guard(dev);

  // Launch groups: the tensors of each dtype, or one tensor each if some share memory.
  std::vector<std::pair<at::ScalarType, std::vector<NoiseItem>>> groups;
  const bool serial = tensors.size() > 1 && any_overlap(tensors);
  if (!serial) {
    for (const at::ScalarType type : kNoiseTypes) groups.emplace_back(type, std::vector<NoiseItem>{});
  }
  int64_t base = offset;
  for (const at::Tensor& x : tensors) {
    if (x.numel() > 0) {
      const NoiseItem it{x.data_ptr(), x.numel(), base};
      if (serial) {
        groups.emplace_back(x.scalar_type(), std::vector<NoiseItem>{it});
      } else {
        const auto g =
            std::find(kNoiseTypes.begin(), kNoiseTypes.end(), x.scalar_type()) - kNoiseTypes.begin();
        groups[g].second.push_back(it);
      }
    }
    base += x.numel();
  }
  for (const auto& [type, items] : groups) {
    if (items.empty()) continue;
    DPK_DISPATCH_GRAD_TYPES(type, "gaussian_noise", [&] {
      if (accumulate) {
        launch_noise<scalar_t, NoiseOp::kAdd, kMaxNoiseSlots, Gen>(items, key, s);
      } else {
        launch_noise<scalar_t, NoiseOp::kFill, 1, Gen>(items, key, s);
      }
    });
  }
}

void gaussian_fill_cuda(at::Tensor& out, double std, int64_t seed, int64_t step, int64_t stream,
                        int64_t offset) {
  gaussian_cuda<PhiloxGen>({out}, static_cast<float>(std), make_key(seed, step, stream), offset,
                           /*accumulate=*/false);
}

void add_gaussian_noise_cuda(at::TensorList tensors, double std, int64_t seed, int64_t step, int64_t stream,
                             int64_t offset) {
  gaussian_cuda<PhiloxGen>(tensors, static_cast<float>(std), make_key(seed, step, stream), offset,
                           /*accumulate=*/true);
}

void chacha20_gaussian_fill_cuda(at::Tensor& out, double std, at::IntArrayRef key, int64_t step,
                                 int64_t stream, int64_t offset) {
  gaussian_cuda<ChachaGen>({out}, std, make_chacha_key(key, step, stream), offset, /*accumulate=*/false);
}

void chacha20_add_gaussian_noise_cuda(at::TensorList tensors, double std, at::IntArrayRef key, int64_t step,
                                      int64_t stream, int64_t offset) {
  gaussian_cuda<ChachaGen>(tensors, std, make_chacha_key(key, step, stream), offset, /*accumulate=*/true);
}

}  // namespace

TORCH_LIBRARY_IMPL(dpkernels_C, CUDA, m) {
  m.impl("philox_uint32_", &philox_uint32_cuda);
  m.impl("gaussian_fill_", &gaussian_fill_cuda);
  m.impl("add_gaussian_noise_", &add_gaussian_noise_cuda);
  m.impl("chacha20_uint32_", &chacha20_uint32_cuda);
  m.impl("chacha20_gaussian_fill_", &chacha20_gaussian_fill_cuda);
  m.impl("chacha20_add_gaussian_noise_", &chacha20_add_gaussian_noise_cuda);
}

}  // namespace dpkernels

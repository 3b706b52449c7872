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
// The work items of a tensor are cut into chunks of kNoiseChunk items (one CUDA block runs a chunk:
// kNoiseThreads threads, kNoiseIters items each, thread t taking t, t + kNoiseThreads, ..., so that a
// warp writes consecutive addresses), on the driver of multi_tensor.cuh (see [note: multi-tensor
// launches] and [note: chunk grid] there, a work item being a unit). add_gaussian_noise_ covers all
// tensors of one storage dtype with one launch; the grid is at most one wave of resident blocks that
// strides over the chunks, so any number of elements takes one launch. gaussian_fill_ and
// philox_uint32_ use the same kernel with a one-slot table.
//
// [note: noise stores]
// A thread moves each quad of 4 elements that lies wholly in its tensor with as few accesses as the
// quad's address allows: one access of 4 elements when it is aligned to 4 elements (16 bytes for
// fp32, 8 for fp16/bf16; two 16-byte ones for int64), two of 2 elements when aligned to 2, else 4
// scalar ones; a quad that straddles the tensor's ends goes element by element. Alignment is a
// property of the tensor (its base address and e0 % 4), so the launcher sets it as the slot's width
// and the paths do not diverge inside a warp except at a tensor's first and last block.
//
// [note: noise rounding]
// As on the CPU and in the reference: std is rounded to fp32 once, std * z is rounded to fp32, the
// sum with the fp32 value of the element is rounded to fp32, and the result is rounded once to the
// storage dtype. __fmul_rn/__fadd_rn keep nvcc from contracting the product and the sum into an
// FMA (which rounds once, so it would differ from the reference in the last bit). box_muller() uses
// the precise logf/cosf/sinf/sqrtf; this file must not be built with --use_fast_math.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "dpkernels/chacha20.h"
#include "dpkernels/kernels.h"
#include "dpkernels/macros.h"
#include "dpkernels/noise_key.h"
#include "dpkernels/philox.h"
#include "multi_tensor.cuh"

namespace dpkernels {
namespace {

constexpr int kMaxNoiseSlots = kLargeKernelArgs ? 800 : 96;  // tensors per add_gaussian_noise_ launch

constexpr int kNoiseThreads = 256;
// Work items per thread and chunk: a chunk is kNoiseChunk items, 4 * kNoiseChunk elements (16 KiB of
// fp32) in Philox mode, enough to amortise the chunk's table lookup.
constexpr int kNoiseIters = 4;
constexpr int64_t kNoiseChunk = int64_t{kNoiseThreads} * kNoiseIters;

enum class NoiseOp { kWords, kFill, kAdd };

// One tensor per slot, kSlots per launch.
template <int kSlots>
using NoiseTable = TensorTable<kSlots, kSlots>;
static_assert(sizeof(NoiseTable<kMaxNoiseSlots>) + kScalarArgBytes <= kArgBytes);

// ---------------------------------------------------------------------------------------------
// Device helpers.
// ---------------------------------------------------------------------------------------------

// Elements per access on the widest path: 4, at most 16 bytes.
template <typename T>
constexpr int max_width() {
  return static_cast<int>(std::min<size_t>(4, 16 / sizeof(T)));
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

// Elements per access for the quad p[i0 .. i0 + 3] of a tensor of n elements and width w: 0 when the
// quad straddles the tensor's ends (i0 may be negative, down to -3, or near n).
__device__ __forceinline__ int quad_access(int64_t i0, int64_t n, int w) {
  return i0 >= 0 && i0 + 4 <= n ? w : 0;
}

// p[i0 .. i0 + 3] read into x / written from v, by quad_access `acc`.
template <typename T>
__device__ __forceinline__ void load_quad(const T* p, int64_t i0, int64_t n, int acc, float (&x)[4]) {
  constexpr int kW = max_width<T>();
  if (acc == kW) {
    load_vec<kW>(p + i0, x);
  } else if (acc == 2) {
    if constexpr (kW == 4) load_vec<2>(p + i0, x);
  } else if (acc == 1) {
    load_vec<1>(p + i0, x);
  } else {
    load_tail<4, 1, true>(p, i0, n, x);
  }
}

template <typename T>
__device__ __forceinline__ void store_quad(T* p, int64_t i0, int64_t n, int acc, const T (&v)[4]) {
  constexpr int kW = max_width<T>();
  if (acc == kW) {
    store_vec<kW>(p + i0, v);
  } else if (acc == 2) {
    if constexpr (kW == 4) store_vec<2>(p + i0, v);
  } else if (acc == 1) {
    store_vec<1>(p + i0, v);
  } else {
    store_tail<4, 1, true>(p, i0, n, v);
  }
}

// Work item `item` of the stream, whose element j is element i0 + j of the n-element tensor p of
// width w (see [note: noise work items]), one quad of 4 elements at a time. kWords: p[i] = word;
// kFill: p[i] = round(s * z); kAdd: p[i] = round(p[i] + s * z).
template <typename T, NoiseOp kOp, typename Gen>
__device__ __forceinline__ void noise_item(T* __restrict__ p, int64_t i0, int64_t n, int w, uint64_t item,
                                           const typename Gen::Key& key, typename Gen::Scale s) {
  constexpr int kQuads = Gen::template elems<kOp>() / 4;
  int acc[kQuads];
#pragma unroll
  for (int q = 0; q < kQuads; ++q) acc[q] = quad_access(i0 + 4 * q, n, w);
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

// The chunking of work items of kE = Gen::elems<kOp>() elements.
template <typename Gen, NoiseOp kOp>
using NoiseChunks = Chunking<kNoiseChunk * Gen::template elems<kOp>(), Gen::template elems<kOp>()>;

// The chunks blockIdx.x, blockIdx.x + gridDim.x, ... < num_chunks of the table (see [note: noise
// launches]), one work item per thread at a time.
template <typename T, NoiseOp kOp, int kSlots, typename Gen>
__global__ void __launch_bounds__(kNoiseThreads)
    noise_kernel(const __grid_constant__ NoiseTable<kSlots> tab, int64_t num_chunks, typename Gen::Key key,
                 typename Gen::Scale s) {
  using Chunks = NoiseChunks<Gen, kOp>;
  Chunks::for_each_chunk(tab, num_chunks, [&](int64_t, const ChunkRef& ch) {
    T* const p = tab.template tensor<T>(ch.slot, 0);
    Chunks::template for_each_unit<kNoiseThreads>(ch, [&](int64_t i0, uint64_t item) {
      noise_item<T, kOp, Gen>(p, i0, ch.numel, ch.width, item, key, s);
    });
  });
}

// ---------------------------------------------------------------------------------------------
// Host side.
// ---------------------------------------------------------------------------------------------

// The width of a tensor at p whose element 0 is global element e0 (see [note: noise stores]): the
// alignment of its quads, which start lead = e0 % 4 elements before p.
template <typename T>
int quad_width(const void* p, int64_t e0) {
  constexpr int kW = max_width<T>();
  const uintptr_t a = reinterpret_cast<uintptr_t>(p) - static_cast<uintptr_t>(e0 % 4) * sizeof(T);
  if (a % (kW * sizeof(T)) == 0) return kW;
  if (kW == 4 && a % (2 * sizeof(T)) == 0) return 2;
  return 1;
}

// Runs noise_kernel over refs into tensors (any order, non-overlapping memory), kSlots tensors per launch.
template <typename T, NoiseOp kOp, int kSlots, typename Gen>
void launch_noise(at::TensorList tensors, const std::vector<TensorRef>& refs, const typename Gen::Key& key,
                  typename Gen::Scale s) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto kernel = noise_kernel<T, kOp, kSlots, Gen>;
  const auto fill = [&](const void** row, const TensorRef& t) {
    row[0] = tensors[t.index].data_ptr();
    return quad_width<T>(row[0], t.elem0);
  };
  for_each_table<NoiseChunks<Gen, kOp>, NoiseTable<kSlots>>(
      refs, 1, kAnyChunks, fill, [&](const NoiseTable<kSlots>& tab, int64_t chunks, int64_t) {
        kernel<<<one_wave(kernel, kNoiseThreads, chunks), kNoiseThreads, 0, stream>>>(tab, chunks, key, s);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
}

// offset + total elements, plus the rounding up to whole work items, must not overflow int64.
void check_offset(int64_t offset, int64_t total) {
  DPK_CHECK(offset >= 0, "offset must be >= 0, got ", offset);
  DPK_CHECK(total <= std::numeric_limits<int64_t>::max() - 16 - offset, "offset + numel overflows: offset ",
            offset, ", ", total, " elements");
}

}  // namespace

void philox_uint32_cuda(at::Tensor& out, int64_t seed, int64_t step, int64_t stream, int64_t offset) {
  DPK_CHECK(out.is_cuda() && out.scalar_type() == at::kLong && out.is_contiguous(),
            "out must be a contiguous int64 CUDA tensor, got ", out.scalar_type(), " on ", out.device());
  check_offset(offset, out.numel());
  const NoiseKey key = make_key(seed, step, stream);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  launch_noise<int64_t, NoiseOp::kWords, 1, PhiloxGen>(out, {{0, out.numel(), offset}}, key, 0.f);
}

void chacha20_uint32_cuda(at::Tensor& out, at::IntArrayRef key, int64_t step, int64_t stream,
                          int64_t offset) {
  DPK_CHECK(out.is_cuda() && out.scalar_type() == at::kLong && out.is_contiguous(),
            "out must be a contiguous int64 CUDA tensor, got ", out.scalar_type(), " on ", out.device());
  check_offset(offset, out.numel());
  const ChachaKey k = make_chacha_key(key, step, stream);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  launch_noise<int64_t, NoiseOp::kWords, 1, ChachaGen>(out, {{0, out.numel(), offset}}, k, 0.0);
}

namespace {

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
  std::vector<int64_t> numel;
  int64_t total = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const at::Tensor& x = tensors[t];
    DPK_CHECK(x.is_cuda() && x.is_contiguous(), "tensors[", t, "] must be a contiguous CUDA tensor, got a ",
              x.is_contiguous() ? "contiguous" : "non-contiguous", " tensor on ", x.device());
    DPK_CHECK(x.device() == dev, "tensors[", t, "] is on ", x.device(), " but tensors[0] is on ", dev);
    DPK_CHECK(std::find(kStorageTypes.begin(), kStorageTypes.end(), x.scalar_type()) != kStorageTypes.end(),
              "tensors[", t, "] has dtype ", x.scalar_type(), "; supported: float32, float16, bfloat16");
    DPK_CHECK(x.numel() <= std::numeric_limits<int64_t>::max() - total, "too many elements");
    total += x.numel();
    numel.push_back(x.numel());
  }
  check_offset(offset, total);
  if (total == 0) return;
  const c10::cuda::CUDAGuard guard(dev);
  const auto run = [&](auto tag, const std::vector<TensorRef>& refs) {
    using T = typename decltype(tag)::type;
    if (accumulate) {
      launch_noise<T, NoiseOp::kAdd, kMaxNoiseSlots, Gen>(tensors, refs, key, s);
    } else {
      launch_noise<T, NoiseOp::kFill, 1, Gen>(tensors, refs, key, s);
    }
  };
  const std::vector<TensorRef> refs = tensor_refs(numel, offset);
  const auto type_of = [&](int64_t t) { return tensors[t].scalar_type(); };
  // One launch per dtype, or one per tensor in list order if some share memory.
  if (tensors.size() > 1 && any_overlap(tensors)) {
    for (const TensorRef& t : refs) for_each_type(group_by_type({t}, type_of), run);
  } else {
    for_each_type(group_by_type(refs, type_of), run);
  }
}

}  // namespace

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

}  // namespace dpkernels

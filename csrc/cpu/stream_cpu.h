// The streaming skeleton of the CPU kernels that make one pass over a whole tensor list: the
// per-sample clipping ops (clip.cpp), linear_filter_ (filter.cpp) and the fused optimizer steps
// (optim.cpp).
//
// A call's tensors are laid end to end in the global element index (offset + position in the
// list, the index the Philox noise is keyed by, docs/RNG.md). The list is cut into tasks of at
// most kTask elements of one tensor, and the threads claim contiguous runs of tasks of about
// equal cost (parallel_over_tasks): one parallel region per call, however many tensors. A task is
// walked in chunks of at most kChunk elements whose boundaries sit at multiples of kChunk of the
// global index, so a chunk's noise is whole Philox runs (cpu::normals wastes nothing) and its
// fp32 temporaries (noise, filter input and output) live in small stack buffers that stay in L1.
//
// filter_chunk() runs filter.h's step over a chunk; the build compiles it without FMA contraction
// (see filter.cpp) so that products and sums round as in the reference.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <unistd.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "dpkernels/filter.h"
#include "noise_cpu.h"
#include "vec_cpu.h"

namespace dpkernels {
namespace cpu {

// Elements per chunk: whole Philox runs and whole SIMD vectors; 2 KiB per fp32 stack buffer.
constexpr int64_t kChunk = 512;
static_assert(kChunk % kRun == 0 && kChunk % Vec::size() == 0);
// Elements per task: large enough to amortise the task, small enough to balance the threads.
constexpr int64_t kTask = 32 * kChunk;
// Fixed cost of a task, in elements, so that many tiny tensors are not counted as free.
constexpr int64_t kTaskOverhead = 64;

// Runs fn(first_task, last_task) over runs of consecutive tasks of about equal cost: the list is
// cut into kRunsPerThread runs per thread, and each thread claims the next run from a shared
// counter until none is left. A statically split list leaves a thread idle whenever the other is
// slowed down (a descheduled vCPU, a late wake-up); claiming runs hands the slow thread's share to
// the fast one (3% faster on the 148-tensor bench shape at B = 8, interleaved A/B). Runs are
// contiguous, so each thread still streams through memory in order. Which thread runs a task
// never matters: every task writes its own outputs.
template <typename F>
void parallel_over_tasks(const std::vector<int64_t>& cost, const F& fn) {
  constexpr int64_t kRunsPerThread = 8;
  const int64_t n = static_cast<int64_t>(cost.size());
  if (n == 0) return;
  std::vector<int64_t> prefix(n + 1, 0);
  for (int64_t t = 0; t < n; ++t) prefix[t + 1] = prefix[t] + cost[t];
  const int64_t threads = at::get_num_threads();
  const int64_t runs = std::min<int64_t>(n, threads > 1 ? threads * kRunsPerThread : 1);
  const auto bound = [&](int64_t q) {
    if (q == runs) return n;
    return static_cast<int64_t>(std::lower_bound(prefix.begin(), prefix.end(), prefix[n] * q / runs) -
                                prefix.begin());
  };
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, runs), 1, [&](int64_t, int64_t) {
    for (int64_t q = next.fetch_add(1); q < runs; q = next.fetch_add(1)) {
      const int64_t lo = bound(q), hi = bound(q + 1);
      if (lo < hi) fn(lo, hi);
    }
  });
}

// Elements [begin, end) of tensor l.
struct StreamTask {
  int64_t l, begin, end;
};

// The tasks of one pass over tensors of numel[l] elements, the first at global index `offset`.
// The decomposition depends on the sizes only, never on the thread count, so per-task partial
// results summed in task order are deterministic.
struct StreamPlan {
  std::vector<StreamTask> tasks;
  std::vector<int64_t> cost;
  std::vector<int64_t> start;  // global index of tensor l's first element

  StreamPlan(const std::vector<int64_t>& numel, int64_t offset) {
    int64_t e = offset;
    for (int64_t l = 0; l < static_cast<int64_t>(numel.size()); ++l) {
      start.push_back(e);
      for (int64_t i = 0; i < numel[l];) {
        const int64_t end = std::min(numel[l], ((e + i) / kTask + 1) * kTask - e);
        tasks.push_back({l, i, end});
        cost.push_back(end - i + kTaskOverhead);
        i = end;
      }
      e += numel[l];
    }
  }

  // fn(t, task) for every task, spread over the threads by cost.
  template <typename F>
  void parallel(const F& fn) const {
    parallel_over_tasks(cost, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) fn(t, tasks[t]);
    });
  }

  // fn(i0, m, e0) for the chunks of a task in order: elements [i0, i0 + m) of its tensor, m <=
  // kChunk, e0 = the global index of element i0.
  template <typename F>
  void chunks(const StreamTask& task, const F& fn) const {
    const int64_t s = start[task.l];
    for (int64_t i = task.begin; i < task.end;) {
      const int64_t end = std::min(task.end, ((s + i) / kChunk + 1) * kChunk - s);
      fn(i, end - i, s + i);
      i = end;
    }
  }
};

// Requests the cache lines of x[0:m) before they are used. The empty volatile asm is the side
// effect GCC does not see in __builtin_prefetch: without it GCC 12 classes a function that only
// prefetches as const and deletes the calls to it that it has not inlined yet (the passes'
// per-tensor state prefetch and the callback they hand to cpu::normals were both gone from the
// binary).
inline void prefetch_line(uintptr_t line) {
  __builtin_prefetch(reinterpret_cast<const char*>(line), 1, 3);
  asm volatile("" : : "r"(line));
}
template <typename T>
inline void prefetch(const T* x, int64_t m) {
  if (m <= 0) return;
  const uintptr_t end = reinterpret_cast<uintptr_t>(x + m);
  for (uintptr_t line = reinterpret_cast<uintptr_t>(x) & ~uintptr_t{63}; line < end; line += 64)
    prefetch_line(line);
}

// The cache lines of one chunk's arrays, each walked by a cursor, so that requesting the next
// share of them is a compare and an add per line. Shares computed per call (lines * part / parts
// of every array) cost two divisions per array per run of the generator: the passes on the AVX2
// path 0-4% slower, AVX-512 unchanged (builds alternating; docs/BENCHMARKS.md, "Sixteenth
// session").
class ChunkLines {
 public:
  // The most arrays a pass streams: a parameter, its sum, its state (at most kMaxFilterBuffers
  // direction-filter buffers, or a family's few) and its noise filter's buffers.
  static constexpr int kMaxArrays = 4 + 2 * kMaxFilterBuffers;

  void clear() { n_ = 0, lines_ = 0; }

  // Adds x[0:m) to the lines to request.
  template <typename T>
  void add(const T* x, int64_t m) {
    if (m <= 0) return;
    DPK_CHECK(n_ < kMaxArrays, "a pass streams more than ", kMaxArrays, " arrays");
    Cursor& c = cursor_[n_++];
    c.next = reinterpret_cast<uintptr_t>(x) & ~uintptr_t{63};
    c.end = reinterpret_cast<uintptr_t>(x + m);
    lines_ = std::max<int64_t>(lines_, static_cast<int64_t>((c.end - c.next + 63) / 64));
  }

  // Requests the next `lines` lines of every array.
  void request(int64_t lines) {
    for (int a = 0; a < n_; ++a) {
      Cursor& c = cursor_[a];
      uintptr_t line = c.next;
      const uintptr_t stop = std::min(c.end, line + 64 * static_cast<uintptr_t>(lines));
      for (; line < stop; line += 64) prefetch_line(line);
      c.next = line;
    }
  }
  void request_all() { request(lines_); }

  // Share r of `shares` equal shares, in order: after the last one every line has been requested.
  void request_share(int64_t r, int64_t shares) {
    if (r == 0) per_share_ = (lines_ + shares - 1) / shares;
    request(r + 1 == shares ? lines_ : per_share_);
  }

 private:
  struct Cursor {
    uintptr_t next, end;
  };
  Cursor cursor_[kMaxArrays];
  int n_ = 0;
  int64_t lines_ = 0, per_share_ = 0;
};

// When a pass requests the lines of a task's chunks. The first chunk's are requested at once;
// every later chunk's a share at a time while the previous chunk's noise is generated, after each
// run's Philox words and after each transform (the `between` callback of cpu::normals, which
// begin_chunk(i0, m) returns), so that its traffic overlaps the generator.
// Requested at once before a chunk's noise, the lines stall the generator until most of them have
// arrived, and the two times add up (docs/BENCHMARKS.md). arrays(i0, m, lines) adds elements
// [i0, i0 + m) of every array the pass streams to `lines` (ChunkLines::add).
template <typename Arrays>
class ChunkPrefetch {
 public:
  ChunkPrefetch(const StreamTask& task, const Arrays& arrays) : task_(task), arrays_(arrays) {}

  // Called as chunk [i0, i0 + m) starts: requests its lines if it is the task's first, and returns
  // the callback that requests the next chunk's while this one's noise is generated.
  auto begin_chunk(int64_t i0, int64_t m) {
    if (i0 == task_.begin) {
      next_.clear();
      arrays_(i0, m, next_);
      next_.request_all();
    }
    next_.clear();
    const int64_t next = i0 + m;
    arrays_(next, std::min(kChunk, task_.end - next), next_);
    return [this](int64_t k, int64_t calls) { next_.request_share(k, calls); };
  }

 private:
  const StreamTask& task_;
  const Arrays& arrays_;
  ChunkLines next_;
};

// A buffer-major tensor list of fp32 buffers (list[k * L + l] is buffer k of tensor l), as the
// ops take their state and noise buffers.
class BufferTable {
 public:
  BufferTable(at::TensorList list, int64_t L) : L_(L) {
    for (const at::Tensor& t : list) ptr_.push_back(t.data_ptr<float>());
  }
  float* at(int64_t k, int64_t l) const { return ptr_[k * L_ + l]; }
  // Adds elements [i0, i0 + m) of every buffer of tensor l to `lines`.
  void add_lines(int64_t l, int64_t i0, int64_t m, ChunkLines& lines) const {
    for (size_t k = 0; k * L_ < ptr_.size(); ++k) lines.add(at(static_cast<int64_t>(k), l) + i0, m);
  }

 private:
  std::vector<float*> ptr_;
  int64_t L_;
};

// No buffers and a = g = 1: filter_step gives y = 1 · (1 · x), which is x exactly. Plain DP-SGD's
// direction and noise filters are this identity, and evaluating it took a seventh of its pass.
inline bool is_identity(const FilterCoeffs& fc) { return fc.K == 0 && fc.a == 1.f && fc.g == 1.f; }

namespace detail {

// The terms of filter.h's step as loops over a chunk's __restrict arrays, so that GCC vectorises
// each one and the tests of its coefficients run once per chunk.
inline void filter_scale(int64_t m, float a, const float* __restrict x, float* __restrict y) {
  for (int64_t i = 0; i < m; ++i) y[i] = a * x[i];
}
inline void filter_add(int64_t m, float c, const float* __restrict s, float* __restrict y) {
  for (int64_t i = 0; i < m; ++i) y[i] = y[i] + c * s[i];
}
// s <- [d s] + [e y] + [f x], the terms that kD, kE, kF keep, summed from 0 in that order
// (filter_state).
template <bool kD, bool kE, bool kF>
void filter_update(int64_t m, float d, float e, float f, float* __restrict s, const float* __restrict y,
                   const float* __restrict x) {
  for (int64_t i = 0; i < m; ++i) {
    float v = kD ? d * s[i] : 0.f;
    if constexpr (kE) v = v + e * y[i];
    if constexpr (kF) v = v + f * x[i];
    s[i] = v;
  }
}
template <int kMask = 0>
void filter_update(int mask, int64_t m, float d, float e, float f, float* s, const float* y, const float* x) {
  if constexpr (kMask < 7) {
    if (mask != kMask) return filter_update<kMask + 1>(mask, m, d, e, f, s, y, x);
  }
  filter_update<(kMask & 4) != 0, (kMask & 2) != 0, (kMask & 1) != 0>(m, d, e, f, s, y, x);
}

}  // namespace detail

// filter_step(fc, x) on elements [0, m) of a chunk, the fc.K buffers of tensor l read and written
// in place at elements [i0, i0 + m). Returns the output g y: x itself for the identity filter,
// else written to y[0:m) (x and y distinct). Evaluated term by term, a loop over the chunk each
// (y = a x; y += c_k S_k for k = 0, 1, ...; the buffers' updates; g y): filter_step's operations
// in its order on every element, so the same bits. filter_step on Vec lanes in one walk tested
// every coefficient on every vector, and the noise's generator shares the core with those
// instructions: linear_filter_ with two buffers and noise is 17-27% faster this way
// (docs/BENCHMARKS.md, "Seventeenth session").
inline const float* filter_chunk(const FilterCoeffs& fc, const float* x, float* y, int64_t m,
                                 const BufferTable& bufs, int64_t l, int64_t i0) {
  if (is_identity(fc)) return x;
  if (fc.a != 0.f) {
    detail::filter_scale(m, fc.a, x, y);
  } else {
    std::fill(y, y + m, 0.f);
  }
  for (int k = 0; k < fc.K; ++k) {
    if (fc.c[k] != 0.f) detail::filter_add(m, fc.c[k], bufs.at(k, l) + i0, y);
  }
  for (int k = 0; k < fc.K; ++k) {
    if (!filter_updates(fc, k)) continue;
    const int mask = (fc.d[k] != 0.f) << 2 | (fc.e[k] != 0.f) << 1 | (fc.f[k] != 0.f);
    detail::filter_update(mask, m, fc.d[k], fc.e[k], fc.f[k], bufs.at(k, l) + i0, y, x);
  }
  if (const float g = fc.g; g != 1.f) {
    for (int64_t i = 0; i < m; ++i) y[i] = g * y[i];
  }
  return y;
}

// How a pass writes an output it does not read back. A pass that streams more bytes than the
// threads' private caches hold cannot leave its output there for the next op: it is evicted by
// the pass's own input. Then plain stores only add a read for ownership of every output line, and
// non-temporal stores skip it. On the 148-tensor bench shape at B = 8 the clipped sums are 1/8 of
// the gradients' bytes and those reads cost 4-5% of clip_and_accumulate (measured interleaved in
// one process: 4.63 vs 4.83 ms and 4.77 vs 5.04 ms). Smaller passes keep plain stores, so that
// their output stays in cache for whatever reads it next.
class OutputStore {
 public:
  explicit OutputStore(int64_t streamed_bytes) {
    static const int64_t l2 = [] {
#ifdef _SC_LEVEL2_CACHE_SIZE
      const long v = sysconf(_SC_LEVEL2_CACHE_SIZE);
      if (v > 0) return static_cast<int64_t>(v);
#endif
      return int64_t{1} << 20;  // not reported: a common per-core L2 size
    }();
    streaming_ = streamed_bytes > l2 * at::get_num_threads();
  }

  // dst[0:n) = src[0:n).
  void operator()(const float* src, int64_t n, float* dst) const {
    int64_t e = 0;
#if defined(__AVX__)
    if (streaming_) {
      for (; e < n && reinterpret_cast<uintptr_t>(dst + e) % 32 != 0; ++e) dst[e] = src[e];
      for (; e + 8 <= n; e += 8) _mm256_stream_ps(dst + e, _mm256_loadu_ps(src + e));
    }
#endif
    std::copy(src + e, src + n, dst + e);
  }

  // Called by each thread after its last store of the pass: non-temporal stores are weakly
  // ordered, and the pass's results must be visible once the parallel region ends.
  void fence() const {
#if defined(__AVX__)
    if (streaming_) _mm_sfence();
#endif
  }

 private:
  bool streaming_ = false;
};

}  // namespace cpu
}  // namespace dpkernels

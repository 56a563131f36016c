#include "copy_kernels.hpp"

#include <pybind11/pybind11.h>

#include <errno.h>
#include <limits.h>
#include <sys/uio.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "thread_pool.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define LMCKV_X86 1
#endif

namespace lmckv {

namespace {

// Measured (benches/bench_copy.py, "kernel" table): streaming stores win from ~4 MiB up
// (1.3-2x over glibc memcpy for the 512 KiB runs of a chunk scatter, which glibc copies
// with cached stores); below that the destination fits in L2 and cached stores are as
// fast and leave the data hot for the reader.
constexpr uint64_t kDefaultStreamThreshold = 4ull << 20;
// Below this a single run (row) is copied with memcpy even when streaming. Rows of a
// tensor-parallel shard copy (W * itemsize, typically 256 B - 2 KiB) still stream whole
// cache lines.
constexpr size_t kMinStreamRun = 256;
// Piece size of cached-store copies into non-resident pages (well below glibc's
// non-temporal threshold, a few L2-sized pieces per 2 MiB).
constexpr size_t kCachedPiece = 256 << 10;

// Streaming copies walk this many 4 KiB pages in lock step, 128 bytes of each in turn.
// The hardware prefetchers stop at page boundaries, so one linear stream per core leaves
// memory idle at every page change; several streams a page apart keep more misses in
// flight (glibc's large-copy path interleaves 4 pages for the same reason). Measured
// (benches/bench_copy.py --kernels-only, 2-core VMs, 512 MiB in 512 KiB runs, 4 KiB pages):
// Intel (Sapphire Rapids): 2 threads 33-37 -> 26-29 ms (1 page = linear; one thread in a
// standalone loop 64 -> 49 ms); 4 and 16 pages within noise of 8. AMD EPYC (2026-12-02):
// the other way round and by far, 8 pages 60 ms against 30 ms linear (memcpy), scatter
// 65 vs 31 ms, gather 87 vs 32 ms; 4 pages as slow as 8 (interleaved non-temporal
// streams outrun the core's write-combining buffers there). So AMD CPUs walk linearly,
// others 8 pages; LMCACHE_KV_FAST_STREAM_INTERLEAVE=n (1..64) overrides. Strided rows
// (tensor-parallel shards, < 32 KiB) stay linear: a row-interleaved variant was within
// noise.
constexpr int kDefaultInterleavePages = 8;
constexpr int kAmdInterleavePages = 1;
constexpr size_t kPage = 4096;
constexpr size_t kInterleaveStep = 128;

int default_interleave_pages() {
  if (const char* env = std::getenv("LMCACHE_KV_FAST_STREAM_INTERLEAVE")) {
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && v >= 1 && v <= 64) return static_cast<int>(v);
  }
#ifdef LMCKV_X86
  __builtin_cpu_init();
  if (__builtin_cpu_is("amd")) return kAmdInterleavePages;
#endif
  return kDefaultInterleavePages;
}

std::atomic<int> g_kernel{static_cast<int>(Kernel::kAuto)};
std::atomic<uint64_t> g_stream_threshold{kDefaultStreamThreshold};
std::atomic<int> g_interleave_pages{default_interleave_pages()};

using StreamFn = void (*)(char*, const char*, size_t);

#ifdef LMCKV_X86
// Copy the head with memcpy until dst is `A`-aligned; returns bytes done.
inline size_t align_head(char* dst, const char* src, size_t n, size_t a) {
  size_t head = (a - (reinterpret_cast<uintptr_t>(dst) & (a - 1))) & (a - 1);
  head = std::min(head, n);
  if (head) std::memcpy(dst, src, head);
  return head;
}

// A streaming copy: memcpy until dst is `A`-aligned, then whole blocks of `pages` x 4 KiB
// walked as `pages` streams 4 KiB apart (1 page: one linear stream), then linearly, with
// `step(dst, src)` copying 128 bytes with non-temporal stores; memcpy for the last < 128.
template <size_t A, typename Step>
__attribute__((always_inline)) inline void stream_copy(char* dst, const char* src, size_t n,
                                                       Step step) {
  const size_t head = align_head(dst, src, n, A);
  dst += head;
  src += head;
  n -= head;
  const int pages = g_interleave_pages.load(std::memory_order_relaxed);
  if (pages > 1) {
    const size_t block = static_cast<size_t>(pages) * kPage;
    for (; n >= block; n -= block, dst += block, src += block) {
      for (size_t off = 0; off < kPage; off += kInterleaveStep) {
        for (size_t k = 0; k < static_cast<size_t>(pages); ++k) {
          step(dst + k * kPage + off, src + k * kPage + off);
        }
      }
    }
  }
  for (; n >= kInterleaveStep; n -= kInterleaveStep, dst += kInterleaveStep,
                               src += kInterleaveStep) {
    step(dst, src);
  }
  if (n) std::memcpy(dst, src, n);
}

// Spans side by side: each one's head by memcpy until its dst is `A`-aligned, then 128
// bytes of every span in turn while it has them, then each one's last < 128 by memcpy.
template <size_t A, typename Step>
__attribute__((always_inline)) inline void stream_side_by_side(const StreamSpan* spans,
                                                               size_t count, Step step) {
  char* d[kMaxStreamSpans];
  const char* s[kMaxStreamSpans];
  size_t n[kMaxStreamSpans], longest = 0;
  count = std::min(count, kMaxStreamSpans);
  for (size_t i = 0; i < count; ++i) {
    const size_t head = align_head(spans[i].dst, spans[i].src, spans[i].n, A);
    d[i] = spans[i].dst + head;
    s[i] = spans[i].src + head;
    n[i] = spans[i].n - head;
    longest = std::max(longest, n[i]);
  }
  for (size_t off = 0; off + kInterleaveStep <= longest; off += kInterleaveStep) {
    for (size_t i = 0; i < count; ++i) {
      if (off + kInterleaveStep <= n[i]) step(d[i] + off, s[i] + off);
    }
  }
  for (size_t i = 0; i < count; ++i) {
    const size_t tail = n[i] % kInterleaveStep;
    if (tail) std::memcpy(d[i] + n[i] - tail, s[i] + n[i] - tail, tail);
  }
}

__attribute__((target("avx512f"))) inline void step_avx512(char* d, const char* s) {
  const __m512i a = _mm512_loadu_si512(reinterpret_cast<const void*>(s));
  const __m512i b = _mm512_loadu_si512(reinterpret_cast<const void*>(s + 64));
  _mm512_stream_si512(reinterpret_cast<__m512i*>(d), a);
  _mm512_stream_si512(reinterpret_cast<__m512i*>(d + 64), b);
}

__attribute__((target("avx512f"))) void stream_avx512(char* dst, const char* src, size_t n) {
  stream_copy<64>(dst, src, n, [](char* d, const char* s) __attribute__((target("avx512f"))) {
    step_avx512(d, s);
  });
}

__attribute__((target("avx512f"))) void spans_avx512(const StreamSpan* spans, size_t count) {
  stream_side_by_side<64>(spans, count, [](char* d, const char* s)
                          __attribute__((target("avx512f"))) { step_avx512(d, s); });
}

__attribute__((target("avx2"))) void stream_avx2(char* dst, const char* src, size_t n) {
  stream_copy<32>(dst, src, n, [](char* d, const char* s) __attribute__((target("avx2"))) {
    for (size_t i = 0; i < kInterleaveStep; i += 64) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
    }
  });
}

void stream_sse2(char* dst, const char* src, size_t n) {
  stream_copy<16>(dst, src, n, [](char* d, const char* s) {
    for (size_t i = 0; i < kInterleaveStep; i += 32) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    }
  });
}

inline void store_fence() { _mm_sfence(); }

StreamFn best_stream() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return stream_avx512;
  if (__builtin_cpu_supports("avx2")) return stream_avx2;
  return stream_sse2;
}
#else
void plain_memcpy(char* dst, const char* src, size_t n) { std::memcpy(dst, src, n); }
inline void store_fence() {}
StreamFn best_stream() { return plain_memcpy; }
#endif

StreamFn stream_fn_for(Kernel k) {
#ifdef LMCKV_X86
  if (k == Kernel::kStreamAvx2) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? stream_avx2 : stream_sse2;
  }
  if (k == Kernel::kStreamSse2) return stream_sse2;
#endif
  static const StreamFn best = best_stream();
  return best;
}

}  // namespace

Kernel parse_kernel(const std::string& name) {
  if (name == "auto") return Kernel::kAuto;
  if (name == "libc") return Kernel::kLibc;
  if (name == "stream") return Kernel::kStream;
  if (name == "stream_avx2") return Kernel::kStreamAvx2;
  if (name == "stream_sse2") return Kernel::kStreamSse2;
  throw pybind11::value_error("unknown copy kernel '" + name +
                              "'; expected auto, libc, stream, stream_avx2 or stream_sse2");
}

std::string kernel_name(Kernel k) {
  switch (k) {
    case Kernel::kAuto: return "auto";
    case Kernel::kLibc: return "libc";
    case Kernel::kStream: return "stream";
    case Kernel::kStreamAvx2: return "stream_avx2";
    case Kernel::kStreamSse2: return "stream_sse2";
  }
  return "auto";
}

void set_kernel(Kernel k) { g_kernel.store(static_cast<int>(k)); }
Kernel get_kernel() { return static_cast<Kernel>(g_kernel.load()); }
void set_stream_threshold(uint64_t nbytes) { g_stream_threshold.store(nbytes); }
void set_stream_interleave(int pages) {
  if (pages < 1 || pages > 64) {
    throw pybind11::value_error("stream interleave: pages must be in [1, 64], got " +
                                std::to_string(pages));
  }
  g_interleave_pages.store(pages);
}
int get_stream_interleave() { return g_interleave_pages.load(); }
uint64_t get_stream_threshold() { return g_stream_threshold.load(); }

std::string stream_isa() {
#ifdef LMCKV_X86
  const StreamFn f = stream_fn_for(Kernel::kStream);
  if (f == stream_avx512) return "avx512";
  if (f == stream_avx2) return "avx2";
  return "sse2";
#else
  return "none";
#endif
}

void CopyPlan::add(char* dst, const char* src, uint64_t rows, uint64_t row_bytes,
                   uint64_t dst_pitch, uint64_t src_pitch, int64_t tag, bool cached) {
  if (rows == 0 || row_bytes == 0) return;
  // Callers validated sizes; rows * row_bytes cannot overflow for in-bounds ranges.
  if (rows == 1 && !ops_.empty()) {  // coalesce runs contiguous on both sides
    CopyOp& last = ops_.back();
    if (last.rows == 1 && last.tag == tag && last.cached == cached &&
        last.dst + last.row_bytes == dst && last.src + last.row_bytes == src) {
      last.row_bytes += row_bytes;
      total_ += row_bytes;
      return;
    }
  }
  ops_.push_back(CopyOp{dst, src, rows, row_bytes, dst_pitch, src_pitch, tag, cached});
  start_.push_back(total_);
  total_ += rows * row_bytes;
}

void CopyPlan::run_part(int part, int nparts, bool stream) const {
  // Split points on 64-byte boundaries of the byte stream (no shared cache lines
  // between threads for the common contiguous case).
  auto split = [&](int p) -> uint64_t {
    if (p >= nparts) return total_;
    const unsigned __int128 x = static_cast<unsigned __int128>(total_) * p / nparts;
    return static_cast<uint64_t>(x) & ~uint64_t{63};
  };
  const uint64_t begin = split(part);
  const uint64_t end = split(part + 1);
  if (begin >= end) return;
  const StreamFn sfn = stream ? stream_fn_for(get_kernel()) : nullptr;
  bool cached = false;  // of the op being copied
  auto copy = [&](char* d, const char* s, size_t n) {
    if (cached) {
      // Fresh pages: the kernel has just zeroed each one into the cache on the fault, so
      // cached stores hit it there (streaming stores would write it to memory twice). In
      // pieces, so glibc's memcpy does not switch to non-temporal stores for big runs.
      while (n > 0) {
        const size_t take = std::min<size_t>(n, kCachedPiece);
        std::memcpy(d, s, take);
        d += take;
        s += take;
        n -= take;
      }
    } else if (sfn != nullptr && n >= kMinStreamRun) {
      sfn(d, s, n);
    } else {
      std::memcpy(d, s, n);
    }
  };
  size_t i = static_cast<size_t>(std::upper_bound(start_.begin(), start_.end(), begin) -
                                 start_.begin()) - 1;
  uint64_t pos = begin;
  while (pos < end && i < ops_.size()) {
    const CopyOp& op = ops_[i];
    const uint64_t op_bytes = op.rows * op.row_bytes;
    uint64_t local = pos - start_[i];
    const uint64_t stop = std::min(end - start_[i], op_bytes);
    cached = op.cached;
    if (op.rows == 1) {
      copy(op.dst + local, op.src + local, stop - local);
      local = stop;
    } else {
      uint64_t row = local / op.row_bytes;
      uint64_t col = local % op.row_bytes;
      while (local < stop) {
        const uint64_t take = std::min(op.row_bytes - col, stop - local);
        copy(op.dst + row * op.dst_pitch + col, op.src + row * op.src_pitch + col, take);
        local += take;
        ++row;
        col = 0;
      }
    }
    pos = start_[i] + local;
    ++i;
  }
  if (sfn != nullptr) store_fence();  // order the weakly-ordered stores before "done"
}

bool CopyPlan::stream_for(uint64_t total) {
  const Kernel k = get_kernel();
  return k == Kernel::kStream || k == Kernel::kStreamAvx2 || k == Kernel::kStreamSse2 ||
         (k == Kernel::kAuto && total >= g_stream_threshold.load(std::memory_order_relaxed));
}

StreamCopyFn stream_copy_for(uint64_t total) {
  return CopyPlan::stream_for(total) ? stream_fn_for(get_kernel()) : nullptr;
}

void stream_fence() { store_fence(); }

StreamSpansFn stream_spans_for(StreamCopyFn fn) {
#ifdef LMCKV_X86
  if (fn == stream_avx512 && g_interleave_pages.load(std::memory_order_relaxed) > 1) {
    return spans_avx512;
  }
#endif
  (void)fn;
  return nullptr;
}

int CopyPlan::execute() const {
  if (total_ == 0) return 0;
  const bool stream = stream_for(total_);
  if (sequential_) {
    run_part(0, 1, stream);
    return 1;
  }
  return run_parallel(total_, 1 << 20,
                      [this, stream](int part, int nparts) { run_part(part, nparts, stream); });
}

namespace {

// Write one FileWrite completely; 0 or errno. Retries EINTR and short writes.
std::atomic<int> g_file_write_fault{0};

int write_all(const FileWrite& w) {
  if (const int fault = g_file_write_fault.load(std::memory_order_relaxed)) return fault;
  std::vector<iovec> iov(w.iov);
  size_t first = 0;
  uint64_t offset = w.offset;
  while (first < iov.size()) {
    const int cnt = static_cast<int>(std::min<size_t>(iov.size() - first, IOV_MAX));
    const ssize_t n = pwritev(w.fd, iov.data() + first, cnt, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EIO;
    offset += static_cast<uint64_t>(n);
    size_t left = static_cast<size_t>(n);
    while (first < iov.size() && left >= iov[first].iov_len) {
      left -= iov[first].iov_len;
      ++first;
    }
    if (left > 0) {
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
  return 0;
}

}  // namespace

void set_file_write_fault(int err) { g_file_write_fault.store(err); }

int execute_with_files(const CopyPlan& mem, const std::vector<FileWrite>& files) {
  uint64_t file_bytes = 0;
  for (const FileWrite& w : files) file_bytes += w.bytes;
  std::atomic<int> err{0};
  auto do_files = [&] {
    for (const FileWrite& w : files) {
      const int e = write_all(w);
      if (e != 0) {
        int expected = 0;
        err.compare_exchange_strong(expected, e);
        return;
      }
    }
  };
  const bool stream = CopyPlan::stream_for(mem.total_bytes());
  // Task 0 writes the files; tasks 1.. split the mapped copy. Tasks are handed out in
  // order, so the writes start at once and the other threads share the rest.
  run_parallel(mem.total_bytes() + file_bytes, 1 << 20, [&](int part, int nparts) {
    if (nparts == 1) {
      do_files();
      mem.run_part(0, 1, stream);
    } else if (part == 0) {
      do_files();
    } else {
      mem.run_part(part - 1, nparts - 1, stream);
    }
  });
  return err.load();
}

}  // namespace lmckv

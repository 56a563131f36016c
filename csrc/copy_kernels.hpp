// Byte-copy kernels and the parallel copy plan.
//
// A CopyPlan is a list of 2-D copies (rows of `row_bytes`, each side with its own pitch);
// executing it splits the concatenated byte stream of all copies evenly across the pool
// threads (splitting inside runs and rows), so one huge run still uses every thread.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace lmckv {

// Byte-copy kernel selection.
//   auto:   glibc memcpy for jobs below the streaming threshold, streaming (non-temporal)
//           stores for larger jobs (they skip the read-for-ownership of the destination
//           and do not evict the cache for data that is not re-read soon).
//   libc:   always glibc memcpy.
//   stream: always streaming stores (best ISA available: AVX-512, AVX2 or SSE2).
//   stream_avx2 / stream_sse2: force one ISA (benchmarking).
enum class Kernel { kAuto, kLibc, kStream, kStreamAvx2, kStreamSse2 };

Kernel parse_kernel(const std::string& name);  // ValueError on an unknown name
std::string kernel_name(Kernel k);
void set_kernel(Kernel k);
Kernel get_kernel();
// Jobs of at least this many bytes use streaming stores under Kernel::kAuto.
void set_stream_threshold(uint64_t nbytes);
uint64_t get_stream_threshold();
// Streaming copies walk this many 4 KiB pages in lock step (1: one linear stream).
void set_stream_interleave(int pages);  // ValueError outside [1, 64]
int get_stream_interleave();
// Name of the streaming implementation picked for this CPU ("avx512", "avx2", "sse2", "none").
std::string stream_isa();

// The streaming copy CopyPlan::execute() would use for a job of `total` bytes (by the
// configured kernel, threshold and ISA), or nullptr: cached stores (memcpy). A caller
// that streams runs stream_fence() at the end of each part (weakly-ordered stores).
using StreamCopyFn = void (*)(char* dst, const char* src, size_t n);
StreamCopyFn stream_copy_for(uint64_t total);
void stream_fence();

// Several streaming copies walked side by side, 128 bytes of each in turn: runs shorter
// than stream_copy's interleaved block (a gather's runs of a few rows) keep as many
// streams in flight as its pages do. `fn` is what stream_copy_for returned; returns
// nullptr where runs are copied one after the other: an interleave of 1 page (AMD), or
// an ISA without this walker (only the AVX-512 copy has one).
struct StreamSpan {
  char* dst;
  const char* src;
  size_t n;
};
constexpr size_t kMaxStreamSpans = 8;
using StreamSpansFn = void (*)(const StreamSpan* spans, size_t count);  // count <= kMaxStreamSpans
StreamSpansFn stream_spans_for(StreamCopyFn fn);

struct CopyOp {
  char* dst;
  const char* src;
  uint64_t rows;
  uint64_t row_bytes;
  uint64_t dst_pitch;
  uint64_t src_pitch;
  int64_t tag;   // caller's label (kv copies: the region index); runs coalesce within a tag
  bool cached;   // destination pages are not resident: always use cached stores (see below)
};

class CopyPlan {
 public:
  void reserve(size_t n) {
    ops_.reserve(n);
    start_.reserve(n);
  }
  // Add `rows` rows of `row_bytes` bytes; rows == 1 is a flat run.
  void add(char* dst, const char* src, uint64_t rows, uint64_t row_bytes, uint64_t dst_pitch,
           uint64_t src_pitch, int64_t tag = -1, bool cached = false);
  const std::vector<CopyOp>& ops() const { return ops_; }
  bool sequential() const { return sequential_; }
  uint64_t total_bytes() const { return total_; }
  size_t size() const { return ops_.size(); }
  // Keep the copies in order on one thread (overlapping destinations: last write wins,
  // as a sequential copy would give).
  void set_sequential(bool v) { sequential_ = v; }

  // Run the copies (pool or calling thread). Call WITHOUT the GIL. Returns parts used.
  int execute() const;

  // Whether execute() would use streaming stores for a job of `total` bytes.
  static bool stream_for(uint64_t total);
  // Copy byte range [total * part / nparts, total * (part + 1) / nparts) of the plan.
  void run_part(int part, int nparts, bool stream) const;

 private:
  std::vector<CopyOp> ops_;
  std::vector<uint64_t> start_;  // byte offset of each op in the concatenated stream
  uint64_t total_ = 0;
  bool sequential_ = false;
};

// One positional write into a file: `iov` gathered from memory, written at `offset`.
struct FileWrite {
  int fd;
  uint64_t offset;
  uint64_t bytes;
  std::vector<iovec> iov;
};

// Run `mem` on the pool while one participant writes `files` (in order, with pwritev)
// concurrently. Stores into pages a tmpfs file does not have yet are ~2x cheaper through
// write(2) than through a mapping: the kernel skips zeroing a page that a write covers
// whole and there is no page fault per 4 KiB. Writes to one file serialise on its inode
// lock, so one participant does them all while the others copy through the mapping.
// Call WITHOUT the GIL. Never throws: returns 0, or the errno of the first failed write
// (the remaining writes are skipped; `mem` is still copied).
int execute_with_files(const CopyPlan& mem, const std::vector<FileWrite>& files);

// Fault injection for tests: every file write fails with `err` (0: off).
void set_file_write_fault(int err);

}  // namespace lmckv

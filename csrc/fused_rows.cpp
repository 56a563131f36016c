#include "fused_rows.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "common.hpp"
#include "copy_kernels.hpp"
#include "rope_rotate.hpp"
#include "thread_pool.hpp"

namespace lmckv {

namespace {

constexpr const char* kWhat = "fused_rows";
// Shorter runs are copied with memcpy even when streaming (as CopyPlan's kMinStreamRun).
constexpr uint64_t kMinStreamBytes = 256;
// Piece size of cached-store copies (as copy_kernels.cpp's kCachedPiece).
constexpr uint64_t kCachedPiece = 256 << 10;

// Cold destinations (common.hpp: mostly_absent) get cached stores: the first store to
// each page faults in a zeroed page, which cached stores then hit in the cache while
// streaming ones write it to memory twice. Measured (7 x 32 MiB chunks, 2 threads, fresh
// pages): streaming 75 ms, cached 58 ms.
bool cold_pages(const char* p, uint64_t n) {
  const long ps = sysconf(_SC_PAGESIZE);
  return ps > 0 && mostly_absent(reinterpret_cast<uintptr_t>(p), n, static_cast<uint64_t>(ps));
}

std::string num(uint64_t v) { return std::to_string(v); }

std::string object_shape(const FusedRowsArgs& a) {
  return "[" + num(a.planes) + ", " + num(a.layers) + ", " + num(a.chunk_tokens) + ", " +
         num(a.width) + "] x " + num(a.itemsize);
}

}  // namespace

// Every count >= 1 and the rotation's geometry; the object's bytes, overflow-checked.
uint64_t FusedRowsPlan::checked_chunk_nbytes(const FusedRowsArgs& a) {
  if (a.planes == 0 || a.layers == 0 || a.chunk_tokens == 0 || a.width == 0 ||
      a.itemsize == 0) {
    fused_fail(kWhat, "planes, layers, chunk_tokens, width and itemsize must be >= 1, got [" +
                          num(a.planes) + ", " + num(a.layers) + ", " + num(a.chunk_tokens) +
                          ", " + num(a.width) + "] x " + num(a.itemsize));
  }
  check_fused_rotation(a, kWhat);
  const uint64_t row = checked_mul(a.width, a.itemsize, kWhat);
  const uint64_t plc = checked_mul(checked_mul(a.planes, a.layers, kWhat), a.chunk_tokens, kWhat);
  return checked_mul(plc, row, kWhat);
}

FusedRowsPlan::FusedRowsPlan(const FusedRowsArgs& a)
    : a_(a),
      row_bytes_(a.width * a.itemsize),  // checked by checked_chunk_nbytes below
      chunk_nbytes_(checked_chunk_nbytes(a)),
      half_(a.rotary_dim / 2),
      io_(a, kWhat, chunk_nbytes_, object_shape(a)) {
  build_runs();
  for (char* d : io_.dst) cold_.push_back(cold_pages(d, chunk_nbytes_) ? 1 : 0);
}

void FusedRowsPlan::build_runs() {
  const uint64_t c = a_.chunk_tokens;
  run_start_.assign(1, 0);
  for (const uint64_t id : io_.ids) {
    for (uint64_t r = 0; r < c; ++r) {
      const auto s = static_cast<uint64_t>(io_.idx[id * c + r]);
      const uint64_t chunk = s / c, row = s % c;
      if (runs_.size() > run_start_.back()) {
        Run& last = runs_.back();
        if (last.src_chunk == chunk && last.src_row + last.rows == row) {
          ++last.rows;
          continue;
        }
      }
      runs_.push_back(Run{r, chunk, row, 1});
    }
    run_start_.push_back(runs_.size());
  }
}

// Rows [r0, r1) of block `block` = (destination j, plane p, layer l). Copied runs use
// `stream` when set and the destination's pages are there: non-temporal stores, up to
// kMaxStreamSpans runs side by side (a selection's runs are a few rows, shorter than one
// interleaved block of stream_copy). Rotated rows are stored normally: staging them to
// stream out was no faster (docs/performance.md).
void FusedRowsPlan::run_block(uint64_t block, uint64_t r0, uint64_t r1,
                              StreamCopyFn stream) const {
  const uint64_t pl_count = a_.planes * a_.layers;
  const uint64_t j = block / pl_count, pl = block % pl_count;
  const uint64_t plane_off = pl * a_.chunk_tokens * row_bytes_, row = row_bytes_;
  char* const dbase = io_.dst[j] + plane_off;
  const bool rotate = pl < a_.layers && a_.rotary_dim;  // plane 0
  const RowGeom g{rotate ? a_.width / a_.head_dim : 0, a_.head_dim, a_.rotary_dim, half_,
                  a_.interleaved};
  const RotateFn fn = rotate ? rotate_for(a_.dtype, g) : nullptr;
  const uint64_t t0 = io_.ids[j] * a_.chunk_tokens;  // output token of row 0
  const Run* first = runs_.data() + run_start_[j];
  const Run* last = runs_.data() + run_start_[j + 1];
  // the run holding r0: the last one starting at or before it
  const Run* run = std::upper_bound(first, last, r0,
                                    [](uint64_t r, const Run& x) { return r < x.dst_row; }) - 1;
  const StreamSpansFn side_by_side = stream_spans_for(stream);
  StreamSpan spans[kMaxStreamSpans];
  size_t nspans = 0;
  for (; run < last && run->dst_row < r1; ++run) {
    uint64_t lo = std::max(r0, run->dst_row);
    const uint64_t hi = std::min(r1, run->dst_row + run->rows);
    char* d = dbase + lo * row;
    const char* s = io_.src[run->src_chunk] + plane_off + (run->src_row + lo - run->dst_row) * row;
    if (rotate) {
      for (; lo < hi; ++lo, d += row, s += row) {
        fn(d, s, io_.cos + (t0 + lo) * half_, io_.sin + (t0 + lo) * half_, g);
      }
    } else if (stream != nullptr && !cold_[j] && (hi - lo) * row >= kMinStreamBytes) {
      if (side_by_side == nullptr) {
        stream(d, s, (hi - lo) * row);
        continue;
      }
      spans[nspans++] = StreamSpan{d, s, (hi - lo) * row};  // runs write disjoint rows
      if (nspans == kMaxStreamSpans) {
        side_by_side(spans, nspans);
        nspans = 0;
      }
    } else {
      // in pieces: glibc would switch to non-temporal stores for big ones
      for (uint64_t n = (hi - lo) * row, take; n > 0; n -= take, d += take, s += take) {
        take = std::min(n, kCachedPiece);
        std::memcpy(d, s, take);
      }
    }
  }
  if (nspans > 0) side_by_side(spans, nspans);
}

// Global rows [first, last) of the (destination, plane, layer, row) order.
void FusedRowsPlan::run_rows(uint64_t first, uint64_t last, StreamCopyFn stream) const {
  const uint64_t c = a_.chunk_tokens;
  while (first < last) {
    const uint64_t block = first / c, r0 = first % c;
    const uint64_t r1 = std::min(c, r0 + (last - first));
    run_block(block, r0, r1, stream);
    first += r1 - r0;
  }
  if (stream != nullptr) stream_fence();  // order the weakly-ordered stores before "done"
}

void FusedRowsPlan::execute() const {
  const uint64_t total = io_.dst.size() * a_.planes * a_.layers * a_.chunk_tokens;
  if (total == 0) return;
  const int max_tasks = static_cast<int>(std::min<uint64_t>(total, 1u << 20));
  const StreamCopyFn stream = stream_copy_for(total_bytes());
  run_parallel(total_bytes(), max_tasks, [this, total, stream](int task, int ntasks) {
    using U = unsigned __int128;  // total * ntasks may pass 64 bits
    const U t = static_cast<U>(task), nt = static_cast<U>(ntasks);
    run_rows(static_cast<uint64_t>(total * t / nt), static_cast<uint64_t>(total * (t + 1) / nt),
             stream);
  });
}

}  // namespace lmckv

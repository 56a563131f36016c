#include "fused_rows.hpp"

#include <pybind11/pybind11.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>

#include "common.hpp"
#include "copy_kernels.hpp"
#include "rope_rotate.hpp"
#include "thread_pool.hpp"

namespace lmckv {

namespace py = pybind11;

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

[[noreturn]] void fail(const std::string& msg) {
  throw py::value_error(std::string(kWhat) + ": " + msg);
}

std::string num(uint64_t v) { return std::to_string(v); }

void check_geometry(const FusedRowsArgs& a) {
  if (a.planes == 0 || a.layers == 0 || a.chunk_tokens == 0 || a.width == 0 ||
      a.itemsize == 0) {
    fail("planes, layers, chunk_tokens, width and itemsize must be >= 1, got [" +
         num(a.planes) + ", " + num(a.layers) + ", " + num(a.chunk_tokens) + ", " +
         num(a.width) + "] x " + num(a.itemsize));
  }
  if (a.rotary_dim == 0) return;
  const uint64_t esize = a.dtype == EditDType::kF32 ? 4 : 2;
  if (a.itemsize != esize) {
    fail("a rotation of " + std::string(a.dtype == EditDType::kF32 ? "float32" : "bfloat16") +
         " rows needs itemsize " + num(esize) + ", got " + num(a.itemsize));
  }
  if (a.head_dim == 0 || a.width % a.head_dim) {
    fail("width " + num(a.width) + " is not a whole number of heads of " + num(a.head_dim));
  }
  if (a.rotary_dim % 2 || a.rotary_dim > a.head_dim) {
    fail("rotary_dim must be even and at most head_dim " + num(a.head_dim) + ", got " +
         num(a.rotary_dim));
  }
}

// [lo, hi) byte ranges.
using Range = std::pair<uint64_t, uint64_t>;

// The sorted, pairwise disjoint `dst` range that overlaps [lo, hi), or nullptr.
const Range* hit(const std::vector<Range>& dst, uint64_t lo, uint64_t hi) {
  if (lo == hi) return nullptr;
  auto it = std::lower_bound(dst.begin(), dst.end(), Range{hi, 0});  // first starting >= hi
  if (it == dst.begin()) return nullptr;
  --it;  // the last destination starting before hi: the one reaching furthest
  return it->second > lo ? &*it : nullptr;
}

}  // namespace

FusedRowsPlan::FusedRowsPlan(const FusedRowsArgs& a) : a_(a) {
  check_geometry(a);
  row_bytes_ = checked_mul(a.width, a.itemsize, kWhat);
  const uint64_t plc = checked_mul(checked_mul(a.planes, a.layers, kWhat), a.chunk_tokens, kWhat);
  chunk_nbytes_ = checked_mul(plc, row_bytes_, kWhat);
  half_ = a.rotary_dim / 2;
  check_regions(a);
  check_ids(a);
  read_index(a);
  check_overlaps(a);
  for (char* d : dst_) cold_.push_back(cold_pages(d, chunk_nbytes_) ? 1 : 0);
}

// Region counts, addresses and sizes: each holds at least one chunk object.
void FusedRowsPlan::check_regions(const FusedRowsArgs& a) {
  if (a.src_addrs.size() != a.src_nbytes.size()) {
    fail(num(a.src_addrs.size()) + " source addresses for " + num(a.src_nbytes.size()) +
         " lengths");
  }
  if (a.dst_addrs.size() != a.dst_nbytes.size() || a.dst_ids.size() != a.dst_addrs.size()) {
    fail(num(a.dst_ids.size()) + " destination chunk ids for " + num(a.dst_addrs.size()) +
         " destination regions (" + num(a.dst_nbytes.size()) + " lengths)");
  }
  const std::string shape = "[" + num(a.planes) + ", " + num(a.layers) + ", " +
                            num(a.chunk_tokens) + ", " + num(a.width) + "] x " +
                            num(a.itemsize);
  auto check = [&](const std::vector<int64_t>& addrs, const std::vector<int64_t>& lens,
                   const char* kind, size_t j) {
    if (addrs[j] <= 0) fail(std::string(kind) + " region " + num(j) + " has a null address");
    if (lens[j] < 0 || static_cast<uint64_t>(lens[j]) < chunk_nbytes_) {
      fail(std::string(kind) + " region " + num(j) + " holds " + std::to_string(lens[j]) +
           " bytes, expected at least " + num(chunk_nbytes_) + " (one " + shape + " chunk)");
    }
    checked_add(static_cast<uint64_t>(addrs[j]), static_cast<uint64_t>(lens[j]), kWhat);
    if (a.rotary_dim && static_cast<uint64_t>(addrs[j]) % a.itemsize) {  // rotated as T*
      fail(std::string(kind) + " region " + num(j) + " at " + std::to_string(addrs[j]) +
           " is not aligned to its " + num(a.itemsize) + "-byte elements");
    }
    return reinterpret_cast<char*>(static_cast<uintptr_t>(addrs[j]));
  };
  for (size_t j = 0; j < a.src_addrs.size(); ++j) {
    src_.push_back(check(a.src_addrs, a.src_nbytes, "source", j));
  }
  for (size_t j = 0; j < a.dst_addrs.size(); ++j) {
    dst_.push_back(check(a.dst_addrs, a.dst_nbytes, "destination", j));
  }
}

// Destination chunk ids: unique, each chunk's tokens inside the index.
void FusedRowsPlan::check_ids(const FusedRowsArgs& a) {
  const uint64_t c = a.chunk_tokens;
  for (size_t j = 0; j < a.dst_ids.size(); ++j) {
    const int64_t id = a.dst_ids[j];
    if (id < 0) fail("destination chunk id " + num(j) + " is " + std::to_string(id) + ", < 0");
    const uint64_t end = checked_mul(static_cast<uint64_t>(id) + 1, c, kWhat);
    if (end > a.n_out) {
      fail("destination chunk id " + num(j) + " is " + std::to_string(id) +
           ": its output tokens [" + num(end - c) + ", " + num(end) + ") pass the index's " +
           num(a.n_out) + " (at most " + num(a.n_out / c) + " chunks of " + num(c) + ")");
    }
    ids_.push_back(static_cast<uint64_t>(id));
  }
  std::vector<uint64_t> sorted(ids_);
  std::sort(sorted.begin(), sorted.end());
  const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  if (dup != sorted.end()) fail("destination chunk id " + num(*dup) + " appears twice");
}

// The index (copied: nothing reads the caller's buffer after planning), every value
// checked, then the runs; the tables' spans.
void FusedRowsPlan::read_index(const FusedRowsArgs& a) {
  const uint64_t n_src_rows = checked_mul(src_.size(), a.chunk_tokens, kWhat);
  const char* p = checked_span(a.idx.base, a.idx.nbytes, a.idx.offset,
                               checked_mul(a.n_out, 8, kWhat), kWhat, "index");
  std::vector<int64_t> idx(a.n_out);
  if (a.n_out) std::memcpy(idx.data(), p, a.n_out * 8);
  for (uint64_t t = 0; t < a.n_out; ++t) {
    if (idx[t] < 0 || static_cast<uint64_t>(idx[t]) >= n_src_rows) {
      fail("index " + num(t) + " is " + std::to_string(idx[t]) + ", outside [0, " +
           num(n_src_rows) + ") (" + num(src_.size()) + " source chunks of " +
           num(a.chunk_tokens) + " tokens)");
    }
  }
  const uint64_t tab = a.rotary_dim ? checked_mul(a.n_out, checked_mul(half_, 4, kWhat), kWhat) : 0;
  const char* c = checked_span(a.cos.base, a.cos.nbytes, a.cos.offset, tab, kWhat, "cos");
  const char* s = checked_span(a.sin.base, a.sin.nbytes, a.sin.offset, tab, kWhat, "sin");
  if (reinterpret_cast<uint64_t>(c) % 4 || reinterpret_cast<uint64_t>(s) % 4) {
    fail("cos and sin must be 4-byte aligned float32 tables");
  }
  cos_ = reinterpret_cast<const float*>(c);
  sin_ = reinterpret_cast<const float*>(s);
  build_runs(idx);
}

// No destination chunk overlaps another, a source chunk or a table (bytes each touches).
void FusedRowsPlan::check_overlaps(const FusedRowsArgs& a) const {
  std::vector<Range> dst;
  std::vector<size_t> order(dst_.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) { return dst_[x] < dst_[y]; });
  for (size_t k = 0; k < order.size(); ++k) {
    const auto lo = reinterpret_cast<uint64_t>(dst_[order[k]]);
    if (k && lo < dst.back().second) {
      fail("destination regions " + num(order[k - 1]) + " and " + num(order[k]) + " overlap");
    }
    dst.emplace_back(lo, lo + chunk_nbytes_);
  }
  for (size_t j = 0; j < src_.size(); ++j) {
    const auto lo = reinterpret_cast<uint64_t>(src_[j]);
    if (const Range* r = hit(dst, lo, lo + chunk_nbytes_)) {
      const auto d = static_cast<size_t>(std::find(dst.begin(), dst.end(), *r) - dst.begin());
      fail("destination region " + num(order[d]) + " overlaps source region " + num(j));
    }
  }
  const uint64_t tab = a.rotary_dim ? a.n_out * half_ * 4 : 0;
  for (const float* t : {cos_, sin_}) {
    const auto lo = reinterpret_cast<uint64_t>(t);
    if (t != nullptr && hit(dst, lo, lo + tab)) fail("a destination region overlaps cos or sin");
  }
}

void FusedRowsPlan::build_runs(const std::vector<int64_t>& idx) {
  const uint64_t c = a_.chunk_tokens;
  run_start_.assign(1, 0);
  for (const uint64_t id : ids_) {
    for (uint64_t r = 0; r < c; ++r) {
      const auto s = static_cast<uint64_t>(idx[id * c + r]);
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
// `stream` when set and the destination's pages are there: non-temporal stores, measured
// 13 ms against 18 with memcpy (7 x 32 MiB bf16 chunks from 8, drop every 10th, 2
// threads). Rotated rows are stored normally: staging them to stream out was no faster.
void FusedRowsPlan::run_block(uint64_t block, uint64_t r0, uint64_t r1,
                              StreamCopyFn stream) const {
  const uint64_t pl_count = a_.planes * a_.layers;
  const uint64_t j = block / pl_count, pl = block % pl_count;
  const uint64_t plane_off = pl * a_.chunk_tokens * row_bytes_, row = row_bytes_;
  char* const dbase = dst_[j] + plane_off;
  const bool rotate = pl < a_.layers && a_.rotary_dim;  // plane 0
  const RowGeom g{rotate ? a_.width / a_.head_dim : 0, a_.head_dim, a_.rotary_dim, half_,
                  a_.interleaved};
  const RotateFn fn = rotate ? rotate_for(a_.dtype, g) : nullptr;
  const uint64_t t0 = ids_[j] * a_.chunk_tokens;  // output token of row 0
  const Run* first = runs_.data() + run_start_[j];
  const Run* last = runs_.data() + run_start_[j + 1];
  // the run holding r0: the last one starting at or before it
  const Run* run = std::upper_bound(first, last, r0,
                                    [](uint64_t r, const Run& x) { return r < x.dst_row; }) - 1;
  for (; run < last && run->dst_row < r1; ++run) {
    uint64_t lo = std::max(r0, run->dst_row);
    const uint64_t hi = std::min(r1, run->dst_row + run->rows);
    char* d = dbase + lo * row;
    const char* s = src_[run->src_chunk] + plane_off + (run->src_row + lo - run->dst_row) * row;
    if (rotate) {
      for (; lo < hi; ++lo, d += row, s += row) {
        fn(d, s, cos_ + (t0 + lo) * half_, sin_ + (t0 + lo) * half_, g);
      }
    } else if (stream != nullptr && !cold_[j] && (hi - lo) * row >= kMinStreamBytes) {
      stream(d, s, (hi - lo) * row);
    } else {
      // in pieces: glibc would switch to non-temporal stores for big ones
      for (uint64_t n = (hi - lo) * row, take; n > 0; n -= take, d += take, s += take) {
        take = std::min(n, kCachedPiece);
        std::memcpy(d, s, take);
      }
    }
  }
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
  const uint64_t total = dst_.size() * a_.planes * a_.layers * a_.chunk_tokens;
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

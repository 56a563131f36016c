#include "fused_chunks.hpp"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <utility>

#include "common.hpp"

namespace lmckv {

namespace py = pybind11;

namespace {

std::string num(uint64_t v) { return std::to_string(v); }

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

// Region counts, addresses and sizes: each holds at least one chunk object.
void check_regions(FusedChunks& io, const FusedChunkArgs& a, const char* op,
                   const std::string& shape) {
  if (a.src_addrs.size() != a.src_nbytes.size()) {
    fused_fail(op, num(a.src_addrs.size()) + " source addresses for " +
                       num(a.src_nbytes.size()) + " lengths");
  }
  if (a.dst_addrs.size() != a.dst_nbytes.size() || a.dst_ids.size() != a.dst_addrs.size()) {
    fused_fail(op, num(a.dst_ids.size()) + " destination chunk ids for " +
                       num(a.dst_addrs.size()) + " destination regions (" +
                       num(a.dst_nbytes.size()) + " lengths)");
  }
  auto check = [&](const std::vector<int64_t>& addrs, const std::vector<int64_t>& lens,
                   const char* kind, size_t j) {
    const std::string region = std::string(kind) + " region " + num(j);
    if (addrs[j] <= 0) fused_fail(op, region + " has a null address");
    if (lens[j] < 0 || static_cast<uint64_t>(lens[j]) < io.chunk_nbytes) {
      fused_fail(op, region + " holds " + std::to_string(lens[j]) + " bytes, expected at least " +
                         num(io.chunk_nbytes) + " (one " + shape + " chunk)");
    }
    checked_add(static_cast<uint64_t>(addrs[j]), static_cast<uint64_t>(lens[j]), op);
    if (a.rotary_dim && static_cast<uint64_t>(addrs[j]) % a.itemsize) {  // rotated as T*
      fused_fail(op, region + " at " + std::to_string(addrs[j]) + " is not aligned to its " +
                         num(a.itemsize) + "-byte elements");
    }
    return reinterpret_cast<char*>(static_cast<uintptr_t>(addrs[j]));
  };
  for (size_t j = 0; j < a.src_addrs.size(); ++j) {
    io.src.push_back(check(a.src_addrs, a.src_nbytes, "source", j));
  }
  for (size_t j = 0; j < a.dst_addrs.size(); ++j) {
    io.dst.push_back(check(a.dst_addrs, a.dst_nbytes, "destination", j));
  }
}

// Destination chunk ids: unique, each chunk's tokens inside the index.
void check_ids(FusedChunks& io, const FusedChunkArgs& a, const char* op) {
  const uint64_t c = a.chunk_tokens;
  for (size_t j = 0; j < a.dst_ids.size(); ++j) {
    const int64_t id = a.dst_ids[j];
    const std::string what = "destination chunk id " + num(j) + " is " + std::to_string(id);
    if (id < 0) fused_fail(op, what + ", < 0");
    const uint64_t end = checked_mul(static_cast<uint64_t>(id) + 1, c, op);
    if (end > a.n_out) {
      fused_fail(op, what + ": its output tokens [" + num(end - c) + ", " + num(end) +
                         ") pass the index's " + num(a.n_out) + " (at most " +
                         num(a.n_out / c) + " chunks of " + num(c) + ")");
    }
    io.ids.push_back(static_cast<uint64_t>(id));
  }
  std::vector<uint64_t> sorted(io.ids);
  std::sort(sorted.begin(), sorted.end());
  const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  if (dup != sorted.end()) fused_fail(op, "destination chunk id " + num(*dup) + " appears twice");
}

// The index (copied), every value checked; the tables' spans.
void read_index(FusedChunks& io, const FusedChunkArgs& a, const char* op) {
  const uint64_t n_src_rows = checked_mul(io.src.size(), a.chunk_tokens, op);
  const char* p = checked_span(a.idx.base, a.idx.nbytes, a.idx.offset,
                               checked_mul(a.n_out, 8, op), op, "index");
  io.idx.resize(a.n_out);
  if (a.n_out) std::memcpy(io.idx.data(), p, a.n_out * 8);
  for (uint64_t t = 0; t < a.n_out; ++t) {
    if (io.idx[t] < 0 || static_cast<uint64_t>(io.idx[t]) >= n_src_rows) {
      fused_fail(op, "index " + num(t) + " is " + std::to_string(io.idx[t]) + ", outside [0, " +
                         num(n_src_rows) + ") (" + num(io.src.size()) + " source chunks of " +
                         num(a.chunk_tokens) + " tokens)");
    }
  }
  const uint64_t half = a.rotary_dim / 2;
  const uint64_t tab = a.rotary_dim ? checked_mul(a.n_out, checked_mul(half, 4, op), op) : 0;
  const char* c = checked_span(a.cos.base, a.cos.nbytes, a.cos.offset, tab, op, "cos");
  const char* s = checked_span(a.sin.base, a.sin.nbytes, a.sin.offset, tab, op, "sin");
  if (reinterpret_cast<uint64_t>(c) % 4 || reinterpret_cast<uint64_t>(s) % 4) {
    fused_fail(op, "cos and sin must be 4-byte aligned float32 tables");
  }
  io.cos = reinterpret_cast<const float*>(c);
  io.sin = reinterpret_cast<const float*>(s);
}

// No destination chunk overlaps another, a source chunk or a table (bytes each touches).
void check_overlaps(const FusedChunks& io, const FusedChunkArgs& a, const char* op) {
  std::vector<Range> dst;
  std::vector<size_t> order(io.dst.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t x, size_t y) { return io.dst[x] < io.dst[y]; });
  for (size_t k = 0; k < order.size(); ++k) {
    const auto lo = reinterpret_cast<uint64_t>(io.dst[order[k]]);
    if (k && lo < dst.back().second) {
      fused_fail(op, "destination regions " + num(order[k - 1]) + " and " + num(order[k]) +
                         " overlap");
    }
    dst.emplace_back(lo, lo + io.chunk_nbytes);
  }
  for (size_t j = 0; j < io.src.size(); ++j) {
    const auto lo = reinterpret_cast<uint64_t>(io.src[j]);
    if (const Range* r = hit(dst, lo, lo + io.chunk_nbytes)) {
      const auto d = static_cast<size_t>(std::find(dst.begin(), dst.end(), *r) - dst.begin());
      fused_fail(op, "destination region " + num(order[d]) + " overlaps source region " + num(j));
    }
  }
  const uint64_t tab = a.rotary_dim ? a.n_out * (a.rotary_dim / 2) * 4 : 0;
  for (const float* t : {io.cos, io.sin}) {
    const auto lo = reinterpret_cast<uint64_t>(t);
    if (t != nullptr && hit(dst, lo, lo + tab)) {
      fused_fail(op, "a destination region overlaps cos or sin");
    }
  }
}

}  // namespace

void fused_fail(const char* op, const std::string& msg) {
  throw py::value_error(std::string(op) + ": " + msg);
}

void check_fused_rotation(const FusedChunkArgs& a, const char* op) {
  if (a.rotary_dim == 0) return;
  const uint64_t esize = a.dtype == EditDType::kF32 ? 4 : 2;
  if (a.itemsize != esize) {
    fused_fail(op, "a rotation of " +
                       std::string(a.dtype == EditDType::kF32 ? "float32" : "bfloat16") +
                       " rows needs itemsize " + num(esize) + ", got " + num(a.itemsize));
  }
  if (a.head_dim == 0 || a.width % a.head_dim) {
    fused_fail(op, "width " + num(a.width) + " is not a whole number of heads of " +
                       num(a.head_dim));
  }
  if (a.rotary_dim % 2 || a.rotary_dim > a.head_dim) {
    fused_fail(op, "rotary_dim must be even and at most head_dim " + num(a.head_dim) +
                       ", got " + num(a.rotary_dim));
  }
}

FusedChunks::FusedChunks(const FusedChunkArgs& a, const char* op, uint64_t nbytes,
                         const std::string& shape)
    : chunk_nbytes(nbytes) {
  check_regions(*this, a, op, shape);
  check_ids(*this, a, op);
  read_index(*this, a, op);
  check_overlaps(*this, a, op);
}

}  // namespace lmckv

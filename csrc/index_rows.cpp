#include "index_rows.hpp"

#include <pybind11/pybind11.h>

#include <cstring>
#include <string>
#include <vector>

#include "common.hpp"

namespace lmckv {

namespace py = pybind11;

namespace {

constexpr const char* kWhat = "index_rows";
// Most flat copies a plan holds (outer index x run) before it switches to 2-D copies.
constexpr uint64_t kMaxFlatOps = 1u << 16;

int64_t index_at(const char* idx, uint64_t itemsize, uint64_t i) {
  if (itemsize == 8) {
    int64_t v;
    std::memcpy(&v, idx + i * 8, 8);
    return v;
  }
  int32_t v;
  std::memcpy(&v, idx + i * 4, 4);
  return v;
}

}  // namespace

CopyPlan plan_index_rows(const IndexRowsArgs& a) {
  if (a.idx_itemsize != 4 && a.idx_itemsize != 8) {
    throw py::value_error(std::string(kWhat) + ": index itemsize must be 4 or 8, got " +
                          std::to_string(a.idx_itemsize));
  }
  const uint64_t src_span = checked_mul(checked_mul(a.outer, a.rows, kWhat), a.row_bytes, kWhat);
  const uint64_t dst_span = checked_mul(checked_mul(a.outer, a.n_idx, kWhat), a.row_bytes, kWhat);
  const char* idx = checked_span(a.idx, a.idx_nbytes, a.idx_offset,
                                 checked_mul(a.n_idx, a.idx_itemsize, kWhat), kWhat, "index");
  const char* src = checked_span(a.src, a.src_nbytes, a.src_offset, src_span, kWhat, "source");
  char* dst = const_cast<char*>(checked_span(a.dst, a.dst_nbytes, a.dst_offset, dst_span,
                                             kWhat, "destination"));
  CopyPlan plan;
  const uint64_t s0 = reinterpret_cast<uint64_t>(src), d0 = reinterpret_cast<uint64_t>(dst);
  if (src_span != 0 && dst_span != 0 && s0 < d0 + dst_span && d0 < s0 + src_span) {
    throw py::value_error(std::string(kWhat) + ": source and destination overlap");
  }
  // Runs of consecutive indices; every index checked before any byte moves.
  struct Run {
    uint64_t dst_row, src_row, n;
  };
  std::vector<Run> runs;
  uint64_t i = 0;
  while (i < a.n_idx) {
    const int64_t first = index_at(idx, a.idx_itemsize, i);
    uint64_t n = 1;
    for (;; ++n) {
      const int64_t v = index_at(idx, a.idx_itemsize, i + n - 1);
      if (v < 0 || static_cast<uint64_t>(v) >= a.rows) {
        throw py::value_error(std::string(kWhat) + ": index " + std::to_string(i + n - 1) +
                              " is " + std::to_string(v) + ", outside [0, " +
                              std::to_string(a.rows) + ")");
      }
      if (i + n >= a.n_idx || index_at(idx, a.idx_itemsize, i + n) != v + 1) break;
    }
    runs.push_back(Run{i, static_cast<uint64_t>(first), n});
    i += n;
  }
  if (dst_span == 0) return plan;
  const uint64_t src_pitch = a.rows * a.row_bytes, dst_pitch = a.n_idx * a.row_bytes;
  // The destination in order (one flat copy per run and outer index) while that is a
  // modest number of copies; else one 2-D copy per run over every outer index.
  const bool flat = checked_mul(a.outer, runs.size(), kWhat) <= kMaxFlatOps;
  plan.reserve(flat ? a.outer * runs.size() : runs.size());
  if (flat) {
    for (uint64_t o = 0; o < a.outer; ++o) {
      for (const Run& r : runs) {
        plan.add(dst + o * dst_pitch + r.dst_row * a.row_bytes,
                 src + o * src_pitch + r.src_row * a.row_bytes, 1, r.n * a.row_bytes, 0, 0);
      }
    }
  } else {
    for (const Run& r : runs) {
      plan.add(dst + r.dst_row * a.row_bytes, src + r.src_row * a.row_bytes, a.outer,
               r.n * a.row_bytes, dst_pitch, src_pitch);
    }
  }
  return plan;
}

}  // namespace lmckv

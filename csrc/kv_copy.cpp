#include "kv_copy.hpp"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <utility>

#include "common.hpp"

namespace lmckv {

namespace py = pybind11;

namespace {

std::string num(uint64_t v) { return std::to_string(v); }

}  // namespace

CopyPlan plan_kv_copy(bool to_regions, uintptr_t tensor_ptr, uint64_t tensor_nbytes,
                      const KvGeometry& g, const std::vector<int64_t>& chunk_ids,
                      const std::vector<int64_t>& region_addrs,
                      const std::vector<int64_t>& region_nbytes) {
  const char* op = to_regions ? "scatter" : "gather";
  const std::string who(op);
  if (tensor_ptr == 0) {
    throw TensorSpanError(who + ": null tensor address (its storage was freed?)");
  }
  if (g.planes == 0 || g.layers == 0 || g.dfull == 0 || g.itemsize == 0) {
    throw py::value_error(who + ": planes, layers, D and itemsize must be >= 1");
  }
  if (g.width == 0 || g.chunk_tokens == 0) {
    throw py::value_error(who + ": width and chunk_tokens must be >= 1");
  }
  if (g.col_offset > g.dfull || g.width > g.dfull - g.col_offset) {
    throw py::value_error(who + ": columns [" + num(g.col_offset) + ", " + num(g.col_offset) +
                          " + " + num(g.width) + ") exceed D=" + num(g.dfull));
  }
  // Bytes the [P, L, T, Dfull] view needs; must fit the tensor and the address space.
  const uint64_t pl = checked_mul(g.planes, g.layers, op);
  const uint64_t row_elems_t = checked_mul(g.tokens, g.dfull, op);  // T * Dfull
  const uint64_t view_bytes = checked_mul(checked_mul(pl, row_elems_t, op), g.itemsize, op);
  if (view_bytes > tensor_nbytes) {
    throw TensorSpanError(who + ": the tensor's memory holds " + num(tensor_nbytes) +
                          " bytes, fewer than [" + num(g.planes) + ", " + num(g.layers) + ", " +
                          num(g.tokens) + ", " + num(g.dfull) + "] x " + num(g.itemsize) +
                          " = " + num(view_bytes));
  }
  (void)checked_add(tensor_ptr, tensor_nbytes, op);
  const uint64_t row_bytes = checked_mul(g.width, g.itemsize, op);    // W * itemsize
  const uint64_t t_pitch = g.dfull * g.itemsize;                     // fits: <= view_bytes
  const uint64_t chunk_rows_bytes = checked_mul(g.chunk_tokens, row_bytes, op);
  const uint64_t chunk_nbytes = checked_mul(pl, chunk_rows_bytes, op);

  const size_t n = chunk_ids.size();
  if (region_addrs.size() != n || region_nbytes.size() != n) {
    throw py::value_error(who + ": " + num(n) + " chunk ids for " + num(region_addrs.size()) +
                          " region addresses and " + num(region_nbytes.size()) + " lengths");
  }
  const uint64_t n_chunks = g.tokens / g.chunk_tokens;
  for (size_t j = 0; j < n; ++j) {
    if (chunk_ids[j] < 0 || static_cast<uint64_t>(chunk_ids[j]) >= n_chunks) {
      throw py::value_error(who + ": chunk index " + std::to_string(chunk_ids[j]) +
                            " outside [0, " + num(n_chunks) + ")");
    }
    if (region_nbytes[j] < 0 || static_cast<uint64_t>(region_nbytes[j]) != chunk_nbytes) {
      throw py::value_error(who + ": region " + num(j) + " of " +
                            std::to_string(region_nbytes[j]) + " bytes, expected " +
                            num(chunk_nbytes));
    }
    if (region_addrs[j] <= 0) {
      throw py::value_error(who + ": region " + num(j) + " has an invalid address");
    }
    const uint64_t a = static_cast<uint64_t>(region_addrs[j]);
    const uint64_t end = checked_add(a, chunk_nbytes, op);
    // A region may not overlap the tensor (memcpy of overlapping ranges is undefined).
    if (chunk_nbytes > 0 && a < tensor_ptr + tensor_nbytes && tensor_ptr < end) {
      throw py::value_error(who + ": region " + num(j) + " overlaps the tensor's memory");
    }
  }

  // Overlapping destinations make the result depend on copy order: keep those copies
  // sequential and in order (last write wins, as in the torch backend).
  bool sequential = false;
  if (to_regions) {
    std::vector<size_t> order(n);
    std::iota(order.begin(), order.end(), size_t{0});
    std::sort(order.begin(), order.end(),
              [&](size_t a, size_t b) { return region_addrs[a] < region_addrs[b]; });
    for (size_t k = 1; k < n && !sequential; ++k) {
      sequential = static_cast<uint64_t>(region_addrs[order[k]]) <
                   static_cast<uint64_t>(region_addrs[order[k - 1]]) + chunk_nbytes;
    }
  } else {
    std::vector<int64_t> ids(chunk_ids);
    std::sort(ids.begin(), ids.end());
    sequential = std::adjacent_find(ids.begin(), ids.end()) != ids.end();
  }

  CopyPlan plan;
  plan.reserve(n * pl);
  plan.set_sequential(sequential);
  char* const tbase = reinterpret_cast<char*>(tensor_ptr);
  const bool full = g.width == g.dfull;
  // Extent of one (p, l) run in the tensor: (C - 1) rows of pitch plus one row.
  const uint64_t run_extent = (g.chunk_tokens - 1) * t_pitch + row_bytes;
  for (size_t j = 0; j < n; ++j) {
    const uint64_t i = static_cast<uint64_t>(chunk_ids[j]);
    char* const rbase = reinterpret_cast<char*>(static_cast<uintptr_t>(region_addrs[j]));
    for (uint64_t p = 0; p < g.planes; ++p) {
      for (uint64_t l = 0; l < g.layers; ++l) {
        const uint64_t pl_idx = p * g.layers + l;
        // Element offset (((p * L + l) * T + i * C) * Dfull + col) * itemsize.
        const uint64_t toff =
            ((pl_idx * g.tokens + i * g.chunk_tokens) * g.dfull + g.col_offset) * g.itemsize;
        const uint64_t roff = pl_idx * chunk_rows_bytes;
        if (toff > view_bytes || run_extent > view_bytes - toff) {  // never true if valid
          throw py::value_error(who + ": run (" + num(j) + ", " + num(p) + ", " + num(l) +
                                ") outside the tensor");
        }
        if (roff + chunk_rows_bytes > chunk_nbytes) {
          throw py::value_error(who + ": run outside region " + num(j));
        }
        char* t = tbase + toff;
        char* r = rbase + roff;
        const int64_t tag = static_cast<int64_t>(j);
        if (full) {
          if (to_regions) {
            plan.add(r, t, 1, chunk_rows_bytes, 0, 0, tag);
          } else {
            plan.add(t, r, 1, chunk_rows_bytes, 0, 0, tag);
          }
        } else if (to_regions) {
          plan.add(r, t, g.chunk_tokens, row_bytes, row_bytes, t_pitch, tag);
        } else {
          plan.add(t, r, g.chunk_tokens, row_bytes, t_pitch, row_bytes, tag);
        }
      }
    }
  }
  return plan;
}

}  // namespace lmckv

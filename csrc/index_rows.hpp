// Row gather along one dimension: `torch.index_select(src, dim, index)` of a contiguous
// tensor, as a byte copy on the copy pool.
//
// A contiguous tensor viewed as [outer, rows, row_bytes] (outer = product of the sizes
// before `dim`, rows = its size, row_bytes = the bytes of one index's slice) is gathered
// into a contiguous [outer, n, row_bytes] destination: dst[o][i] = src[o][index[i]].
// Consecutive indices (k, k+1, ...) coalesce into one run, and each run is one 2-D copy
// over `outer` (CopyPlan: split evenly over the pool's threads, streaming stores for large
// jobs), so a token-dropping edit (keep 9 of every 10 tokens) moves whole runs of rows
// instead of one torch copy per index.
//
// Planning validates everything (ValueError, GIL held, before any byte moves): every
// index in [0, rows), both buffers' spans inside their [addr, addr + nbytes), the index
// buffer inside its span, no overlap between source and destination. Execution runs on
// the copy pool WITHOUT the GIL.
#pragma once

#include <cstdint>

#include "copy_kernels.hpp"

namespace lmckv {

struct IndexRowsArgs {
  uint64_t dst, dst_nbytes, dst_offset;  // buffer base, its bytes, first byte of the view
  uint64_t src, src_nbytes, src_offset;
  uint64_t idx, idx_nbytes, idx_offset;
  uint64_t idx_itemsize;  // 4 (int32) or 8 (int64)
  uint64_t n_idx;
  uint64_t outer, rows, row_bytes;
};

// Validate and plan the gather (ValueError on anything inconsistent, GIL held).
CopyPlan plan_index_rows(const IndexRowsArgs& a);

}  // namespace lmckv

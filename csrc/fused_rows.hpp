// Token gather from one set of chunk regions straight into another, with an optional RoPE
// re-rotation of K on the way: a selection edit's whole data movement in one pass, with
// no [P, L, T, W] tensor assembled in between.
//
// Every region holds one chunk object, [P, L, C, W] contiguous (P planes, L layers, C
// tokens, W elements of `itemsize` bytes per token row). The source is n_src regions in
// chunk order: source token s is row s % C of region s / C. Destination region j holds
// output chunk dst_ids[j], output tokens [id * C, (id + 1) * C); output token t takes
// source token idx[t]:
//
//   dst[j][p][l][r] = src[idx[t] / C][p][l][idx[t] % C],   t = dst_ids[j] * C + r
//
// With a rotation (rotary_dim > 0), plane 0's rows are turned exactly as rope_gather
// turns them (rope_rotate.hpp; row of output token t with cos[t], sin[t], float32 tables
// [n_out, rotary_dim / 2]); other planes are copied. Rows that follow each other in one
// source chunk are copied as one run.
//
// Planning validates everything (ValueError, GIL held, before any byte moves): the
// geometry and the rotation's, then what fused_chunks.hpp checks (region sizes, chunk ids
// unique and inside the index, every index value, the tables' spans, no destination
// overlapping a source, another destination or a table); sizes are overflow-checked.
// Execution runs on the copy pool WITHOUT the GIL. The caller pins mapped regions'
// owners (native.cpp) for the duration.
#pragma once

#include <cstdint>
#include <vector>

#include "copy_kernels.hpp"
#include "edit_common.hpp"
#include "fused_chunks.hpp"

namespace lmckv {

// The shared arguments (fused_chunks.hpp) and the objects' plane count.
struct FusedRowsArgs : FusedChunkArgs {
  uint64_t planes = 0;
};

class FusedRowsPlan {
 public:
  explicit FusedRowsPlan(const FusedRowsArgs& a);  // validates (ValueError)
  void execute() const;                            // without the GIL
  uint64_t total_bytes() const { return io_.dst.size() * chunk_nbytes_; }

 private:
  // `rows` destination rows from `dst_row` on come from rows `src_row`.. of source chunk
  // `src_chunk`.
  struct Run {
    uint64_t dst_row, src_chunk, src_row, rows;
  };

  static uint64_t checked_chunk_nbytes(const FusedRowsArgs& a);  // validates the geometry
  void build_runs();
  void run_rows(uint64_t first, uint64_t last, StreamCopyFn stream) const;
  void run_block(uint64_t block, uint64_t r0, uint64_t r1, StreamCopyFn stream) const;

  FusedRowsArgs a_;
  uint64_t row_bytes_ = 0, chunk_nbytes_ = 0, half_ = 0;
  FusedChunks io_;          // validated regions, ids, index and tables
  std::vector<char> cold_;  // destination j's pages are mostly not in memory yet
  std::vector<Run> runs_;
  std::vector<size_t> run_start_;  // runs of destination j: [run_start_[j], run_start_[j + 1])
};

}  // namespace lmckv

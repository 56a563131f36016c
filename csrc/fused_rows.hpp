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
// Planning validates everything (ValueError, GIL held, before any byte moves): region
// sizes, chunk ids (unique, inside the index), every index value, the tables' spans, no
// destination overlapping a source, another destination or a table, and the rotation's
// geometry; sizes are overflow-checked. Execution runs on the copy pool WITHOUT the GIL.
// The caller pins mapped regions' owners (native.cpp) for the duration.
#pragma once

#include <cstdint>
#include <vector>

#include "copy_kernels.hpp"
#include "edit_common.hpp"

namespace lmckv {

struct FusedRowsArgs {
  std::vector<int64_t> src_addrs, src_nbytes;            // n_src source regions
  std::vector<int64_t> dst_ids, dst_addrs, dst_nbytes;   // n_dst destination regions
  Span idx, cos, sin;  // idx: int64 [n_out]; cos, sin: float32 [n_out, rotary_dim / 2]
  uint64_t n_out = 0;
  uint64_t planes = 0, layers = 0, chunk_tokens = 0, width = 0, itemsize = 0;
  uint64_t head_dim = 0, rotary_dim = 0;  // rotary_dim 0: a plain gather
  bool interleaved = false;
  EditDType dtype = EditDType::kBF16;  // used with a rotation only
};

class FusedRowsPlan {
 public:
  explicit FusedRowsPlan(const FusedRowsArgs& a);  // validates (ValueError)
  void execute() const;                            // without the GIL
  uint64_t total_bytes() const { return dst_.size() * chunk_nbytes_; }

 private:
  // `rows` destination rows from `dst_row` on come from rows `src_row`.. of source chunk
  // `src_chunk`.
  struct Run {
    uint64_t dst_row, src_chunk, src_row, rows;
  };

  void check_regions(const FusedRowsArgs& a);
  void check_ids(const FusedRowsArgs& a);
  void read_index(const FusedRowsArgs& a);
  void check_overlaps(const FusedRowsArgs& a) const;
  void build_runs(const std::vector<int64_t>& idx);
  void run_rows(uint64_t first, uint64_t last, StreamCopyFn stream) const;
  void run_block(uint64_t block, uint64_t r0, uint64_t r1, StreamCopyFn stream) const;

  FusedRowsArgs a_;
  uint64_t row_bytes_ = 0, chunk_nbytes_ = 0, half_ = 0;
  std::vector<const char*> src_;
  std::vector<char*> dst_;
  std::vector<uint64_t> ids_;
  std::vector<char> cold_;  // destination j's pages are mostly not in memory yet
  std::vector<Run> runs_;
  std::vector<size_t> run_start_;  // runs of destination j: [run_start_[j], run_start_[j + 1])
  const float* cos_ = nullptr;
  const float* sin_ = nullptr;
};

}  // namespace lmckv

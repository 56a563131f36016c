// N-d strided element copy between two buffers (a permutation such as a CPU engine's KV
// rows <-> per-token K/V), blocked so that both sides move in runs.
//
// Each view is (buffer base, buffer bytes, element offset, per-dimension element strides)
// over the same sizes and element size. Planning validates everything (ValueError, GIL
// held): strides non-negative, every element either view touches inside its buffer
// (checked arithmetic), buffers not overlapping, no destination element written twice.
// Execution runs on the copy pool WITHOUT the GIL.
//
// Plan: dimensions contiguous in each other on both sides are merged. If one dimension is
// contiguous on both sides, each outer index copies one row (memcpy). Otherwise the
// innermost block is a tile: A = up to one cache line of elements contiguous on the
// destination (dimensions chained from destination stride 1) times B = up to one line
// contiguous on the source (chained from source stride 1), with an offset table per side,
// moved through a small staging buffer (source lines in, destination lines out). A chain
// takes the fast part of a dimension too large for the tile.
#pragma once

#include <cstdint>
#include <vector>

namespace lmckv {

struct StridedDim {
  uint64_t size;
  uint64_t dst_stride;  // elements
  uint64_t src_stride;  // elements
};

struct StridedPlan {
  char* dst = nullptr;        // first element of the dst view
  const char* src = nullptr;  // first element of the src view
  uint64_t itemsize = 0;
  uint64_t total_bytes = 0;   // bytes copied (0: nothing to do)
  // Outer dimensions, outermost first (every task walks its share of them).
  std::vector<StridedDim> outer;
  // Row mode: one contiguous run of row_elems elements per outer index.
  uint64_t row_elems = 0;
  // Tile mode: element offsets of the A (destination-contiguous) and B (source-contiguous)
  // members on each side.
  std::vector<uint64_t> a_dst, a_src, b_dst, b_src;
  bool a_dst_unit = true;  // a_dst[i] == i
  bool b_src_unit = true;  // b_src[j] == j
  bool nt_ok = false;      // streaming stores allowed (large copy, 32-byte destination lines)
  // Staged boxes (tile mode): the innermost `box_outer` outer dimensions and the tile
  // together cover `box_bytes` contiguous on BOTH sides; each box is read whole into a
  // per-thread buffer, transposed there and written whole (0: no boxes).
  uint64_t box_outer = 0;
  uint64_t box_bytes = 0;
};

StridedPlan plan_strided_copy(uintptr_t dst_base, uint64_t dst_nbytes, uint64_t dst_offset,
                              uintptr_t src_base, uint64_t src_nbytes, uint64_t src_offset,
                              uint64_t itemsize, const std::vector<int64_t>& sizes,
                              const std::vector<int64_t>& dst_strides,
                              const std::vector<int64_t>& src_strides);

// Run the plan on the copy pool (or the calling thread). Call WITHOUT the GIL.
void execute_strided_copy(const StridedPlan& plan);

// Testing only: staging buffers for boxes cannot be had (the boxes' tiles run in place).
void set_box_staging_fault(bool on);
// Bytes copied through staged boxes since the process started (copy_stats()).
uint64_t staged_box_bytes();
// Of those, bytes whose tiles went straight from the staged source to the destination.
uint64_t staged_box_direct_bytes();

}  // namespace lmckv

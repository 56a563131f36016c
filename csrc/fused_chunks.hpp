// What the fused chunk-to-chunk token gathers share (fused_rows.cpp: token rows,
// fused_blocks.cpp: a CPU engine's raw blocks): their common arguments and the planning
// both do before any byte moves.
//
// A call reads n_src source regions (chunk objects in chunk order: source token s is token
// s % C of region s / C) and writes n_dst destination regions, region j holding output
// chunk dst_ids[j] (output tokens [id * C, (id + 1) * C)); output token t takes source
// token idx[t]. With a rotation, K of output token t is turned by cos[t], sin[t] (float32
// tables [n_out, rotary_dim / 2]).
//
// FusedChunks validates (ValueError "<op>: ...", GIL held) what does not depend on how a
// chunk object is laid out: region counts, addresses, sizes (each at least one object of
// `chunk_nbytes`) and alignment, the chunk ids (unique, inside the index), every index
// value, the tables' spans, and that no destination overlaps another, a source or a table.
// The index is copied, so nothing reads the caller's buffer after planning.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "edit_common.hpp"

namespace lmckv {

// The arguments every fused gather takes (a plan adds its object's geometry).
struct FusedChunkArgs {
  std::vector<int64_t> src_addrs, src_nbytes;           // n_src source regions
  std::vector<int64_t> dst_ids, dst_addrs, dst_nbytes;  // n_dst destination regions
  Span idx, cos, sin;  // idx: int64 [n_out]; cos, sin: float32 [n_out, rotary_dim / 2]
  uint64_t n_out = 0;
  uint64_t layers = 0, chunk_tokens = 0, width = 0, itemsize = 0;
  uint64_t head_dim = 0, rotary_dim = 0;  // rotary_dim 0: a plain gather
  bool interleaved = false;
  EditDType dtype = EditDType::kBF16;  // used with a rotation only
};

// Throw ValueError "<op>: <msg>".
[[noreturn]] void fused_fail(const char* op, const std::string& msg);

// With a rotation: the element type matches itemsize, width is whole heads of head_dim,
// rotary_dim is even and at most head_dim. Nothing without one.
void check_fused_rotation(const FusedChunkArgs& a, const char* op);

// The validated regions, chunk ids, index and tables of one call (see the file comment).
struct FusedChunks {
  // `shape` names one chunk object of `chunk_nbytes` bytes in messages.
  FusedChunks(const FusedChunkArgs& a, const char* op, uint64_t chunk_nbytes,
              const std::string& shape);

  uint64_t chunk_nbytes;
  std::vector<const char*> src;
  std::vector<char*> dst;
  std::vector<uint64_t> ids;  // dst_ids, checked
  std::vector<int64_t> idx;   // the index, every value in [0, n_src * C)
  const float* cos = nullptr;  // nullptr without a rotation
  const float* sin = nullptr;
};

}  // namespace lmckv

// Token gather with RoPE re-rotation: the selection edits' one pass over the KV.
//
// dst[p][l][j] = src[p][l][idx[j]] for a [planes, layers, rows, width] source and a
// [planes, layers, n, width] destination (contiguous), where plane 0 (K) is rotated on
// the way: in every head of `head_dim`, each rotary pair (neox: dims i, i + rotary/2;
// interleaved: 2i, 2i + 1) of row j becomes (x1 c - x2 s, x2 c + x1 s) with c, s =
// cos[j][i], sin[j][i] (the caller's float32 tables, [n, rotary/2]). Dims past
// `rotary_dim` and the other planes are copied unchanged. The rotation (rope_rotate.hpp)
// rounds as torch's `mul` + `addcmul_` do: the bytes are those of `edits.rerotate`'s
// torch code, bit for bit.
//
// Planning validates everything (ValueError, GIL held, before any byte moves): every
// index in [0, rows), every span inside its buffer, no overlap of source and destination.
// Execution runs on the copy pool WITHOUT the GIL.
#pragma once

#include <cstdint>
#include <vector>

#include "edit_common.hpp"

namespace lmckv {

struct RopeGatherArgs {
  Span dst, src, idx, cos, sin;  // idx: int64 [n]; cos, sin: float32 [n, rotary_dim / 2]
  uint64_t planes = 0, layers = 0, rows = 0, n = 0, width = 0;
  uint64_t head_dim = 0, rotary_dim = 0;  // rotary_dim 0: a plain gather
  bool interleaved = false;
  EditDType dtype = EditDType::kBF16;
};

class RopeGatherPlan {
 public:
  explicit RopeGatherPlan(const RopeGatherArgs& a);  // validates (ValueError)
  void execute() const;                              // without the GIL

 private:
  void run_rows(uint64_t first, uint64_t last) const;

  RopeGatherArgs a_;
  const char* src_ = nullptr;
  char* dst_ = nullptr;
  const float* cos_ = nullptr;
  const float* sin_ = nullptr;
  std::vector<int64_t> idx_;
  uint64_t esize_ = 0;
};

}  // namespace lmckv

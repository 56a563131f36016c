// SnapKV's clustering step: each score replaced by the max (or mean) of the scores within
// kernel / 2 tokens of it, row by row, in place.
//
// buf holds `rows` rows of `ld` float32; the first `n` of each row are pooled (the
// window's own scores after them are left alone). Positions past a row's ends do not
// count (torch's max_pool1d with -inf padding; avg_pool1d with count_include_pad=False).
// Validation raises ValueError with the GIL held; execution runs on the copy pool
// without it.
#pragma once

#include <cstdint>

#include "edit_common.hpp"

namespace lmckv {

struct ScorePoolArgs {
  Span buf;
  uint64_t rows = 0, n = 0, ld = 0, kernel = 1;
  bool max = true;
};

class ScorePoolPlan {
 public:
  explicit ScorePoolPlan(const ScorePoolArgs& a);  // validates (ValueError)
  void execute() const;                            // without the GIL

 private:
  void run_row(float* row, float* pad) const;

  ScorePoolArgs a_;
  float* buf_ = nullptr;
};

}  // namespace lmckv

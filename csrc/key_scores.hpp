// Query-free key scores of the selection edits (KeyDiff, L2), per (layer, KV head, token).
//
// keydiff: -cos(k_t, mean key of the head) (Park et al. 2025); l2: -|k_t| / mean |k| of
// the head (Devoto et al. 2024). float32 from bfloat16 keys [L, T, n_kv * head_dim], the
// values of edits._scores.key_scores to float32 rounding (its eps: 1e-8 on the product
// of norms, 1e-12 on the mean norm).
//
// Planning validates shapes and spans (ValueError, GIL held); execution runs one task per
// (layer, KV head) on the copy pool WITHOUT the GIL.
#pragma once

#include <cstdint>

#include "key_heads.hpp"

namespace lmckv {

struct KeyScoresArgs {
  KeyHeadsArgs heads;   // k: bf16 [L, T, n_kv * head_dim]; out: f32 [L, n_kv, T]
  bool keydiff = true;  // else l2
};

class KeyScoresPlan {
 public:
  explicit KeyScoresPlan(const KeyScoresArgs& a);  // validates (ValueError)
  void execute() const;                            // without the GIL

 private:
  KeyHeads heads_;
  bool keydiff_;
};

}  // namespace lmckv

// R-KV's key redundancy: how much each key duplicates the other keys of its head.
//
// out[l][h][i] = the sum over keys j != i of layer l's KV head h of cos(k_i, k_j), counting
// only the pairs with cos > threshold (torch's F.threshold), float32 from bfloat16 keys
// [L, T, n_kv * head_dim]. The dot products run on AMX tiles, or AVX512-BF16's vdpbf16ps
// for the pairs (i, j > i) only (window_avx512.cpp; bf16 products exact in float32 either
// way), divided by both keys' norms (norms below 1e-12 count as 1e-12, as F.normalize);
// the caller takes the mean and the softmax over tokens. No portable loop (torch is the
// fallback): supported() says whether this machine, head size and forced isa
// (set_window_scores_isa) run it.
//
// Planning validates shapes and spans (ValueError, GIL held); execution runs one task per
// (layer, KV head) on the copy pool WITHOUT the GIL.
#pragma once

#include <cstdint>

#include "key_heads.hpp"
#include "window_scores.hpp"

namespace lmckv {

struct KeyRedundancyArgs {
  KeyHeadsArgs heads;  // k: bf16 [L, T, n_kv * head_dim]; out: f32 [L, n_kv, T]
  float threshold = 0.5f;
};

class KeyRedundancyPlan {
 public:
  explicit KeyRedundancyPlan(const KeyRedundancyArgs& a);  // validates (ValueError)
  void execute() const;                                    // without the GIL

  // Whether this CPU runs the kernel for keys of `head_dim` elements.
  static bool supported(uint64_t head_dim);

 private:
  void run_unit(uint64_t unit) const;

  KeyHeads heads_;
  float threshold_;
  DotIsa isa_;  // the path, fixed at planning
};

}  // namespace lmckv

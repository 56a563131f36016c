// SnapKV's window attention: how much the last `window` queries attend to every key.
//
// For each layer l and query head hq (GQA: KV head hq / group): out[l][hq][t] = the sum
// over the window's queries w of softmax_t(scale * q_w . k_t), queries and keys bfloat16,
// products and sums float32. With `at_end` the queries are those of the KV's last
// `window` tokens and each sees keys up to its own position (causal); otherwise every key.
// The logits come from AMX tiles where the CPU has them (bf16 products are exact in
// float32, accumulated in float32: the float32 matmul of the same inputs up to summation
// order), else from a portable loop; the softmax is float32 either way.
//
// Planning validates shapes and spans (ValueError, GIL held); execution runs one task per
// (layer, KV head) on the copy pool WITHOUT the GIL.
#pragma once

#include <cstdint>
#include <string>

#include "edit_common.hpp"

namespace lmckv {

struct WindowScoresArgs {
  Span q, k, out;  // q: bf16 [L, tq, Hq * hd]; k: bf16 [L, T, Hkv * hd]; out: f32 [L, Hq, T]
  uint64_t layers = 0, tokens = 0, tq = 0, n_kv = 0, group = 0, head_dim = 0, window = 0;
  bool at_end = true;
  float scale = 1.0f;
};

class WindowScoresPlan {
 public:
  explicit WindowScoresPlan(const WindowScoresArgs& a);  // validates (ValueError)
  void execute() const;                                  // without the GIL

 private:
  void run_unit(uint64_t unit, bool amx) const;

  WindowScoresArgs a_;
  const uint16_t* q_ = nullptr;
  const uint16_t* k_ = nullptr;
  float* out_ = nullptr;
};

// "amx" when this CPU and OS run the AMX path, else "generic".
std::string window_scores_isa();
// Force the path ("amx", "generic", or "auto"); ValueError for "amx" where it cannot run.
void set_window_scores_isa(const std::string& name);

}  // namespace lmckv

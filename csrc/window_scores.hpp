// SnapKV's window attention: how much the last `window` queries attend to every key.
//
// For each layer l and query head hq (GQA: KV head hq / group): out[l][hq][t] = the sum
// over the window's queries w of softmax_t(scale * q_w . k_t), queries and keys bfloat16,
// products and sums float32. With `at_end` the queries are those of the KV's last
// `window` tokens and each sees keys up to its own position (causal); otherwise every key.
// The logits come from AMX tiles where the CPU has them, else from AVX512-BF16's
// vdpbf16ps (window_avx512.cpp) where it has that (bf16 products are exact in float32,
// accumulated in float32: the float32 matmul of the same inputs up to summation order),
// else from a portable loop (several times slower than torch's matmul: the Python side
// does not call it unless a test forces it); the softmax is float32 either way.
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

// The paths of the logits (and of key_redundancy's dot products), slowest first.
enum class DotIsa : int { kGeneric = 0, kAvx512 = 1, kAmx = 2 };

// The path for keys of head_dim elements: the fastest this CPU runs that takes the head
// size (AMX: a multiple of 32 up to 128; AVX-512: even) and that the forced isa allows.
DotIsa window_dot_isa(uint64_t head_dim);

class WindowScoresPlan {
 public:
  explicit WindowScoresPlan(const WindowScoresArgs& a);  // validates (ValueError)
  void execute() const;                                  // without the GIL

 private:
  void run_unit(uint64_t unit, DotIsa isa) const;

  WindowScoresArgs a_;
  const uint16_t* q_ = nullptr;
  const uint16_t* k_ = nullptr;
  float* out_ = nullptr;
};

// "amx", "avx512" or "generic": the fastest path this CPU runs and the forced isa allows
// (for a head size it takes); with head_dim, the path window_dot_isa(head_dim) names.
std::string window_scores_isa();
std::string window_scores_isa(uint64_t head_dim);
// Cap the path at "amx" (the same as "auto"), "avx512" or "generic" for window_scores
// and key_redundancy; ValueError for a name or a path this CPU cannot run.
void set_window_scores_isa(const std::string& name);

}  // namespace lmckv

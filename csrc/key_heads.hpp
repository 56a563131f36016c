// The shape the key-only edit kernels share (key_scores.cpp, key_redundancy.cpp): bfloat16
// keys [L, T, n_kv * head_dim] in, one float32 value per (layer, KV head, token) out
// [L, n_kv, T], one task per (layer, KV head).
#pragma once

#include <cstdint>
#include <functional>

#include "edit_common.hpp"

namespace lmckv {

struct KeyHeadsArgs {
  Span k, out;
  uint64_t layers = 0, tokens = 0, n_kv = 0, head_dim = 0;
};

class KeyHeads {
 public:
  // Validates the spans and sizes (ValueError "<what>: ...", GIL held).
  KeyHeads(const KeyHeadsArgs& a, const char* what);

  // One layer's KV head: its token t's key at k + t * stride (head_dim elements), its
  // outputs at out[0 .. tokens).
  struct Unit {
    const uint16_t* k;
    uint64_t stride;
    float* out;
  };
  Unit unit(uint64_t u) const;
  const KeyHeadsArgs& args() const { return a_; }

  // fn(u) for every unit on the copy pool, `work` bytes deciding how many threads.
  // Call WITHOUT the GIL; fn must not throw.
  void for_each(uint64_t work, const std::function<void(uint64_t)>& fn) const;

 private:
  KeyHeadsArgs a_;
  const uint16_t* k_ = nullptr;
  float* out_ = nullptr;
};

}  // namespace lmckv

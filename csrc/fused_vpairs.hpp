// fused_blocks' fast path for a plane whose tokens come in interleaved pairs: V of a CPU
// engine's amx order, where one 64-byte line of a (block, head) holds 16 dims of an
// aligned token pair 2k, 2k + 1 side by side (element 2i + t: dim i of token 2k + t) and
// the head's HS dims are HS / 16 such lines (fused_blocks.hpp has the layout and tables).
//
// A selection that keeps the pairs aligned copies lines; one that shifts them by a token
// (after a drop) makes each destination line the even-place elements of one source line
// and the odd-place elements of another. Either is one two-table permute per line:
// the source lines of both tokens, indices by the two tokens' parities (four vectors),
// one 64-byte store. The token path of fused_blocks.cpp does this element by element.
// Lines go column by column (one head's 16 dims), pair after pair: a column's lines of
// consecutive pairs are adjacent, so both blocks are read and written in address order
// (a pair's own lines lie a column's length apart).
//
// Bounds: the planning checks tok_off[2k + 1] = tok_off[2k] + 1 and dim_off[16j + i] =
// dim_off[16j] + 2i, so a line's 32 elements are exactly the cells of two tokens and 16
// dims of one head, inside their block (fused_blocks' check_cells bijection): every load
// and store is such a line.
#pragma once

#include <cstdint>
#include <vector>

#include "fused_tiles.hpp"

namespace lmckv {

class TokenPairs {
 public:
  TokenPairs() = default;
  // tok, dim: the plane's tok_off [BS] and dim_off [HS]; W = NH * 2 * HS elements of
  // `itemsize` bytes. Disabled unless the plane is laid out as above (2-byte elements)
  // and fused_blocks moves lanes with AVX-512 here.
  TokenPairs(const int64_t* tok, const int64_t* dim, uint64_t bs, uint64_t hs, uint64_t width,
             uint64_t itemsize);
  bool enabled() const { return enabled_; }
  // Destination tokens [first, last) of one block, both even (dst: its first byte; token
  // tb from from[tb]); `stream`: non-temporal stores allowed (the caller fences them).
  void copy(char* dst, const BlockToken* from, uint64_t first, uint64_t last,
            bool stream) const;

 private:
  std::vector<int64_t> pair_at_;  // per token: its pair's line base, bytes from the block
  std::vector<int64_t> cols_;     // per (head, 16 dims): the line's offset from that base
  bool aligned_ = false;          // every line a whole aligned cache line
  bool enabled_ = false;
};

}  // namespace lmckv

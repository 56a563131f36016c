// fused_blocks' fast path for a plane whose token holds, per head, one run of HS
// consecutive elements: V of a CPU engine's vec / vec16 order ([BS, HS] per block and
// head; fused_blocks.hpp has the layout and the tables).
//
// There the V of an aligned token pair of one head is 2 * HS consecutive elements and the
// heads of a raw row sit side by side, so a raw row holds one aligned pair for every head
// and consecutive pairs are consecutive rows. A "row group" is the fewest tokens tb ..
// tb + n - 1 whose cells on the plane are whole raw rows. When destination tokens of a
// group come from source tokens of a group of the same shape in one block, their bytes
// are one contiguous span on both sides (all heads), and consecutive such groups whose
// spans follow each other on both sides are one copy. Every other token moves head by
// head, HS elements at a time. Both use AVX-512 64-byte moves (streaming into warm
// destinations when every store is a whole aligned cache line), or the token path of
// fused_blocks.cpp on a CPU without AVX-512BW or when tests force the portable path.
//
// Bounds: a group's rows and a token's runs are cells of its block (fused_blocks'
// check_cells bijection), so every access stays inside the blocks planning proved.
#pragma once

#include <cstdint>
#include <vector>

#include "fused_tiles.hpp"

namespace lmckv {

// Copies one destination token's HS elements of every head: `bytes` per head, heads
// `stride` bytes apart on both sides.
using TokenHeadsFn = void (*)(char* dst, const char* src, uint64_t bytes, uint64_t heads,
                              uint64_t stride);
// Copies n bytes (one span of whole raw rows).
using SpanFn = void (*)(char* dst, const char* src, uint64_t n);

class TokenRows {
 public:
  TokenRows() = default;
  // tok, dim: the plane's tok_off [BS] and dim_off [HS] (dim_off consecutive: checked by
  // the caller); width W = NH * 2 * HS elements of `itemsize` bytes.
  TokenRows(const int64_t* tok, const int64_t* dim, uint64_t bs, uint64_t hs, uint64_t width,
            uint64_t itemsize);
  bool enabled() const { return heads_fn_ != nullptr; }
  // Destination tokens [first, last) of one block (dst: its first byte; token tb from
  // from[tb]); `stream`: non-temporal stores allowed (the caller fences them).
  void copy(char* dst, const BlockToken* from, uint64_t first, uint64_t last,
            bool stream) const;

 private:
  // The row group a token starts: `tokens` 0 when it starts none.
  struct Group {
    uint32_t tokens = 0;
    uint32_t shape = 0;  // equal: the same tokens' offsets relative to the first
    uint64_t start = 0;  // the group's first row, in bytes from the block
    uint64_t bytes = 0;  // its rows' bytes
  };
  void plan_groups(const int64_t* tok, uint64_t bs, uint64_t hs, uint64_t width);

  std::vector<uint64_t> at_;  // per token: its first element's byte offset in the block
  std::vector<Group> group_;
  uint64_t token_bytes_ = 0, heads_ = 0, stride_ = 0;
  bool aligned_ = false;  // every token's runs and every group whole aligned cache lines
  TokenHeadsFn heads_fn_ = nullptr, heads_stream_ = nullptr;
  SpanFn span_fn_ = nullptr, span_stream_ = nullptr;
};

}  // namespace lmckv

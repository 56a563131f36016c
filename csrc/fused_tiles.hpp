// fused_blocks' fast path for a plane whose tokens are consecutive elements (lanes): K
// of a CPU engine's vec / vec16 order, where one (block, head, dim) row holds the block's
// tokens side by side (fused_blocks.hpp has the layout and the tables).
//
// A selection edit makes each destination row a gather of short runs from a few source
// blocks (drop every 10th: runs of 9). Token by token that is one tiny copy per run, row
// and head. Here a destination block is cut into aligned groups of G tokens (one 64-byte
// register: G = 32 of 2 bytes, 16 of 4), and each group is planned once per unit: which
// source windows its tokens come from (a window: one source block's lane, at most 2G
// tokens from its base w) and each token's place in its window. Every row of the unit
// then moves a group with masked loads of its windows (reading only the elements from a
// window's first to its last token, all inside the source block's lane), one two-table
// permute per window, masked merges and one 64-byte store; a group of two windows that
// each lie inside one aligned run of G elements (amx's K: two source groups' lines) is
// one permute of those two masked lines. All rows share the plan.
//
// A rotated K (neox pairs of dims i, i + half; interleaved 2i, 2i + 1) turns both rows of
// a pair in float32 per group, with the unit's cos / sin transposed to [pair][token], in
// the row kernel's roundings (rope_rotate.hpp: the bytes are torch's; bfloat16 rounded as
// f32_to_bf16, denormals kept); dims past the rotary ones are copied as above.
//
// Groups that do not fit (a destination group not inside one lane, more windows than
// kMaxWindows, a window spanning more than 2G tokens) are left to the token path, as are
// all groups on a CPU without AVX-512BW or when tests force the portable path.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lmckv {

// Where a token of one destination block comes from: the source block's first byte
// (layer l, head 0), the token's place in it, and how many tokens from this one on come
// from the tokens after it in the same block.
struct BlockToken {
  const char* block;
  uint64_t tb, run;
};

// One source window of a lane group (offsets in bytes).
struct LaneWindow {
  alignas(64) unsigned char idx[64];  // per destination token: its window element (+ G: hi)
  const char* block;  // the source block's first byte (layer l, head 0)
  int64_t base;       // tok_off[w] * itemsize: the window's first element in a head's row
  uint64_t load;      // bit i: element base + i is read (i < 2G)
  uint64_t take;      // bit i: destination token i of the group comes from this window
};

// One group of G destination tokens, all moved by the fast path.
struct LaneGroup {
  static constexpr uint32_t kMaxWindows = 4;
  LaneWindow win[kMaxWindows];
  // Two windows each inside one aligned run of G elements of its row (amx's K: a source
  // group's line): one two-table permute of those two lines (idx2), not one per window.
  alignas(64) unsigned char idx2[64];
  const char* line[2] = {nullptr, nullptr};  // the lines' first bytes (row 0)
  uint64_t line_load[2] = {0, 0};             // bit i: element i of the line is read
  int64_t dst = 0;       // tok_off of the group's first token, times itemsize
  uint32_t t0 = 0;       // the group's first token in its block
  uint32_t windows = 0;  // 1 .. kMaxWindows
  bool straight = false;  // one window, tokens base .. base + G - 1 in order: a plain copy
  bool two_lines = false;  // idx2 / line / line_load hold the group
};

// Destination tokens [first, last) of a block left to the token path.
struct TokenRange {
  uint64_t first, last;
};

// Moves every row of one plane's lane groups: dst, the destination block's first byte;
// rows, each row's byte offset.
using LaneRowsFn = void (*)(char* dst, const LaneGroup* groups, uint64_t n,
                            const int64_t* rows, uint64_t nrows);

// One rotated pair of rows of one head (byte offsets of dims a and b in a block), turned
// by pair i of the rotation.
struct LanePair {
  int64_t a, b;
  uint64_t i;
};

// Turns every pair of rows of the groups: cos_t / sin_t [pairs][BS], the unit's tables.
using LaneRotateFn = void (*)(char* dst, const LaneGroup* groups, uint64_t n,
                              const LanePair* pairs, uint64_t npairs, const float* cos_t,
                              const float* sin_t, uint64_t bs);

// The lane groups of one plane (tok: its tok_off [BS]; rows: each (dim, head) row's
// element offset h * 2 * HS + dim_off[d], in the order they are walked).
class LaneGroups {
 public:
  LaneGroups() = default;
  LaneGroups(const int64_t* tok, uint64_t bs, uint64_t itemsize, std::vector<int64_t> rows);
  bool enabled() const { return fn_ != nullptr; }
  // One destination block's groups (from: its BS source tokens): the ones the fast path
  // moves into `groups`, the tokens it does not into `rest`.
  void plan(const BlockToken* from, std::vector<LaneGroup>& groups,
            std::vector<TokenRange>& rest) const;
  // Every row of the planned groups; `stream`: with non-temporal stores where every store
  // is a whole aligned cache line (the caller fences them).
  void run(char* dst, const std::vector<LaneGroup>& groups, bool stream) const;
  // K rotated in the lanes: these pairs of rows (offsets in elements) are turned by rotate
  // instead of copied by run (whose rows are then the other dims'). `dim_pairs`: the
  // elements are 4-byte pairs of bfloat16 dims 2m, 2m + 1 (amx's K), turned by rotation
  // pairs i and i + 1 (LanePair::i = 2m).
  void set_rotation(std::vector<LanePair> pairs, bool dim_pairs = false);
  bool rotates() const { return rot_fn_ != nullptr; }
  // Every pair of rows of the planned groups, turned by cos_t / sin_t ([pair][BS] floats:
  // pair i of the unit's token tb at i * BS + tb).
  void rotate(char* dst, const std::vector<LaneGroup>& groups, bool stream, const float* cos_t,
              const float* sin_t) const;

 private:
  bool plan_group(const BlockToken* from, uint64_t t0, LaneGroup& g) const;
  bool streams(bool stream, char* dst, const std::vector<LaneGroup>& groups) const;
  void fill_windows(const BlockToken* group, const uint32_t* of, const uint64_t* lo,
                    LaneGroup& g) const;
  void plan_lines(const BlockToken* group, const uint32_t* of, const uint64_t* lo,
                  const uint64_t* hi, LaneGroup& g) const;
  void put_index(unsigned char* idx, uint64_t i, uint64_t at) const;

  std::vector<int64_t> tok_;
  std::vector<uint64_t> lane_;  // per token: the first token of its run of consecutive elements
  std::vector<uint8_t> dst_ok_;  // per group: its G tokens are consecutive elements
  std::vector<int64_t> rows_;  // in bytes
  uint64_t bs_ = 0, g_ = 0, e_ = 0;
  bool rows_aligned_ = false;  // every row starts on a 64-byte boundary of its block
  LaneRowsFn fn_ = nullptr;    // nullptr: the token path moves everything
  LaneRowsFn stream_fn_ = nullptr;
  std::vector<LanePair> pairs_;  // in bytes
  LaneRotateFn rot_fn_ = nullptr, rot_stream_fn_ = nullptr;
};

// "avx512" when fused_blocks moves lane groups with AVX-512 here, else "generic".
std::string fused_blocks_isa();
// Force the path ("avx512", "generic", or "auto"); ValueError for "avx512" where it
// cannot run. Plans made afterwards follow it.
void set_fused_blocks_isa(const std::string& name);

}  // namespace lmckv

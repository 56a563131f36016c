// fused_rows' job (fused_chunks.hpp: a selection edit's token gather from source chunk
// regions straight into destination chunk regions, K optionally re-rotated, one pass) for
// a CPU vLLM engine's raw chunk objects, where a token's K and V are not one row.
//
// Every region holds one object [L, C, W] contiguous (W = NH * 2 * HS elements of
// `itemsize` bytes per raw row, NH kv heads of head size HS; C a multiple of the engine's
// block size BS). Element (plane p: 0 = K, 1 = V; layer l; chunk token t; head h; dim d)
// lies at element offset
//
//   l * C * W + (t / BS) * BS * W + h * 2 * HS + tok_off[p][t % BS] + dim_off[p][d]
//
// (tok_off int64 [2, BS], dim_off int64 [2, HS]: CpuEngineKV.block_offsets()). Output
// token t of destination region j (output chunk dst_ids[j]) takes source token idx[t] on
// both planes, every layer and head. With a rotation (head_dim == HS), K's HS elements of
// each (token, layer, head) are gathered through dim_off[0] into a small buffer, turned by
// the row kernel of rope_rotate.hpp (so the bytes are torch's, as in fused_rows) and
// scattered back through dim_off[0]; V is copied.
//
// Planning validates everything fused_rows does (fused_chunks.hpp) plus the block
// geometry and the tables: (p, tb, d) -> tok_off[p][tb] + dim_off[p][d] must be a
// bijection onto the cells {r * W + c : r < BS, c < 2 * HS} of one (block, head), which
// proves every access in bounds and every destination byte written. Execution runs on the
// copy pool WITHOUT the GIL, in units of (destination, layer, block); the caller pins
// mapped regions' owners (native.cpp). A plane whose tokens are consecutive elements (K of
// vec / vec16) moves by AVX-512 lane groups where they fit (fused_tiles.hpp; a rotated K
// turned pair of rows by pair of rows), streaming whole cache lines into warm destinations
// when a copy of the call's size would stream (copy_kernels.hpp); a plane whose token is
// one run of HS elements per head (V of vec / vec16) by whole raw rows where source and
// destination groups match, else token by token with 64-byte moves (fused_vrows.hpp); a
// plane of a token's dims in adjacent pairs (K of amx, plain or neox-rotated) by lane
// groups of 4-byte elements; a plane of interleaved token pairs (V of amx) line by line,
// one permute per destination line (fused_vpairs.hpp); every other token as before. A
// geometry's tables and these plans are kept across calls (the last 8 geometries).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "fused_chunks.hpp"
#include "fused_tiles.hpp"
#include "fused_vpairs.hpp"
#include "fused_vrows.hpp"
#include "rope_rotate.hpp"

namespace lmckv {

// The shared arguments plus the engine's block geometry and offset tables.
struct FusedBlocksArgs : FusedChunkArgs {
  uint64_t block_size = 0, head_size = 0;  // BS, HS (width = NH * 2 * HS)
  std::vector<int64_t> tok_off, dim_off;   // [2, BS], [2, HS], row-major
};

// Engine geometries whose tables were planned so far in this process (tables() planned
// them rather than reusing kept ones); for tests and benches.
uint64_t fused_block_tables_planned();

class FusedBlocksPlan {
 public:
  explicit FusedBlocksPlan(const FusedBlocksArgs& a);  // validates (ValueError)
  void execute() const;                                // without the GIL
  uint64_t total_bytes() const { return io_.dst.size() * io_.chunk_nbytes; }

 private:
  // dim_off[p][k0 .. k0 + len) are offsets off, off + 1, ..: one copy of len elements.
  struct Seg {
    int64_t off;
    uint64_t len;
  };
  // How one plane's elements move. Per token: segment by segment, or element by element
  // (every segment one element long, itemsize 2 or 4: a tight loop). Tokens tb ..
  // tb + lane[tb] - 1 follow each other `seg_len` elements apart, so when their sources
  // do too, each segment of all of them is one contiguous copy (vec's K: a run of tokens
  // per dim; amx's K: per pair of dims within 16 tokens; vec's V: two tokens' rows).
  // `tokens` aligned tokens whose sources are aligned tokens of one block, in order: their
  // cells are the same segments (offsets from the first token's) on both sides.
  struct Tile {
    uint64_t tokens;
    std::vector<Seg> segs;
  };
  struct PlaneCopy {
    std::vector<Tile> tiles;  // the useful ones, most tokens first
    std::vector<Seg> segs;
    uint64_t seg_len = 0;  // every segment's length, 0 if they differ
    bool elementwise = false;
    std::vector<uint64_t> lane;  // [BS]; all 1 when seg_len is 0
  };
  // The engine geometry's checked tables and how each plane moves: the same for every
  // call with the same block tables, so planned once and kept (tables()).
  struct Tables {
    PlaneCopy copy[2];
    LaneGroups lanes[2];  // a plane's lane groups (fused_tiles.hpp), when it has lanes
    TokenRows rows[2];    // a plane of one run per token and head (fused_vrows.hpp)
    TokenPairs pairs[2];  // a plane of interleaved token pairs (fused_vpairs.hpp)
  };
  using SrcToken = BlockToken;  // where a token of a destination block comes from
  // One task's scratch, reused unit after unit.
  struct Scratch {
    std::vector<SrcToken> from;  // [BS]
    std::vector<char> buf;       // a rotated K token's gather and result
    std::vector<float> cos_t, sin_t;  // [pair][BS]: the unit's tables for lane groups
    std::vector<LaneGroup> groups;
    std::vector<TokenRange> rest;
    bool stream = false;  // lane groups may stream whole cache lines out (warm destinations)
  };

  static uint64_t checked_chunk_nbytes(const FusedBlocksArgs& a);  // validates the geometry
  static void append_cell(std::vector<Seg>& segs, int64_t r);
  void check_tables() const;
  void check_cells() const;
  void check_cell(std::vector<int64_t>& owner, uint64_t code, int64_t r, int64_t c) const;
  std::shared_ptr<const Tables> tables() const;  // kept, or checked and planned now
  void plan_copies(Tables& t) const;
  void plan_tiles(int p, PlaneCopy& c) const;
  void plan_lanes(int p, LaneGroups& lanes) const;
  LaneGroups pair_lanes(int p) const;
  void run_units(uint64_t first, uint64_t last, bool stream) const;
  void run_unit(uint64_t unit, Scratch& s) const;
  void copy_plane(int p, char* d, uint64_t dtb, const char* s, uint64_t stb, uint64_t n) const;
  const Tile* tile_for(int p, uint64_t tb, const SrcToken& f, uint64_t most) const;
  void copy_tokens(int p, char* d, const SrcToken* from, uint64_t first, uint64_t last) const;
  void copy_block(char* d, Scratch& s, uint64_t t0, bool stream) const;
  void copy_range(int p, char* d, Scratch& s, uint64_t t0, uint64_t first, uint64_t last,
                  bool stream) const;
  void rotate_tokens(char* d, Scratch& s, uint64_t t0, uint64_t first, uint64_t last) const;
  void unit_tables(Scratch& s, uint64_t t0) const;
  void rotate_k(char* d, uint64_t dtb, const char* s, uint64_t stb, uint64_t t,
                char* buf) const;

  FusedBlocksArgs a_;
  uint64_t chunk_nbytes_ = 0;
  FusedChunks io_;  // validated regions, ids, index and tables
  std::shared_ptr<const Tables> t_;
  std::vector<char> cold_;    // destination j's pages are mostly not in memory yet
  RowGeom geom_{};            // one head of K, for the rotation
  RotateFn rotate_ = nullptr;  // nullptr: no rotation
};

}  // namespace lmckv

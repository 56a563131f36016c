#include "fused_blocks.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <list>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "common.hpp"
#include "copy_kernels.hpp"
#include "thread_pool.hpp"

namespace lmckv {

namespace {

constexpr const char* kWhat = "fused_blocks";

// What a geometry's tables are planned from: equal keys plan equal tables.
struct TablesKey {
  uint64_t bs, hs, width, itemsize, rotary;
  bool interleaved;
  std::string isa;  // set_fused_blocks_isa: plans made afterwards follow it
  std::vector<int64_t> tok_off, dim_off;

  bool operator==(const TablesKey& o) const {
    return std::tie(bs, hs, width, itemsize, rotary, interleaved, isa, tok_off, dim_off) ==
           std::tie(o.bs, o.hs, o.width, o.itemsize, o.rotary, o.interleaved, o.isa, o.tok_off,
                    o.dim_off);
  }
};

constexpr size_t kTablesKept = 8;  // geometries kept (a process rarely has more than one)
std::atomic<uint64_t> g_tables_planned{0};

// Cold destinations (common.hpp: mostly_absent) get cached stores, as in fused_rows.cpp:
// the first store to a page faults in a zeroed page, which streaming stores would then
// write to memory twice.
bool cold_pages(const char* p, uint64_t n) {
  const long ps = sysconf(_SC_PAGESIZE);
  return ps > 0 && mostly_absent(reinterpret_cast<uintptr_t>(p), n, static_cast<uint64_t>(ps));
}

std::string num(uint64_t v) { return std::to_string(v); }
std::string inum(int64_t v) { return std::to_string(v); }

std::string object_shape(const FusedBlocksArgs& a) {
  return "[" + num(a.layers) + ", " + num(a.chunk_tokens) + ", " + num(a.width) + "] x " +
         num(a.itemsize);
}

// "(plane p, token tb, dim d)" of the table cell code (p * BS + tb) * HS + d.
std::string cell_name(uint64_t code, uint64_t bs, uint64_t hs) {
  return "(plane " + num(code / hs / bs) + ", token " + num(code / hs % bs) + ", dim " +
         num(code % hs) + ")";
}

// B bytes from s to d through a register-sized temporary (no libc call, no alignment).
template <size_t B>
inline void copy_fixed(char* d, const char* s) {
  char t[B];
  std::memcpy(t, s, B);
  std::memcpy(d, t, B);
}

// The first and the last B of n bytes (B <= n <= 2B): overlapping, so any n in one go.
template <size_t B>
inline void copy_ends(char* d, const char* s, size_t n) {
  char a[B], b[B];
  std::memcpy(a, s, B);
  std::memcpy(b, s + n - B, B);
  std::memcpy(d, a, B);
  std::memcpy(d + n - B, b, B);
}

// n bytes from s to d (disjoint): the short copies of a block (a few to a few hundred
// bytes) inline, where a libc memcpy call would cost more than the bytes.
inline void copy_small(char* d, const char* s, size_t n) {
  if (n > 512) {
    std::memcpy(d, s, n);
  } else if (n >= 32) {
    size_t i = 0;
    for (; i + 32 <= n; i += 32) copy_fixed<32>(d + i, s + i);
    if (i < n) copy_fixed<32>(d + n - 32, s + n - 32);
  } else if (n >= 16) {
    copy_ends<16>(d, s, n);
  } else if (n >= 8) {
    copy_ends<8>(d, s, n);
  } else if (n >= 4) {
    copy_ends<4>(d, s, n);
  } else if (n >= 2) {
    copy_ends<2>(d, s, n);
  } else if (n == 1) {
    *d = *s;
  }
}

// The n elements of one token's plane, E bytes each: element k moves from src offset
// sofs + off[k] to dst offset dofs + off[k] (in elements; both >= 0, checked at planning).
// memcpy of a constant E compiles to one load and store, without an aligned-T* assumption.
template <size_t E>
void copy_elements(char* d, int64_t dofs, const char* s, int64_t sofs, const int64_t* off,
                   uint64_t n) {
  constexpr auto e = static_cast<int64_t>(E);
  for (uint64_t k = 0; k < n; ++k) {
    std::memcpy(d + (dofs + off[k]) * e, s + (sofs + off[k]) * e, E);
  }
}

// K of one (token, head) through a contiguous buffer: gather by `off`, rotate, scatter.
template <size_t E>
void rotate_elements(char* d, int64_t dofs, const char* s, int64_t sofs, const int64_t* off,
                     char* buf, RotateFn fn, const float* c, const float* sn, const RowGeom& g) {
  constexpr auto e = static_cast<int64_t>(E);
  const uint64_t n = g.head_dim;
  char* in = buf;
  char* out = buf + n * E;
  for (uint64_t k = 0; k < n; ++k) std::memcpy(in + k * E, s + (sofs + off[k]) * e, E);
  fn(out, in, c, sn, g);
  for (uint64_t k = 0; k < n; ++k) std::memcpy(d + (dofs + off[k]) * e, out + k * E, E);
}

}  // namespace

// Every count >= 1, whole blocks and heads, the rotation's geometry; the object's bytes,
// overflow-checked.
uint64_t FusedBlocksPlan::checked_chunk_nbytes(const FusedBlocksArgs& a) {
  if (a.layers == 0 || a.chunk_tokens == 0 || a.width == 0 || a.itemsize == 0 ||
      a.block_size == 0 || a.head_size == 0) {
    fused_fail(kWhat, "layers, chunk_tokens, width, itemsize, block_size and head_size must be "
                      ">= 1, got " + object_shape(a) + ", block_size " + num(a.block_size) +
                      ", head_size " + num(a.head_size));
  }
  if (a.chunk_tokens % a.block_size) {
    fused_fail(kWhat, "chunk_tokens " + num(a.chunk_tokens) + " is not a multiple of block_size " +
                          num(a.block_size));
  }
  const uint64_t head = checked_mul(2, a.head_size, kWhat);
  if (a.width % head) {
    fused_fail(kWhat, "width " + num(a.width) + " is not a whole number of heads of 2 x " +
                          num(a.head_size) + " (K and V)");
  }
  if (a.rotary_dim && a.head_dim != a.head_size) {
    fused_fail(kWhat, "the rotation's head_dim " + num(a.head_dim) + " is not head_size " +
                          num(a.head_size));
  }
  check_fused_rotation(a, kWhat);
  const uint64_t lc = checked_mul(a.layers, a.chunk_tokens, kWhat);
  return checked_mul(checked_mul(lc, a.width, kWhat), a.itemsize, kWhat);
}

uint64_t fused_block_tables_planned() { return g_tables_planned.load(); }

FusedBlocksPlan::FusedBlocksPlan(const FusedBlocksArgs& a)
    : a_(a),
      chunk_nbytes_(checked_chunk_nbytes(a)),
      io_(a, kWhat, chunk_nbytes_, object_shape(a)),
      t_(tables()) {
  for (char* d : io_.dst) cold_.push_back(cold_pages(d, chunk_nbytes_) ? 1 : 0);
  if (a.rotary_dim) {
    geom_ = RowGeom{1, a.head_size, a.rotary_dim, a.rotary_dim / 2, a.interleaved};
    rotate_ = rotate_for(a.dtype, geom_);
  }
}

// This geometry's tables: the kept ones when the same tables were planned before (~0.2 ms
// per call for W6's geometry, a third of a one-chunk call), else checked and planned now.
// A kept plan was checked from the same values, so every check still holds.
std::shared_ptr<const FusedBlocksPlan::Tables> FusedBlocksPlan::tables() const {
  TablesKey key{a_.block_size, a_.head_size, a_.width,    a_.itemsize, a_.rotary_dim,
                a_.interleaved, fused_blocks_isa(), a_.tok_off, a_.dim_off};
  static std::mutex mu;
  static std::list<std::pair<TablesKey, std::shared_ptr<const Tables>>> kept;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (auto it = kept.begin(); it != kept.end(); ++it) {
      if (it->first == key) {
        kept.splice(kept.begin(), kept, it);  // most recent first
        return it->second;
      }
    }
  }
  check_tables();
  check_cells();
  auto t = std::make_shared<Tables>();
  plan_copies(*t);
  g_tables_planned.fetch_add(1);
  std::lock_guard<std::mutex> lock(mu);
  kept.emplace_front(std::move(key), t);
  if (kept.size() > kTablesKept) kept.pop_back();
  return t;
}

// The tables' shapes, and entries small enough (|x| <= 2^61) that sums and differences of
// a few of them cannot overflow.
void FusedBlocksPlan::check_tables() const {
  const uint64_t bs = a_.block_size, hs = a_.head_size;
  if (a_.tok_off.size() != checked_mul(2, bs, kWhat)) {
    fused_fail(kWhat, "tok_off has " + num(a_.tok_off.size()) + " entries, expected [2, " +
                          num(bs) + "] (planes x block_size)");
  }
  if (a_.dim_off.size() != checked_mul(2, hs, kWhat)) {
    fused_fail(kWhat, "dim_off has " + num(a_.dim_off.size()) + " entries, expected [2, " +
                          num(hs) + "] (planes x head_size)");
  }
  const uint64_t block = checked_mul(bs, a_.width, kWhat);  // elements of one block's rows
  if (block > (uint64_t{1} << 61)) fused_fail(kWhat, "size overflows 64 bits");
  const auto lim = static_cast<int64_t>(block);
  auto check = [&](const std::vector<int64_t>& tab, const char* name, uint64_t n) {
    for (size_t i = 0; i < tab.size(); ++i) {
      if (tab[i] < -lim || tab[i] > lim) {
        fused_fail(kWhat, std::string(name) + "[" + num(i / n) + "][" + num(i % n) + "] is " +
                              inum(tab[i]) + ", beyond one block's " + num(block) + " elements");
      }
    }
  };
  check(a_.tok_off, "tok_off", bs);
  check(a_.dim_off, "dim_off", hs);
}

// (p, tb, d) -> tok_off[p][tb] + dim_off[p][d] lands on the cells {r * W + c : r < BS,
// c < 2 * HS} of one (block, head), each at most once. There are 2 * BS * HS of both, so
// this is a bijection: every access stays in its block and head, every byte is written.
// A cell's row and column are its token's plus its dim's (x = q * W + m, 0 <= m < W),
// carried: one division per table entry, not per cell.
void FusedBlocksPlan::check_cells() const {
  const uint64_t bs = a_.block_size, hs = a_.head_size, row = 2 * hs;
  const auto w = static_cast<int64_t>(a_.width);
  auto split = [w](int64_t x) {
    const int64_t q = x / w - (x % w < 0 ? 1 : 0);
    return std::pair<int64_t, int64_t>{q, x - q * w};
  };
  std::vector<int64_t> owner(bs * row, -1);  // the (p, tb, d) code that took each cell
  std::vector<std::pair<int64_t, int64_t>> dims(hs);
  for (uint64_t p = 0; p < 2; ++p) {
    for (uint64_t d = 0; d < hs; ++d) dims[d] = split(a_.dim_off[p * hs + d]);
    for (uint64_t tb = 0; tb < bs; ++tb) {
      const auto [tr, tc] = split(a_.tok_off[p * bs + tb]);
      for (uint64_t d = 0; d < hs; ++d) {
        int64_t r = tr + dims[d].first, c = tc + dims[d].second;
        if (c >= w) {
          ++r;
          c -= w;
        }
        check_cell(owner, (p * bs + tb) * hs + d, r, c);
      }
    }
  }
}

// Cell (r, c) of a (block, head) for table cell `code`: inside, and not taken before.
void FusedBlocksPlan::check_cell(std::vector<int64_t>& owner, uint64_t code, int64_t r,
                                 int64_t c) const {
  const uint64_t bs = a_.block_size, hs = a_.head_size, w = a_.width, row = 2 * hs;
  const int64_t v = r * static_cast<int64_t>(w) + c;
  if (r < 0 || static_cast<uint64_t>(r) >= bs || static_cast<uint64_t>(c) >= row) {
    fused_fail(kWhat, cell_name(code, bs, hs) + " is at offset " + inum(v) +
                          ", outside its block's cells (" + num(bs) + " rows of " + num(w) +
                          ", the first " + num(row) + " of each)");
  }
  int64_t& cell = owner[static_cast<uint64_t>(r) * row + static_cast<uint64_t>(c)];
  if (cell >= 0) {
    fused_fail(kWhat, cell_name(static_cast<uint64_t>(cell), bs, hs) + " and " +
                          cell_name(code, bs, hs) + " are both at offset " + inum(v));
  }
  cell = static_cast<int64_t>(code);
}

// Add element offset r to segments built in order: extend the last one when r follows
// it, else start a new one.
void FusedBlocksPlan::append_cell(std::vector<Seg>& segs, int64_t r) {
  if (!segs.empty() && segs.back().off + static_cast<int64_t>(segs.back().len) == r) {
    ++segs.back().len;
  } else {
    segs.push_back(Seg{r, 1});
  }
}

// Each plane's dim_off as maximal runs of consecutive offsets, its token lanes, and its
// token rows when a token's dims are one run.
void FusedBlocksPlan::plan_copies(Tables& t) const {
  const uint64_t bs = a_.block_size, hs = a_.head_size;
  for (int p = 0; p < 2; ++p) {
    const int64_t* off = a_.dim_off.data() + p * hs;
    const int64_t* tok = a_.tok_off.data() + p * bs;
    PlaneCopy& c = t.copy[p];
    for (uint64_t k = 0; k < hs; ++k) append_cell(c.segs, off[k]);
    c.seg_len = c.segs.front().len;
    for (const Seg& g : c.segs) c.seg_len = g.len == c.seg_len ? c.seg_len : 0;
    c.elementwise = c.segs.size() == hs && (a_.itemsize == 2 || a_.itemsize == 4);
    c.lane.assign(bs, 1);
    const auto step = static_cast<int64_t>(c.seg_len);
    for (uint64_t tb = bs - 1; step && tb-- > 0;) {
      if (tok[tb + 1] == tok[tb] + step) c.lane[tb] = c.lane[tb + 1] + 1;
    }
    plan_tiles(p, c);
    plan_lanes(p, t.lanes[p]);
    if (c.segs.size() == 1) t.rows[p] = TokenRows(tok, off, bs, hs, a_.width, a_.itemsize);
    t.pairs[p] = TokenPairs(tok, off, bs, hs, a_.width, a_.itemsize);
  }
}

// Plane p's lane groups (fused_tiles.hpp) over its rows, dims outermost: a dim's heads sit
// side by side in one raw row. A rotated K's rotary dims as pairs of rows (neox: i and
// i + half; interleaved: 2i and 2i + 1), the rest copied.
void FusedBlocksPlan::plan_lanes(int p, LaneGroups& lanes) const {
  const uint64_t hs = a_.head_size, heads = a_.width / (2 * hs);
  const uint64_t rotary = p == 0 ? a_.rotary_dim : 0, half = rotary / 2;
  const int64_t* off = a_.dim_off.data() + p * hs;
  auto row = [&](uint64_t h, uint64_t d) { return static_cast<int64_t>(h * 2 * hs) + off[d]; };
  std::vector<int64_t> rows;
  for (uint64_t d = rotary; d < hs; ++d) {
    for (uint64_t h = 0; h < heads; ++h) rows.push_back(row(h, d));
  }
  lanes = LaneGroups(a_.tok_off.data() + p * a_.block_size, a_.block_size, a_.itemsize,
                     std::move(rows));
  if (!lanes.enabled()) {
    lanes = pair_lanes(p);
    return;
  }
  if (rotary == 0) return;
  std::vector<LanePair> pairs;
  for (uint64_t i = 0; i < half; ++i) {
    const uint64_t da = a_.interleaved ? 2 * i : i, db = a_.interleaved ? 2 * i + 1 : i + half;
    for (uint64_t h = 0; h < heads; ++h) pairs.push_back(LanePair{row(h, da), row(h, db), i});
  }
  lanes.set_rotation(std::move(pairs));
}

// Plane p's lane groups over 4-byte elements, each a token's pair of dims 2m, 2m + 1, when
// those are adjacent and every token's cells start on an even element (2-byte items):
// amx's K, a block's tokens in runs of 16 pairs per (head, pair of dims) = one 64-byte
// line, whose destination lines each gather from at most a few source lines. A rotated K
// (neox, rotary_dim a multiple of 4) turns rows m and m + rotary / 4 of its rotary pairs
// together; the other rows are copied. A disabled LaneGroups (the token path) where the
// plane is not like that.
LaneGroups FusedBlocksPlan::pair_lanes(int p) const {
  const uint64_t bs = a_.block_size, hs = a_.head_size, heads = a_.width / (2 * hs);
  const uint64_t rotary = p == 0 ? a_.rotary_dim : 0, quarter = rotary / 4;
  const int64_t* off = a_.dim_off.data() + p * hs;
  const int64_t* tok = a_.tok_off.data() + p * bs;
  bool pairs = a_.itemsize == 2 && hs % 2 == 0 && rotary % 4 == 0 &&
               (rotary == 0 || (!a_.interleaved && a_.dtype == EditDType::kBF16));
  for (uint64_t i = 0; pairs && i < hs / 2; ++i) {
    pairs = off[2 * i] % 2 == 0 && off[2 * i + 1] == off[2 * i] + 1;
  }
  for (uint64_t tb = 0; pairs && tb < bs; ++tb) pairs = tok[tb] % 2 == 0;
  if (!pairs) return LaneGroups();
  auto row = [&](uint64_t h, uint64_t m) {  // in 4-byte elements
    return (static_cast<int64_t>(h * 2 * hs) + off[2 * m]) / 2;
  };
  std::vector<int64_t> tok4(bs), rows;
  for (uint64_t tb = 0; tb < bs; ++tb) tok4[tb] = tok[tb] / 2;
  for (uint64_t h = 0; h < heads; ++h) {  // a head's lines of a group in address order
    for (uint64_t m = rotary / 2; m < hs / 2; ++m) rows.push_back(row(h, m));
  }
  LaneGroups lanes(tok4.data(), bs, 4, std::move(rows));
  if (rotary == 0) return lanes;
  std::vector<LanePair> turned;
  for (uint64_t h = 0; h < heads; ++h) {
    for (uint64_t m = 0; m < quarter; ++m) {
      turned.push_back(LanePair{row(h, m), row(h, m + quarter), 2 * m});
    }
  }
  lanes.set_rotation(std::move(turned), true);
  return lanes;
}

// Tiles of n = BS, BS/2, .. 2 tokens (halving while even) where every aligned group of n
// tokens has the same shape, kept when their segments are on average at least twice as
// long as one token's (amx's V: a pair of tokens is 4 runs of 32 elements, not 64 single
// ones; any plane: a whole block). The group's cells are put in order by a bitmap over
// the block's elements (each cell distinct and inside, check_cells): a sort of its
// n * HS offsets cost ~0.7 ms per call for W6's geometry.
void FusedBlocksPlan::plan_tiles(int p, PlaneCopy& c) const {
  const uint64_t bs = a_.block_size, hs = a_.head_size;
  const int64_t* tok = a_.tok_off.data() + p * bs;
  const int64_t* off = a_.dim_off.data() + p * hs;
  std::vector<uint64_t> bits((bs * a_.width + 63) / 64);
  for (uint64_t n = bs; n >= 2; n = n % 2 ? 0 : n / 2) {
    bool same = true;
    for (uint64_t tb = n; same && tb < bs; ++tb) {
      same = tok[tb] - tok[tb / n * n] == tok[tb % n] - tok[0];
    }
    if (!same) continue;
    std::fill(bits.begin(), bits.end(), 0);
    for (uint64_t i = 0; i < n; ++i) {
      for (uint64_t d = 0; d < hs; ++d) {
        const auto u = static_cast<uint64_t>(tok[i] + off[d]);
        bits[u / 64] |= uint64_t{1} << (u % 64);
      }
    }
    Tile t{n, {}};
    for (uint64_t k = 0; k < bits.size(); ++k) {
      for (uint64_t x = bits[k]; x != 0; x &= x - 1) {  // its cells, from the first token's
        append_cell(t.segs, static_cast<int64_t>(k * 64 + __builtin_ctzll(x)) - tok[0]);
      }
    }
    if (2 * t.segs.size() <= n * c.segs.size()) c.tiles.push_back(std::move(t));
  }
}

// Plane p of n tokens of one head: d, s are the head's first byte in the destination and
// source blocks; destination tokens dtb.. take source tokens stb.. (n > 1 only inside both
// lanes: then each segment of the n tokens is one contiguous range on both sides).
void FusedBlocksPlan::copy_plane(int p, char* d, uint64_t dtb, const char* s, uint64_t stb,
                                 uint64_t n) const {
  const uint64_t bs = a_.block_size, hs = a_.head_size, e = a_.itemsize;
  const int64_t dofs = a_.tok_off[p * bs + dtb], sofs = a_.tok_off[p * bs + stb];
  const PlaneCopy& c = t_->copy[p];
  if (n == 1 && c.elementwise) {
    const int64_t* off = a_.dim_off.data() + p * hs;
    if (e == 2) {
      copy_elements<2>(d, dofs, s, sofs, off, hs);
    } else {
      copy_elements<4>(d, dofs, s, sofs, off, hs);
    }
    return;
  }
  for (const Seg& g : c.segs) {
    copy_small(d + static_cast<uint64_t>(dofs + g.off) * e,
               s + static_cast<uint64_t>(sofs + g.off) * e, n * g.len * e);
  }
}

// K of one (token, head), re-rotated for output token t (as copy_plane; `buf`: 2 * HS
// elements of scratch).
void FusedBlocksPlan::rotate_k(char* d, uint64_t dtb, const char* s, uint64_t stb,
                               uint64_t t, char* buf) const {
  const int64_t dofs = a_.tok_off[dtb], sofs = a_.tok_off[stb];
  const int64_t* off = a_.dim_off.data();
  const float* c = io_.cos + t * geom_.half;
  const float* sn = io_.sin + t * geom_.half;
  if (a_.itemsize == 2) {
    rotate_elements<2>(d, dofs, s, sofs, off, buf, rotate_, c, sn, geom_);
  } else {
    rotate_elements<4>(d, dofs, s, sofs, off, buf, rotate_, c, sn, geom_);
  }
}

// The largest tile of at most `most` tokens of plane p that destination token tb starts:
// tb and its source aligned to it, the tile's tokens all from the sources that follow in
// the same block.
const FusedBlocksPlan::Tile* FusedBlocksPlan::tile_for(int p, uint64_t tb, const SrcToken& f,
                                                       uint64_t most) const {
  for (const Tile& t : t_->copy[p].tiles) {
    if (t.tokens <= most && tb % t.tokens == 0 && f.tb % t.tokens == 0 && f.run >= t.tokens) {
      return &t;
    }
  }
  return nullptr;
}

// Plane p of destination tokens [first, last) of one block (d: its first byte; token tb
// from `from[tb]`): whole tiles where they fit, else runs of tokens whose sources follow
// each other within both lanes. Heads innermost: the heads of one token sit side by side
// in a raw row, so both sides are walked row by row, as the prefetchers like (head by
// head, whole blocks moved 3x slower: 12.8 against 3.9 ms for 56 MiB of amx blocks, 2
// threads).
void FusedBlocksPlan::copy_tokens(int p, char* d, const SrcToken* from, uint64_t first,
                                  uint64_t last) const {
  const uint64_t e = a_.itemsize, head = 2 * a_.head_size * e;
  const uint64_t heads = a_.width / (2 * a_.head_size);
  const int64_t* tok = a_.tok_off.data() + p * a_.block_size;
  for (uint64_t tb = first, n; tb < last; tb += n) {
    const SrcToken& f = from[tb];
    if (const Tile* t = tile_for(p, tb, f, last - tb)) {
      for (const Seg& g : t->segs) {
        char* dg = d + static_cast<uint64_t>(tok[tb] + g.off) * e;
        const char* sg = f.block + static_cast<uint64_t>(tok[f.tb] + g.off) * e;
        for (uint64_t h = 0; h < heads; ++h) {
          copy_small(dg + h * head, sg + h * head, g.len * e);
        }
      }
      n = t->tokens;
    } else {
      n = std::min({f.run, t_->copy[p].lane[tb], t_->copy[p].lane[f.tb], last - tb});
      for (uint64_t h = 0; h < heads; ++h) {
        copy_plane(p, d + h * head, tb, f.block + h * head, f.tb, n);
      }
    }
  }
}

// One destination block (d: its first byte; token tb from `s.from[tb]`, output token
// t0 + tb), plane by plane: by lane groups where the plane has them (fused_tiles.hpp;
// `stream`: they may use non-temporal stores), the other tokens by copy_range.
void FusedBlocksPlan::copy_block(char* d, Scratch& s, uint64_t t0, bool stream) const {
  const uint64_t bs = a_.block_size;
  for (int p = 0; p < 2; ++p) {
    const bool rotated = p == 0 && rotate_ != nullptr;
    const LaneGroups& lanes = t_->lanes[p];
    if (!lanes.enabled() || (rotated && !lanes.rotates())) {
      copy_range(p, d, s, t0, 0, bs, stream);
      continue;
    }
    lanes.plan(s.from.data(), s.groups, s.rest);
    if (!s.groups.empty()) {
      lanes.run(d, s.groups, stream);
      if (rotated) {
        unit_tables(s, t0);
        lanes.rotate(d, s.groups, stream, s.cos_t.data(), s.sin_t.data());
      }
    }
    for (const TokenRange& r : s.rest) copy_range(p, d, s, t0, r.first, r.last, stream);
  }
}

// Plane p of destination tokens [first, last) of one block without lane groups: a rotated
// K by rotate_tokens; else by token rows or token pairs where the plane has those
// (fused_vrows.hpp, fused_vpairs.hpp), every other token by copy_tokens.
void FusedBlocksPlan::copy_range(int p, char* d, Scratch& s, uint64_t t0, uint64_t first,
                                 uint64_t last, bool stream) const {
  const SrcToken* from = s.from.data();
  if (p == 0 && rotate_ != nullptr) {
    rotate_tokens(d, s, t0, first, last);
  } else if (t_->rows[p].enabled()) {
    t_->rows[p].copy(d, from, first, last, stream);
  } else if (t_->pairs[p].enabled() && first % 2 == 0 && last % 2 == 0) {
    t_->pairs[p].copy(d, from, first, last, stream);
  } else {
    copy_tokens(p, d, from, first, last);
  }
}

// K of destination tokens [first, last) of one block, token by token and head by head:
// gathered, rotated for output token t0 + tb, scattered (rotate_k).
void FusedBlocksPlan::rotate_tokens(char* d, Scratch& s, uint64_t t0, uint64_t first,
                                    uint64_t last) const {
  const uint64_t head = 2 * a_.head_size * a_.itemsize, heads = a_.width / (2 * a_.head_size);
  for (uint64_t tb = first; tb < last; ++tb) {
    const SrcToken& f = s.from[tb];
    for (uint64_t h = 0; h < heads; ++h) {
      rotate_k(d + h * head, tb, f.block + h * head, f.tb, t0 + tb, s.buf.data());
    }
  }
}

// The rotation tables of output tokens t0 .. t0 + BS - 1 as [pair][token] (s.cos_t,
// s.sin_t): what one pair of rows of a lane group reads.
void FusedBlocksPlan::unit_tables(Scratch& s, uint64_t t0) const {
  const uint64_t bs = a_.block_size, half = geom_.half;
  for (uint64_t tb = 0; tb < bs; ++tb) {
    const float* c = io_.cos + (t0 + tb) * half;
    const float* sn = io_.sin + (t0 + tb) * half;
    for (uint64_t i = 0; i < half; ++i) {
      s.cos_t[i * bs + tb] = c[i];
      s.sin_t[i * bs + tb] = sn[i];
    }
  }
}

// One (destination j, layer l, block b): the destination block (BS raw rows) and the few
// source blocks it reads stay in L1/L2 while it is written.
void FusedBlocksPlan::run_unit(uint64_t unit, Scratch& s) const {
  const uint64_t bs = a_.block_size, c = a_.chunk_tokens, row_bytes = a_.width * a_.itemsize;
  const uint64_t nblk = c / bs;
  const uint64_t j = unit / (a_.layers * nblk), l = unit / nblk % a_.layers, b = unit % nblk;
  const uint64_t t0 = io_.ids[j] * c + b * bs;  // output token of the block's token 0
  std::vector<SrcToken>& from = s.from;
  uint64_t q = 0, st = 0, stb = 0;  // source chunk, token in it, token in its block
  for (uint64_t tb = 0; tb < bs; ++tb) {
    const auto i = static_cast<uint64_t>(io_.idx[t0 + tb]);
    if (tb > 0 && i == static_cast<uint64_t>(io_.idx[t0 + tb - 1]) + 1 && st + 1 < c) {
      ++st;  // the source token after the last one: no divisions (most tokens of a selection)
      stb = stb + 1 == bs ? 0 : stb + 1;
    } else {
      q = i / c;
      st = i % c;
      stb = st % bs;
    }
    from[tb] = SrcToken{io_.src[q] + (l * c + st - stb) * row_bytes, stb, 1};
  }
  for (uint64_t tb = bs - 1; tb-- > 0;) {  // runs of sources that follow each other
    const SrcToken &f = from[tb], &g = from[tb + 1];
    if (g.block == f.block && g.tb == f.tb + 1) from[tb].run = g.run + 1;
  }
  copy_block(io_.dst[j] + (l * c + b * bs) * row_bytes, s, t0, s.stream && cold_[j] == 0);
}

// Units [first, last) of the (destination, layer, block) order, with this task's scratch.
void FusedBlocksPlan::run_units(uint64_t first, uint64_t last, bool stream) const {
  Scratch s;
  s.stream = stream;
  s.from.resize(a_.block_size);
  s.buf.resize(rotate_ != nullptr ? 2 * a_.head_size * a_.itemsize : 0);
  s.cos_t.resize(rotate_ != nullptr ? geom_.half * a_.block_size : 0);
  s.sin_t.resize(s.cos_t.size());
  for (uint64_t u = first; u < last; ++u) run_unit(u, s);
  if (stream) stream_fence();  // order the weakly-ordered stores before "done"
}

void FusedBlocksPlan::execute() const {
  const uint64_t units = io_.dst.size() * a_.layers * (a_.chunk_tokens / a_.block_size);
  if (units == 0) return;
  const int max_tasks = static_cast<int>(std::min<uint64_t>(units, 1u << 20));
  // lane groups stream whole cache lines when a copy of this size would (copy_kernels.hpp)
  const bool stream = stream_copy_for(total_bytes()) != nullptr;
  run_parallel(total_bytes(), max_tasks, [this, units, stream](int task, int ntasks) {
    using U = unsigned __int128;  // units * ntasks may pass 64 bits
    const U t = static_cast<U>(task), nt = static_cast<U>(ntasks);
    run_units(static_cast<uint64_t>(units * t / nt),
              static_cast<uint64_t>(units * (t + 1) / nt), stream);
  });
}

}  // namespace lmckv

#include "fused_tiles.hpp"

#include "bf16_avx512.hpp"
#include "line_store.hpp"

#include <pybind11/pybind11.h>

// GCC's intrinsic headers build undefined vectors as `__Y = __Y`, which -O1 (the
// sanitizer build) reports as maybe-uninitialized at every use: not this code's values.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace lmckv {

namespace py = pybind11;

namespace {

std::atomic<int> g_forced{-1};  // -1 auto, 0 generic (the token path), 1 avx512

bool avx512_here() {
#if defined(__x86_64__)
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return ok;
#else
  return false;
#endif
}

#if defined(__x86_64__)
#define LMCKV_LANE_TARGET __attribute__((target("avx512f,avx512bw")))

// The element-size-specific instructions: masked load, two-table permute, masked merge.
template <size_t E>
struct Lanes;
template <>
struct Lanes<2> {
  LMCKV_LANE_TARGET static __m512i load(uint64_t m, const char* p) {
    return _mm512_maskz_loadu_epi16(static_cast<__mmask32>(m), p);
  }
  LMCKV_LANE_TARGET static __m512i permute(__m512i lo, __m512i idx, __m512i hi) {
    return _mm512_permutex2var_epi16(lo, idx, hi);
  }
  LMCKV_LANE_TARGET static __m512i merge(__m512i acc, uint64_t take, __m512i v) {
    return _mm512_mask_mov_epi16(acc, static_cast<__mmask32>(take), v);
  }
};
template <>
struct Lanes<4> {
  LMCKV_LANE_TARGET static __m512i load(uint64_t m, const char* p) {
    return _mm512_maskz_loadu_epi32(static_cast<__mmask16>(m), p);
  }
  LMCKV_LANE_TARGET static __m512i permute(__m512i lo, __m512i idx, __m512i hi) {
    return _mm512_permutex2var_epi32(lo, idx, hi);
  }
  LMCKV_LANE_TARGET static __m512i merge(__m512i acc, uint64_t take, __m512i v) {
    return _mm512_mask_mov_epi32(acc, static_cast<__mmask16>(take), v);
  }
};

// One window's tokens of a group, in the group's order, for R rows (`r`: each row's
// bytes into every block): only the window's elements from its first to its last token
// are read (the masks; the second register only when they reach into it). The window's
// indices and masks are loaded once for the R rows.
template <size_t E, int R>
LMCKV_LANE_TARGET inline void window_rows(const LaneWindow& w, const int64_t* r, __m512i* out) {
  constexpr uint64_t kG = 64 / E;
  const char* p = w.block + w.base;
  const __m512i idx = _mm512_load_si512(w.idx);
  const uint64_t high = w.load >> kG;
  for (int i = 0; i < R; ++i) {
    const __m512i hi = high != 0 ? Lanes<E>::load(high, p + r[i] + 64) : _mm512_setzero_si512();
    out[i] = Lanes<E>::permute(Lanes<E>::load(w.load, p + r[i]), idx, hi);
  }
}

// A group's G tokens of R rows: gathered from its windows, or plain loads when it is
// straight.
template <size_t E, int R>
LMCKV_LANE_TARGET inline void group_rows(const LaneGroup& g, const int64_t* r, __m512i* out) {
  if (g.two_lines) {
    const __m512i idx = _mm512_load_si512(g.idx2);
    for (int i = 0; i < R; ++i) {
      out[i] = Lanes<E>::permute(Lanes<E>::load(g.line_load[0], g.line[0] + r[i]), idx,
                                 Lanes<E>::load(g.line_load[1], g.line[1] + r[i]));
    }
    return;
  }
  if (g.straight) {
    const char* p = g.win[0].block + g.win[0].base;
    for (int i = 0; i < R; ++i) out[i] = _mm512_loadu_si512(p + r[i]);
    return;
  }
  window_rows<E, R>(g.win[0], r, out);
  for (uint32_t s = 1; s < g.windows; ++s) {
    __m512i more[R];
    window_rows<E, R>(g.win[s], r, more);
    for (int i = 0; i < R; ++i) out[i] = Lanes<E>::merge(out[i], g.win[s].take, more[i]);
  }
}

// Every group of R rows.
template <size_t E, bool S, int R>
LMCKV_LANE_TARGET inline void groups_of_rows(char* dst, const LaneGroup* groups, uint64_t n,
                                             const int64_t* r) {
  for (uint64_t k = 0; k < n; ++k) {
    __m512i v[R];
    group_rows<E, R>(groups[k], r, v);
    for (int i = 0; i < R; ++i) store_line<S>(dst + (r[i] + groups[k].dst), v[i]);
  }
}

// Every row, every group: rows outermost, two at a time, so both blocks are walked in
// order and each group's indices and masks serve two rows (7-9% faster than one row at a
// time; four or eight rows, or groups outermost, are not faster for vec / vec16, whose
// groups lie side by side in a row: docs/performance.md).
template <size_t E, bool S>
LMCKV_LANE_TARGET void lane_rows(char* dst, const LaneGroup* groups, uint64_t n,
                                 const int64_t* rows, uint64_t nrows) {
  uint64_t r = 0;
  for (; r + 2 <= nrows; r += 2) groups_of_rows<E, S, 2>(dst, groups, n, rows + r);
  // an odd count does not come from an engine (HS is even)
  if (r < nrows) groups_of_rows<E, S, 1>(dst, groups, n, rows + r);
}

// The lines a group's windows will load for R rows, asked for ahead (the same addresses
// its loads read, inside the source blocks).
template <int R>
LMCKV_LANE_TARGET inline void prefetch_rows(const LaneGroup& g, const int64_t* r) {
  for (uint32_t s = 0; s < g.windows; ++s) {
    const char* p = g.win[s].block + g.win[s].base;
    for (int i = 0; i < R; ++i) _mm_prefetch(p + r[i], _MM_HINT_T1);
  }
}

// Every group, every row: for planes whose groups lie apart in a row and whose rows are
// adjacent lines (amx's K: a group's rows, 2 KiB a head at HS 64), group by group, the
// next group's lines asked for (to L2) while this one moves (docs/performance.md).
template <size_t E, bool S>
LMCKV_LANE_TARGET void lane_groups(char* dst, const LaneGroup* groups, uint64_t n,
                                   const int64_t* rows, uint64_t nrows) {
  for (uint64_t k = 0; k < n; ++k) {
    uint64_t r = 0;
    for (; r + 2 <= nrows; r += 2) {
      if (k + 1 < n) prefetch_rows<2>(groups[k + 1], rows + r);
      groups_of_rows<E, S, 2>(dst, groups + k, 1, rows + r);
    }
    if (r < nrows) groups_of_rows<E, S, 1>(dst, groups + k, 1, rows + r);
  }
}

// (a, b) -> (a c - b s, b c + a s) in rotate_body's roundings (rope_rotate.cpp): a c
// rounded, then b s fused in; likewise b c, then a s.
LMCKV_LANE_TARGET inline void turn(__m512& a, __m512& b, __m512 c, __m512 s) {
  const __m512 ya = _mm512_fnmadd_ps(b, s, _mm512_mul_ps(a, c));
  b = _mm512_fmadd_ps(a, s, _mm512_mul_ps(b, c));
  a = ya;
}

// One group's pair of rows turned (E = 2: bfloat16 in two halves of 16; 4: float32) and
// stored; c, s: the pair's cos / sin of the group's tokens.
template <size_t E, bool S>
LMCKV_LANE_TARGET inline void turn_group(char* dst, const LaneGroup& g, const LanePair& pr,
                                         const float* c, const float* s) {
  const int64_t r[2] = {pr.a, pr.b};
  __m512i v[2];
  group_rows<E, 2>(g, r, v);
  const __m512i va = v[0], vb = v[1];
  if constexpr (E == 2) {
    __m512 a0 = bf16x16_widen(_mm512_castsi512_si256(va)), a1 = bf16x16_widen(_mm512_extracti64x4_epi64(va, 1));
    __m512 b0 = bf16x16_widen(_mm512_castsi512_si256(vb)), b1 = bf16x16_widen(_mm512_extracti64x4_epi64(vb, 1));
    turn(a0, b0, _mm512_loadu_ps(c), _mm512_loadu_ps(s));
    turn(a1, b1, _mm512_loadu_ps(c + 16), _mm512_loadu_ps(s + 16));
    store_line<S>(dst + (pr.a + g.dst),
             _mm512_inserti64x4(_mm512_castsi256_si512(bf16x16_narrow(a0)), bf16x16_narrow(a1), 1));
    store_line<S>(dst + (pr.b + g.dst),
             _mm512_inserti64x4(_mm512_castsi256_si512(bf16x16_narrow(b0)), bf16x16_narrow(b1), 1));
  } else {
    __m512 a = _mm512_castsi512_ps(va), b = _mm512_castsi512_ps(vb);
    turn(a, b, _mm512_loadu_ps(c), _mm512_loadu_ps(s));
    store_line<S>(dst + (pr.a + g.dst), _mm512_castps_si512(a));
    store_line<S>(dst + (pr.b + g.dst), _mm512_castps_si512(b));
  }
}

// One group's pair of rows of bfloat16 dim pairs (4-byte elements: dims 2m, 2m + 1 of a
// token, amx's K) turned: dim 2m of row a with dim 2m of row b by pair i = 2m of the
// rotation (c0, s0), dims 2m + 1 by pair i + 1 (c1, s1), in turn's roundings.
template <bool S>
LMCKV_LANE_TARGET inline void turn_dim_pairs(char* dst, const LaneGroup& g, const LanePair& pr,
                                             const float* c0, const float* s0, const float* c1,
                                             const float* s1) {
  const int64_t r[2] = {pr.a, pr.b};
  __m512i v[2];
  group_rows<4, 2>(g, r, v);
  const __m512i va = v[0], vb = v[1];
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  __m512 a0 = _mm512_castsi512_ps(_mm512_slli_epi32(va, 16));
  __m512 b0 = _mm512_castsi512_ps(_mm512_slli_epi32(vb, 16));
  __m512 a1 = _mm512_castsi512_ps(_mm512_and_si512(va, hi));
  __m512 b1 = _mm512_castsi512_ps(_mm512_and_si512(vb, hi));
  turn(a0, b0, _mm512_loadu_ps(c0), _mm512_loadu_ps(s0));
  turn(a1, b1, _mm512_loadu_ps(c1), _mm512_loadu_ps(s1));
  auto join = [](__m512 even, __m512 odd) LMCKV_LANE_TARGET {
    return _mm512_or_si512(_mm512_cvtepu16_epi32(bf16x16_narrow(even)),
                           _mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16_narrow(odd)), 16));
  };
  store_line<S>(dst + (pr.a + g.dst), join(a0, a1));
  store_line<S>(dst + (pr.b + g.dst), join(b0, b1));
}

// Every pair of rows of dim pairs, every group (pr.i is the even dim's rotation pair):
// group by group, as lane_groups, the next group's lines of each pair asked for ahead.
template <bool S>
LMCKV_LANE_TARGET void lane_dim_pairs(char* dst, const LaneGroup* groups, uint64_t n,
                                      const LanePair* pairs, uint64_t npairs,
                                      const float* cos_t, const float* sin_t, uint64_t bs) {
  for (uint64_t k = 0; k < n; ++k) {
    for (uint64_t p = 0; p < npairs; ++p) {
      const LanePair& pr = pairs[p];
      if (k + 1 < n) {
        const int64_t r[2] = {pr.a, pr.b};
        prefetch_rows<2>(groups[k + 1], r);
      }
      const uint64_t at = pr.i * bs + groups[k].t0;
      turn_dim_pairs<S>(dst, groups[k], pr, cos_t + at, sin_t + at, cos_t + at + bs,
                        sin_t + at + bs);
    }
  }
}

// Every pair of rows, every group (pairs outermost: a pair's rows, head after head, are
// walked in order).
template <size_t E, bool S>
LMCKV_LANE_TARGET void lane_pairs(char* dst, const LaneGroup* groups, uint64_t n,
                                  const LanePair* pairs, uint64_t npairs, const float* cos_t,
                                  const float* sin_t, uint64_t bs) {
  for (uint64_t p = 0; p < npairs; ++p) {
    const LanePair& pr = pairs[p];
    for (uint64_t k = 0; k < n; ++k) {
      const uint64_t at = pr.i * bs + groups[k].t0;
      turn_group<E, S>(dst, groups[k], pr, cos_t + at, sin_t + at);
    }
  }
}
#endif

// The lane kernels for elements of `itemsize` bytes here (S: streaming stores), nullptr
// for the token path. Rotations come in bfloat16 (2 bytes) and float32 only.
template <bool S>
LaneRowsFn lane_rows_for(uint64_t itemsize) {
  if (g_forced.load() == 0 || !avx512_here()) return nullptr;
#if defined(__x86_64__)
  if (itemsize == 2) return &lane_rows<2, S>;
  if (itemsize == 4) return &lane_rows<4, S>;
#endif
  (void)itemsize;
  return nullptr;
}

template <bool S>
LaneRotateFn lane_pairs_for(uint64_t itemsize) {
  if (g_forced.load() == 0 || !avx512_here()) return nullptr;
#if defined(__x86_64__)
  if (itemsize == 2) return &lane_pairs<2, S>;
  if (itemsize == 4) return &lane_pairs<4, S>;
#endif
  (void)itemsize;
  return nullptr;
}

// Append tokens [first, last), joined to the previous range when they follow it.
void add_range(std::vector<TokenRange>& rest, uint64_t first, uint64_t last) {
  if (!rest.empty() && rest.back().last == first) {
    rest.back().last = last;
  } else {
    rest.push_back(TokenRange{first, last});
  }
}

}  // namespace

LaneGroups::LaneGroups(const int64_t* tok, uint64_t bs, uint64_t itemsize,
                       std::vector<int64_t> rows)
    : tok_(tok, tok + bs), lane_(bs), rows_(std::move(rows)), bs_(bs), e_(itemsize) {
  fn_ = lane_rows_for<false>(itemsize);
  stream_fn_ = lane_rows_for<true>(itemsize);
  if (fn_ == nullptr) return;
  g_ = 64 / itemsize;
  for (int64_t& r : rows_) r *= static_cast<int64_t>(itemsize);
  rows_aligned_ = std::all_of(rows_.begin(), rows_.end(), [](int64_t r) { return r % 64 == 0; });
  for (uint64_t tb = 0; tb < bs; ++tb) {
    lane_[tb] = tb > 0 && tok[tb] == tok[tb - 1] + 1 ? lane_[tb - 1] : tb;
  }
  bool any = false;
  for (uint64_t t0 = 0; t0 + g_ <= bs; t0 += g_) {
    dst_ok_.push_back(lane_[t0 + g_ - 1] == lane_[t0] ? 1 : 0);
    any = any || dst_ok_.back() != 0;
  }
  if (!any) fn_ = nullptr;
  if (fn_ != nullptr && bs >= 2 * g_ && lane_[g_] != lane_[0]) {  // groups apart in a row
#if defined(__x86_64__)
    fn_ = itemsize == 2 ? &lane_groups<2, false> : &lane_groups<4, false>;
    stream_fn_ = itemsize == 2 ? &lane_groups<2, true> : &lane_groups<4, true>;
#endif
  }
}

void LaneGroups::plan(const BlockToken* from, std::vector<LaneGroup>& groups,
                      std::vector<TokenRange>& rest) const {
  groups.clear();
  rest.clear();
  for (uint64_t k = 0; k < dst_ok_.size(); ++k) {
    const uint64_t t0 = k * g_;
    if (dst_ok_[k] != 0) {
      groups.emplace_back();
      if (plan_group(from, t0, groups.back())) continue;
      groups.pop_back();
    }
    add_range(rest, t0, t0 + g_);
  }
  if (bs_ % g_ != 0) add_range(rest, bs_ - bs_ % g_, bs_);
}

// Tokens t0 .. t0 + G - 1 into at most kMaxWindows windows: a token joins the window of
// its block and lane that stays within 2G tokens with it (the last one used first), else
// opens one. False when it needs more.
bool LaneGroups::plan_group(const BlockToken* from, uint64_t t0, LaneGroup& g) const {
  uint32_t of[32];  // each token's window (G <= 32)
  uint64_t lo[LaneGroup::kMaxWindows], hi[LaneGroup::kMaxWindows];
  uint32_t n = 0, last = 0;
  auto fits = [&](uint32_t s, const BlockToken& f) {
    return g.win[s].block == f.block && lane_[lo[s]] == lane_[f.tb] &&
           std::max(hi[s], f.tb) - std::min(lo[s], f.tb) < 2 * g_;
  };
  for (uint64_t i = 0; i < g_; ++i) {
    const BlockToken& f = from[t0 + i];
    uint32_t s = last;
    if (n == 0 || !fits(s, f)) {
      for (s = 0; s < n && !fits(s, f); ++s) {
      }
      if (s == n) {
        if (n == LaneGroup::kMaxWindows) return false;
        g.win[n].block = f.block;
        lo[n] = hi[n] = f.tb;
        ++n;
      }
    }
    lo[s] = std::min(lo[s], f.tb);
    hi[s] = std::max(hi[s], f.tb);
    of[i] = last = s;
  }
  g.windows = n;
  const auto e = static_cast<int64_t>(e_);
  g.dst = tok_[t0] * e;
  g.t0 = static_cast<uint32_t>(t0);
  for (uint32_t s = 0; s < n; ++s) {
    LaneWindow& w = g.win[s];
    w.base = tok_[lo[s]] * e;
    const uint64_t span = hi[s] - lo[s] + 1;  // <= 2G <= 64
    w.load = span == 64 ? ~uint64_t{0} : (uint64_t{1} << span) - 1;
  }
  fill_windows(from + t0, of, lo, g);
  g.straight = n == 1;
  for (uint64_t i = 0; g.straight && i < g_; ++i) {
    g.straight = from[t0 + i].tb == lo[0] + i;
  }
  g.two_lines = false;
  if (n == 2) plan_lines(from + t0, of, lo, hi, g);
  return true;
}

// Whether both windows lie inside one aligned run of G elements each (their lines); if
// so, the lines, their masks (only the windows' elements are read) and idx2: token i's
// place in line 0 or, + G, line 1.
void LaneGroups::plan_lines(const BlockToken* group, const uint32_t* of, const uint64_t* lo,
                            const uint64_t* hi, LaneGroup& g) const {
  uint64_t start[2];
  for (uint32_t s = 0; s < 2; ++s) {
    const auto x = static_cast<uint64_t>(tok_[lo[s]]);
    start[s] = x - x % g_;
    if (static_cast<uint64_t>(tok_[hi[s]]) >= start[s] + g_) return;
    g.line[s] = g.win[s].block + static_cast<int64_t>(start[s] * e_);
    g.line_load[s] = g.win[s].load << (x - start[s]);
  }
  for (uint64_t i = 0; i < g_; ++i) {
    const uint32_t s = of[i];
    put_index(g.idx2, i, static_cast<uint64_t>(tok_[group[i].tb]) - start[s] + (s == 1 ? g_ : 0));
  }
  g.two_lines = true;
}

// Each window's permute indices (a token's distance from the window's first token lo[s])
// and the tokens it gives (group: the group's G source tokens; of: each one's window).
void LaneGroups::fill_windows(const BlockToken* group, const uint32_t* of, const uint64_t* lo,
                              LaneGroup& g) const {
  for (uint32_t s = 0; s < g.windows; ++s) {
    std::memset(g.win[s].idx, 0, sizeof g.win[s].idx);
    g.win[s].take = 0;
  }
  for (uint64_t i = 0; i < g_; ++i) {
    LaneWindow& w = g.win[of[i]];
    w.take |= uint64_t{1} << i;
    put_index(w.idx, i, group[i].tb - lo[of[i]]);  // < 2G: lo .. hi are one lane
  }
}

// Permute index `at` for destination token i, in the element size's lanes.
void LaneGroups::put_index(unsigned char* idx, uint64_t i, uint64_t at) const {
  if (e_ == 2) {
    const auto v = static_cast<uint16_t>(at);
    std::memcpy(idx + 2 * i, &v, 2);
  } else {
    const auto v = static_cast<uint32_t>(at);
    std::memcpy(idx + 4 * i, &v, 4);
  }
}

// Whether the groups' stores may stream: asked to, and every one a whole cache line.
bool LaneGroups::streams(bool stream, char* dst, const std::vector<LaneGroup>& groups) const {
  return stream && rows_aligned_ &&
         std::all_of(groups.begin(), groups.end(), [dst](const LaneGroup& g) {
           return reinterpret_cast<uintptr_t>(dst + g.dst) % 64 == 0;
         });
}

void LaneGroups::run(char* dst, const std::vector<LaneGroup>& groups, bool stream) const {
  if (rows_.empty()) return;
  (streams(stream, dst, groups) ? stream_fn_ : fn_)(dst, groups.data(), groups.size(),
                                                    rows_.data(), rows_.size());
}

void LaneGroups::set_rotation(std::vector<LanePair> pairs, bool dim_pairs) {
  pairs_ = std::move(pairs);
  const auto e = static_cast<int64_t>(e_);
  for (LanePair& p : pairs_) {
    p.a *= e;
    p.b *= e;
    rows_aligned_ = rows_aligned_ && p.a % 64 == 0 && p.b % 64 == 0;
  }
  if (fn_ == nullptr) return;
  if (dim_pairs) {
    if (e_ != 4) return;
#if defined(__x86_64__)
    rot_fn_ = &lane_dim_pairs<false>;
    rot_stream_fn_ = &lane_dim_pairs<true>;
#endif
    return;
  }
  rot_fn_ = lane_pairs_for<false>(e_);
  rot_stream_fn_ = lane_pairs_for<true>(e_);
}

void LaneGroups::rotate(char* dst, const std::vector<LaneGroup>& groups, bool stream,
                        const float* cos_t, const float* sin_t) const {
  (streams(stream, dst, groups) ? rot_stream_fn_ : rot_fn_)(
      dst, groups.data(), groups.size(), pairs_.data(), pairs_.size(), cos_t, sin_t, bs_);
}

std::string fused_blocks_isa() {
  return g_forced.load() != 0 && avx512_here() ? "avx512" : "generic";
}

void set_fused_blocks_isa(const std::string& name) {
  if (name == "auto") {
    g_forced.store(-1);
  } else if (name == "generic") {
    g_forced.store(0);
  } else if (name == "avx512") {
    if (!avx512_here()) throw py::value_error("fused_blocks: this CPU has no AVX-512BW");
    g_forced.store(1);
  } else {
    throw py::value_error("fused_blocks: isa must be 'auto', 'avx512' or 'generic', got '" +
                          name + "'");
  }
}

}  // namespace lmckv

#include "fused_vpairs.hpp"

#include "line_store.hpp"

// GCC's intrinsic headers build undefined vectors as `__Y = __Y`, which -O1 (the
// sanitizer build) reports as maybe-uninitialized at every use: not this code's values.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace lmckv {

namespace {

#if defined(__x86_64__)
#define LMCKV_PAIRS_TARGET __attribute__((target("avx512f,avx512bw")))

// The permute indices of a destination line: its even places from table a at parity pa,
// its odd places from table b (+ 32) at parity pb.
LMCKV_PAIRS_TARGET __m512i pair_index(unsigned pa, unsigned pb) {
  alignas(64) uint16_t idx[32];
  for (unsigned i = 0; i < 16; ++i) {
    idx[2 * i] = static_cast<uint16_t>(2 * i + pa);
    idx[2 * i + 1] = static_cast<uint16_t>(32 + 2 * i + pb);
  }
  return _mm512_load_si512(idx);
}

// Destination pairs moved column by column at once (a block of 128 tokens in one go).
constexpr uint64_t kPairsAtOnce = 64;

// The source lines of one destination pair, and which permute joins them.
struct PairSource {
  const char* a;
  const char* b;
  int64_t dst;  // the pair's line base, bytes from the destination block
  unsigned sel;  // 2 * parity of a + parity of b: the index vector
};

// Destination pairs, column by column: every (head, 16 dims) line of each pair, each line
// one two-table permute of its two tokens' source lines. Columns outermost, so each
// column's lines (consecutive pairs 64 bytes apart) are read and written in address order;
// the next column's source lines (another page) are asked for one column ahead.
template <bool S>
LMCKV_PAIRS_TARGET void pair_lines(char* dst, const PairSource* ps, uint64_t npairs,
                                   const int64_t* cols, uint64_t ncols) {
  const __m512i idx[4] = {pair_index(0, 0), pair_index(0, 1), pair_index(1, 0),
                          pair_index(1, 1)};
  for (uint64_t c = 0; c < ncols; ++c) {
    const int64_t col = cols[c];
    const bool more = c + 1 < ncols;
    for (uint64_t k = 0; k < npairs; ++k) {
      const PairSource& p = ps[k];
      if (more) {  // this pair's lines of the next column
        _mm_prefetch(p.b + cols[c + 1], _MM_HINT_T1);
        if (p.a != p.b) _mm_prefetch(p.a + cols[c + 1], _MM_HINT_T1);
      }
      const __m512i va = _mm512_loadu_si512(p.a + col), vb = _mm512_loadu_si512(p.b + col);
      store_line<S>(dst + p.dst + col, _mm512_permutex2var_epi16(va, idx[p.sel], vb));
    }
  }
}
#endif

}  // namespace

TokenPairs::TokenPairs(const int64_t* tok, const int64_t* dim, uint64_t bs, uint64_t hs,
                       uint64_t width, uint64_t itemsize) {
  if (itemsize != 2 || bs % 2 != 0 || hs % 16 != 0 || fused_blocks_isa() != "avx512") return;
  for (uint64_t k = 0; k < bs; k += 2) {
    if (tok[k + 1] != tok[k] + 1) return;
  }
  for (uint64_t j = 0; j < hs; j += 16) {
    for (uint64_t i = 0; i < 16; ++i) {
      if (dim[j + i] != dim[j] + static_cast<int64_t>(2 * i)) return;
    }
  }
#if defined(__x86_64__)
  pair_at_.resize(bs);
  for (uint64_t tb = 0; tb < bs; ++tb) pair_at_[tb] = tok[tb & ~uint64_t{1}] * 2;
  const uint64_t heads = width / (2 * hs);
  aligned_ = true;
  for (uint64_t h = 0; h < heads; ++h) {
    for (uint64_t j = 0; j < hs; j += 16) {
      cols_.push_back((static_cast<int64_t>(h * 2 * hs) + dim[j]) * 2);
      for (uint64_t tb = 0; tb < bs; tb += 2) aligned_ = aligned_ && (pair_at_[tb] + cols_.back()) % 64 == 0;
    }
  }
  enabled_ = true;
#endif
}

void TokenPairs::copy(char* dst, const BlockToken* from, uint64_t first, uint64_t last,
                      bool stream) const {
#if defined(__x86_64__)
  const bool s = stream && aligned_ && reinterpret_cast<uintptr_t>(dst) % 64 == 0;
  const auto fn = s ? &pair_lines<true> : &pair_lines<false>;
  PairSource ps[kPairsAtOnce];
  for (uint64_t tb = first; tb + 1 < last;) {
    uint64_t n = 0;
    for (; n < kPairsAtOnce && tb + 1 < last; ++n, tb += 2) {
      const BlockToken &a = from[tb], &b = from[tb + 1];
      ps[n] = {a.block + pair_at_[a.tb], b.block + pair_at_[b.tb], pair_at_[tb],
               static_cast<unsigned>(2 * (a.tb & 1) + (b.tb & 1))};
    }
    fn(dst, ps, n, cols_.data(), cols_.size());
  }
#else
  (void)dst, (void)from, (void)first, (void)last, (void)stream;
#endif
}

}  // namespace lmckv

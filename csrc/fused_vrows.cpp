#include "fused_vrows.hpp"

#include "line_store.hpp"

// GCC's intrinsic headers build undefined vectors as `__Y = __Y`, which -O1 (the
// sanitizer build) reports as maybe-uninitialized at every use: not this code's values.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <algorithm>
#include <map>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace lmckv {

namespace {

// Longest row group looked for (tokens): vec's is a pair.
constexpr uint64_t kMaxGroup = 64;

#if defined(__x86_64__)
#define LMCKV_ROWS_TARGET __attribute__((target("avx512f,avx512bw")))

// The last n % 64 bytes of n (n % 64 != 0; never with S: a streaming caller has whole
// lines), masked: no byte past n is read or written.
LMCKV_ROWS_TARGET inline void put_tail(char* d, const char* s, uint64_t n) {
  const uint64_t full = n / 64 * 64;
  const __mmask64 m = (uint64_t{1} << (n % 64)) - 1;
  _mm512_mask_storeu_epi8(d + full, m, _mm512_maskz_loadu_epi8(m, s + full));
}

// One token's runs of `bytes`, head after head (`stride` apart on both sides).
template <bool S>
LMCKV_ROWS_TARGET void token_heads(char* d, const char* s, uint64_t bytes, uint64_t heads,
                                   uint64_t stride) {
  const uint64_t full = bytes / 64 * 64;
  for (uint64_t h = 0; h < heads; ++h, d += stride, s += stride) {
    for (uint64_t i = 0; i < full; i += 64) {
      store_line<S>(d + i, _mm512_loadu_si512(s + i));
    }
    if (full != bytes) put_tail(d, s, bytes);
  }
}

// n contiguous bytes, four lines per step.
template <bool S>
LMCKV_ROWS_TARGET void span(char* d, const char* s, uint64_t n) {
  uint64_t i = 0;
  for (; i + 256 <= n; i += 256) {
    const __m512i a = _mm512_loadu_si512(s + i), b = _mm512_loadu_si512(s + i + 64);
    const __m512i c = _mm512_loadu_si512(s + i + 128), e = _mm512_loadu_si512(s + i + 192);
    store_line<S>(d + i, a);
    store_line<S>(d + i + 64, b);
    store_line<S>(d + i + 128, c);
    store_line<S>(d + i + 192, e);
  }
  for (; i + 64 <= n; i += 64) store_line<S>(d + i, _mm512_loadu_si512(s + i));
  if (i != n) put_tail(d, s, n);
}

bool avx512_fast_path() { return fused_blocks_isa() == "avx512"; }
#else
bool avx512_fast_path() { return false; }
#endif

}  // namespace

TokenRows::TokenRows(const int64_t* tok, const int64_t* dim, uint64_t bs, uint64_t hs,
                     uint64_t width, uint64_t itemsize)
    : at_(bs), token_bytes_(hs * itemsize), heads_(width / (2 * hs)),
      stride_(2 * hs * itemsize) {
  if (!avx512_fast_path()) return;
#if defined(__x86_64__)
  heads_fn_ = &token_heads<false>;
  heads_stream_ = &token_heads<true>;
  span_fn_ = &span<false>;
  span_stream_ = &span<true>;
#endif
  // a token's first cell: >= 0 and inside its block (check_cells)
  for (uint64_t tb = 0; tb < bs; ++tb) at_[tb] = static_cast<uint64_t>(tok[tb] + dim[0]);
  plan_groups(tok, bs, hs, width);
  aligned_ = token_bytes_ % 64 == 0 && stride_ % 64 == 0;
  for (uint64_t tb = 0; tb < bs; ++tb) {
    aligned_ = aligned_ && at_[tb] * itemsize % 64 == 0;
    at_[tb] *= itemsize;
    group_[tb].start *= itemsize;
    group_[tb].bytes *= itemsize;
    aligned_ = aligned_ && group_[tb].start % 64 == 0 && group_[tb].bytes % 64 == 0;
  }
}

// Each token's row group (in elements until the constructor scales them): the fewest
// tokens from it on whose cells fill rows r0 .. r1 of a (block, head), i.e. (since
// check_cells proved the cells distinct and inside those rows' 2 * HS columns) exactly
// (r1 - r0 + 1) * 2 * HS cells. Groups of the same relative token offsets share a shape.
void TokenRows::plan_groups(const int64_t* tok, uint64_t bs, uint64_t hs, uint64_t width) {
  group_.assign(bs, Group{});
  std::map<std::vector<int64_t>, uint32_t> shapes;
  for (uint64_t tb = 0; tb < bs; ++tb) {
    uint64_t r0 = at_[tb] / width, r1 = r0;
    const uint64_t most = std::min(kMaxGroup, bs - tb);
    for (uint64_t n = 2; n <= most; ++n) {
      const uint64_t r = at_[tb + n - 1] / width;
      r0 = std::min(r0, r);
      r1 = std::max(r1, r);
      if ((r1 - r0 + 1) * 2 * hs != n * hs) continue;
      std::vector<int64_t> rel(n);
      for (uint64_t i = 0; i < n; ++i) rel[i] = tok[tb + i] - tok[tb];
      const auto it = shapes.emplace(std::move(rel), static_cast<uint32_t>(shapes.size())).first;
      group_[tb] = Group{static_cast<uint32_t>(n), it->second, r0 * width, (r1 - r0 + 1) * width};
      break;
    }
  }
}

void TokenRows::copy(char* dst, const BlockToken* from, uint64_t first, uint64_t last,
                     bool stream) const {
  const bool s = stream && aligned_ && reinterpret_cast<uintptr_t>(dst) % 64 == 0;
  const TokenHeadsFn heads = s ? heads_stream_ : heads_fn_;
  const SpanFn spans = s ? span_stream_ : span_fn_;
  char* pd = nullptr;  // the span being gathered: consecutive groups on both sides
  const char* ps = nullptr;
  uint64_t pn = 0;
  for (uint64_t tb = first; tb < last;) {
    const BlockToken& f = from[tb];
    const Group& gd = group_[tb];
    const uint64_t n = gd.tokens;
    if (n != 0 && n <= last - tb && n <= f.run) {
      const Group& gs = group_[f.tb];
      if (gs.tokens == n && gs.shape == gd.shape) {
        char* d = dst + gd.start;
        const char* sp = f.block + gs.start;
        if (pn != 0 && pd + pn == d && ps + pn == sp) {
          pn += gd.bytes;
        } else {
          if (pn != 0) spans(pd, ps, pn);
          pd = d;
          ps = sp;
          pn = gd.bytes;
        }
        tb += n;
        continue;
      }
    }
    if (pn != 0) {  // the span first: both sides walked forward, as the prefetchers like
      spans(pd, ps, pn);
      pn = 0;
    }
    heads(dst + at_[tb], f.block + at_[f.tb], token_bytes_, heads_, stride_);
    ++tb;
  }
  if (pn != 0) spans(pd, ps, pn);
}

}  // namespace lmckv

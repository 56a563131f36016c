#include "key_redundancy.hpp"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "amx_tiles.hpp"
#include "common.hpp"
#include "window_avx512.hpp"
#include "window_scores.hpp"

// GCC's `__Y = __Y` in its intrinsic headers (window_avx512.cpp), at -O1 (the sanitizer build)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace lmckv {

namespace py = pybind11;

namespace {

constexpr const char* kWhat = "key_redundancy";
using amx::kTile;

struct Scratch {
  std::vector<uint16_t> a;    // the head's keys, [rows_pad, head_dim]
  std::vector<uint32_t> b;    // the same keys as bf16 pairs (avx512::pack_pairs)
  std::vector<float> inv;     // 1 / each key's norm, padded with zeros
  std::vector<float> dots;    // 32 rows of key . key, [32, ld]
  std::vector<float> col;     // AVX-512: the counted cosines of earlier rows, per key
};
thread_local Scratch t_scratch;

// inv[t] = 1 / max(|key t|, 1e-12) for the T keys of a (rows hd apart), as F.normalize.
void inv_norms(const uint16_t* a, uint64_t T, uint64_t hd, float* inv) {
  for (uint64_t t = 0; t < T; ++t) {
    const uint16_t* row = a + t * hd;
    float sq = 0.0f;
    for (uint64_t d = 0; d < hd; ++d) sq += bf16_to_f32(row[d]) * bf16_to_f32(row[d]);
    inv[t] = 1.0f / std::max(std::sqrt(sq), 1e-12f);
  }
}

#ifdef LMCKV_AMX
// Sum over j < n of c = dot[j] * inv_i * inv[j] where c > thr (the caller set the pair
// with itself to -inf: never counted).
LMCKV_AMX_TARGET float row_redundancy(const float* dot, const float* inv, uint64_t n,
                                      float inv_i, float thr) {
  const __m512 vi = _mm512_set1_ps(inv_i), vt = _mm512_set1_ps(thr);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
  uint64_t t = 0;
  for (; t + 32 <= n; t += 32) {
    const __m512 c0 = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(dot + t), vi),
                                    _mm512_loadu_ps(inv + t));
    const __m512 c1 = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(dot + t + 16), vi),
                                    _mm512_loadu_ps(inv + t + 16));
    acc0 = _mm512_mask_add_ps(acc0, _mm512_cmp_ps_mask(c0, vt, _CMP_GT_OQ), acc0, c0);
    acc1 = _mm512_mask_add_ps(acc1, _mm512_cmp_ps_mask(c1, vt, _CMP_GT_OQ), acc1, c1);
  }
  for (; t < n; t += 16) {
    const __mmask16 m = avx512::tail_mask(n - t);
    const __m512 c = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, dot + t), vi),
                                   _mm512_maskz_loadu_ps(m, inv + t));
    acc0 = _mm512_mask_add_ps(acc0, m & _mm512_cmp_ps_mask(c, vt, _CMP_GT_OQ), acc0, c);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

LMCKV_AMX_TARGET void unit_amx(Scratch& s, uint64_t rows_pad, uint64_t ld, uint64_t hd,
                               uint64_t T, float thr, float* out) {
  avx512::pack_pairs(s.b.data(), s.a.data(), hd, T, hd);
  amx::configure_tiles();
  for (uint64_t rb = 0; rb < rows_pad;) {
    const uint64_t step = rb + 2 * kTile <= rows_pad ? 2 * kTile : kTile;
    amx::dot_rows(s.a.data() + rb * hd, step, hd, s.b.data(), T, s.dots.data(), ld);
    for (uint64_t i = rb; i < std::min(rb + step, T); ++i) {
      float* dot = s.dots.data() + (i - rb) * ld;
      dot[i] = -std::numeric_limits<float>::infinity();  // not a pair: torch zeroes it
      out[i] = row_redundancy(dot, s.inv.data(), T, s.inv[i], thr);
    }
    rb += step;
  }
  amx::release_tiles();
}
#endif

#ifdef LMCKV_AVX512
// inv_norms with the squares by vdpbf16ps (exact products, float32 sums in 16 lanes):
// the scalar loop's chain of dependent adds would cost as much as a tenth of the dots.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void inv_norms_bf16(
    const uint16_t* a, uint64_t T, uint64_t hd, float* inv) {
  for (uint64_t t = 0; t < T; ++t) {
    __m512 acc = _mm512_setzero_ps();
    for (uint64_t d = 0; d < hd; d += 32) {
      const __mmask32 m = hd - d >= 32 ? ~0u : (1u << (hd - d)) - 1;
      const __m512bh x = (__m512bh)_mm512_maskz_loadu_epi16(m, a + t * hd + d);
      acc = _mm512_dpbf16_ps(acc, x, x);
    }
    inv[t] = 1.0f / std::max(std::sqrt(_mm512_reduce_add_ps(acc)), 1e-12f);
  }
}

// Sum over j < n of c = dot[j] * inv_i * inv[j] where c > thr, each such c also added to
// col[j] (the pair seen from key j).
LMCKV_AVX512_TARGET float row_pairs(const float* dot, const float* inv, float* col, uint64_t n,
                                    float inv_i, float thr) {
  const __m512 vi = _mm512_set1_ps(inv_i), vt = _mm512_set1_ps(thr);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
  uint64_t t = 0;
  for (; t + 32 <= n; t += 32) {
    const __m512 c0 = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(dot + t), vi),
                                    _mm512_loadu_ps(inv + t));
    const __m512 c1 = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(dot + t + 16), vi),
                                    _mm512_loadu_ps(inv + t + 16));
    const __mmask16 m0 = _mm512_cmp_ps_mask(c0, vt, _CMP_GT_OQ);
    const __mmask16 m1 = _mm512_cmp_ps_mask(c1, vt, _CMP_GT_OQ);
    acc0 = _mm512_mask_add_ps(acc0, m0, acc0, c0);
    acc1 = _mm512_mask_add_ps(acc1, m1, acc1, c1);
    const __m512 s0 = _mm512_loadu_ps(col + t), s1 = _mm512_loadu_ps(col + t + 16);
    _mm512_storeu_ps(col + t, _mm512_mask_add_ps(s0, m0, s0, c0));
    _mm512_storeu_ps(col + t + 16, _mm512_mask_add_ps(s1, m1, s1, c1));
  }
  for (; t < n; t += 16) {
    const __mmask16 m = avx512::tail_mask(n - t);
    const __m512 c = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, dot + t), vi),
                                   _mm512_maskz_loadu_ps(m, inv + t));
    const __mmask16 mc = m & _mm512_cmp_ps_mask(c, vt, _CMP_GT_OQ);
    acc0 = _mm512_mask_add_ps(acc0, mc, acc0, c);
    const __m512 cs = _mm512_maskz_loadu_ps(m, col + t);
    _mm512_mask_storeu_ps(col + t, m, _mm512_mask_add_ps(cs, mc, cs, c));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

// The AVX-512 path of one head: the similarity is symmetric, so each chunk of 32 (or 16)
// rows is dotted only with the keys from the chunk on, and each row i counts the pairs
// (i, j > i) for itself (its sum) and for j (col[j]); row i's total is complete once the
// rows before it are done. Half the dot products of the full matrix.
void unit_avx512(Scratch& s, uint64_t rows_pad, uint64_t ld, uint64_t hd, uint64_t T,
                 float thr, float* out) {
  const uint64_t bstep = hd / 2 * avx512::kKeys;  // words per packed block of 16 keys
  avx512::pack_pairs(s.b.data(), s.a.data(), hd, T, hd);
  s.col.assign(ld, 0.0f);
  for (uint64_t rb = 0; rb < rows_pad;) {  // rb: a multiple of 16, below T
    const uint64_t step = rb + 2 * kTile <= rows_pad ? 2 * kTile : kTile;
    float* dots = s.dots.data();  // row rb + r, key rb + t at dots[r * ld + t]
    avx512::dot_rows(s.a.data() + rb * hd, step, hd, s.b.data() + rb / avx512::kKeys * bstep,
                     T - rb, dots, ld);
    for (uint64_t i = rb; i < std::min(rb + step, T); ++i) {
      const float* dot = dots + (i - rb) * ld + (i + 1 - rb);  // keys i + 1 ..
      const float sum = row_pairs(dot, s.inv.data() + i + 1, s.col.data() + i + 1, T - i - 1,
                                  s.inv[i], thr);
      out[i] = s.col[i] + sum;
    }
    rb += step;
  }
}
#endif  // LMCKV_AVX512

[[noreturn]] void fail(const std::string& msg) {
  throw py::value_error(std::string(kWhat) + ": " + msg);
}

}  // namespace

bool KeyRedundancyPlan::supported(uint64_t head_dim) {
  return window_dot_isa(head_dim) != DotIsa::kGeneric;
}

namespace {
const KeyHeadsArgs& checked(const KeyRedundancyArgs& a) {
  if (!KeyRedundancyPlan::supported(a.heads.head_dim)) {
    fail("needs AMX (head_dim a multiple of 32 up to 128) or AVX512-BF16 (an even "
         "head_dim), got head_dim " + std::to_string(a.heads.head_dim) + " on " +
         window_scores_isa());
  }
  if (!std::isfinite(a.threshold)) fail("threshold must be finite");
  return a.heads;
}
}  // namespace

KeyRedundancyPlan::KeyRedundancyPlan(const KeyRedundancyArgs& a)
    : heads_(checked(a), kWhat), threshold_(a.threshold),
      isa_(window_dot_isa(a.heads.head_dim)) {}

void KeyRedundancyPlan::run_unit(uint64_t unit) const {
  const KeyHeadsArgs& a = heads_.args();
  const uint64_t hd = a.head_dim, T = a.tokens;
  const uint64_t rows_pad = round_up(T, kTile), ld = rows_pad + kTile;  // +1 line: L1 sets
  Scratch& s = t_scratch;
  s.a.assign(rows_pad * hd, 0);
  s.inv.assign(ld, 0.0f);
  s.b.resize(rows_pad * hd / 2);
  s.dots.resize(2 * kTile * ld);
  const KeyHeads::Unit x = heads_.unit(unit);
  for (uint64_t t = 0; t < T; ++t) std::memcpy(s.a.data() + t * hd, x.k + t * x.stride, hd * 2);
#ifdef LMCKV_AMX
  if (isa_ == DotIsa::kAmx) {
    inv_norms(s.a.data(), T, hd, s.inv.data());
    unit_amx(s, rows_pad, ld, hd, T, threshold_, x.out);
    return;
  }
#endif
#ifdef LMCKV_AVX512
  inv_norms_bf16(s.a.data(), T, hd, s.inv.data());
  unit_avx512(s, rows_pad, ld, hd, T, threshold_, x.out);
#endif
}

void KeyRedundancyPlan::execute() const {
  const KeyHeadsArgs& a = heads_.args();
  heads_.for_each(a.layers * a.n_kv * a.tokens * a.tokens * 4,  // the dot products' bytes
                  [this](uint64_t u) { run_unit(u); });
}

}  // namespace lmckv

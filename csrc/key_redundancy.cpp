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

#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC's `__Y = __Y` (amx_tiles.cpp)

namespace lmckv {

namespace py = pybind11;

namespace {

constexpr const char* kWhat = "key_redundancy";
using amx::kTile;

struct Scratch {
  std::vector<uint16_t> a;    // the head's keys, [rows_pad, head_dim]
  std::vector<uint32_t> b;    // the same keys packed as AMX's B operand
  std::vector<float> inv;     // 1 / each key's norm, padded with zeros
  std::vector<float> dots;    // 32 rows of key . key, [32, ld]
};
thread_local Scratch t_scratch;


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

[[noreturn]] void fail(const std::string& msg) {
  throw py::value_error(std::string(kWhat) + ": " + msg);
}

}  // namespace

bool KeyRedundancyPlan::supported(uint64_t head_dim) {
  return window_dot_isa(head_dim) == DotIsa::kAmx;
}

namespace {
const KeyHeadsArgs& checked(const KeyRedundancyArgs& a) {
  if (!KeyRedundancyPlan::supported(a.heads.head_dim)) {
    fail("needs AMX and a head_dim that is a multiple of 32 up to 128, got head_dim " +
         std::to_string(a.heads.head_dim));
  }
  if (!std::isfinite(a.threshold)) fail("threshold must be finite");
  return a.heads;
}
}  // namespace

KeyRedundancyPlan::KeyRedundancyPlan(const KeyRedundancyArgs& a)
    : heads_(checked(a), kWhat), threshold_(a.threshold) {}

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
  for (uint64_t t = 0; t < T; ++t) {
    const uint16_t* row = x.k + t * x.stride;
    std::memcpy(s.a.data() + t * hd, row, hd * 2);
    float sq = 0.0f;
    for (uint64_t d = 0; d < hd; ++d) sq += bf16_to_f32(row[d]) * bf16_to_f32(row[d]);
    s.inv[t] = 1.0f / std::max(std::sqrt(sq), 1e-12f);
  }
#ifdef LMCKV_AMX
  unit_amx(s, rows_pad, ld, hd, T, threshold_, x.out);
#endif
}

void KeyRedundancyPlan::execute() const {
  const KeyHeadsArgs& a = heads_.args();
  heads_.for_each(a.layers * a.n_kv * a.tokens * a.tokens * 4,  // the dot products' bytes
                  [this](uint64_t u) { run_unit(u); });
}

}  // namespace lmckv

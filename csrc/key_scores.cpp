#include "key_scores.hpp"

#include "bf16_avx512.hpp"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace lmckv {

namespace py = pybind11;

namespace {

constexpr const char* kWhat = "key_scores";

// One head's keys: row t at k + t * stride, hd elements; scores into out[T].
struct Head {
  const uint16_t* k;
  uint64_t stride, tokens, hd;
  float* out;
};

// L2: out (the norms) over their mean, negated.
inline void score_l2(const Head& h) {
  double total = 0.0;
  for (uint64_t t = 0; t < h.tokens; ++t) total += h.out[t];
  const float ref = std::max(static_cast<float>(total / h.tokens), 1e-12f);
  for (uint64_t t = 0; t < h.tokens; ++t) h.out[t] = -(h.out[t] / ref);
}

// Norms into out, the mean key into mean[hd] (float32 sums).
__attribute__((always_inline)) inline void norms_and_mean(const Head& h, float* mean,
                                                          float* row) {
  std::fill(mean, mean + h.hd, 0.0f);
  for (uint64_t t = 0; t < h.tokens; ++t) {
    const uint16_t* x = h.k + t * h.stride;
    float sq = 0.0f;
    for (uint64_t d = 0; d < h.hd; ++d) {
      row[d] = bf16_to_f32(x[d]);
      sq += row[d] * row[d];
      mean[d] += row[d];
    }
    h.out[t] = std::sqrt(sq);
  }
  for (uint64_t d = 0; d < h.hd; ++d) mean[d] /= static_cast<float>(h.tokens);
}

__attribute__((always_inline)) inline void score_body(const Head& h, bool keydiff,
                                                      float* scratch) {
  float* mean = scratch;
  float* row = scratch + h.hd;
  norms_and_mean(h, mean, row);
  if (!keydiff) {
    score_l2(h);
    return;
  }
  float msq = 0.0f;
  for (uint64_t d = 0; d < h.hd; ++d) msq += mean[d] * mean[d];
  const float mnorm = std::sqrt(msq);
  for (uint64_t t = 0; t < h.tokens; ++t) {
    const uint16_t* x = h.k + t * h.stride;
    float dot = 0.0f;
    for (uint64_t d = 0; d < h.hd; ++d) dot += bf16_to_f32(x[d]) * mean[d];
    h.out[t] = -(dot / std::max(h.out[t] * mnorm, 1e-8f));
  }
}

using ScoreFn = void (*)(const Head&, bool, float*);

void score_generic(const Head& h, bool keydiff, float* scratch) { score_body(h, keydiff, scratch); }

#if defined(__x86_64__)
#define LMCKV_KS_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

// score_body with explicit vectors over the head (hd a multiple of 16, at most 256): the
// compiler does not vectorise the float sums of norms and dots on its own.
LMCKV_KS_TARGET void score_avx512(const Head& h, bool keydiff, float* scratch) {
  const uint64_t nv = h.hd / 16;
  __m512 mean[16];
  for (uint64_t v = 0; v < nv; ++v) mean[v] = _mm512_setzero_ps();
  for (uint64_t t = 0; t < h.tokens; ++t) {
    const uint16_t* x = h.k + t * h.stride;
    __m512 sq = _mm512_setzero_ps();
    for (uint64_t v = 0; v < nv; ++v) {
      const __m512 r = bf16x16_load(x + 16 * v);
      sq = _mm512_fmadd_ps(r, r, sq);
      mean[v] = _mm512_add_ps(mean[v], r);
    }
    h.out[t] = std::sqrt(_mm512_reduce_add_ps(sq));
  }
  const __m512 inv_t = _mm512_set1_ps(1.0f / static_cast<float>(h.tokens));
  __m512 msq = _mm512_setzero_ps();
  for (uint64_t v = 0; v < nv; ++v) {
    mean[v] = _mm512_mul_ps(mean[v], inv_t);
    msq = _mm512_fmadd_ps(mean[v], mean[v], msq);
  }
  if (!keydiff) {
    score_l2(h);
    return;
  }
  const float mnorm = std::sqrt(_mm512_reduce_add_ps(msq));
  for (uint64_t t = 0; t < h.tokens; ++t) {
    const uint16_t* x = h.k + t * h.stride;
    __m512 dot = _mm512_setzero_ps();
    for (uint64_t v = 0; v < nv; ++v) dot = _mm512_fmadd_ps(bf16x16_load(x + 16 * v), mean[v], dot);
    h.out[t] = -(_mm512_reduce_add_ps(dot) / std::max(h.out[t] * mnorm, 1e-8f));
  }
  (void)scratch;
}
#endif

ScoreFn pick(uint64_t hd) {
#if defined(__x86_64__)
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  if (avx512 && hd % 16 == 0 && hd <= 256) return &score_avx512;
#endif
  (void)hd;
  return &score_generic;
}

}  // namespace

KeyScoresPlan::KeyScoresPlan(const KeyScoresArgs& a)
    : heads_(a.heads, kWhat), keydiff_(a.keydiff) {}

void KeyScoresPlan::execute() const {
  const KeyHeadsArgs& a = heads_.args();
  const ScoreFn fn = pick(a.head_dim);
  heads_.for_each(a.layers * a.n_kv * a.tokens * a.head_dim * 2, [this, &a, fn](uint64_t u) {
    thread_local std::vector<float> scratch;
    scratch.resize(2 * a.head_dim);
    const KeyHeads::Unit x = heads_.unit(u);
    fn(Head{x.k, x.stride, a.tokens, a.head_dim, x.out}, keydiff_, scratch.data());
  });
}

}  // namespace lmckv

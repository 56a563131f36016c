#include "window_avx512.hpp"

#include <algorithm>
#include <cstring>
#include <limits>

// GCC's intrinsic headers build undefined vectors as `__Y = __Y`, which -O1 (the
// sanitizer build) reports as (maybe-)uninitialized at every use (here: the reductions'
// extracts): not this code's values.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace lmckv::avx512 {

bool available() {
#ifdef LMCKV_AVX512
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return ok;
#else
  return false;
#endif
}

bool bf16_available() {
#ifdef LMCKV_AVX512
  static const bool ok = available() && __builtin_cpu_supports("avx512bf16");
  return ok;
#else
  return false;
#endif
}

#ifdef LMCKV_AVX512
#define LMCKV_BF16_DOT_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

namespace {

// In-register transpose of a 16 x 16 matrix of 32-bit words: r[j][c] -> r[c][j].
LMCKV_AVX512_TARGET inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // u[4g + m], lane L: column 4L + m of rows 4g .. 4g + 3
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int m = 0; m < 4; ++m) {  // a 4 x 4 transpose of 128-bit lanes
    const __m512i v0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xEE);
    r[m] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + m] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + m] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + m] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// kRows rows against V blocks of 16 keys (pairs np apart in b): per pair step V key
// loads and kRows broadcast query pairs feed kRows * V independent accumulators (enough
// to hide vdpbf16ps's latency), stored once at the end.
template <int V>
LMCKV_BF16_DOT_TARGET inline void dot_tile(const uint16_t* a, uint64_t hd, const uint32_t* b,
                                           uint64_t np, float* lg, uint64_t ld) {
  __m512 acc[kRows][V];  // every loop over it unrolled: the accumulators stay in registers
#pragma GCC unroll 8
  for (uint64_t r = 0; r < kRows; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (uint64_t p = 0; p < np; ++p) {
    __m512bh kv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) kv[v] = (__m512bh)_mm512_loadu_si512(b + (v * np + p) * kKeys);
#pragma GCC unroll 8
    for (uint64_t r = 0; r < kRows; ++r) {
      uint32_t w;  // the query pair (dims 2p, 2p + 1), as one 32-bit word
      std::memcpy(&w, a + r * hd + 2 * p, 4);
      const __m512bh q = (__m512bh)_mm512_set1_epi32(static_cast<int>(w));
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], q, kv[v]);
    }
  }
#pragma GCC unroll 8
  for (uint64_t r = 0; r < kRows; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(lg + r * ld + v * kKeys, acc[r][v]);
  }
}

// 2^z for z <= 0: 2^round(z) times a degree-7 polynomial of the rest (|f| <= 1/2,
// relative error ~1e-7); underflows to 0 far below.
LMCKV_AVX512_TARGET inline __m512 exp2_512(__m512 z) {
  const __m512 n = _mm512_roundscale_ps(z, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(z, n);
  __m512 p = _mm512_set1_ps(1.5252733804059841e-05f);  // ln2^k / k!, k = 7 .. 1
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284770e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

LMCKV_AVX512_TARGET inline __m512 exp_term(const float* x, __m512 a, __m512 b) {
  return exp2_512(_mm512_fmadd_ps(_mm512_loadu_ps(x), a, b));
}

}  // namespace

// One block of 16 keys at a time: each 32 dims by an in-register transpose (16 pairs),
// the pairs past the last multiple of 32 (hd not one) one word at a time.
LMCKV_AVX512_TARGET void pack_pairs(uint32_t* b, const uint16_t* k, uint64_t k_row,
                                    uint64_t tokens, uint64_t hd) {
  const uint64_t np = hd / 2, nkt = hd / 32;
  for (uint64_t t0 = 0; t0 < tokens; t0 += kKeys, b += np * kKeys) {
    const uint64_t n = std::min(kKeys, tokens - t0);
    for (uint64_t kt = 0; kt < nkt; ++kt) {
      __m512i r[16];
      for (uint64_t j = 0; j < kKeys; ++j) {
        r[j] = j < n ? _mm512_loadu_si512(k + (t0 + j) * k_row + kt * 32) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (uint64_t p = 0; p < 16; ++p) _mm512_storeu_si512(b + (kt * 16 + p) * kKeys, r[p]);
    }
    for (uint64_t p = nkt * 16; p < np; ++p) {
      for (uint64_t j = 0; j < kKeys; ++j) {
        uint32_t w = 0;
        if (j < n) std::memcpy(&w, k + (t0 + j) * k_row + 2 * p, 4);
        b[p * kKeys + j] = w;
      }
    }
  }
}

// Rows kRows at a time against every key, two blocks of 16 keys per tile (16
// accumulators), one block for an odd last one. The keys stream from L2 once per kRows
// rows; a row tile's logits are written once.
LMCKV_BF16_DOT_TARGET void dot_rows(const uint16_t* a, uint64_t rows, uint64_t hd,
                                    const uint32_t* b, uint64_t tokens, float* lg, uint64_t ld) {
  const uint64_t np = hd / 2, blocks = (tokens + kKeys - 1) / kKeys, bstep = np * kKeys;
  for (uint64_t r = 0; r < rows; r += kRows) {
    const uint16_t* ar = a + r * hd;
    float* lr = lg + r * ld;
    uint64_t kb = 0;
    for (; kb + 2 <= blocks; kb += 2) dot_tile<2>(ar, hd, b + kb * bstep, np, lr + kb * kKeys, ld);
    if (kb < blocks) dot_tile<1>(ar, hd, b + kb * bstep, np, lr + kb * kKeys, ld);
  }
}

// Four independent maxima, a mask only at the end.
LMCKV_AVX512_TARGET float row_max(const float* x, uint64_t n) {
  const __m512 lo = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m0 = lo, m1 = lo, m2 = lo, m3 = lo;
  const uint64_t n64 = n / 64 * 64;
  uint64_t t = 0;
  for (; t < n64; t += 64) {
    m0 = _mm512_max_ps(m0, _mm512_loadu_ps(x + t));
    m1 = _mm512_max_ps(m1, _mm512_loadu_ps(x + t + 16));
    m2 = _mm512_max_ps(m2, _mm512_loadu_ps(x + t + 32));
    m3 = _mm512_max_ps(m3, _mm512_loadu_ps(x + t + 48));
  }
  for (; t < n; t += 16) m0 = _mm512_mask_max_ps(m0, tail_mask(n - t), m0, _mm512_loadu_ps(x + t));
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
}

// e[t] = exp(scale * (x[t] - mx)) for t < n, then out[t] += e[t] / sum(e). Four
// independent sums (an add's latency would otherwise bound the loop); masks only at the
// end.
LMCKV_AVX512_TARGET void softmax_add(const float* x, uint64_t n, float scale, float mx,
                                     float* e, float* out) {
  constexpr double kLog2e = 1.4426950408889634;
  const __m512 a = _mm512_set1_ps(static_cast<float>(scale * kLog2e));
  const __m512 b = _mm512_set1_ps(static_cast<float>(-mx * scale * kLog2e));
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  const uint64_t n64 = n / 64 * 64, n16 = n / 16 * 16;
  uint64_t t = 0;
  for (; t < n64; t += 64) {
    const __m512 v0 = exp_term(x + t, a, b), v1 = exp_term(x + t + 16, a, b);
    const __m512 v2 = exp_term(x + t + 32, a, b), v3 = exp_term(x + t + 48, a, b);
    s0 = _mm512_add_ps(s0, v0);
    s1 = _mm512_add_ps(s1, v1);
    s2 = _mm512_add_ps(s2, v2);
    s3 = _mm512_add_ps(s3, v3);
    _mm512_storeu_ps(e + t, v0);
    _mm512_storeu_ps(e + t + 16, v1);
    _mm512_storeu_ps(e + t + 32, v2);
    _mm512_storeu_ps(e + t + 48, v3);
  }
  for (; t < n; t += 16) {  // e has room for whole vectors
    const __m512 v = _mm512_maskz_mov_ps(tail_mask(n - t), exp_term(x + t, a, b));
    s0 = _mm512_add_ps(s0, v);
    _mm512_storeu_ps(e + t, v);
  }
  const __m512 sum = _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3));
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
  for (t = 0; t < n16; t += 16) {
    _mm512_storeu_ps(out + t, _mm512_fmadd_ps(_mm512_loadu_ps(e + t), inv, _mm512_loadu_ps(out + t)));
  }
  if (t < n) {
    const __mmask16 m = tail_mask(n - t);
    const __m512 o = _mm512_fmadd_ps(_mm512_loadu_ps(e + t), inv, _mm512_maskz_loadu_ps(m, out + t));
    _mm512_mask_storeu_ps(out + t, m, o);
  }
}
#endif  // LMCKV_AVX512

}  // namespace lmckv::avx512

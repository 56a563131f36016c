#include "window_scores.hpp"

#include <pybind11/pybind11.h>

// GCC's intrinsic headers build undefined vectors as `__Y = __Y`, which -O1 (the
// sanitizer build) reports as maybe-uninitialized at every use: not this code's values.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "amx_tiles.hpp"
#include "common.hpp"
#include "thread_pool.hpp"

namespace lmckv {

namespace py = pybind11;

namespace {

constexpr const char* kWhat = "window_scores";
using amx::kTile;

// Per-thread scratch, reused across tasks and calls.
struct Scratch {
  std::vector<uint16_t> a;    // the unit's queries, [rows_pad, head_dim]
  std::vector<uint32_t> b;    // the head's keys, packed as AMX's B operand
  std::vector<float> logits;  // [rows, ld]: all of the unit's rows, or AMX's 32 at a time
  std::vector<float> e;       // one row's softmax numerators
};
thread_local Scratch t_scratch;

// ------------------------------------------------------------------ ISA selection
std::atomic<int> g_forced{-1};  // -1 auto, 0 generic, 1 amx

bool use_amx(uint64_t head_dim) {
  const int forced = g_forced.load(std::memory_order_relaxed);
  const bool fits = head_dim % 32 == 0 && head_dim <= 128;
  if (forced == 0 || !fits) return false;
  return amx::available();
}

// ------------------------------------------------------------------ logits, portable
void logits_generic(const uint16_t* a, uint64_t rows, const uint16_t* k, uint64_t k_row,
                    uint64_t tokens, uint64_t hd, float* lg, uint64_t ld) {
  std::vector<float> kf(hd), af(rows * hd);
  for (uint64_t i = 0; i < rows * hd; ++i) af[i] = bf16_to_f32(a[i]);
  for (uint64_t t = 0; t < tokens; ++t) {
    for (uint64_t d = 0; d < hd; ++d) kf[d] = bf16_to_f32(k[t * k_row + d]);
    for (uint64_t r = 0; r < rows; ++r) {
      const float* x = af.data() + r * hd;
      float acc = 0.0f;
      for (uint64_t d = 0; d < hd; ++d) acc += x[d] * kf[d];
      lg[r * ld + t] = acc;
    }
  }
}

#ifdef LMCKV_AMX
using amx::tail_mask;

// ------------------------------------------------------------------ softmax, AVX-512
// 2^z for z <= 0: 2^round(z) times a degree-7 polynomial of the rest (|f| <= 1/2,
// relative error ~1e-7); underflows to 0 far below.
LMCKV_AMX_TARGET inline __m512 exp2_512(__m512 z) {
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

LMCKV_AMX_TARGET inline __m512 exp_term(const float* x, __m512 a, __m512 b) {
  return exp2_512(_mm512_fmadd_ps(_mm512_loadu_ps(x), a, b));
}

// max(x[0 .. n)): four independent maxima, a mask only at the end.
LMCKV_AMX_TARGET inline float row_max(const float* x, uint64_t n) {
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

// e[t] = exp(scale * (x[t] - mx)) for t < n (mx: x's maximum over them), then
// out[t] += e[t] / sum(e): row x's softmax over its first n keys, added to out. Four
// independent sums (an add's latency would otherwise bound the loop); masks only at the
// end.
LMCKV_AMX_TARGET void softmax_add_avx512(const float* x, uint64_t n, float scale, float mx,
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
#endif  // LMCKV_AMX

// ------------------------------------------------------------------ softmax, portable
void softmax_add_generic(float* x, uint64_t n, float scale, float* out) {
  float mx = -std::numeric_limits<float>::infinity();
  for (uint64_t t = 0; t < n; ++t) mx = std::max(mx, x[t]);
  const float m = mx * scale;
  double s = 0.0;
  for (uint64_t t = 0; t < n; ++t) {
    x[t] = std::exp(x[t] * scale - m);
    s += x[t];
  }
  const float inv = static_cast<float>(1.0 / s);
  for (uint64_t t = 0; t < n; ++t) out[t] += x[t] * inv;
}

#ifdef LMCKV_AMX
// The AMX path of one unit: 32 (or 16) rows at a time, their logits, then each row's
// softmax added to its query head's out row [T] while the logits are still in L2.
template <typename Visible>
LMCKV_AMX_TARGET void scores_amx(Scratch& s, const uint16_t* k, uint64_t k_row, uint64_t T,
                                 uint64_t hd, uint64_t rows, uint64_t rows_pad, uint64_t ld,
                                 uint64_t w, float scale, const Visible& visible, float* out) {
  s.b.resize(ld * hd / 2);
  s.logits.resize(2 * kTile * ld);
  s.e.resize(ld);  // one row's exp terms, L1-sized: each row is added while it is hot
  amx::pack_keys(s.b.data(), k, k_row, T, hd);
  std::fill(out, out + rows / w * T, 0.0f);
  amx::configure_tiles();
  for (uint64_t rb = 0; rb < rows_pad;) {
    const uint64_t step = rb + 2 * kTile <= rows_pad ? 2 * kTile : kTile;
    float* lg = s.logits.data();  // row rb + i of the chunk at lg + i * ld
    amx::dot_rows(s.a.data() + rb * hd, step, hd, s.b.data(), T, lg, ld);
    for (uint64_t r = rb; r < std::min(rb + step, rows); ++r) {
      const float* x = lg + (r - rb) * ld;
      const uint64_t n = visible(r);
      softmax_add_avx512(x, n, scale, row_max(x, n), s.e.data(), out + (r / w) * T);
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

WindowScoresPlan::WindowScoresPlan(const WindowScoresArgs& a) : a_(a) {
  if (a.n_kv == 0 || a.group == 0 || a.head_dim == 0) fail("heads and head_dim must be >= 1");
  if (a.window == 0 || a.window > a.tq) {
    fail("window must be 1 .. " + std::to_string(a.tq) + " (the queries), got " +
         std::to_string(a.window));
  }
  if (a.at_end && a.window > a.tokens) fail("window is longer than the KV");
  if (!(a.scale > 0.0f) || !std::isfinite(a.scale)) fail("scale must be a finite float > 0");
  const uint64_t hq = checked_mul(a.n_kv, a.group, kWhat);
  const uint64_t qn = checked_mul(checked_mul(a.layers, a.tq, kWhat), hq * a.head_dim, kWhat);
  const uint64_t kn = checked_mul(checked_mul(a.layers, a.tokens, kWhat), a.n_kv * a.head_dim,
                                  kWhat);
  const uint64_t on = checked_mul(checked_mul(a.layers, hq, kWhat), a.tokens, kWhat);
  q_ = reinterpret_cast<const uint16_t*>(
      checked_span(a.q.base, a.q.nbytes, a.q.offset, checked_mul(qn, 2, kWhat), kWhat, "q"));
  k_ = reinterpret_cast<const uint16_t*>(
      checked_span(a.k.base, a.k.nbytes, a.k.offset, checked_mul(kn, 2, kWhat), kWhat, "k"));
  const uint64_t out_bytes = checked_mul(on, 4, kWhat);
  out_ = reinterpret_cast<float*>(const_cast<char*>(
      checked_span(a.out.base, a.out.nbytes, a.out.offset, out_bytes, kWhat, "out")));
  const char* o = reinterpret_cast<const char*>(out_);
  const char* qb = reinterpret_cast<const char*>(q_);
  const char* kb = reinterpret_cast<const char*>(k_);
  if (on && ((o < qb + qn * 2 && qb < o + out_bytes) || (o < kb + kn * 2 && kb < o + out_bytes))) {
    fail("out overlaps q or k");
  }
}

void WindowScoresPlan::run_unit(uint64_t unit, bool amx) const {
  const uint64_t l = unit / a_.n_kv, h = unit % a_.n_kv, hd = a_.head_dim, T = a_.tokens;
  const uint64_t hq = a_.n_kv * a_.group, rows = a_.group * a_.window, w = a_.window;
  const uint64_t rows_pad = round_up(rows, kTile);
  // one cache line more than the keys: rows 2^k bytes apart would share L1 sets
  const uint64_t ld = round_up(T, kTile) + kTile;
  Scratch& s = t_scratch;
  s.a.assign(rows_pad * hd, 0);
  for (uint64_t r = 0; r < rows; ++r) {  // row r: query head h*group + r / w, query r % w
    const uint64_t head = h * a_.group + r / w, pos = a_.tq - w + r % w;
    std::memcpy(s.a.data() + r * hd, q_ + ((l * a_.tq + pos) * hq + head) * hd, hd * 2);
  }
  const uint16_t* k = k_ + l * T * a_.n_kv * hd + h * hd;
  float* out = out_ + (l * hq + h * a_.group) * T;
  auto visible = [&](uint64_t r) { return a_.at_end ? T - w + r % w + 1 : T; };
#ifdef LMCKV_AMX
  if (amx) {
    scores_amx(s, k, a_.n_kv * hd, T, hd, rows, rows_pad, ld, w, a_.scale, visible, out);
    return;
  }
#endif
  s.logits.resize(rows * ld);
  float* lg = s.logits.data();
  logits_generic(s.a.data(), rows, k, a_.n_kv * hd, T, hd, lg, ld);
  std::fill(out, out + a_.group * T, 0.0f);
  for (uint64_t r = 0; r < rows; ++r) {
    softmax_add_generic(lg + r * ld, visible(r), a_.scale, out + (r / w) * T);
  }
}

void WindowScoresPlan::execute() const {
  const uint64_t units = a_.layers * a_.n_kv;
  if (units == 0 || a_.tokens == 0) return;
  const bool amx = use_amx(a_.head_dim);
  // the pool splits by bytes: weigh a unit by its logits (the work), not its inputs
  const uint64_t work = units * a_.group * a_.window * a_.tokens * 4;
  run_parallel(work, static_cast<int>(std::min<uint64_t>(units, 1u << 20)),
               [this, units, amx](int task, int ntasks) {
                 const uint64_t t = static_cast<uint64_t>(task), nt = static_cast<uint64_t>(ntasks);
                 for (uint64_t u = units * t / nt; u < units * (t + 1) / nt; ++u) run_unit(u, amx);
               });
}

std::string window_scores_isa() {
  const int forced = g_forced.load();
  if (forced == 0) return "generic";
  return amx::available() ? "amx" : "generic";
}

void set_window_scores_isa(const std::string& name) {
  if (name == "auto") {
    g_forced.store(-1);
  } else if (name == "generic") {
    g_forced.store(0);
  } else if (name == "amx") {
    if (!amx::available()) fail("this CPU or OS cannot run AMX tiles (no AMX-BF16 or no permission)");
    g_forced.store(1);
  } else {
    fail("isa must be 'auto', 'amx' or 'generic', got '" + name + "'");
  }
}

}  // namespace lmckv

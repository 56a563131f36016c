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
#include "window_avx512.hpp"

namespace lmckv {

namespace py = pybind11;

namespace {

constexpr const char* kWhat = "window_scores";
using amx::kTile;
static_assert(kTile % avx512::kRows == 0, "row chunks of 16 and 32 suit both dot paths");

// Per-thread scratch, reused across tasks and calls.
struct Scratch {
  std::vector<uint16_t> a;    // the unit's queries, [rows_pad, head_dim]
  std::vector<uint32_t> b;    // the head's keys as bf16 pairs (avx512::pack_pairs)
  std::vector<float> logits;  // [rows, ld]: all of the unit's rows, or 32 at a time
  std::vector<float> e;       // one row's softmax numerators
};
thread_local Scratch t_scratch;

// ------------------------------------------------------------------ ISA selection
// The fastest path allowed (DotIsa's value): "auto" allows every one.
std::atomic<int> g_cap{static_cast<int>(DotIsa::kAmx)};

bool allows(DotIsa isa) { return g_cap.load(std::memory_order_relaxed) >= static_cast<int>(isa); }

const char* isa_name(DotIsa isa) {
  return isa == DotIsa::kAmx ? "amx" : isa == DotIsa::kAvx512 ? "avx512" : "generic";
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

#ifdef LMCKV_AVX512
// Rows of the unit's queries dotted with every key of the head (packed as bf16 pairs):
// AMX tiles or vdpbf16ps.
void dot_rows(DotIsa isa, const uint16_t* a, uint64_t rows, uint64_t hd, const uint32_t* b,
              uint64_t T, float* lg, uint64_t ld) {
#ifdef LMCKV_AMX
  if (isa == DotIsa::kAmx) {
    amx::dot_rows(a, rows, hd, b, T, lg, ld);
    return;
  }
#endif
  avx512::dot_rows(a, rows, hd, b, T, lg, ld);
}

// The fast paths of one unit (AMX or AVX-512): 32 (or 16) rows at a time, their logits,
// then each row's softmax added to its query head's out row [T] while the logits are
// still in L2.
template <typename Visible>
void scores_fast(Scratch& s, DotIsa isa, const uint16_t* k, uint64_t k_row, uint64_t T,
                 uint64_t hd, uint64_t rows, uint64_t rows_pad, uint64_t ld, uint64_t w,
                 float scale, const Visible& visible, float* out) {
  s.b.resize(ld * hd / 2);
  s.logits.resize(2 * kTile * ld);
  s.e.resize(ld);  // one row's exp terms, L1-sized: each row is added while it is hot
  avx512::pack_pairs(s.b.data(), k, k_row, T, hd);
  std::fill(out, out + rows / w * T, 0.0f);
#ifdef LMCKV_AMX
  if (isa == DotIsa::kAmx) amx::configure_tiles();
#endif
  for (uint64_t rb = 0; rb < rows_pad;) {
    const uint64_t step = rb + 2 * kTile <= rows_pad ? 2 * kTile : kTile;
    float* lg = s.logits.data();  // row rb + i of the chunk at lg + i * ld
    dot_rows(isa, s.a.data() + rb * hd, step, hd, s.b.data(), T, lg, ld);
    for (uint64_t r = rb; r < std::min(rb + step, rows); ++r) {
      const float* x = lg + (r - rb) * ld;
      const uint64_t n = visible(r);
      avx512::softmax_add(x, n, scale, avx512::row_max(x, n), s.e.data(), out + (r / w) * T);
    }
    rb += step;
  }
#ifdef LMCKV_AMX
  if (isa == DotIsa::kAmx) amx::release_tiles();
#endif
}
#endif  // LMCKV_AVX512

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

void WindowScoresPlan::run_unit(uint64_t unit, DotIsa isa) const {
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
#ifdef LMCKV_AVX512
  if (isa != DotIsa::kGeneric) {
    scores_fast(s, isa, k, a_.n_kv * hd, T, hd, rows, rows_pad, ld, w, a_.scale, visible, out);
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
  const DotIsa isa = window_dot_isa(a_.head_dim);
  // the pool splits by bytes: weigh a unit by its logits (the work), not its inputs
  const uint64_t work = units * a_.group * a_.window * a_.tokens * 4;
  run_parallel(work, static_cast<int>(std::min<uint64_t>(units, 1u << 20)),
               [this, units, isa](int task, int ntasks) {
                 const uint64_t t = static_cast<uint64_t>(task), nt = static_cast<uint64_t>(ntasks);
                 for (uint64_t u = units * t / nt; u < units * (t + 1) / nt; ++u) run_unit(u, isa);
               });
}

DotIsa window_dot_isa(uint64_t head_dim) {
  const bool amx_fits = head_dim % 32 == 0 && head_dim > 0 && head_dim <= 128;
  if (amx_fits && allows(DotIsa::kAmx) && amx::available()) return DotIsa::kAmx;
  const bool even = head_dim % 2 == 0 && head_dim > 0;
  if (even && allows(DotIsa::kAvx512) && avx512::bf16_available()) return DotIsa::kAvx512;
  return DotIsa::kGeneric;
}

std::string window_scores_isa() {
  if (allows(DotIsa::kAmx) && amx::available()) return "amx";
  if (allows(DotIsa::kAvx512) && avx512::bf16_available()) return "avx512";
  return "generic";
}

std::string window_scores_isa(uint64_t head_dim) { return isa_name(window_dot_isa(head_dim)); }

void set_window_scores_isa(const std::string& name) {
  DotIsa cap = DotIsa::kAmx;
  if (name == "generic") {
    cap = DotIsa::kGeneric;
  } else if (name == "avx512") {
    if (!avx512::bf16_available()) fail("this CPU cannot run the AVX-512 path (no AVX512F/BW/BF16)");
    cap = DotIsa::kAvx512;
  } else if (name == "amx") {
    if (!amx::available()) fail("this CPU or OS cannot run AMX tiles (no AMX-BF16 or no permission)");
  } else if (name != "auto") {
    fail("isa must be 'auto', 'amx', 'avx512' or 'generic', got '" + name + "'");
  }
  g_cap.store(static_cast<int>(cap));
}

}  // namespace lmckv

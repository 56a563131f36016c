#include "rope_gather.hpp"

#include <pybind11/pybind11.h>

// GCC's intrinsic headers build undefined vectors as `__Y = __Y`, which -O1 (the
// sanitizer build) reports as maybe-uninitialized at every use: not this code's values.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <cmath>
#include <cstring>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common.hpp"
#include "thread_pool.hpp"

namespace lmckv {

namespace py = pybind11;

namespace {

constexpr const char* kWhat = "rope_gather";

// What one rotated row looks like: `heads` heads of `head_dim` elements, the first
// `rotary` of each rotated in `half` pairs.
struct RowGeom {
  uint64_t heads, head_dim, rotary, half;
  bool interleaved;
};

template <EditDType D>
struct Elem;
template <>
struct Elem<EditDType::kF32> {
  using T = float;
  static float load(T v) { return v; }
  static T store(float f) { return f; }
};
template <>
struct Elem<EditDType::kBF16> {
  using T = uint16_t;
  static float load(T v) { return bf16_to_f32(v); }
  static T store(float f) { return f32_to_bf16(f); }
};

// One row of K: every head's rotary pairs turned by (c[i], s[i]); the rest copied.
template <EditDType D>
__attribute__((always_inline)) inline void rotate_body(void* dst, const void* src,
                                                       const float* c, const float* s,
                                                       const RowGeom& g) {
  using E = Elem<D>;
  using T = typename E::T;
  const T* x = static_cast<const T*>(src);
  T* y = static_cast<T*>(dst);
  for (uint64_t h = 0; h < g.heads; ++h, x += g.head_dim, y += g.head_dim) {
    if (g.interleaved) {
      for (uint64_t i = 0; i < g.half; ++i) {
        const float a = E::load(x[2 * i]), b = E::load(x[2 * i + 1]);
        y[2 * i] = E::store(std::fma(-b, s[i], a * c[i]));
        y[2 * i + 1] = E::store(std::fma(a, s[i], b * c[i]));
      }
    } else {
      const T* x2 = x + g.half;
      T* y2 = y + g.half;
      for (uint64_t i = 0; i < g.half; ++i) {
        const float a = E::load(x[i]), b = E::load(x2[i]);
        y[i] = E::store(std::fma(-b, s[i], a * c[i]));
        y2[i] = E::store(std::fma(a, s[i], b * c[i]));
      }
    }
    if (g.rotary < g.head_dim) {
      std::memcpy(y + g.rotary, x + g.rotary, (g.head_dim - g.rotary) * sizeof(T));
    }
  }
}

using RotateFn = void (*)(void*, const void*, const float*, const float*, const RowGeom&);

template <EditDType D>
void rotate_generic(void* dst, const void* src, const float* c, const float* s,
                    const RowGeom& g) {
  rotate_body<D>(dst, src, c, s, g);
}

#if defined(__x86_64__) || defined(__i386__)
template <EditDType D>
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void rotate_avx512(
    void* dst, const void* src, const float* c, const float* s, const RowGeom& g) {
  rotate_body<D>(dst, src, c, s, g);
}
#endif

#if defined(__x86_64__)
#define LMCKV_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))

// 16 bfloat16 at p as float32.
LMCKV_BF16_TARGET inline __m512 load_bf16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 float32 to bfloat16 at p, rounded to nearest even (as torch).
LMCKV_BF16_TARGET inline void store_bf16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

// bfloat16 neox rows whose half rotary width is a multiple of 16: explicit AVX-512 BF16.
LMCKV_BF16_TARGET void rotate_bf16_neox(void* dst, const void* src, const float* c,
                                        const float* s, const RowGeom& g) {
  const uint16_t* x = static_cast<const uint16_t*>(src);
  uint16_t* y = static_cast<uint16_t*>(dst);
  for (uint64_t h = 0; h < g.heads; ++h, x += g.head_dim, y += g.head_dim) {
    for (uint64_t i = 0; i < g.half; i += 16) {
      const __m512 a = load_bf16(x + i), b = load_bf16(x + g.half + i);
      const __m512 cv = _mm512_loadu_ps(c + i), sv = _mm512_loadu_ps(s + i);
      store_bf16(y + i, _mm512_fnmadd_ps(b, sv, _mm512_mul_ps(a, cv)));
      store_bf16(y + g.half + i, _mm512_fmadd_ps(a, sv, _mm512_mul_ps(b, cv)));
    }
    if (g.rotary < g.head_dim) {
      std::memcpy(y + g.rotary, x + g.rotary, (g.head_dim - g.rotary) * 2);
    }
  }
}
#endif

template <EditDType D>
RotateFn pick_rotate(const RowGeom& g) {
#if defined(__x86_64__)
  static const bool bf16 = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
  if (D == EditDType::kBF16 && bf16 && !g.interleaved && g.half % 16 == 0) {
    return &rotate_bf16_neox;
  }
#endif
#if defined(__x86_64__) || defined(__i386__)
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  if (avx512) return &rotate_avx512<D>;
#endif
  (void)g;
  return &rotate_generic<D>;
}

RotateFn rotate_for(EditDType d, const RowGeom& g) {
  return d == EditDType::kF32 ? pick_rotate<EditDType::kF32>(g) : pick_rotate<EditDType::kBF16>(g);
}

[[noreturn]] void fail(const std::string& msg) { throw py::value_error(std::string(kWhat) + ": " + msg); }

void check_geometry(const RopeGatherArgs& a) {
  if (a.rotary_dim == 0) return;
  if (a.head_dim == 0 || a.width % a.head_dim) {
    fail("width " + std::to_string(a.width) + " is not a whole number of heads of " +
         std::to_string(a.head_dim));
  }
  if (a.rotary_dim % 2 || a.rotary_dim > a.head_dim) {
    fail("rotary_dim must be even and at most head_dim " + std::to_string(a.head_dim) +
         ", got " + std::to_string(a.rotary_dim));
  }
}

bool overlaps(const char* a, uint64_t an, const char* b, uint64_t bn) {
  return an && bn && a < b + bn && b < a + an;
}

}  // namespace

RopeGatherPlan::RopeGatherPlan(const RopeGatherArgs& a) : a_(a) {
  check_geometry(a);
  esize_ = a.dtype == EditDType::kF32 ? 4 : 2;
  const uint64_t row = checked_mul(a.width, esize_, kWhat);
  const uint64_t planes_layers = checked_mul(a.planes, a.layers, kWhat);
  const uint64_t src_span = checked_mul(checked_mul(planes_layers, a.rows, kWhat), row, kWhat);
  const uint64_t dst_span = checked_mul(checked_mul(planes_layers, a.n, kWhat), row, kWhat);
  const uint64_t tab_span = a.rotary_dim ? checked_mul(a.n, a.rotary_dim / 2 * 4, kWhat) : 0;
  src_ = checked_span(a.src.base, a.src.nbytes, a.src.offset, src_span, kWhat, "source");
  dst_ = const_cast<char*>(
      checked_span(a.dst.base, a.dst.nbytes, a.dst.offset, dst_span, kWhat, "destination"));
  const char* idx = checked_span(a.idx.base, a.idx.nbytes, a.idx.offset,
                                 checked_mul(a.n, 8, kWhat), kWhat, "index");
  const char* c = checked_span(a.cos.base, a.cos.nbytes, a.cos.offset, tab_span, kWhat, "cos");
  const char* s = checked_span(a.sin.base, a.sin.nbytes, a.sin.offset, tab_span, kWhat, "sin");
  if (overlaps(dst_, dst_span, src_, src_span) || overlaps(dst_, dst_span, idx, a.n * 8) ||
      overlaps(dst_, dst_span, c, tab_span) || overlaps(dst_, dst_span, s, tab_span)) {
    fail("the destination overlaps an input");
  }
  cos_ = reinterpret_cast<const float*>(c);
  sin_ = reinterpret_cast<const float*>(s);
  idx_.resize(a.n);
  if (a.n) std::memcpy(idx_.data(), idx, a.n * 8);
  for (uint64_t j = 0; j < a.n; ++j) {
    if (idx_[j] < 0 || static_cast<uint64_t>(idx_[j]) >= a.rows) {
      fail("index " + std::to_string(j) + " is " + std::to_string(idx_[j]) + ", outside [0, " +
           std::to_string(a.rows) + ")");
    }
  }
}

void RopeGatherPlan::run_rows(uint64_t first, uint64_t last) const {
  const uint64_t row = a_.width * esize_, per_plane = a_.layers * a_.n;
  const RowGeom g{a_.rotary_dim ? a_.width / a_.head_dim : 0, a_.head_dim, a_.rotary_dim,
                  a_.rotary_dim / 2, a_.interleaved};
  const RotateFn rotate = rotate_for(a_.dtype, g);
  for (uint64_t r = first; r < last; ++r) {
    const uint64_t p = r / per_plane, l = (r % per_plane) / a_.n, j = r % a_.n;
    const char* s = src_ + ((p * a_.layers + l) * a_.rows + static_cast<uint64_t>(idx_[j])) * row;
    char* d = dst_ + r * row;
    if (p == 0 && a_.rotary_dim) {
      rotate(d, s, cos_ + j * g.half, sin_ + j * g.half, g);
    } else {
      std::memcpy(d, s, row);
    }
  }
}

void RopeGatherPlan::execute() const {
  const uint64_t total = a_.planes * a_.layers * a_.n;
  if (total == 0) return;
  const uint64_t bytes = total * a_.width * esize_;
  const int max_tasks = static_cast<int>(std::min<uint64_t>(total, 1u << 20));
  run_parallel(bytes, max_tasks, [this, total](int task, int ntasks) {
    const uint64_t t = static_cast<uint64_t>(task), nt = static_cast<uint64_t>(ntasks);
    run_rows(total * t / nt, total * (t + 1) / nt);
  });
}

}  // namespace lmckv

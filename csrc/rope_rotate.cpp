#include "rope_rotate.hpp"

// GCC's intrinsic headers build undefined vectors as `__Y = __Y`, which -O1 (the
// sanitizer build) reports as maybe-uninitialized at every use: not this code's values.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <cmath>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace lmckv {

namespace {

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

}  // namespace

RotateFn rotate_for(EditDType d, const RowGeom& g) {
  return d == EditDType::kF32 ? pick_rotate<EditDType::kF32>(g) : pick_rotate<EditDType::kBF16>(g);
}

}  // namespace lmckv

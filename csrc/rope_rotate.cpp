#include "rope_rotate.hpp"

#include "bf16_avx512.hpp"

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
#define LMCKV_NEOX_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16,fma")))

// 16 float32 to bfloat16 at p as bf16x16_narrow. vcvtneps2bf16 rounds every other input
// the same way (normal float32 never rounds to a bfloat16 denormal) but reads denormal
// inputs as zero: vectors holding one take bf16x16_narrow (rare; more instructions).
LMCKV_NEOX_TARGET inline void store_bf16(uint16_t* p, __m512 v) {
  constexpr int kDenormal = 0x20;  // vfpclassps: a denormal of either sign
  const __m256i h = __builtin_expect(_mm512_fpclass_ps_mask(v, kDenormal) != 0, 0)
                        ? bf16x16_narrow(v)
                        : reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
}

// bfloat16 neox rows whose half rotary width is a multiple of 16: explicit AVX-512 (F, BW,
// DQ, BF16).
LMCKV_NEOX_TARGET void rotate_bf16_neox(void* dst, const void* src, const float* c,
                                        const float* s, const RowGeom& g) {
  const uint16_t* x = static_cast<const uint16_t*>(src);
  uint16_t* y = static_cast<uint16_t*>(dst);
  for (uint64_t h = 0; h < g.heads; ++h, x += g.head_dim, y += g.head_dim) {
    for (uint64_t i = 0; i < g.half; i += 16) {
      const __m512 a = bf16x16_load(x + i), b = bf16x16_load(x + g.half + i);
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
#if defined(__x86_64__) || defined(__i386__)
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#if defined(__x86_64__)
  static const bool neox = avx512 && __builtin_cpu_supports("avx512dq") &&
                           __builtin_cpu_supports("avx512bf16");
  if (D == EditDType::kBF16 && neox && !g.interleaved && g.half % 16 == 0) {
    return &rotate_bf16_neox;
  }
#endif
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

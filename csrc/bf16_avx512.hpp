// 16 lanes of bfloat16 <-> float32 in AVX-512 registers, shared by the vector kernels.
//
// The narrowing rounds exactly as f32_to_bf16 (edit_common.hpp) does, on the bits: to
// nearest even, denormals kept, a NaN quieted with its sign and payload. The BF16
// instruction (vcvtneps2bf16) reads denormal inputs as zero, so it is only a shortcut for
// vectors without one (rope_rotate.cpp).
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>

#define LMCKV_BF16X16_TARGET __attribute__((target("avx512f,avx512bw")))

namespace lmckv {

// 16 bfloat16 (a 256-bit half of a register) as float32.
LMCKV_BF16X16_TARGET inline __m512 bf16x16_widen(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// 16 bfloat16 at p (unaligned) as float32.
LMCKV_BF16X16_TARGET inline __m512 bf16x16_load(const uint16_t* p) {
  return bf16x16_widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 float32 as bfloat16, rounded as f32_to_bf16.
LMCKV_BF16X16_TARGET inline __m256i bf16x16_narrow(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i top = _mm512_srli_epi32(u, 16);
  const __m512i bias =
      _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(top, _mm512_set1_epi32(1)));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_cvtepi32_epi16(
      _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(top, _mm512_set1_epi32(0x40))));
}

}  // namespace lmckv
#endif

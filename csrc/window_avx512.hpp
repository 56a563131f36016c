// AVX-512 building blocks of the edit kernels (window_scores.cpp, key_redundancy.cpp):
// keys packed as bf16 pairs, rows of bf16 vectors dotted with every key by vdpbf16ps
// (CPUs with AVX512-BF16 but no AMX, e.g. AMD Zen 4; bf16 products exact in float32,
// float32 sums), and the float32 softmax both the AMX and this path add into the scores.
// Compiled for any x86-64 with per-function target attributes: callable only where
// available() / bf16_available() say so.
#pragma once

#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#define LMCKV_AVX512 1
#define LMCKV_AVX512_TARGET __attribute__((target("avx512f,avx512bw")))
#endif

namespace lmckv::avx512 {

constexpr uint64_t kKeys = 16;  // keys per packed block (one vector of float32 lanes)
constexpr uint64_t kRows = 8;   // rows dot_rows computes at a time (rows: a multiple)

// AVX-512F and BW: the softmax, the packing, and the row sums of key_redundancy.
bool available();
// Those and AVX512-BF16: dot_rows.
bool bf16_available();

#ifdef LMCKV_AVX512
// Lanes [0, left) of a 16-lane vector (all from 16 on).
LMCKV_AVX512_TARGET inline __mmask16 tail_mask(uint64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
}

// One head's keys (row t at k + t * k_row, hd elements, hd even) as blocks of 16 keys:
// word (block kb, pair p, key j) at b[(kb * hd / 2 + p) * 16 + j] holds dims 2p, 2p + 1 of
// key kb * 16 + j, zero past `tokens` (b: round_up(tokens, 16) * hd / 2 words). For hd a
// multiple of 32 these are AMX's B tiles too (16 pairs per tile).
void pack_pairs(uint32_t* b, const uint16_t* k, uint64_t k_row, uint64_t tokens, uint64_t hd);

// lg[i * ld + t] = a[i] . key t for the rows i < rows (a multiple of kRows; row i at
// a + i * hd) and every key t < round_up(tokens, 16) of b (pack_pairs). AVX512-BF16.
void dot_rows(const uint16_t* a, uint64_t rows, uint64_t hd, const uint32_t* b,
              uint64_t tokens, float* lg, uint64_t ld);

// max(x[0 .. n)), n >= 1.
float row_max(const float* x, uint64_t n);

// out[t] += softmax over t < n of scale * x[t] (mx: x's maximum over them); e: scratch of
// round_up(n, 16) floats for the numerators.
void softmax_add(const float* x, uint64_t n, float scale, float mx, float* e, float* out);
#endif

}  // namespace lmckv::avx512

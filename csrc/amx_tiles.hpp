// AMX building blocks of the edit kernels (window_scores.cpp, key_redundancy.cpp): keys
// packed as the B operand, and rows of bfloat16 vectors dotted with every key through
// AMX tiles (bf16 products exact in float32, float32 sums). Usable only where
// available() says so: an x86-64 CPU with AMX-BF16 and AVX-512, and the OS's permission
// for tile data (asked once per process).
#pragma once

#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#define LMCKV_AMX 1
#define LMCKV_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))
#endif

namespace lmckv::amx {

constexpr uint64_t kTile = 16;  // rows and columns of a float32 tile

// Whether this CPU and OS run the tile code below.
bool available();

#ifdef LMCKV_AMX
// Lanes [0, left) of a 16-lane vector (all from 16 on).
LMCKV_AMX_TARGET inline __mmask16 tail_mask(uint64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
}

// One head's keys (row t at k + t * k_row, hd elements) as B tiles into b
// (round_up(tokens, 16) * hd / 2 words); keys past `tokens` are zero.
LMCKV_AMX_TARGET void pack_keys(uint32_t* b, const uint16_t* k, uint64_t k_row,
                                uint64_t tokens, uint64_t hd);

// Load this thread's tile shapes (before dot_rows) / release its tiles (after).
LMCKV_AMX_TARGET void configure_tiles();
LMCKV_AMX_TARGET void release_tiles();

// lg[i * ld + t] = a[i] . key t for the 16 or 32 rows of a (row i at a + i * hd; hd a
// multiple of 32, at most 128) and every key t < round_up(tokens, 16) of b (pack_keys).
LMCKV_AMX_TARGET void dot_rows(const uint16_t* a, uint64_t rows, uint64_t hd,
                               const uint32_t* b, uint64_t tokens, float* lg, uint64_t ld);
#endif

}  // namespace lmckv::amx

// AMX building blocks of the edit kernels (window_scores.cpp, key_redundancy.cpp): rows
// of bfloat16 vectors dotted with every key (packed by avx512::pack_pairs) through AMX
// tiles (bf16 products exact in float32, float32 sums). Usable only where
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

// The self-check of configure_tiles: the 64 bytes of tile shapes the CPU holds after it
// ran over a scribbled stack (sttilecfg), in out; false where available() is false.
bool loaded_shapes(uint8_t out[64]);

#ifdef LMCKV_AMX
// Load this thread's tile shapes (before dot_rows) / release its tiles (after).
LMCKV_AMX_TARGET void configure_tiles();
LMCKV_AMX_TARGET void release_tiles();

// lg[i * ld + t] = a[i] . key t for the 16 or 32 rows of a (row i at a + i * hd; hd a
// multiple of 32, at most 128) and every key t < round_up(tokens, 16) of b
// (avx512::pack_pairs: for such hd, block by block of 16 keys, tile by tile of 16 pairs).
LMCKV_AMX_TARGET void dot_rows(const uint16_t* a, uint64_t rows, uint64_t hd,
                               const uint32_t* b, uint64_t tokens, float* lg, uint64_t ld);
#endif

}  // namespace lmckv::amx

// One 64-byte store of the AVX-512 kernels that may write around the cache
// (fused_tiles.cpp, fused_vrows.cpp): non-temporal for a streaming copy, cached otherwise.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

namespace lmckv {

// 64 bytes to d: non-temporal when S (d must then be 64-byte aligned), else cached.
template <bool S>
__attribute__((target("avx512f"))) inline void store_line(char* d, __m512i v) {
  if constexpr (S) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d), v);
  } else {
    _mm512_storeu_si512(d, v);
  }
}

}  // namespace lmckv

#endif  // __x86_64__

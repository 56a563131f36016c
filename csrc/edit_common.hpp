// Shared pieces of the edit kernels (rope_gather.cpp, window_scores.cpp): a buffer span
// as Python hands it over, and bfloat16 <-> float32 conversions.
#pragma once

#include <cstdint>
#include <cstring>

namespace lmckv {

// A view into a buffer: the buffer [base, base + nbytes) and the view's first byte.
struct Span {
  uint64_t base = 0, nbytes = 0, offset = 0;
};

// Element types the edit kernels read and write.
enum class EditDType : int { kF32 = 0, kBF16 = 1 };

// v rounded up to a multiple of m.
inline uint64_t round_up(uint64_t v, uint64_t m) { return (v + m - 1) / m * m; }

inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as torch's `.to(torch.bfloat16)`; NaN stays a (quiet) NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace lmckv

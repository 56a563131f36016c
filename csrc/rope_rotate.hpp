// The RoPE re-rotation of one row of K, shared by the token gathers (rope_gather.cpp,
// fused_rows.cpp).
//
// In every head of `head_dim`, each rotary pair (neox: dims i, i + rotary/2; interleaved:
// 2i, 2i + 1) becomes (x1 c - x2 s, x2 c + x1 s) with c, s = cos[i], sin[i] (float32
// tables of rotary/2); dims past `rotary` are copied. float32 math, rounded back to the
// element type in the order torch's `mul` + `addcmul_` round them (x1 c rounded, then x2 s
// fused in: fma(-x2, s, x1 c)); bfloat16 as f32_to_bf16: to nearest even, denormals kept
// (as torch), a NaN quieted with its sign and payload (torch writes 0xffff).
// rope_rotate.cpp is built with -ffp-contract=off (CMakeLists.txt) so no other operation
// fuses: the bytes are those of `edits.rerotate`'s torch code, bit for bit (NaNs aside).
#pragma once

#include <cstdint>

#include "edit_common.hpp"

namespace lmckv {

// What one rotated row looks like: `heads` heads of `head_dim` elements, the first
// `rotary` of each rotated in `half` pairs.
struct RowGeom {
  uint64_t heads, head_dim, rotary, half;
  bool interleaved;
};

// Rotate one row: dst (heads * head_dim elements) from src with the tables c, s (half
// floats each). dst and src must not overlap.
using RotateFn = void (*)(void* dst, const void* src, const float* c, const float* s,
                          const RowGeom& g);

// The fastest rotation this CPU runs for rows of type `d` shaped `g` (same bytes on
// every path).
RotateFn rotate_for(EditDType d, const RowGeom& g);

}  // namespace lmckv

#include "amx_tiles.hpp"

#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

// GCC's intrinsic headers build undefined vectors as `__Y = __Y`, which -O1 (the
// sanitizer build) reports as maybe-uninitialized at every use: not this code's values.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace lmckv::amx {

bool available() {
#ifdef LMCKV_AMX
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool amx = (d >> 22 & 1u) && (d >> 24 & 1u);  // AMX-BF16, AMX-TILE
    if (!amx || !__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw")) {
      return false;
    }
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

#ifdef LMCKV_AMX
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

// Every tile 16 rows of 64 bytes (16 float32 or 32 bfloat16 columns); tiles 8..15 (not
// in palette 1) all zero, as ldtilecfg requires.
constexpr TileConfig tile_shapes() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = kTile;
    cfg.colsb[i] = 64;
  }
  return cfg;
}

// A constant, not a stack object: GCC 12's _tile_loadconfig tells the compiler it reads
// only 8 bytes, so the stores of a local config were dropped as dead and ldtilecfg read
// stack garbage (a #GP in CI). The "m" operand below is the whole 64-byte object.
alignas(64) constexpr TileConfig kShapes = tile_shapes();

// Two row blocks of 16 (tmm4/5 and tmm6/7 hold their A tiles) against every key block:
// head_dim 64 or less (one or two 32-element k steps).
LMCKV_AMX_TARGET void rows_x2_small(const uint16_t* a, uint64_t hd, const uint32_t* b,
                                    uint64_t tokens, float* lg, uint64_t ld) {
  const uint64_t nkt = hd / 32, stride = hd * 2, next = 16 * hd;
  _tile_loadd(4, a, stride);
  _tile_loadd(6, a + next, stride);
  if (nkt > 1) {
    _tile_loadd(5, a + 32, stride);
    _tile_loadd(7, a + next + 32, stride);
  }
  for (uint64_t t0 = 0; t0 < tokens; t0 += kTile, b += nkt * kTile * kTile) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, b, 64);
    _tile_dpbf16ps(0, 4, 2);
    _tile_dpbf16ps(1, 6, 2);
    if (nkt > 1) {
      _tile_loadd(3, b + 256, 64);
      _tile_dpbf16ps(0, 5, 3);
      _tile_dpbf16ps(1, 7, 3);
    }
    _tile_stored(0, lg + t0, ld * 4);
    _tile_stored(1, lg + 16 * ld + t0, ld * 4);
  }
}

// One row block of 16 (tmm4 .. tmm7 hold its A tiles) against every key block: any
// head_dim the AMX path takes (up to four k steps).
LMCKV_AMX_TARGET void rows_x1(const uint16_t* a, uint64_t hd, const uint32_t* b,
                              uint64_t tokens, float* lg, uint64_t ld) {
  const uint64_t nkt = hd / 32, stride = hd * 2;
  _tile_loadd(4, a, stride);
  if (nkt > 1) _tile_loadd(5, a + 32, stride);
  if (nkt > 2) _tile_loadd(6, a + 64, stride);
  if (nkt > 3) _tile_loadd(7, a + 96, stride);
  for (uint64_t t0 = 0; t0 < tokens; t0 += kTile, b += nkt * kTile * kTile) {
    _tile_zero(0);
    _tile_loadd(2, b, 64);
    _tile_dpbf16ps(0, 4, 2);
    if (nkt > 1) {
      _tile_loadd(3, b + 256, 64);
      _tile_dpbf16ps(0, 5, 3);
    }
    if (nkt > 2) {
      _tile_loadd(2, b + 512, 64);
      _tile_dpbf16ps(0, 6, 2);
    }
    if (nkt > 3) {
      _tile_loadd(3, b + 768, 64);
      _tile_dpbf16ps(0, 7, 3);
    }
    _tile_stored(0, lg + t0, ld * 4);
  }
}

}  // namespace

LMCKV_AMX_TARGET void configure_tiles() { __asm__ volatile("ldtilecfg %0" ::"m"(kShapes)); }

LMCKV_AMX_TARGET void release_tiles() { _tile_release(); }

LMCKV_AMX_TARGET void dot_rows(const uint16_t* a, uint64_t rows, uint64_t hd,
                               const uint32_t* b, uint64_t tokens, float* lg, uint64_t ld) {
  // GCC's tileloadd asm takes only the address, not the memory behind it: without this
  // barrier the compiler may sink or drop the stores of a and b that it reads (LTO inlines
  // this into the callers that pack them).
  __asm__ volatile("" ::: "memory");
  if (rows == 2 * kTile && hd <= 64) {
    rows_x2_small(a, hd, b, tokens, lg, ld);
    return;
  }
  for (uint64_t r = 0; r < rows; r += kTile) rows_x1(a + r * hd, hd, b, tokens, lg + r * ld, ld);
}

namespace {
// Fills the stack below the caller's frame with bytes no tile shape has.
__attribute__((noinline)) void scribble_stack() {
  volatile uint8_t junk[4096];
  for (auto& b : junk) b = 0xA5;
}
}  // namespace

bool loaded_shapes(uint8_t out[64]) {
  if (!available()) return false;
  scribble_stack();
  configure_tiles();
  TileConfig got{};
  __asm__ volatile("sttilecfg %0" : "=m"(got));
  release_tiles();
  std::memcpy(out, &got, sizeof(got));
  return true;
}
#else
bool loaded_shapes(uint8_t*) { return false; }
#endif

}  // namespace lmckv::amx

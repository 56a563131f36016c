#include "strided_copy.hpp"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <new>
#include <cstring>
#include <string>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#define LMCKV_AVX2_TILE 1
#endif

#include "common.hpp"
#include "copy_kernels.hpp"
#include "thread_pool.hpp"

namespace lmckv {

namespace py = pybind11;

namespace {

constexpr size_t kMaxDims = 16;
// Tile side: one 64-byte cache line of elements (bf16: 32), at most kTileMax.
constexpr uint64_t kTileBytes = 64;
constexpr uint64_t kTileMax = 64;

// Largest element offset a view reaches: offset + sum((size - 1) * stride).
uint64_t max_offset(uint64_t offset, const std::vector<StridedDim>& dims, bool dst) {
  uint64_t m = offset;
  for (const StridedDim& d : dims) {
    const uint64_t s = dst ? d.dst_stride : d.src_stride;
    m = checked_add(m, checked_mul(d.size - 1, s, "strided_copy"), "strided_copy");
  }
  return m;
}

// Offsets of every member of a chain of dimensions (first = fastest) on both sides.
void chain_offsets(const std::vector<StridedDim>& chain, std::vector<uint64_t>& dst,
                   std::vector<uint64_t>& src) {
  dst.assign(1, 0);
  src.assign(1, 0);
  for (const StridedDim& d : chain) {
    const size_t n = dst.size();
    for (uint64_t k = 1; k < d.size; ++k) {
      for (size_t i = 0; i < n; ++i) {
        dst.push_back(dst[i] + k * d.dst_stride);
        src.push_back(src[i] + k * d.src_stride);
      }
    }
  }
}

// Take from `dims` a chain for one side of the tile, fastest first: the dimension with the
// smallest stride on that side, then the next, until the chain holds `side` elements
// (contiguous when the strides chain up: stride 1, then each stride == the product so far;
// else the tile reads or writes through its offset table). A dimension too large for the
// rest of the tile is split when it divides evenly: its fast part joins the chain, its
// slow part stays in `dims`.
std::vector<StridedDim> take_chain(std::vector<StridedDim>& dims, bool dst_side,
                                   uint64_t side) {
  std::vector<StridedDim> chain;
  uint64_t span = 1;
  while (span < side && !dims.empty()) {
    auto it = std::min_element(dims.begin(), dims.end(), [&](const StridedDim& x,
                                                              const StridedDim& y) {
      return (dst_side ? x.dst_stride : x.src_stride) < (dst_side ? y.dst_stride : y.src_stride);
    });
    const uint64_t room = side / span;
    if (it->size <= room) {
      span *= it->size;
      chain.push_back(*it);
      dims.erase(it);
      continue;
    }
    if (room < 2 || it->size % room) break;
    chain.push_back({room, it->dst_stride, it->src_stride});
    *it = {it->size / room, it->dst_stride * room, it->src_stride * room};
    break;
  }
  return chain;
}

// One tile through a small staging buffer: A x B elements, read source line by source
// line (B contiguous), written destination line by destination line (A contiguous). The
// destination rows of a tile are often a power of two apart (and so are the source rows):
// writing straight from the source lines would keep 2 x kTileMax lines live in a few cache
// sets; the buffer keeps only one line of each side live at a time.
template <typename T>
void tile_typed(char* dst, const char* src, const StridedPlan& p) {
  T buf[kTileMax * kTileMax];
  T* d = reinterpret_cast<T*>(dst);
  const T* s = reinterpret_cast<const T*>(src);
  const size_t na = p.a_dst.size(), nb = p.b_dst.size();
  const uint64_t* ad = p.a_dst.data();
  const uint64_t* as = p.a_src.data();
  const uint64_t* bd = p.b_dst.data();
  const uint64_t* bs = p.b_src.data();
  for (size_t i = 0; i < na; ++i) {  // source lines
    const T* srow = s + as[i];
    T* brow = buf + i * nb;
    if (p.b_src_unit) {
      std::memcpy(brow, srow, nb * sizeof(T));
    } else {
      for (size_t j = 0; j < nb; ++j) std::memcpy(brow + j, srow + bs[j], sizeof(T));
    }
  }
  for (size_t j = 0; j < nb; ++j) {  // destination lines
    T* drow = d + bd[j];
    for (size_t i = 0; i < na; ++i) {
      std::memcpy(drow + (p.a_dst_unit ? i : ad[i]), buf + i * nb + j, sizeof(T));
    }
  }
}

#if defined(__SSE2__)
// out[j][i] = in[i][j] for an 8 x 8 block of 16-bit elements: in row i at in[i], out row j
// at out[j] (unaligned 16-byte loads and stores).
inline void transpose8x8_u16(const uint16_t* const in[8], uint16_t* const out[8]) {
  __m128i r[8];
  for (int k = 0; k < 8; ++k) r[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in[k]));
  const __m128i t0 = _mm_unpacklo_epi16(r[0], r[1]), t1 = _mm_unpackhi_epi16(r[0], r[1]);
  const __m128i t2 = _mm_unpacklo_epi16(r[2], r[3]), t3 = _mm_unpackhi_epi16(r[2], r[3]);
  const __m128i t4 = _mm_unpacklo_epi16(r[4], r[5]), t5 = _mm_unpackhi_epi16(r[4], r[5]);
  const __m128i t6 = _mm_unpacklo_epi16(r[6], r[7]), t7 = _mm_unpackhi_epi16(r[6], r[7]);
  const __m128i u0 = _mm_unpacklo_epi32(t0, t2), u1 = _mm_unpackhi_epi32(t0, t2);
  const __m128i u2 = _mm_unpacklo_epi32(t1, t3), u3 = _mm_unpackhi_epi32(t1, t3);
  const __m128i u4 = _mm_unpacklo_epi32(t4, t6), u5 = _mm_unpackhi_epi32(t4, t6);
  const __m128i u6 = _mm_unpacklo_epi32(t5, t7), u7 = _mm_unpackhi_epi32(t5, t7);
  const __m128i c[8] = {_mm_unpacklo_epi64(u0, u4), _mm_unpackhi_epi64(u0, u4),
                        _mm_unpacklo_epi64(u1, u5), _mm_unpackhi_epi64(u1, u5),
                        _mm_unpacklo_epi64(u2, u6), _mm_unpackhi_epi64(u2, u6),
                        _mm_unpacklo_epi64(u3, u7), _mm_unpackhi_epi64(u3, u7)};
  for (int k = 0; k < 8; ++k) _mm_storeu_si128(reinterpret_cast<__m128i*>(out[k]), c[k]);
}

// The same for a 4 x 4 block of 32-bit elements.
inline void transpose4x4_u32(const uint32_t* const in[4], uint32_t* const out[4]) {
  __m128i r[4];
  for (int k = 0; k < 4; ++k) r[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in[k]));
  const __m128i t0 = _mm_unpacklo_epi32(r[0], r[1]), t1 = _mm_unpackhi_epi32(r[0], r[1]);
  const __m128i t2 = _mm_unpacklo_epi32(r[2], r[3]), t3 = _mm_unpackhi_epi32(r[2], r[3]);
  const __m128i c[4] = {_mm_unpacklo_epi64(t0, t2), _mm_unpackhi_epi64(t0, t2),
                        _mm_unpacklo_epi64(t1, t3), _mm_unpackhi_epi64(t1, t3)};
  for (int k = 0; k < 4; ++k) _mm_storeu_si128(reinterpret_cast<__m128i*>(out[k]), c[k]);
}

#if defined(LMCKV_AVX2_TILE)
// The 8 x 8 transpose of transpose8x8_u16 in each 128-bit lane of 8 AVX2 rows: lane 0 of
// c[k] is column k of the rows' lane 0, lane 1 column k + 8.
__attribute__((target("avx2"))) inline void transpose8x8_lanes(const __m256i r[8],
                                                               __m256i c[8]) {
  const __m256i t0 = _mm256_unpacklo_epi16(r[0], r[1]), t1 = _mm256_unpackhi_epi16(r[0], r[1]);
  const __m256i t2 = _mm256_unpacklo_epi16(r[2], r[3]), t3 = _mm256_unpackhi_epi16(r[2], r[3]);
  const __m256i t4 = _mm256_unpacklo_epi16(r[4], r[5]), t5 = _mm256_unpackhi_epi16(r[4], r[5]);
  const __m256i t6 = _mm256_unpacklo_epi16(r[6], r[7]), t7 = _mm256_unpackhi_epi16(r[6], r[7]);
  const __m256i u0 = _mm256_unpacklo_epi32(t0, t2), u1 = _mm256_unpackhi_epi32(t0, t2);
  const __m256i u2 = _mm256_unpacklo_epi32(t1, t3), u3 = _mm256_unpackhi_epi32(t1, t3);
  const __m256i u4 = _mm256_unpacklo_epi32(t4, t6), u5 = _mm256_unpackhi_epi32(t4, t6);
  const __m256i u6 = _mm256_unpacklo_epi32(t5, t7), u7 = _mm256_unpackhi_epi32(t5, t7);
  c[0] = _mm256_unpacklo_epi64(u0, u4);
  c[1] = _mm256_unpackhi_epi64(u0, u4);
  c[2] = _mm256_unpacklo_epi64(u1, u5);
  c[3] = _mm256_unpackhi_epi64(u1, u5);
  c[4] = _mm256_unpacklo_epi64(u2, u6);
  c[5] = _mm256_unpackhi_epi64(u2, u6);
  c[6] = _mm256_unpacklo_epi64(u3, u7);
  c[7] = _mm256_unpackhi_epi64(u3, u7);
}

// A 32 x 32 tile of 16-bit elements (one cache line per row on both sides) through a 2 KiB
// staging tile: every source line is loaded whole, once (8 lines at a time, transposed in
// registers into the staging tile), then every destination line is written whole, once.
// A CPU engine's K plane reads lines 4 KiB apart and writes lines 2 KiB apart: the SSE2
// 8 x 8 blocks straight from source to destination revisit each line 4 times, after its
// neighbours in the same L1 set (all lines 4 KiB apart share one) have evicted it.
// One thread, 64 MiB of K/V (8 layers x 8 heads x 128): the K plane to per-token 5.4-6.9 ms
// (SSE2 blocks: 7.7-12.3 ms), to the engine's rows 2.9-3.4 ms (7.0-10.9 ms).
__attribute__((target("avx2"))) bool tile32_u16_avx2(char* dst, const char* src,
                                                     const StridedPlan& p) {
  if (!p.a_dst_unit || !p.b_src_unit || p.a_dst.size() != 32 || p.b_dst.size() != 32) {
    return false;
  }
  alignas(64) uint16_t buf[32 * 32];  // [j][i]: destination line j, element i
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  for (int i0 = 0; i0 < 32; i0 += 8) {
    __m256i lo[8], hi[8], c[8];
    for (int k = 0; k < 8; ++k) {
      const uint16_t* line = s + p.a_src[static_cast<size_t>(i0 + k)];
      lo[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
      hi[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 16));
    }
    transpose8x8_lanes(lo, c);  // columns k (lane 0) and k + 8 (lane 1) of rows i0..i0+7
    for (int k = 0; k < 8; ++k) {
      _mm_store_si128(reinterpret_cast<__m128i*>(buf + k * 32 + i0), _mm256_castsi256_si128(c[k]));
      _mm_store_si128(reinterpret_cast<__m128i*>(buf + (k + 8) * 32 + i0),
                      _mm256_extracti128_si256(c[k], 1));
    }
    transpose8x8_lanes(hi, c);  // columns 16 + k and 24 + k
    for (int k = 0; k < 8; ++k) {
      _mm_store_si128(reinterpret_cast<__m128i*>(buf + (k + 16) * 32 + i0),
                      _mm256_castsi256_si128(c[k]));
      _mm_store_si128(reinterpret_cast<__m128i*>(buf + (k + 24) * 32 + i0),
                      _mm256_extracti128_si256(c[k], 1));
    }
  }
  // Streaming stores (no read of the destination lines first) for copies larger than the
  // caches, where every destination line of the tile starts on a 32-byte boundary.
  const bool stream = p.nt_ok && (reinterpret_cast<uintptr_t>(d) & 31) == 0;
  for (int j = 0; j < 32; ++j) {
    uint16_t* line = d + p.b_dst[static_cast<size_t>(j)];
    const __m256i* from = reinterpret_cast<const __m256i*>(buf + j * 32);
    if (stream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(line), _mm256_load_si256(from));
      _mm256_stream_si256(reinterpret_cast<__m256i*>(line + 16), _mm256_load_si256(from + 1));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(line), _mm256_load_si256(from));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(line + 16), _mm256_load_si256(from + 1));
    }
  }
  return true;
}

bool have_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}

// Whether tile32_u16_avx2 takes the plan's tiles (it then writes whole destination lines).
bool tile32_fits(const StridedPlan& p) {
  return have_avx2() && p.itemsize == 2 && p.row_elems == 0 && p.a_dst_unit && p.b_src_unit &&
         p.a_dst.size() == 32 && p.b_dst.size() == 32;
}

// One row of `bytes` (a multiple of 32) to a 32-byte-aligned destination with streaming
// stores. A CPU engine's V plane is rows of one head (256 B for head size 128) between the
// engine's contiguous blocks and per-token rows 2 KiB apart: copied with memcpy each
// destination line is read before it is written; one thread, the 32 MiB V plane of a
// 2,048-token stream of 8 layers x 8 heads x 128: 4.2 ms with memcpy, 2.4 ms streamed.
__attribute__((target("avx2"))) void stream_row_avx2(char* dst, const char* src,
                                                     uint64_t bytes) {
  for (uint64_t k = 0; k < bytes; k += 32) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + k),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k)));
  }
}
#endif

// A tile whose A side is contiguous on the destination and B side on the source, both
// multiples of the block: transposed block by block straight from source to destination.
template <typename T, int K, void (*Block)(const T* const*, T* const*)>
bool tile_simd(char* dst, const char* src, const StridedPlan& p) {
  const size_t na = p.a_dst.size(), nb = p.b_dst.size();
  if (!p.a_dst_unit || !p.b_src_unit || na % K || nb % K) return false;
  T* d = reinterpret_cast<T*>(dst);
  const T* s = reinterpret_cast<const T*>(src);
  const T* in[K];
  T* out[K];
  for (size_t i0 = 0; i0 < na; i0 += K) {
    for (size_t j0 = 0; j0 < nb; j0 += K) {
      for (int k = 0; k < K; ++k) {
        in[k] = s + p.a_src[i0 + k] + j0;
        out[k] = d + p.b_dst[j0 + k] + i0;
      }
      Block(in, out);
    }
  }
  return true;
}
#endif

void tile_bytes(char* dst, const char* src, const StridedPlan& p) {
  const uint64_t isz = p.itemsize;
  for (size_t j = 0; j < p.b_dst.size(); ++j) {
    for (size_t i = 0; i < p.a_dst.size(); ++i) {
      std::memcpy(dst + (p.a_dst[i] + p.b_dst[j]) * isz, src + (p.a_src[i] + p.b_src[j]) * isz,
                  isz);
    }
  }
}

// Copy the innermost block at dst/src.
void inner(char* dst, const char* src, const StridedPlan& p) {
  if (p.row_elems) {
#if defined(LMCKV_AVX2_TILE)
    if (p.nt_ok && (reinterpret_cast<uintptr_t>(dst) & 31) == 0 && have_avx2()) {
      stream_row_avx2(dst, src, p.row_elems * p.itemsize);
      return;
    }
#endif
    std::memcpy(dst, src, p.row_elems * p.itemsize);
    return;
  }
  switch (p.itemsize) {
    case 1: tile_typed<uint8_t>(dst, src, p); break;
    case 2:
#if defined(LMCKV_AVX2_TILE)
      if (have_avx2() && tile32_u16_avx2(dst, src, p)) break;
#endif
#if defined(__SSE2__)
      if (tile_simd<uint16_t, 8, transpose8x8_u16>(dst, src, p)) break;
#endif
      tile_typed<uint16_t>(dst, src, p);
      break;
    case 4:
#if defined(__SSE2__)
      if (tile_simd<uint32_t, 4, transpose4x4_u32>(dst, src, p)) break;
#endif
      tile_typed<uint32_t>(dst, src, p);
      break;
    case 8: tile_typed<uint64_t>(dst, src, p); break;
    default: tile_bytes(dst, src, p); break;
  }
}


// Staged boxes. A CPU engine's K plane moves as 32 x 32 tiles whose 32 source lines lie in
// 16-32 different pages and whose destination lines lie 2 KiB apart: neither side
// streams, and the plane ran at a third of memcpy's rate although each (layer, block) of
// it is one contiguous range on both sides (256 KiB for 8 heads x 128 x 128 tokens). When
// the tile and the innermost outer dimensions cover such a range on both sides, each range
// is read whole into a per-thread buffer (one sequential copy), transposed there
// (cache-resident), and written whole (one sequential streaming copy). Measured
// (benches/bench_engine_convert.py --layers 8, 64 MiB, AMD EPYC VM, 2026-12-02): one
// thread, per-token retrieve 21.5-23.6 -> 15.5-17.4 ms, to_tokens 16.2-18.7 -> 11.0-13.3;
// the modify of bench W6's 32 KiB/token streams 0.78 -> 0.61 s of CPU per warm rep.
constexpr uint64_t kMinBoxBytes = 64u << 10;
// LMCACHE_KV_FAST_STAGED_TILES=0 turns boxes off (the tiles then run in place).
bool box_disabled() {
  static const bool off = [] {
    const char* v = std::getenv("LMCACHE_KV_FAST_STAGED_TILES");
    return v != nullptr && std::string(v) == "0";
  }();
  return off;
}
std::atomic<bool> g_box_staging_fault{false};
std::atomic<uint64_t> g_staged_box_bytes{0};
std::atomic<uint64_t> g_staged_box_direct_bytes{0};
constexpr uint64_t kMaxBoxBytes = 1u << 20;

// Whether `dims` cover [0, prod(sizes)) exactly on one side (strides chain up from 1).
bool dense(std::vector<StridedDim> dims, bool dst_side) {
  auto st = [&](const StridedDim& d) { return dst_side ? d.dst_stride : d.src_stride; };
  std::sort(dims.begin(), dims.end(),
            [&](const StridedDim& x, const StridedDim& y) { return st(x) < st(y); });
  uint64_t span = 1;
  for (const StridedDim& d : dims) {
    if (st(d) != span) return false;
    span *= d.size;
  }
  return true;
}

void plan_boxes(StridedPlan& plan, const std::vector<StridedDim>& a,
                const std::vector<StridedDim>& b, const std::vector<StridedDim>& outer) {
  std::vector<StridedDim> box(a);
  box.insert(box.end(), b.begin(), b.end());
  uint64_t elems = 1;
  for (const StridedDim& d : box) elems *= d.size;
  size_t best = 0;
  uint64_t best_bytes = 0;
  for (size_t k = 1; k <= outer.size(); ++k) {  // the k innermost outer dimensions
    const StridedDim& d = outer[outer.size() - k];
    box.push_back(d);
    elems *= d.size;
    const uint64_t bytes = elems * plan.itemsize;
    if (bytes > kMaxBoxBytes) break;
    if (bytes >= kMinBoxBytes && dense(box, true) && dense(box, false)) {
      best = k;
      best_bytes = bytes;
    }
  }
  plan.box_outer = best;
  plan.box_bytes = best_bytes;
}
}  // namespace

StridedPlan plan_strided_copy(uintptr_t dst_base, uint64_t dst_nbytes, uint64_t dst_offset,
                              uintptr_t src_base, uint64_t src_nbytes, uint64_t src_offset,
                              uint64_t itemsize, const std::vector<int64_t>& sizes,
                              const std::vector<int64_t>& dst_strides,
                              const std::vector<int64_t>& src_strides) {
  const std::string who = "strided_copy";
  if (itemsize == 0) throw py::value_error(who + ": itemsize must be >= 1");
  if (sizes.size() != dst_strides.size() || sizes.size() != src_strides.size()) {
    throw py::value_error(who + ": sizes and strides differ in length");
  }
  if (sizes.size() > kMaxDims) {
    throw py::value_error(who + ": at most " + std::to_string(kMaxDims) + " dimensions");
  }
  std::vector<StridedDim> dims;
  uint64_t count = 1;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 0 || dst_strides[i] < 0 || src_strides[i] < 0) {
      throw py::value_error(who + ": negative size or stride in dimension " + std::to_string(i));
    }
    if (sizes[i] == 0) return StridedPlan{};  // nothing to copy
    count = checked_mul(count, static_cast<uint64_t>(sizes[i]), "strided_copy");
    if (sizes[i] > 1) {
      dims.push_back({static_cast<uint64_t>(sizes[i]), static_cast<uint64_t>(dst_strides[i]),
                      static_cast<uint64_t>(src_strides[i])});
    }
  }
  const uint64_t total = checked_mul(count, itemsize, "strided_copy");
  if (dst_base == 0 || src_base == 0) throw py::value_error(who + ": null buffer address");
  (void)checked_add(dst_base, dst_nbytes, "strided_copy");
  (void)checked_add(src_base, src_nbytes, "strided_copy");
  if (dst_base < src_base + src_nbytes && src_base < dst_base + dst_nbytes) {
    throw py::value_error(who + ": the destination buffer overlaps the source buffer");
  }
  for (const bool dst : {true, false}) {
    const uint64_t off = dst ? dst_offset : src_offset;
    const uint64_t end = checked_mul(checked_add(max_offset(off, dims, dst), 1, "strided_copy"),
                                     itemsize, "strided_copy");
    if (end > (dst ? dst_nbytes : src_nbytes)) {
      throw py::value_error(who + ": the " + (dst ? "destination" : "source") + " view reaches "
                            "byte " + std::to_string(end) + " of a " +
                            std::to_string(dst ? dst_nbytes : src_nbytes) + "-byte buffer");
    }
  }
  // A destination that writes one element twice would make the result order-dependent:
  // every dimension must step over all the faster ones (nested strides).
  std::stable_sort(dims.begin(), dims.end(), [](const StridedDim& x, const StridedDim& y) {
    return x.dst_stride > y.dst_stride;
  });
  {
    uint64_t span = 1;
    for (size_t k = dims.size(); k-- > 0;) {
      if (dims[k].dst_stride < span) {
        throw py::value_error(who + ": the destination view overlaps itself");
      }
      span = checked_mul(dims[k].dst_stride, dims[k].size, "strided_copy");
    }
  }
  StridedPlan plan;
  plan.dst = reinterpret_cast<char*>(dst_base) + dst_offset * itemsize;
  plan.src = reinterpret_cast<const char*>(src_base) + src_offset * itemsize;
  plan.itemsize = itemsize;
  plan.total_bytes = total;
  // Merge dimensions contiguous in each other on both sides (dst strides descending).
  std::vector<StridedDim> merged;
  for (const StridedDim& d : dims) {
    if (!merged.empty()) {
      StridedDim& o = merged.back();
      if (o.dst_stride == d.size * d.dst_stride && o.src_stride == d.size * d.src_stride) {
        o = {o.size * d.size, d.dst_stride, d.src_stride};
        continue;
      }
    }
    merged.push_back(d);
  }
  auto row = std::find_if(merged.begin(), merged.end(), [](const StridedDim& d) {
    return d.dst_stride == 1 && d.src_stride == 1;
  });
  // A short run contiguous on both sides (e.g. AMX's pairs of bf16) becomes the element:
  // the rest is then tiled in units of that run instead of copied run by run.
  if (row != merged.end() && row->size * itemsize < kTileBytes &&
      std::all_of(merged.begin(), merged.end(), [&](const StridedDim& d) {
        return &d == &*row || (d.dst_stride % row->size == 0 && d.src_stride % row->size == 0);
      })) {
    const uint64_t r = row->size;
    merged.erase(row);
    for (StridedDim& d : merged) {
      d.dst_stride /= r;
      d.src_stride /= r;
    }
    itemsize *= r;
    plan.itemsize = itemsize;
    row = merged.end();
  }
  std::vector<StridedDim> chain_a, chain_b;  // the tile's chains (tile mode)
  if (merged.empty()) {
    plan.row_elems = 1;
  } else if (row != merged.end()) {
    plan.row_elems = row->size;
    merged.erase(row);
  } else {
    std::vector<StridedDim> rest(merged);
    const uint64_t side = std::clamp<uint64_t>(kTileBytes / itemsize, 1, kTileMax);
    const std::vector<StridedDim> a = take_chain(rest, true, side);
    const std::vector<StridedDim> b = take_chain(rest, false, side);
    chain_offsets(a, plan.a_dst, plan.a_src);
    chain_offsets(b, plan.b_dst, plan.b_src);
    for (size_t i = 0; i < plan.a_dst.size(); ++i) plan.a_dst_unit &= plan.a_dst[i] == i;
    for (size_t j = 0; j < plan.b_src.size(); ++j) plan.b_src_unit &= plan.b_src[j] == j;
    merged = std::move(rest);
    std::stable_sort(merged.begin(), merged.end(), [](const StridedDim& x, const StridedDim& y) {
      return x.dst_stride > y.dst_stride;
    });
    chain_a = a;
    chain_b = b;
  }
  plan.outer = std::move(merged);
  // Streaming stores (copies larger than the caches) need every destination line 32-byte
  // aligned once the first is: tiles' line offsets multiples of 32 bytes; rows of whole
  // 32-byte units, from 64 bytes (shorter rows leave lines partly written) up to 64 KiB
  // (longer ones are memcpy's, which streams large copies itself), whose outer steps are
  // multiples of 32 bytes. Each tile or row checks its own destination's alignment.
  const uint64_t row_bytes = plan.row_elems * plan.itemsize;
  plan.nt_ok = total >= (4u << 20) &&
               (plan.row_elems
                    ? row_bytes % 32 == 0 && row_bytes >= 64 && row_bytes <= (64u << 10) &&
                          std::all_of(plan.outer.begin(), plan.outer.end(),
                                      [&](const StridedDim& d) {
                                        return (d.dst_stride * plan.itemsize) % 32 == 0;
                                      })
                    : std::all_of(plan.b_dst.begin(), plan.b_dst.end(), [&](uint64_t o) {
                        return (o * plan.itemsize) % 32 == 0;
                      }));
  // Tiles only: a CPU engine's V plane (256-byte rows, streamed) was slower staged (the
  // modify of bench W6's 32 KiB/token streams: 0.70 s of CPU against 0.61 s).
  if (plan.nt_ok && !chain_a.empty() && !chain_b.empty()) {
    plan_boxes(plan, chain_a, chain_b, plan.outer);
  }
  return plan;
}

namespace {

// A thread's two staging buffers for boxes (64-byte aligned, grown on demand, kept).
struct BoxStaging {
  struct Free {
    void operator()(char* q) const { std::free(q); }
  };
  std::unique_ptr<char, Free> src, dst;
  uint64_t capacity = 0;

  void reserve(uint64_t bytes) {
    if (g_box_staging_fault.load(std::memory_order_relaxed)) throw std::bad_alloc();
    if (bytes <= capacity) return;
    const uint64_t n = (bytes + 63) / 64 * 64;
    src.reset(static_cast<char*>(std::aligned_alloc(64, n)));
    dst.reset(static_cast<char*>(std::aligned_alloc(64, n)));
    if (!src || !dst) {
      src.reset();
      dst.reset();
      capacity = 0;
      throw std::bad_alloc();
    }
    capacity = n;
  }
};

// Step the odometer over dims [first, last) of `outer`; offsets follow.
inline void odometer_step(const std::vector<StridedDim>& outer, size_t first, size_t last,
                          uint64_t* idx, uint64_t& doff, uint64_t& soff) {
  for (size_t k = last; k-- > first;) {
    const StridedDim& d = outer[k];
    if (++idx[k] < d.size) {
      doff += d.dst_stride;
      soff += d.src_stride;
      return;
    }
    idx[k] = 0;
    doff -= (d.size - 1) * d.dst_stride;
    soff -= (d.size - 1) * d.src_stride;
  }
}

void execute_boxes(const StridedPlan& p) {
  const size_t nd = p.outer.size(), no = nd - static_cast<size_t>(p.box_outer);
  uint64_t n_box = 1;
  for (size_t k = 0; k < no; ++k) n_box *= p.outer[k].size;
  uint64_t per_box = 1;
  for (size_t k = no; k < nd; ++k) per_box *= p.outer[k].size;
  const uint64_t isz = p.itemsize, bytes = p.box_bytes;
  StridedPlan local = p;  // the tiles inside the staging buffers: cached stores
  local.nt_ok = false;
  const bool stream = CopyPlan::stream_for(p.total_bytes);
  // Streamed copies of 32 x 32 16-bit tiles skip the destination staging buffer: each tile
  // writes its 32 whole destination lines with streaming stores, which saves writing the
  // box into the buffer and reading it back. Measured (benches/bench_engine_convert.py
  // --layers 8, one copy thread, 3 alternating runs, AMD EPYC VM, 2026-12-02): to_tokens
  // 8.4-9.1 -> 7.4-7.7 ms, to_raw 11.1-11.5 -> 10.0-10.2 ms. Other tiles (no streaming
  // stores of their own) keep the staged write.
#if defined(LMCKV_AVX2_TILE)
  const bool direct = stream && tile32_fits(p);
#else
  const bool direct = false;
#endif
  StridedPlan direct_plan = p;
  direct_plan.nt_ok = true;
  const int max_tasks = static_cast<int>(std::min<uint64_t>(n_box, 1 << 16));
  run_parallel(p.total_bytes, max_tasks, [&](int task, int ntasks) {
    const uint64_t lo = n_box * static_cast<uint64_t>(task) / static_cast<uint64_t>(ntasks);
    const uint64_t hi = n_box * static_cast<uint64_t>(task + 1) / static_cast<uint64_t>(ntasks);
    if (lo >= hi) return;
    thread_local BoxStaging staging;
    try {
      staging.reserve(bytes);
    } catch (const std::bad_alloc&) {
      // No staging memory: the boxes of this task as plain tiles (same bytes).
      for (uint64_t it = lo; it < hi; ++it) {
        // decode `it` into the outer-outer offsets, then walk the box's tiles in place
        uint64_t rem = it, doff = 0, soff = 0;
        for (size_t k = no; k-- > 0;) {
          const uint64_t i = rem % p.outer[k].size;
          rem /= p.outer[k].size;
          doff += i * p.outer[k].dst_stride;
          soff += i * p.outer[k].src_stride;
        }
        uint64_t ridx[kMaxDims] = {};
        for (uint64_t j = 0; j < per_box; ++j) {
          inner(p.dst + doff * isz, p.src + soff * isz, p);
          odometer_step(p.outer, no, nd, ridx, doff, soff);
        }
      }
      return;
    }
    char* sbuf = staging.src.get();
    char* dbuf = staging.dst.get();
    uint64_t idx[kMaxDims] = {};
    uint64_t doff = 0, soff = 0, rem = lo;
    for (size_t k = no; k-- > 0;) {  // decode lo over the outer-outer dimensions
      idx[k] = rem % p.outer[k].size;
      rem /= p.outer[k].size;
      doff += idx[k] * p.outer[k].dst_stride;
      soff += idx[k] * p.outer[k].src_stride;
    }
    for (uint64_t it = lo; it < hi; ++it) {
      std::memcpy(sbuf, p.src + soff * isz, bytes);  // the whole box, one sequential read
      uint64_t ridx[kMaxDims] = {};
      uint64_t rd = 0, rs = 0;
      if (direct) {  // tiles from the staged source straight to the destination, streamed
        for (uint64_t j = 0; j < per_box; ++j) {
          inner(p.dst + (doff + rd) * isz, sbuf + rs * isz, direct_plan);
          odometer_step(p.outer, no, nd, ridx, rd, rs);
        }
      } else {
        for (uint64_t j = 0; j < per_box; ++j) {
          inner(dbuf + rd * isz, sbuf + rs * isz, local);
          odometer_step(p.outer, no, nd, ridx, rd, rs);
        }
        CopyPlan out;  // the whole box, one sequential (streaming) write
        out.add(p.dst + doff * isz, dbuf, 1, bytes, 0, 0);
        out.run_part(0, 1, stream);
      }
      g_staged_box_bytes.fetch_add(bytes, std::memory_order_relaxed);
      if (direct) g_staged_box_direct_bytes.fetch_add(bytes, std::memory_order_relaxed);
      odometer_step(p.outer, 0, no, idx, doff, soff);
    }
#if defined(__SSE2__)
    _mm_sfence();
#endif
  });
}

}  // namespace

void set_box_staging_fault(bool on) { g_box_staging_fault.store(on); }
uint64_t staged_box_bytes() { return g_staged_box_bytes.load(); }
uint64_t staged_box_direct_bytes() { return g_staged_box_direct_bytes.load(); }

void execute_strided_copy(const StridedPlan& p) {
  if (p.total_bytes == 0) return;
  if (p.box_outer > 0 && !box_disabled()) {
    execute_boxes(p);
    return;
  }
  uint64_t n_outer = 1;
  for (const StridedDim& d : p.outer) n_outer *= d.size;  // <= element count: no overflow
  const uint64_t isz = p.itemsize;
  const int max_tasks = static_cast<int>(std::min<uint64_t>(n_outer, 1 << 16));
  run_parallel(p.total_bytes, max_tasks, [&](int task, int ntasks) {
    const uint64_t lo = n_outer * static_cast<uint64_t>(task) / static_cast<uint64_t>(ntasks);
    const uint64_t hi = n_outer * static_cast<uint64_t>(task + 1) / static_cast<uint64_t>(ntasks);
    if (lo >= hi) return;
    const size_t nd = p.outer.size();
    uint64_t idx[2 * kMaxDims] = {};
    uint64_t doff = 0, soff = 0;
    uint64_t rem = lo;
    for (size_t k = nd; k-- > 0;) {  // decode lo (innermost outer dimension last)
      idx[k] = rem % p.outer[k].size;
      rem /= p.outer[k].size;
      doff += idx[k] * p.outer[k].dst_stride;
      soff += idx[k] * p.outer[k].src_stride;
    }
    for (uint64_t it = lo; it < hi; ++it) {
      inner(p.dst + doff * isz, p.src + soff * isz, p);
      odometer_step(p.outer, 0, nd, idx, doff, soff);
    }
#if defined(__SSE2__)
    _mm_sfence();  // streaming stores of the tiles are visible before the task counts done
#endif
  });
}

}  // namespace lmckv

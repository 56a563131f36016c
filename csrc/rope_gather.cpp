#include "rope_gather.hpp"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "common.hpp"
#include "rope_rotate.hpp"
#include "thread_pool.hpp"

namespace lmckv {

namespace py = pybind11;

namespace {

constexpr const char* kWhat = "rope_gather";

[[noreturn]] void fail(const std::string& msg) { throw py::value_error(std::string(kWhat) + ": " + msg); }

void check_geometry(const RopeGatherArgs& a) {
  if (a.rotary_dim == 0) return;
  if (a.head_dim == 0 || a.width % a.head_dim) {
    fail("width " + std::to_string(a.width) + " is not a whole number of heads of " +
         std::to_string(a.head_dim));
  }
  if (a.rotary_dim % 2 || a.rotary_dim > a.head_dim) {
    fail("rotary_dim must be even and at most head_dim " + std::to_string(a.head_dim) +
         ", got " + std::to_string(a.rotary_dim));
  }
}

bool overlaps(const char* a, uint64_t an, const char* b, uint64_t bn) {
  return an && bn && a < b + bn && b < a + an;
}

}  // namespace

RopeGatherPlan::RopeGatherPlan(const RopeGatherArgs& a) : a_(a) {
  check_geometry(a);
  esize_ = a.dtype == EditDType::kF32 ? 4 : 2;
  const uint64_t row = checked_mul(a.width, esize_, kWhat);
  const uint64_t planes_layers = checked_mul(a.planes, a.layers, kWhat);
  const uint64_t src_span = checked_mul(checked_mul(planes_layers, a.rows, kWhat), row, kWhat);
  const uint64_t dst_span = checked_mul(checked_mul(planes_layers, a.n, kWhat), row, kWhat);
  const uint64_t tab_span = a.rotary_dim ? checked_mul(a.n, a.rotary_dim / 2 * 4, kWhat) : 0;
  src_ = checked_span(a.src.base, a.src.nbytes, a.src.offset, src_span, kWhat, "source");
  dst_ = const_cast<char*>(
      checked_span(a.dst.base, a.dst.nbytes, a.dst.offset, dst_span, kWhat, "destination"));
  const char* idx = checked_span(a.idx.base, a.idx.nbytes, a.idx.offset,
                                 checked_mul(a.n, 8, kWhat), kWhat, "index");
  const char* c = checked_span(a.cos.base, a.cos.nbytes, a.cos.offset, tab_span, kWhat, "cos");
  const char* s = checked_span(a.sin.base, a.sin.nbytes, a.sin.offset, tab_span, kWhat, "sin");
  if (overlaps(dst_, dst_span, src_, src_span) || overlaps(dst_, dst_span, idx, a.n * 8) ||
      overlaps(dst_, dst_span, c, tab_span) || overlaps(dst_, dst_span, s, tab_span)) {
    fail("the destination overlaps an input");
  }
  cos_ = reinterpret_cast<const float*>(c);
  sin_ = reinterpret_cast<const float*>(s);
  idx_.resize(a.n);
  if (a.n) std::memcpy(idx_.data(), idx, a.n * 8);
  for (uint64_t j = 0; j < a.n; ++j) {
    if (idx_[j] < 0 || static_cast<uint64_t>(idx_[j]) >= a.rows) {
      fail("index " + std::to_string(j) + " is " + std::to_string(idx_[j]) + ", outside [0, " +
           std::to_string(a.rows) + ")");
    }
  }
}

void RopeGatherPlan::run_rows(uint64_t first, uint64_t last) const {
  const uint64_t row = a_.width * esize_, per_plane = a_.layers * a_.n;
  const RowGeom g{a_.rotary_dim ? a_.width / a_.head_dim : 0, a_.head_dim, a_.rotary_dim,
                  a_.rotary_dim / 2, a_.interleaved};
  const RotateFn rotate = rotate_for(a_.dtype, g);
  for (uint64_t r = first; r < last; ++r) {
    const uint64_t p = r / per_plane, l = (r % per_plane) / a_.n, j = r % a_.n;
    const char* s = src_ + ((p * a_.layers + l) * a_.rows + static_cast<uint64_t>(idx_[j])) * row;
    char* d = dst_ + r * row;
    if (p == 0 && a_.rotary_dim) {
      rotate(d, s, cos_ + j * g.half, sin_ + j * g.half, g);
    } else {
      std::memcpy(d, s, row);
    }
  }
}

void RopeGatherPlan::execute() const {
  const uint64_t total = a_.planes * a_.layers * a_.n;
  if (total == 0) return;
  const uint64_t bytes = total * a_.width * esize_;
  const int max_tasks = static_cast<int>(std::min<uint64_t>(total, 1u << 20));
  run_parallel(bytes, max_tasks, [this, total](int task, int ntasks) {
    const uint64_t t = static_cast<uint64_t>(task), nt = static_cast<uint64_t>(ntasks);
    run_rows(total * t / nt, total * (t + 1) / nt);
  });
}

}  // namespace lmckv

#include "score_pool.hpp"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "common.hpp"
#include "thread_pool.hpp"

namespace lmckv {

namespace py = pybind11;

namespace {
constexpr const char* kWhat = "score_pool";
}  // namespace

ScorePoolPlan::ScorePoolPlan(const ScorePoolArgs& a) : a_(a) {
  if (a.kernel == 0 || a.kernel % 2 == 0) {
    throw py::value_error(std::string(kWhat) + ": kernel must be odd, got " +
                          std::to_string(a.kernel));
  }
  if (a.n > a.ld) throw py::value_error(std::string(kWhat) + ": n is larger than the row");
  const uint64_t bytes = checked_mul(checked_mul(a.rows, a.ld, kWhat), 4, kWhat);
  buf_ = reinterpret_cast<float*>(
      const_cast<char*>(checked_span(a.buf.base, a.buf.nbytes, a.buf.offset, bytes, kWhat, "buf")));
}

// One row: a padded copy (pad[t + r] = row[t]), then each output the max / mean of
// kernel consecutive padded values, the loop over offsets outermost so it vectorises.
void ScorePoolPlan::run_row(float* row, float* pad) const {
  const uint64_t n = a_.n, r = a_.kernel / 2;
  const float fill = a_.max ? -std::numeric_limits<float>::infinity() : 0.0f;
  std::fill(pad, pad + r, fill);
  std::copy(row, row + n, pad + r);
  std::fill(pad + r + n, pad + n + 2 * r, fill);
  std::copy(pad, pad + n, row);
  for (uint64_t j = 1; j < a_.kernel; ++j) {
    const float* p = pad + j;
    if (a_.max) {
      for (uint64_t t = 0; t < n; ++t) row[t] = std::max(row[t], p[t]);
    } else {
      for (uint64_t t = 0; t < n; ++t) row[t] += p[t];
    }
  }
  if (a_.max) return;
  for (uint64_t t = 0; t < n; ++t) {  // positions inside the row only
    const uint64_t lo = t >= r ? t - r : 0, hi = std::min(n - 1, t + r);
    row[t] /= static_cast<float>(hi - lo + 1);
  }
}

void ScorePoolPlan::execute() const {
  if (a_.rows == 0 || a_.n == 0 || a_.kernel == 1) return;
  run_parallel(a_.rows * a_.n * 4 * a_.kernel, static_cast<int>(std::min<uint64_t>(a_.rows, 1u << 20)),
               [this](int task, int ntasks) {
                 std::vector<float> pad(a_.n + a_.kernel);
                 const uint64_t t = static_cast<uint64_t>(task), nt = static_cast<uint64_t>(ntasks);
                 for (uint64_t i = a_.rows * t / nt; i < a_.rows * (t + 1) / nt; ++i) {
                   run_row(buf_ + i * a_.ld, pad.data());
                 }
               });
}

}  // namespace lmckv

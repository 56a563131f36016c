#include "key_heads.hpp"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <string>

#include "common.hpp"
#include "thread_pool.hpp"

namespace lmckv {

namespace py = pybind11;

KeyHeads::KeyHeads(const KeyHeadsArgs& a, const char* what) : a_(a) {
  if (a.n_kv == 0 || a.head_dim == 0) {
    throw py::value_error(std::string(what) + ": n_kv and head_dim must be >= 1");
  }
  const uint64_t kn = checked_mul(checked_mul(a.layers, a.tokens, what),
                                  checked_mul(a.n_kv, a.head_dim, what), what);
  const uint64_t on = checked_mul(checked_mul(a.layers, a.n_kv, what), a.tokens, what);
  const char* k = checked_span(a.k.base, a.k.nbytes, a.k.offset, checked_mul(kn, 2, what),
                               what, "k");
  const char* o = checked_span(a.out.base, a.out.nbytes, a.out.offset,
                               checked_mul(on, 4, what), what, "out");
  if (on && o < k + kn * 2 && k < o + on * 4) {
    throw py::value_error(std::string(what) + ": out overlaps k");
  }
  k_ = reinterpret_cast<const uint16_t*>(k);
  out_ = reinterpret_cast<float*>(const_cast<char*>(o));
}

KeyHeads::Unit KeyHeads::unit(uint64_t u) const {
  const uint64_t l = u / a_.n_kv, h = u % a_.n_kv, row = a_.n_kv * a_.head_dim;
  return Unit{k_ + l * a_.tokens * row + h * a_.head_dim, row, out_ + u * a_.tokens};
}

void KeyHeads::for_each(uint64_t work, const std::function<void(uint64_t)>& fn) const {
  const uint64_t units = a_.layers * a_.n_kv;
  if (units == 0 || a_.tokens == 0) return;
  run_parallel(work, static_cast<int>(std::min<uint64_t>(units, 1u << 20)),
               [units, &fn](int task, int ntasks) {
                 const uint64_t t = static_cast<uint64_t>(task), nt = static_cast<uint64_t>(ntasks);
                 for (uint64_t u = units * t / nt; u < units * (t + 1) / nt; ++u) fn(u);
               });
}

}  // namespace lmckv

#include "common.hpp"

#include <Python.h>
#include <sys/mman.h>

#include <algorithm>

namespace lmckv {

int64_t to_i64(py::handle obj, const std::string& what) {
  PyObject* idx = PyNumber_Index(obj.ptr());  // accepts int, numpy ints, bool
  if (idx == nullptr) {
    PyErr_Clear();
    throw py::type_error(what + ": expected an integer, got " +
                         std::string(Py_TYPE(obj.ptr())->tp_name));
  }
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(idx, &overflow);
  Py_DECREF(idx);
  if (overflow != 0) throw py::value_error(what + ": integer out of the 64-bit range");
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return static_cast<int64_t>(v);
}

std::vector<int64_t> to_i64_vector(py::handle seq, const char* what) {
  if (!PySequence_Check(seq.ptr())) {
    throw py::type_error(std::string(what) + ": expected a sequence of integers");
  }
  py::sequence s = py::reinterpret_borrow<py::sequence>(seq);
  const size_t n = s.size();
  std::vector<int64_t> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    out.push_back(to_i64(s[i], std::string(what) + " " + std::to_string(i)));
  }
  return out;
}

uint64_t to_u64_nonneg(py::handle obj, const char* what) {
  const int64_t v = to_i64(obj, what);
  if (v < 0) throw py::value_error(std::string(what) + " must be >= 0, got " + std::to_string(v));
  return static_cast<uint64_t>(v);
}

const char* checked_span(uint64_t base, uint64_t nbytes, uint64_t offset, uint64_t span,
                         const char* what, const char* name) {
  if (span == 0) return nullptr;
  if (base == 0) throw py::value_error(std::string(what) + ": " + name + " is a null address");
  const uint64_t end = checked_add(offset, span, what);
  if (end > nbytes) {
    throw py::value_error(std::string(what) + ": " + name + " needs bytes [" +
                          std::to_string(offset) + ", " + std::to_string(end) +
                          ") of its buffer, which holds " + std::to_string(nbytes));
  }
  checked_add(base, end, what);
  return reinterpret_cast<const char*>(base + offset);
}

bool mostly_absent(uintptr_t addr, uint64_t n, uint64_t page_size) {
  if (n == 0 || page_size == 0) return false;
  const uint64_t first = addr / page_size * page_size;
  const uint64_t pages = (addr + n - first + page_size - 1) / page_size;
  const uint64_t samples = std::min<uint64_t>(pages, 8);
  uint64_t absent = 0;
  for (uint64_t k = 0; k < samples; ++k) {
    const uint64_t page = samples == 1 ? 0 : (pages - 1) * k / (samples - 1);
    unsigned char v = 0;
    if (mincore(reinterpret_cast<void*>(first + page * page_size), page_size, &v) != 0) {
      return false;
    }
    absent += (v & 1) ? 0 : 1;
  }
  return absent * 2 > samples;
}

}  // namespace lmckv

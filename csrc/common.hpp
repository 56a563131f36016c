// Small shared helpers of the native core: checked arithmetic, argument parsing,
// an immortal-singleton wrapper and a fork-safety registry.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace lmckv {

namespace py = pybind11;

// The tensor span Python handed to the core does not back what the call would touch
// (null address, fewer bytes than the shape needs). Raised to Python as
// `_native.TensorSpanError`, a ValueError subclass that the copy backend turns into
// InvalidArgumentError naming the tensor (kv / out).
class TensorSpanError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// a * b, or ValueError naming `what` on overflow.
inline uint64_t checked_mul(uint64_t a, uint64_t b, const char* what) {
  uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) {
    throw py::value_error(std::string(what) + ": size overflows 64 bits");
  }
  return r;
}

// a + b, or ValueError naming `what` on overflow.
inline uint64_t checked_add(uint64_t a, uint64_t b, const char* what) {
  uint64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) {
    throw py::value_error(std::string(what) + ": size overflows 64 bits");
  }
  return r;
}

// Convert one Python integer-like object to int64 (ValueError naming `what` if it
// does not fit, TypeError if it is not an integer). GIL must be held.
int64_t to_i64(py::handle obj, const std::string& what);

// Convert a Python sequence of integers to int64 (see to_i64); `what` is used as
// "<what> <index>" in messages.
std::vector<int64_t> to_i64_vector(py::handle seq, const char* what);

// A non-negative integer argument, or ValueError.
uint64_t to_u64_nonneg(py::handle obj, const char* what);

// [base + offset, base + offset + span) must lie in [base, base + nbytes) (ValueError
// "<what>: <name> needs bytes ..." otherwise); returns the first byte (nullptr when span
// is 0).
const char* checked_span(uint64_t base, uint64_t nbytes, uint64_t offset, uint64_t span,
                         const char* what, const char* name);

// Holds a T that is constructed on first use and never destroyed: module-level state
// may be touched by Python objects finalised after C++ static destructors ran
// (interpreter shutdown), so process-wide singletons are immortal on purpose.
template <typename T>
class NoDestructor {
 public:
  template <typename... Args>
  explicit NoDestructor(Args&&... args) {
    ::new (static_cast<void*>(storage_)) T(std::forward<Args>(args)...);
  }
  NoDestructor(const NoDestructor&) = delete;
  NoDestructor& operator=(const NoDestructor&) = delete;
  ~NoDestructor() = default;  // intentionally does not destroy T
  T* get() { return std::launder(reinterpret_cast<T*>(storage_)); }
  T* operator->() { return get(); }
  T& operator*() { return *get(); }

 private:
  alignas(T) unsigned char storage_[sizeof(T)];
};

// Number of CPUs this process may run on (sched_getaffinity), at least 1.
int usable_cpus();

// Whether most of a sample (<= 8 pages) of the pages of [addr, addr + n) are not in
// memory yet (mincore); false when unknown or n == 0.
bool mostly_absent(uintptr_t addr, uint64_t n, uint64_t page_size);

}  // namespace lmckv

// Native core of lmcache-kv-fast (placeholder; filled by the native-core work).
#include <pybind11/pybind11.h>

namespace py = pybind11;

PYBIND11_MODULE(_native, m) {
  m.doc() = "lmcache-kv-fast native core";
  m.attr("__version__") = "0.1.0";
}

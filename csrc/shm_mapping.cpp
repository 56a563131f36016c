#include "shm_mapping.hpp"

#include <fcntl.h>
#include <pybind11/pybind11.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <numeric>

#include "common.hpp"
#include "thread_pool.hpp"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace lmckv {

namespace py = pybind11;

namespace {

// Measured (benches/bench_copy.py, "populate" tables, 2-core VM): MADV_POPULATE_READ on
// the pool threads maps resident tmpfs pages fastest (1 GiB ~40 ms, 4 GiB ~180 ms vs
// ~230 ms MAP_POPULATE, ~1 s MADV_POPULATE_WRITE) and the pages come out writable (no
// write faults later). Restricting it to pages that are already allocated keeps a
// lazily-allocated pool lazy: populating a fresh 4 GiB segment would allocate and zero
// all of it (~9 s and 4 GiB of RAM).
constexpr Populate kAutoPopulate = Populate::kResident;

// Raise the OSError subclass for errno (FileNotFoundError, PermissionError, ...).
[[noreturn]] void throw_errno(const std::string& path) {
  PyErr_SetFromErrnoWithFilename(PyExc_OSError, path.c_str());
  throw py::error_already_set();
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

uint64_t page_size() {
  static const uint64_t ps = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return ps;
}

// Touch one byte per page (read faults; fault-around maps neighbours too). Fallback for
// kernels without MADV_POPULATE_READ/WRITE, on a range checked against the file size.
void touch_pages(const volatile char* p, uint64_t n) {
  const uint64_t ps = page_size();
  for (uint64_t off = 0; off < n; off += ps) (void)p[off];
}

}  // namespace

Populate parse_populate(const std::string& name) {
  if (name == "auto") return Populate::kAuto;
  if (name == "none") return Populate::kNone;
  if (name == "map_populate") return Populate::kMapPopulate;
  if (name == "madvise") return Populate::kMadvise;
  if (name == "parallel") return Populate::kParallel;
  if (name == "parallel_read") return Populate::kParallelRead;
  if (name == "resident") return Populate::kResident;
  throw py::value_error("unknown populate mode '" + name +
                        "'; expected auto, none, map_populate, madvise, parallel, "
                        "parallel_read or resident");
}

std::string populate_name(Populate p) {
  switch (p) {
    case Populate::kAuto: return "auto";
    case Populate::kNone: return "none";
    case Populate::kMapPopulate: return "map_populate";
    case Populate::kMadvise: return "madvise";
    case Populate::kParallel: return "parallel";
    case Populate::kParallelRead: return "parallel_read";
    case Populate::kResident: return "resident";
  }
  return "none";
}

std::string validate_segment_name(const std::string& name) {
  std::string bare = (!name.empty() && name[0] == '/') ? name.substr(1) : name;
  if (bare.empty() || bare.size() > 255 || bare.find('/') != std::string::npos ||
      bare.find("..") != std::string::npos || bare.find('\0') != std::string::npos) {
    std::string shown;
    for (char c : name) {
      if (c == '\0') {
        shown += "\\x00";
      } else {
        shown += c;
      }
    }
    throw py::value_error("invalid shared-memory segment name '" + shown + "'");
  }
  return bare;
}

Mapping::Mapping(const std::string& name, int64_t min_size, const std::string& populate)
    : name_(validate_segment_name(name)) {
  Populate mode = parse_populate(populate);
  const std::string path = "/dev/shm/" + name_;
  fd_ = shm_open(("/" + name_).c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd_ < 0) throw_errno(path);
  struct stat st {};
  if (fstat(fd_, &st) != 0) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    errno = err;
    throw_errno(path);
  }
  auto fail = [&](const std::string& msg) {
    ::close(fd_);
    fd_ = -1;
    throw py::value_error(msg);
  };
  if (!S_ISREG(st.st_mode)) fail("segment " + name_ + " is not a regular shared-memory object");
  if (st.st_size <= 0) fail("segment " + name_ + " is empty");
  size_ = static_cast<uint64_t>(st.st_size);
  if (min_size >= 0 && static_cast<uint64_t>(min_size) > size_) {
    fail("segment " + name_ + " has " + std::to_string(size_) + " bytes, expected >= " +
         std::to_string(min_size));
  }
  if (mode == Populate::kAuto) mode = kAutoPopulate;
  const int flags = MAP_SHARED | (mode == Populate::kMapPopulate ? MAP_POPULATE : 0);
  const auto t0 = std::chrono::steady_clock::now();
  {
    py::gil_scoped_release nogil;
    base_ = mmap(nullptr, size_, PROT_READ | PROT_WRITE, flags, fd_, 0);
  }
  if (base_ == MAP_FAILED) {
    base_ = nullptr;
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    errno = err;
    throw_errno(path);
  }
  {
    py::gil_scoped_release nogil;
    prefault(mode, static_cast<uint64_t>(st.st_blocks) * 512u);
  }
  populate_seconds_ = seconds_since(t0);
}

namespace {

// Call fn(first, last) for every run of pages [first, last) within [p0, p1) that the
// file behind `base` (a mapping of `size` bytes) has in memory (mincore). Returns false
// when the residency could not be read (nothing is called then). Never throws.
template <typename Fn>
bool for_each_resident_run(char* base, uint64_t size, uint64_t p0, uint64_t p1, Fn&& fn) {
  if (p1 <= p0) return true;
  const uint64_t ps = page_size();
  std::vector<unsigned char> vec;
  try {
    vec.resize(static_cast<size_t>(p1 - p0));
  } catch (...) {  // best effort: callers run on pool threads or without the GIL
    return false;
  }
  const uint64_t len = std::min(size, p1 * ps) - p0 * ps;
  if (mincore(base + p0 * ps, len, vec.data()) != 0) return false;
  uint64_t run = p1;  // start of the current resident run, p1 = none
  for (uint64_t p = p0; p < p1; ++p) {
    const bool in = (vec[static_cast<size_t>(p - p0)] & 1) != 0;
    if (in && run == p1) run = p;
    if (!in && run != p1) {
      fn(run, p);
      run = p1;
    }
  }
  if (run != p1) fn(run, p1);
  return true;
}

}  // namespace

void Mapping::prefault(Populate mode, uint64_t allocated) {
  populate_used_ = mode;
  if (mode == Populate::kNone || mode == Populate::kMapPopulate) return;
  char* base = static_cast<char*>(base_);
  if (mode == Populate::kMadvise) {
    if (madvise(base, size_, MADV_POPULATE_WRITE) != 0 && errno == EINVAL) {
      touch_pages(base, size_);  // kernel < 5.14
    }
    return;
  }
  // kParallel / kParallelRead / kResident: page-aligned tasks on the pool threads.
  const int advice = mode == Populate::kParallel ? MADV_POPULATE_WRITE : MADV_POPULATE_READ;
  // kResident: tmpfs counts allocated pages in st_blocks, so the common extremes need no
  // per-page mincore() (which costs ~50 ms per resident GiB): nothing allocated -> nothing
  // to do; everything allocated -> populate it all.
  bool resident_only = mode == Populate::kResident;
  if (resident_only && allocated == 0) return;
  if (resident_only && allocated >= size_) resident_only = false;
  const uint64_t ps = page_size();
  const uint64_t pages = (size_ + ps - 1) / ps;
  run_parallel(size_, 1 << 20, [&](int part, int nparts) {
    const uint64_t p0 = pages * static_cast<uint64_t>(part) / static_cast<uint64_t>(nparts);
    const uint64_t p1 = pages * static_cast<uint64_t>(part + 1) / static_cast<uint64_t>(nparts);
    if (p1 <= p0) return;
    auto populate = [&](uint64_t first, uint64_t last) {  // pages [first, last)
      const uint64_t off = first * ps;
      const uint64_t len = std::min(size_, last * ps) - off;
      // Only an unsupported advice (kernel < 5.14) falls back to touching: other errors
      // (e.g. EFAULT when the server shrank the file meanwhile) must not turn into SIGBUS.
      if (madvise(base + off, len, advice) != 0 && errno == EINVAL) touch_pages(base + off, len);
    };
    if (!resident_only) {
      populate(p0, p1);
      return;
    }
    for_each_resident_run(base, size_, p0, p1, populate);
  });
}

Mapping::~Mapping() {
  // Python only destroys the object when no copy holds a reference to it, so no pins.
  unmap();
}

uintptr_t Mapping::address() const {
  if (closed_) throw py::value_error("segment " + name_ + " is closed");
  return reinterpret_cast<uintptr_t>(base_);
}

bool Mapping::contains(uintptr_t addr, uint64_t n) const {
  const uintptr_t b = reinterpret_cast<uintptr_t>(base_);
  return base_ != nullptr && addr >= b && n <= size_ && addr - b <= size_ - n;
}

uint64_t Mapping::populate_resident_range(uint64_t offset, uint64_t length) const {
  if (base_ == nullptr || offset >= size_ || length == 0) return 0;
  length = std::min(length, size_ - offset);
  const uint64_t ps = page_size();
  const uint64_t p0 = offset / ps;
  const uint64_t p1 = (offset + length + ps - 1) / ps;
  char* base = static_cast<char*>(base_);
  uint64_t done = 0;
  for_each_resident_run(base, size_, p0, p1, [&](uint64_t first, uint64_t last) {
    const uint64_t off = first * ps;
    const uint64_t n = std::min(size_, last * ps) - off;
    if (madvise(base + off, n, MADV_POPULATE_READ) == 0) done += last - first;
  });
  return done;
}

bool Mapping::cold(uintptr_t addr, uint64_t n) const {
  if (base_ == nullptr || n == 0 || !contains(addr, n)) return false;
  return mostly_absent(addr, n, page_size());
}

uint64_t Mapping::fs_free_bytes() const {
  struct statvfs sv {};
  if (fd_ < 0 || fstatvfs(fd_, &sv) != 0) return UINT64_MAX;
  return static_cast<uint64_t>(sv.f_bavail) * static_cast<uint64_t>(sv.f_frsize);
}

std::vector<uintptr_t> Mapping::regions(const std::vector<int64_t>& offsets,
                                        const std::vector<int64_t>& lengths,
                                        int64_t expected_nbytes, int64_t align) const {
  if (closed_) throw py::value_error("segment " + name_ + " is closed");
  if (offsets.size() != lengths.size()) {
    throw py::value_error(std::to_string(offsets.size()) + " offsets for " +
                          std::to_string(lengths.size()) + " lengths");
  }
  if (expected_nbytes < 0) throw py::value_error("expected_nbytes must be >= 0");
  // The server may have shrunk the segment since we mapped it: pages past its current
  // end would raise SIGBUS, so bound slots by the smaller of mapping and file size.
  uint64_t limit = size_;
  struct stat st {};
  if (fd_ >= 0 && fstat(fd_, &st) == 0) {
    limit = std::min<uint64_t>(limit, static_cast<uint64_t>(std::max<off_t>(st.st_size, 0)));
  }
  const size_t n = offsets.size();
  for (size_t k = 0; k < n; ++k) {
    const int64_t off = offsets[k];
    const int64_t len = lengths[k];
    const std::string slot = "slot " + std::to_string(k);
    if (len != expected_nbytes) {
      throw py::value_error(slot + ": length " + std::to_string(len) + ", expected " +
                            std::to_string(expected_nbytes));
    }
    if (off < 0 || static_cast<uint64_t>(len) > limit ||
        static_cast<uint64_t>(off) > limit - static_cast<uint64_t>(len)) {
      throw py::value_error(slot + ": [" + std::to_string(off) + ", " + std::to_string(off) +
                            " + " + std::to_string(len) + ") outside the segment of " +
                            std::to_string(limit) + " bytes");
    }
    if (align > 0 && off % align != 0) {
      throw py::value_error(slot + ": offset " + std::to_string(off) + " not aligned to " +
                            std::to_string(align));
    }
  }
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return offsets[a] != offsets[b] ? offsets[a] < offsets[b] : a < b;
  });
  for (size_t k = 1; k < n; ++k) {
    const size_t a = order[k - 1];
    const size_t b = order[k];
    // Both are in bounds, so offsets[a] + lengths[a] cannot overflow.
    if (offsets[b] < offsets[a] + lengths[a]) {
      throw py::value_error("slot " + std::to_string(a) + " and slot " + std::to_string(b) +
                            " overlap at offsets " + std::to_string(offsets[a]) + " and " +
                            std::to_string(offsets[b]));
    }
  }
  const uintptr_t b = reinterpret_cast<uintptr_t>(base_);
  std::vector<uintptr_t> out(n);
  for (size_t k = 0; k < n; ++k) out[k] = b + static_cast<uintptr_t>(offsets[k]);
  return out;
}

void Mapping::pin() {
  if (closed_) throw py::value_error("segment " + name_ + " is closed");
  ++pins_;
}

void Mapping::unpin() {
  if (pins_ > 0) --pins_;
  if (closed_ && pins_ == 0) unmap();
}

void Mapping::close() {
  closed_ = true;
  if (pins_ == 0) unmap();
}

void Mapping::unmap() {
  if (base_ != nullptr) {
    munmap(base_, size_);
    base_ = nullptr;
  }
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

}  // namespace lmckv

// Filling not-yet-allocated shared-memory pages with UFFDIO_COPY.
//
// A store into pool pages the server's segment does not have yet (a fresh or released L1)
// pays for the kernel allocating each 4 KiB page. Through the mapping every page also
// faults and is zeroed before the copy overwrites it; write(2) on the segment file skips
// the zeroing but serialises on the file's inode lock (one thread). UFFDIO_COPY on a
// userfaultfd that tracks missing pages of the mapping does neither: the kernel allocates
// the page, copies the source into it and maps it, from every thread at once.
// Measured (512 MiB into a fresh /dev/shm file, 2-core VM): faulting copies on 2 threads
// ~300 ms, pwrite on 1 thread ~230 ms, UFFDIO_COPY on 2 threads ~140 ms.
//
// Safety: a registered range is one this scatter owns exclusively (a freshly reserved
// slot), only its page-aligned interior is registered, and unregistering (always, RAII)
// wakes any thread that faulted on one of its pages meanwhile, so a stray access can at
// worst wait for the fill to finish. The fd is process-wide, opened lazily with
// UFFD_USER_MODE_ONLY (no privilege needed since Linux 5.11) and re-opened after fork.
// Where userfaultfd is unavailable (old kernel, seccomp, sysctl) fills report false and
// the caller keeps its write(2)/mapping path.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace lmckv {

// One fill: `len` bytes from `src` to `dst`; dst and len page-aligned. `tag`: caller's label.
struct FillJob {
  char* dst;
  const char* src;
  uint64_t len;
  int64_t tag;
};

struct FillResult {
  uint64_t filled = 0;         // bytes placed with UFFDIO_COPY
  int err = 0;                 // first errno other than EEXIST (0: none)
  std::vector<FillJob> rest;   // parts not filled: copy them after fill() returned
};

// Whether fills may be attempted (enabled and userfaultfd not found unusable).
bool uffd_usable();
void set_uffd_enabled(bool on);
bool uffd_enabled();
// userfaultfd could not be used in this process (kept until set_uffd_enabled(true)).
bool uffd_unavailable();
// Testing: every UFFDIO_COPY places the first half of its pages, then fails with `err`.
void set_uffd_fault(int err);

// Register `ranges` (page-aligned start, length) for missing pages, run `jobs` (each
// inside a registered range) with UFFDIO_COPY on the copy pool, unregister. Returns false,
// with nothing registered or copied, when the ranges cannot be registered. The parts of
// jobs that could not be filled (a page already present, an error) are in `out->rest`.
// Call WITHOUT the GIL. Never throws.
bool uffd_fill(const std::vector<std::pair<uintptr_t, uint64_t>>& ranges,
               const std::vector<FillJob>& jobs, FillResult* out);

}  // namespace lmckv

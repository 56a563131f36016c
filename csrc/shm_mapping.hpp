// A read-write MAP_SHARED mapping of one POSIX shared-memory segment.
//
// All state changes happen with the GIL held (Python methods, and the pin/unpin done by
// the copy functions before releasing / after re-acquiring the GIL), so the class needs
// no lock of its own. close() while a copy is using the mapping defers the munmap to the
// end of that copy: a copy can never touch unmapped memory.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lmckv {

// Pre-fault strategy for a new mapping.
//   none:           fault lazily on first access.
//   map_populate:   mmap(MAP_POPULATE) (read-faults the range).
//   madvise:        madvise(MADV_POPULATE_WRITE), one call (kernel >= 5.14).
//   parallel:       MADV_POPULATE_WRITE split across the copy pool threads.
//   parallel_read:  MADV_POPULATE_READ split across the copy pool threads (tmpfs maps
//                   the pages writable: shmem needs no write notification).
//   resident:       like parallel_read, but only for pages already resident in the
//                   segment (mincore): a lazily-allocated server pool is not forced
//                   into memory by mapping it.
//   auto:           resident (see benches/bench_copy.py "populate" tables).
enum class Populate {
  kAuto,
  kNone,
  kMapPopulate,
  kMadvise,
  kParallel,
  kParallelRead,
  kResident
};

Populate parse_populate(const std::string& name);  // ValueError on an unknown name
std::string populate_name(Populate p);

// Bare segment name ("/x" -> "x"); ValueError for "", "/", "a/b", "..", NUL, > 255 chars.
std::string validate_segment_name(const std::string& name);

class Mapping {
 public:
  // Open /dev/shm/<name> read-write and map all of it. `min_size` < 0: no size check;
  // else the segment must hold at least `min_size` bytes (ValueError).
  // OSError (FileNotFoundError, PermissionError, ...) when the segment cannot be opened.
  Mapping(const std::string& name, int64_t min_size, const std::string& populate);
  ~Mapping();
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  const std::string& name() const { return name_; }
  uint64_t size() const { return size_; }
  uintptr_t address() const;  // ValueError if closed
  bool closed() const { return closed_; }
  std::string populate_used() const { return populate_name(populate_used_); }
  double populate_seconds() const { return populate_seconds_; }

  // Validate slots and return their absolute addresses (see the Python docstring).
  std::vector<uintptr_t> regions(const std::vector<int64_t>& offsets,
                                 const std::vector<int64_t>& lengths, int64_t expected_nbytes,
                                 int64_t align) const;

  // Whether [addr, addr + n) lies inside the mapping.
  bool contains(uintptr_t addr, uint64_t n) const;

  // Whether most of a sample of the pages of [addr, addr + n) (inside the mapping) are
  // not allocated in the segment yet (mincore; false when unknown). Cheap: <= 8 pages.
  bool cold(uintptr_t addr, uint64_t n) const;
  // Bytes still free on the file system holding the segment (UINT64_MAX if unknown).
  uint64_t fs_free_bytes() const;
  // The open segment file (-1 once closed); valid while pinned.
  int fd() const { return fd_; }

  // Map the pages of [offset, offset + length) that the segment already has (mincore +
  // MADV_POPULATE_READ), so copies into them take no page fault. Call WITHOUT the GIL,
  // pinned, with a range inside the mapping. Returns the pages populated; never throws.
  uint64_t populate_resident_range(uint64_t offset, uint64_t length) const;

  // Keep the memory mapped while a copy runs (GIL held). ValueError if closed.
  void pin();
  void unpin();

  // Mark closed; unmaps now or when the last pin is released. Idempotent.
  void close();

 private:
  void unmap();
  // `allocated`: bytes the file has pages for (st_blocks * 512).
  void prefault(Populate mode, uint64_t allocated);

  std::string name_;
  int fd_ = -1;
  void* base_ = nullptr;
  uint64_t size_ = 0;
  int64_t pins_ = 0;
  bool closed_ = false;
  Populate populate_used_ = Populate::kNone;
  double populate_seconds_ = 0.0;
};

}  // namespace lmckv

// Result buffers: memory for tensors that a gather fills right after allocation.
//
// A fresh torch.empty() of hundreds of MiB is faulted page by page during the gather
// (~2 GB/s). ResultBuffer instead hands out an anonymous mapping populated on the pool
// threads before the gather (MADV_HUGEPAGE only with LMCACHE_KV_FAST_RESULT_THP=1: see
// huge_results()), and when the last tensor over it dies it goes into a bounded
// process-wide pool of already-faulted buffers, so the next result of a similar size
// (capacity classes: capacity_class()) is written at warm-memory speed. Python wraps a ResultBuffer with
// torch.frombuffer (buffer protocol); the tensor's storage holds a reference to it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace lmckv {

// Move-only owner of one anonymous private mapping.
class AnonRegion {
 public:
  AnonRegion() = default;
  // Map `len` bytes (a multiple of 2 MiB), 2 MiB aligned, MADV_HUGEPAGE if `huge`.
  // Throws std::bad_alloc when the kernel refuses.
  static AnonRegion map(size_t len, bool huge);
  ~AnonRegion();
  AnonRegion(AnonRegion&& o) noexcept;
  AnonRegion& operator=(AnonRegion&& o) noexcept;
  AnonRegion(const AnonRegion&) = delete;
  AnonRegion& operator=(const AnonRegion&) = delete;

  char* data() const { return addr_; }
  size_t size() const { return len_; }
  explicit operator bool() const { return addr_ != nullptr; }

 private:
  AnonRegion(char* a, size_t n) : addr_(a), len_(n) {}
  void reset();
  char* addr_ = nullptr;
  size_t len_ = 0;
};

// Strategy for buffers that the pool cannot serve.
//   none:     fault lazily (during the gather, in parallel on the copy threads).
//   populate: MADV_POPULATE_WRITE on the pool threads before returning.
//   ("auto" = populate, the measured best.)
enum class Prefault { kNone, kPopulate };
Prefault parse_prefault(const std::string& name);

class ResultBuffer {
 public:
  // `nbytes` >= 1. Reuses a pooled buffer of capacity in [nbytes, 2 * nbytes] or maps a
  // new one (call with the GIL released: mapping and pre-faulting may take a while).
  ResultBuffer(uint64_t nbytes, Prefault prefault, bool use_pool);
  ~ResultBuffer();  // returns the memory to the pool (or unmaps it)
  ResultBuffer(const ResultBuffer&) = delete;
  ResultBuffer& operator=(const ResultBuffer&) = delete;

  char* data() const { return region_.data(); }
  uint64_t nbytes() const { return nbytes_; }
  uint64_t capacity() const { return region_.size(); }
  bool recycled() const { return recycled_; }

 private:
  AnonRegion region_;
  uint64_t nbytes_;
  bool recycled_ = false;
  bool use_pool_ = true;
};

struct ResultPoolStats {
  uint64_t limit;
  uint64_t pooled_bytes;
  uint64_t entries;
  uint64_t hits;
  uint64_t misses;
  uint64_t evictions;
  uint64_t reserved;  // buffers mapped ahead by result_pool_reserve
};

ResultPoolStats result_pool_stats();
void set_result_pool_limit(uint64_t nbytes);  // evicts down to the new limit
// Ahead of a known batch of results: make the pool hold `count` free buffers that can
// serve a result of `nbytes` (the class capacity, every page populated on the calling
// thread, not the copy threads: it runs in the background while the caller waits for
// something else). Existing fitting buffers count; never beyond the pool limit. Call
// without the GIL. Returns the number of buffers mapped.
uint64_t result_pool_reserve(uint64_t nbytes, uint64_t count);
void result_pool_trim();                      // unmap every pooled buffer

void result_pool_atfork_prepare();
void result_pool_atfork_parent();
void result_pool_atfork_child();

}  // namespace lmckv

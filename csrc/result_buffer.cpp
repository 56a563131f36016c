#include "result_buffer.hpp"

#include <pybind11/pybind11.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

#include "common.hpp"
#include "thread_pool.hpp"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace lmckv {

namespace {

constexpr size_t kHuge = 2u << 20;

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

size_t page_size() {
  static const size_t size = [] {
    const long p = sysconf(_SC_PAGESIZE);
    return p > 0 ? static_cast<size_t>(p) : size_t{4096};
  }();
  return size;
}

// The capacity mapped for a request of n bytes: whole huge pages, and from 16 MiB up in
// quarter-power-of-two steps (16, 20, 24, 28, 32, 40, ... MiB), so results of nearby
// sizes share pooled regions. Without the classes a pool that served a 57.6 MiB edit
// (a 2,048-token stream with every 10th token dropped) held 58 MiB regions that no
// 64 MiB read could take: every rep of bench W6 mapped and faulted ~100 MiB afresh.
// At most 25% of a region is slack, faulted only when a result uses it.
size_t capacity_class(size_t n) {
  const size_t cap = round_up(n, kHuge);
  if (cap <= (16u << 20)) return cap;
  size_t top = size_t{1} << (63 - __builtin_clzll(static_cast<unsigned long long>(cap)));
  return round_up(cap, top / 4);
}

uint64_t default_limit() {
  if (const char* env = std::getenv("LMCACHE_KV_FAST_RESULT_POOL_MB")) {
    char* end = nullptr;
    const unsigned long long mb = std::strtoull(env, &end, 10);
    if (end != env && *end == '\0' && mb < (1ull << 44)) return mb << 20;
  }
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long psize = sysconf(_SC_PAGESIZE);
  const uint64_t phys =
      (pages > 0 && psize > 0) ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(psize)
                               : (8ull << 30);
  return std::min<uint64_t>(4ull << 30, phys / 8);
}

// Whether fresh result regions are advised MADV_HUGEPAGE (LMCACHE_KV_FAST_RESULT_THP=1).
// Off by default: on a VM whose balloon reports free memory to the host (virtio
// free page reporting, in 8 MiB blocks here: page_reporting_order=11), a huge page
// usually lies in a block the host discarded, and its first touch waits for the host to
// back all of it: populating 3 x 64 MiB took 0.01 s or 0.2-0.45 s (bimodal, 6 fresh
// processes) with MADV_HUGEPAGE against a steady 0.07-0.11 s with 4 KiB pages, and in
// bench W6 (32 KiB of KV per token) that wait was ~0.45 s of a 1.0-1.2 s modify. The
// copies into 4 KiB pages are as fast (sequential writes; the page walks are cached).
bool huge_results() {
  static const bool on = [] {
    const char* env = std::getenv("LMCACHE_KV_FAST_RESULT_THP");
    return env != nullptr && env[0] == '1' && env[1] == '\0';
  }();
  return on;
}

struct Pool {
  std::mutex mu;
  std::vector<AnonRegion> free;  // oldest first
  uint64_t limit = default_limit();
  uint64_t pooled = 0;
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t evictions = 0;
  uint64_t reserved = 0;
};

NoDestructor<Pool> g_pool;

// Take the smallest pooled region with capacity in [cap, 2 * cap].
AnonRegion take(size_t cap) {
  std::lock_guard<std::mutex> lk(g_pool->mu);
  size_t best = g_pool->free.size();
  for (size_t i = 0; i < g_pool->free.size(); ++i) {
    const size_t s = g_pool->free[i].size();
    if (s >= cap && s / 2 <= cap && (best == g_pool->free.size() || s < g_pool->free[best].size())) {
      best = i;
    }
  }
  if (best == g_pool->free.size()) {
    ++g_pool->misses;
    return AnonRegion();
  }
  AnonRegion r = std::move(g_pool->free[best]);
  g_pool->free.erase(g_pool->free.begin() + static_cast<std::ptrdiff_t>(best));
  g_pool->pooled -= r.size();
  ++g_pool->hits;
  return r;
}

// Evict oldest entries until `pooled + extra <= limit`; evicted regions are moved to
// `out` so they are unmapped after the lock is dropped.
void evict_locked(uint64_t extra, std::vector<AnonRegion>& out) {
  while (!g_pool->free.empty() && g_pool->pooled + extra > g_pool->limit) {
    g_pool->pooled -= g_pool->free.front().size();
    out.push_back(std::move(g_pool->free.front()));
    g_pool->free.erase(g_pool->free.begin());
    ++g_pool->evictions;
  }
}

// Unmap regions, without the GIL when we hold it (munmap of GiBs takes milliseconds).
void drop_regions(std::vector<AnonRegion>& regions) {
  if (regions.empty()) return;
  if (PyGILState_Check()) {
    pybind11::gil_scoped_release nogil;
    regions.clear();
  } else {
    regions.clear();
  }
}

void give_back(AnonRegion r) {
  std::vector<AnonRegion> dropped;
  {
    std::lock_guard<std::mutex> lk(g_pool->mu);
    if (r.size() <= g_pool->limit) {
      evict_locked(r.size(), dropped);
      g_pool->pooled += r.size();
      g_pool->free.push_back(std::move(r));
    } else {
      dropped.push_back(std::move(r));
    }
  }
  drop_regions(dropped);
}

}  // namespace

AnonRegion AnonRegion::map(size_t len, bool huge) {
  // Over-map by one huge page and trim, so the region is 2 MiB aligned (THP needs it).
  const size_t span = len + kHuge;
  void* p = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  char* raw = static_cast<char*>(p);
  char* aligned = reinterpret_cast<char*>(round_up(reinterpret_cast<uintptr_t>(raw), kHuge));
  const size_t head = static_cast<size_t>(aligned - raw);
  if (head > 0) munmap(raw, head);
  const size_t tail = span - head - len;
  if (tail > 0) munmap(aligned + len, tail);
  if (huge) madvise(aligned, len, MADV_HUGEPAGE);  // advisory; ignore failure
  return AnonRegion(aligned, len);
}

AnonRegion::~AnonRegion() { reset(); }

AnonRegion::AnonRegion(AnonRegion&& o) noexcept
    : addr_(std::exchange(o.addr_, nullptr)), len_(std::exchange(o.len_, 0)) {}

AnonRegion& AnonRegion::operator=(AnonRegion&& o) noexcept {
  if (this != &o) {
    reset();
    addr_ = std::exchange(o.addr_, nullptr);
    len_ = std::exchange(o.len_, 0);
  }
  return *this;
}

void AnonRegion::reset() {
  if (addr_ != nullptr) {
    munmap(addr_, len_);
    addr_ = nullptr;
    len_ = 0;
  }
}

Prefault parse_prefault(const std::string& name) {
  // "auto": measured in benches/bench_copy.py (gather->new rows): populating a fresh
  // buffer on the pool threads, then copying into warm pages, beats taking the (huge)
  // page faults inside the gather, and is much steadier.
  if (name == "auto" || name == "populate") return Prefault::kPopulate;
  if (name == "none") return Prefault::kNone;
  throw pybind11::value_error("unknown prefault mode '" + name +
                              "'; expected auto, none or populate");
}

ResultBuffer::ResultBuffer(uint64_t nbytes, Prefault prefault, bool use_pool)
    : nbytes_(nbytes), use_pool_(use_pool) {
  const size_t cap = capacity_class(static_cast<size_t>(nbytes));
  if (use_pool) {
    region_ = take(cap);
    recycled_ = static_cast<bool>(region_);
  }
  if (!region_) {
    region_ = AnonRegion::map(cap, huge_results());
    if (prefault == Prefault::kPopulate) {
      // The requested bytes only (whole pages: huge ones when results use them): the
      // class's slack is faulted if a later result uses it, so a 1.1 MiB result in its
      // 2 MiB region costs 1.1 MiB of memory, not 2.
      char* base = region_.data();
      const size_t page = huge_results() ? kHuge : page_size();
      const size_t want = round_up(static_cast<size_t>(nbytes), page);
      const uint64_t pages = want / page;
      run_parallel(want, 1 << 20, [&](int part, int nparts) {
        const uint64_t c0 = pages * static_cast<uint64_t>(part) / static_cast<uint64_t>(nparts);
        const uint64_t c1 =
            pages * static_cast<uint64_t>(part + 1) / static_cast<uint64_t>(nparts);
        if (c1 > c0) madvise(base + c0 * page, (c1 - c0) * page, MADV_POPULATE_WRITE);
      });
    }
  }
}

ResultBuffer::~ResultBuffer() {
  if (!region_) return;
  if (use_pool_) {
    give_back(std::move(region_));
  } else {
    std::vector<AnonRegion> one;
    one.push_back(std::move(region_));
    drop_regions(one);
  }
}

ResultPoolStats result_pool_stats() {
  std::lock_guard<std::mutex> lk(g_pool->mu);
  return ResultPoolStats{g_pool->limit, g_pool->pooled,    g_pool->free.size(), g_pool->hits,
                         g_pool->misses, g_pool->evictions, g_pool->reserved};
}

uint64_t result_pool_reserve(uint64_t nbytes, uint64_t count) {
  if (nbytes == 0 || count == 0) return 0;
  const size_t cap = capacity_class(static_cast<size_t>(nbytes));
  uint64_t missing = 0;
  {
    std::lock_guard<std::mutex> lk(g_pool->mu);
    uint64_t have = 0;
    for (const AnonRegion& r : g_pool->free) {
      if (r.size() >= cap && r.size() / 2 <= cap) ++have;  // what take(cap) would accept
    }
    const uint64_t room = g_pool->limit / cap;  // never more than the limit holds
    const uint64_t want = std::min<uint64_t>(count, room);
    missing = want > have ? want - have : 0;
  }
  uint64_t mapped = 0;
  for (; mapped < missing; ++mapped) {
    AnonRegion r;
    try {
      r = AnonRegion::map(cap, huge_results());
    } catch (const std::bad_alloc&) {
      break;  // the kernel refused: the results will map their own later (or fail then)
    }
    madvise(r.data(), r.size(), MADV_POPULATE_WRITE);  // advisory: faults later if refused
    {
      std::lock_guard<std::mutex> lk(g_pool->mu);
      ++g_pool->reserved;
    }
    give_back(std::move(r));
  }
  return mapped;
}

void set_result_pool_limit(uint64_t nbytes) {
  std::vector<AnonRegion> dropped;
  {
    std::lock_guard<std::mutex> lk(g_pool->mu);
    g_pool->limit = nbytes;
    evict_locked(0, dropped);
  }
  drop_regions(dropped);
}

void result_pool_trim() {
  std::vector<AnonRegion> dropped;
  {
    std::lock_guard<std::mutex> lk(g_pool->mu);
    dropped = std::move(g_pool->free);
    g_pool->free.clear();
    g_pool->pooled = 0;
  }
  drop_regions(dropped);
}

void result_pool_atfork_prepare() { g_pool->mu.lock(); }
void result_pool_atfork_parent() { g_pool->mu.unlock(); }
void result_pool_atfork_child() { g_pool->mu.unlock(); }

}  // namespace lmckv

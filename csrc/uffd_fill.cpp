#include "uffd_fill.hpp"

#include <errno.h>
#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>

#include "thread_pool.hpp"

#if defined(__linux__) && defined(__NR_userfaultfd) && __has_include(<linux/userfaultfd.h>)
#include <linux/userfaultfd.h>
#define LMCKV_HAVE_UFFD 1
#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1
#endif
#endif

namespace lmckv {

namespace {

// LMCACHE_KV_FAST_COLD_UFFD=0 turns fills off from the start (set_uffd_enabled() later).
bool enabled_by_env() {
  const char* v = std::getenv("LMCACHE_KV_FAST_COLD_UFFD");
  return v == nullptr || std::string(v) != "0";
}

std::atomic<bool> g_enabled{enabled_by_env()};
std::atomic<bool> g_unavailable{false};
std::atomic<int> g_fault{0};

// Each UFFDIO_COPY places at most this much (the pool hands these out dynamically).
constexpr uint64_t kPiece = 2ull << 20;

#ifdef LMCKV_HAVE_UFFD
std::mutex g_mu;
int g_fd = -1;    // guarded by g_mu
pid_t g_pid = 0;  // process that opened g_fd (a forked child opens its own)

// The process's userfaultfd, opened on first use; -1 (and unavailable) if it cannot be.
int uffd_fd() {
  std::lock_guard<std::mutex> lk(g_mu);
  const pid_t pid = getpid();
  if (g_fd >= 0 && g_pid == pid) return g_fd;
  if (g_fd >= 0) {  // inherited over fork: it tracks the parent's address space
    close(g_fd);
    g_fd = -1;
  }
  int fd = static_cast<int>(syscall(__NR_userfaultfd, O_CLOEXEC | UFFD_USER_MODE_ONLY));
  if (fd < 0 && errno == EINVAL) {  // kernel < 5.11: no user-mode-only flag
    fd = static_cast<int>(syscall(__NR_userfaultfd, O_CLOEXEC));
  }
  if (fd < 0) {
    g_unavailable.store(true);
    return -1;
  }
  uffdio_api api{};
  api.api = UFFD_API;
  api.features = 0;
  if (ioctl(fd, UFFDIO_API, &api) != 0 ||
      (api.ioctls & (1ull << _UFFDIO_REGISTER)) == 0) {
    close(fd);
    g_unavailable.store(true);
    return -1;
  }
  g_fd = fd;
  g_pid = pid;
  return fd;
}

// Registered ranges of one fill; unregistered (waking any waiting fault) on destruction.
class Registration {
 public:
  explicit Registration(int fd) : fd_(fd) {}
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;
  ~Registration() {
    for (const auto& r : ranges_) {
      uffdio_range range{r.first, r.second};
      (void)ioctl(fd_, UFFDIO_UNREGISTER, &range);
    }
  }
  bool add(uintptr_t start, uint64_t len) {
    uffdio_register reg{};
    reg.range.start = start;
    reg.range.len = len;
    reg.mode = UFFDIO_REGISTER_MODE_MISSING;
    if (ioctl(fd_, UFFDIO_REGISTER, &reg) != 0) return false;
    ranges_.emplace_back(start, len);
    if ((reg.ioctls & (1ull << _UFFDIO_COPY)) == 0) {
      errno = EOPNOTSUPP;
      return false;
    }
    return true;
  }

 private:
  int fd_;
  std::vector<std::pair<uintptr_t, uint64_t>> ranges_;
};

// Place one piece; returns bytes placed, sets *err on a failure that leaves the rest.
uint64_t copy_piece(int fd, char* dst, const char* src, uint64_t len, uint64_t page, int* err) {
  uint64_t done = 0;
  int again = 0;
  const int fault = g_fault.load(std::memory_order_relaxed);
  uint64_t limit = len;
  if (fault != 0) limit = (len / 2) / page * page;  // testing: fail half way
  while (done < limit) {
    uffdio_copy c{};
    c.dst = reinterpret_cast<uintptr_t>(dst + done);
    c.src = reinterpret_cast<uintptr_t>(src + done);
    c.len = limit - done;
    c.mode = 0;
    if (ioctl(fd, UFFDIO_COPY, &c) == 0) {
      done = limit;
      break;
    }
    const int e = errno;
    if (c.copy > 0) done += static_cast<uint64_t>(c.copy);
    if (e == EAGAIN && ++again < 1000) continue;  // the address space changed: retry
    *err = e;
    return done;
  }
  if (fault != 0 && done < len) *err = fault;
  return done;
}
#endif

}  // namespace

bool uffd_enabled() { return g_enabled.load(); }
bool uffd_unavailable() { return g_unavailable.load(); }
bool uffd_usable() { return g_enabled.load() && !g_unavailable.load(); }
void set_uffd_fault(int err) { g_fault.store(err); }
void set_uffd_enabled(bool on) {
  g_enabled.store(on);
  if (on) g_unavailable.store(false);  // try again (e.g. after a sysctl change)
}

bool uffd_fill(const std::vector<std::pair<uintptr_t, uint64_t>>& ranges,
               const std::vector<FillJob>& jobs, FillResult* out) {
#ifndef LMCKV_HAVE_UFFD
  (void)ranges;
  (void)jobs;
  (void)out;
  g_unavailable.store(true);
  return false;
#else
  if (!uffd_usable() || ranges.empty()) return false;
  const int fd = uffd_fd();
  if (fd < 0) return false;
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  Registration reg(fd);
  for (const auto& r : ranges) {
    if (r.first % page != 0 || r.second % page != 0 || r.second == 0) return false;
    if (!reg.add(r.first, r.second)) {
      // Out of memory or of mappings (each registration splits a VMA): this fill only.
      // Anything else (e.g. a kernel without shmem support): stop trying.
      if (errno != ENOMEM) g_unavailable.store(true);
      return false;
    }
  }
  // Pieces of at most kPiece, handed out to the pool's tasks in order.
  struct Piece {
    size_t job;
    uint64_t off;
    uint64_t len;
  };
  std::vector<Piece> pieces;
  uint64_t total = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    for (uint64_t off = 0; off < jobs[j].len; off += kPiece) {
      pieces.push_back(Piece{j, off, std::min(kPiece, jobs[j].len - off)});
    }
    total += jobs[j].len;
  }
  const int max_tasks = static_cast<int>(std::min<size_t>(pieces.size(), 1024));
  if (max_tasks == 0) return true;
  std::vector<std::vector<FillJob>> rest(static_cast<size_t>(max_tasks));
  std::vector<int> errs(static_cast<size_t>(max_tasks), 0);
  std::vector<uint64_t> filled(static_cast<size_t>(max_tasks), 0);
  run_parallel(total, max_tasks, [&](int task, int ntasks) {
    const size_t a = pieces.size() * static_cast<size_t>(task) / static_cast<size_t>(ntasks);
    const size_t b = pieces.size() * static_cast<size_t>(task + 1) / static_cast<size_t>(ntasks);
    const auto t = static_cast<size_t>(task);
    for (size_t k = a; k < b; ++k) {
      const Piece& p = pieces[k];
      const FillJob& job = jobs[p.job];
      char* d = job.dst + p.off;
      const char* s = job.src + p.off;
      int err = 0;
      const uint64_t done = copy_piece(fd, d, s, p.len, page, &err);
      filled[t] += done;
      if (done < p.len) {
        rest[t].push_back(FillJob{d + done, s + done, p.len - done, job.tag});
        if (err != 0 && err != EEXIST && errs[t] == 0) errs[t] = err;
      }
    }
  });
  for (size_t t = 0; t < rest.size(); ++t) {
    out->filled += filled[t];
    out->rest.insert(out->rest.end(), rest[t].begin(), rest[t].end());
    if (out->err == 0) out->err = errs[t];
  }
  return true;  // ~Registration unregisters before the caller copies the rest
#endif
}

}  // namespace lmckv

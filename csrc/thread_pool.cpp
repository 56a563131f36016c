#include "thread_pool.hpp"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <string>

#include "common.hpp"
#include "result_buffer.hpp"

namespace lmckv {

ThreadPool::ThreadPool(int nthreads) : nthreads_(std::max(1, nthreads)) {
  workers_.reserve(static_cast<size_t>(nthreads_ - 1));
  for (int i = 1; i < nthreads_; ++i) {
    workers_.emplace_back([this, i] { worker_loop(i); });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  for (auto& t : workers_) {
    if (t.joinable()) t.join();
  }
}

void ThreadPool::run(int nthreads, int ntasks, const PartFn& fn) {
  nthreads = std::clamp(nthreads, 1, nthreads_);
  if (ntasks <= 0) return;
  if (nthreads == 1 || ntasks == 1) {
    for (int t = 0; t < ntasks; ++t) fn(t, ntasks);
    return;
  }
  uint32_t gen = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    gen = ++generation_;
    invited_ = nthreads - 1;
    ntasks_ = ntasks;
    fn_ = &fn;
    done_.store(0, std::memory_order_relaxed);
    ticket_.store(static_cast<uint64_t>(gen) << 32, std::memory_order_release);
  }
  cv_work_.notify_all();
  work(gen, ntasks, &fn);
  // Wait for tasks other threads took: spin briefly (they are usually nearly done),
  // then sleep.
  for (int spin = 0; spin < 2000; ++spin) {
    if (done_.load(std::memory_order_acquire) == ntasks) return;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  std::unique_lock<std::mutex> lk(mu_);
  cv_done_.wait(lk, [&] { return done_.load(std::memory_order_acquire) == ntasks; });
}

void ThreadPool::work(uint32_t gen, int ntasks, const PartFn* fn) {
  for (;;) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    for (;;) {
      if (static_cast<uint32_t>(t >> 32) != gen ||
          static_cast<int64_t>(t & 0xffffffffu) >= ntasks) {
        return;
      }
      if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) break;
    }
    (*fn)(static_cast<int>(t & 0xffffffffu), ntasks);
    if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == ntasks) {
      std::lock_guard<std::mutex> lk(mu_);  // pairs with the caller's predicate check
      cv_done_.notify_one();
    }
  }
}

void ThreadPool::worker_loop(int index) {
  uint32_t seen = 0;
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_work_.wait(lk, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    if (index > invited_) continue;
    // *fn_ is alive while a task of generation `seen` is unfinished, and work() only
    // dereferences it after winning such a task (a late wake-up finds none left).
    const PartFn* fn = fn_;
    const int ntasks = ntasks_;
    lk.unlock();
    work(seen, ntasks, fn);
    lk.lock();
  }
}

namespace {

// Measured on a 2-core Sapphire Rapids VM (benches/bench_copy.py, "threshold" table):
// below ~1 MiB the wake-up of a sleeping worker costs more than the second core saves.
constexpr uint64_t kDefaultParallelThreshold = 1024 * 1024;
constexpr int kTasksPerThread = 4;
constexpr uint64_t kMinTaskBytes = 256 * 1024;

int default_threads() {
  if (const char* env = std::getenv("LMCACHE_KV_FAST_THREADS")) {
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && v >= 1 && v <= kMaxThreads) return static_cast<int>(v);
  }
  return std::min(usable_cpus(), kMaxThreads);
}

struct PoolState {
  std::mutex mu;  // held for the whole of a pool job and while resizing
  std::unique_ptr<ThreadPool> pool;
  std::atomic<int> threads{0};  // 0 = not yet resolved
  std::atomic<uint64_t> threshold{kDefaultParallelThreshold};
};

NoDestructor<PoolState> g_state;
thread_local int t_call_threads = 0;  // 0: no cap
std::atomic<uint64_t> g_pool_jobs{0};

int resolved_threads() {
  int n = g_state->threads.load(std::memory_order_relaxed);
  if (n == 0) {
    int expected = 0;
    n = default_threads();
    if (!g_state->threads.compare_exchange_strong(expected, n)) n = expected;
  }
  return n;
}

void atfork_prepare() {
  g_state->mu.lock();
  result_pool_atfork_prepare();
}

void atfork_parent() {
  result_pool_atfork_parent();
  g_state->mu.unlock();
}

void atfork_child() {
  result_pool_atfork_child();
  // The workers do not exist in the child; their std::thread objects must not be
  // joined or destroyed (that would terminate), so the old pool is leaked on purpose.
  (void)g_state->pool.release();
  g_state->mu.unlock();
}

}  // namespace

int get_threads() { return resolved_threads(); }

void set_threads(int n) {
  if (n < 1 || n > kMaxThreads) {
    throw pybind11::value_error("thread count must be in [1, " + std::to_string(kMaxThreads) +
                                "], got " + std::to_string(n));
  }
  // The pool itself is only rebuilt (lazily) when it has fewer threads than requested:
  // lowering the count just leaves the extra workers asleep, so switching back and forth
  // costs no thread creation inside a timed copy.
  g_state->threads.store(n);
}

uint64_t get_parallel_threshold() { return g_state->threshold.load(); }

void set_parallel_threshold(uint64_t nbytes) { g_state->threshold.store(nbytes); }

void set_call_threads(int n) {
  if (n < 0 || n > kMaxThreads) {
    throw pybind11::value_error("call thread cap must be in [0, " + std::to_string(kMaxThreads) +
                                "] (0: none), got " + std::to_string(n));
  }
  t_call_threads = n;
}

int get_call_threads() { return t_call_threads; }

uint64_t pool_jobs() { return g_pool_jobs.load(std::memory_order_relaxed); }

int run_parallel(uint64_t nbytes, int max_tasks, const PartFn& fn) {
  const int cap = t_call_threads > 0 ? t_call_threads : kMaxThreads;
  const int n = std::min({resolved_threads(), cap, std::max(1, max_tasks)});
  if (n <= 1 || nbytes < g_state->threshold.load(std::memory_order_relaxed)) {
    fn(0, 1);
    return 1;
  }
  std::unique_lock<std::mutex> lk(g_state->mu, std::try_to_lock);
  if (!lk.owns_lock()) {  // pool busy with another caller's job: copy on this thread
    fn(0, 1);
    return 1;
  }
  if (!g_state->pool || g_state->pool->size() < n) {
    g_state->pool.reset();
    g_state->pool = std::make_unique<ThreadPool>(n);
  }
  const uint64_t by_size = std::max<uint64_t>(static_cast<uint64_t>(n), nbytes / kMinTaskBytes);
  const int ntasks = static_cast<int>(std::min<uint64_t>(
      {by_size, static_cast<uint64_t>(n) * kTasksPerThread, static_cast<uint64_t>(max_tasks)}));
  g_pool_jobs.fetch_add(1, std::memory_order_relaxed);
  g_state->pool->run(n, ntasks, fn);
  return ntasks;
}

void install_fork_handlers() {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(atfork_prepare, atfork_parent, atfork_child); });
}

int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const unsigned hc = std::thread::hardware_concurrency();
  return hc > 0 ? static_cast<int>(hc) : 1;
}

}  // namespace lmckv

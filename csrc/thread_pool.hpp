// Persistent copy thread pool.
//
// One process-wide pool of `n - 1` worker threads; the calling thread is participant 0,
// so a job runs on `n` threads in total. The pool is created lazily on the first
// parallel job and re-created by set_threads() or after fork() (threads do not survive
// fork; the child builds a fresh pool on first use).
// Work is split by bytes, not by runs: see CopyPlan in copy_kernels.hpp.
//
// Concurrency policy: the pool serves one job at a time. A caller that finds the pool
// busy (another Python thread is copying with the GIL released) does NOT wait: it runs
// its whole job on its own thread. Both copies make progress at once, memory bandwidth
// is shared, and no thread ever blocks on another's copy (which also makes the pool
// immune to deadlock through the GIL).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace lmckv {

// Job body: called as fn(task, ntasks) for every task in [0, ntasks). Must not throw
// (it runs on worker threads).
using PartFn = std::function<void(int, int)>;

class ThreadPool {
 public:
  explicit ThreadPool(int nthreads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return nthreads_; }

  // Run fn(task, ntasks) for every task on up to `nthreads` threads (the caller is one of
  // them). Tasks are handed out dynamically through a generation-tagged ticket, so a
  // worker that wakes up late (descheduled on a busy machine) simply finds fewer tasks
  // left and the caller never waits for a thread that has not started.
  // Not re-entrant: callers serialise (see run_parallel()).
  void run(int nthreads, int ntasks, const PartFn& fn);

 private:
  void worker_loop(int index);
  void work(uint32_t gen, int ntasks, const PartFn* fn);

  const int nthreads_;
  std::mutex mu_;
  std::condition_variable cv_work_;
  std::condition_variable cv_done_;
  uint32_t generation_ = 0;  // guarded by mu_
  int invited_ = 0;          // workers 1..invited_ take part in the current job
  int ntasks_ = 0;
  const PartFn* fn_ = nullptr;
  bool stop_ = false;
  std::atomic<uint64_t> ticket_{0};  // (generation << 32) | next task index
  std::atomic<int> done_{0};         // tasks finished in the current job
  std::vector<std::thread> workers_;
};

// Upper bound of the thread count: CPU_SETSIZE, the most CPUs the affinity mask read by
// usable_cpus() can name, so more copy threads could never run at once; and the pool
// creates every requested thread on the next large copy, so an unbounded count would
// exhaust the process's thread and stack limits in the middle of a copy.
constexpr int kMaxThreads = 1024;

// Configured thread count (LMCACHE_KV_FAST_THREADS, else usable CPUs).
int get_threads();
// Set the thread count (1..kMaxThreads). The pool grows lazily when a job needs more
// threads than it has; a lower count leaves surplus workers asleep. ValueError outside.
void set_threads(int n);

// The calling thread's cap on the threads of its own copies (0: none, the configured
// count applies): a caller that already runs alongside its peers on every free core (the
// batched rewrite, batch/_cores.py) keeps its copies to itself. Thread-local.
void set_call_threads(int n);
int get_call_threads();
// Jobs run on the pool so far (process total; tests and benches).
uint64_t pool_jobs();

// Jobs of fewer bytes than this run on the calling thread only.
uint64_t get_parallel_threshold();
void set_parallel_threshold(uint64_t nbytes);

// Run fn over equal-sized tasks (at most `max_tasks`; about kTasksPerThread per thread,
// none smaller than 256 KiB): on the pool if `nbytes` reaches the parallel threshold and
// the pool is free, else as fn(0, 1) on the calling thread. Must be called WITHOUT the
// GIL. Returns the number of tasks used.
int run_parallel(uint64_t nbytes, int max_tasks, const PartFn& fn);

// Install pthread_atfork handlers (idempotent).
void install_fork_handlers();

}  // namespace lmckv

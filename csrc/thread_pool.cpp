#include "thread_pool.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace fastckpt {

namespace {

// More parts than this run on fewer threads (each worker takes several).
constexpr unsigned kMaxWorkers = 64;

struct Batch {
  std::mutex mu;
  std::condition_variable cv;
  unsigned left = 0;
  std::exception_ptr error;

  void finish(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu);
    if (e && !error) error = e;
    if (--left == 0) cv.notify_all();
  }
};

struct Job {
  const std::function<void(unsigned)>* part;
  unsigned index;
  Batch* batch;
};

void run_job(const Job& job) {
  std::exception_ptr error;
  try {
    (*job.part)(job.index);
  } catch (...) {
    error = std::current_exception();
  }
  job.batch->finish(error);
}

// Never destroyed: destroying joinable threads terminates the process, and at exit the
// workers simply sleep on their condition variable.
class Pool {
 public:
  // Queues jobs, starting workers up to `wanted`; returns how many jobs were queued (the
  // rest, from the end of `jobs`, are the caller's to run).
  size_t queue(std::vector<Job>& jobs, unsigned wanted) {
    std::lock_guard<std::mutex> lock(mu_);
    while (workers_.size() < std::min(wanted, kMaxWorkers)) {
      try {
        std::thread t([this] { work(); });
        t.detach();
        workers_.push_back(1);
      } catch (...) {
        break;  // no thread to be had: fewer workers, or none
      }
    }
    if (workers_.empty()) return 0;
    size_t queued = 0;
    try {
      for (const Job& job : jobs) {
        jobs_.push_back(job);
        ++queued;
      }
    } catch (...) {  // out of memory: the caller runs what is not queued
    }
    cv_.notify_all();
    return queued;
  }

 private:
  void work() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return !jobs_.empty(); });
        job = jobs_.front();
        jobs_.pop_front();
      }
      run_job(job);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  std::vector<char> workers_;  // one entry per started (detached) worker
};

std::atomic<Pool*> g_pool{nullptr};
std::once_flag g_atfork_once;

Pool& pool() {
  std::call_once(g_atfork_once, [] {
    // The workers do not exist in a forked child: it starts a pool of its own (the parent's
    // is leaked there, its mutex possibly held by a thread that did not survive).
    pthread_atfork(nullptr, nullptr, [] { g_pool.store(nullptr); });
  });
  Pool* p = g_pool.load();
  if (p) return *p;
  auto* fresh = new Pool();
  if (g_pool.compare_exchange_strong(p, fresh)) return *fresh;
  delete fresh;
  return *p;
}

}  // namespace

void run_parts(unsigned parts, const std::function<void(unsigned)>& part) {
  if (parts <= 1) {
    if (parts == 1) part(0);
    return;
  }
  Batch batch;
  batch.left = parts;
  std::vector<Job> jobs;
  size_t queued = 0;
  try {
    jobs.reserve(parts - 1);
    for (unsigned i = 1; i < parts; ++i) jobs.push_back({&part, i, &batch});
    queued = pool().queue(jobs, parts - 1);
  } catch (...) {  // out of memory: every part not queued runs here
  }
  for (unsigned i = static_cast<unsigned>(queued) + 1; i < parts; ++i) run_job({&part, i, &batch});
  run_job({&part, 0, &batch});
  // Every part must be over before `batch` and `part` go out of scope.
  std::unique_lock<std::mutex> lock(batch.mu);
  batch.cv.wait(lock, [&] { return batch.left == 0; });
  if (batch.error) std::rethrow_exception(batch.error);
}

}  // namespace fastckpt

// A pool of threads doing plain pread/pwrite: works everywhere, including where the
// kernel's asynchronous interfaces are disabled (containers, gVisor).
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <system_error>
#include <thread>

#include "engine.h"
#include "io_error.h"

namespace fastckpt {
namespace {

// Enough threads to keep a fast device busy without one thread per queue slot.
constexpr unsigned kMaxThreads = 16;

class ThreadsEngine final : public Engine {
 public:
  explicit ThreadsEngine(unsigned depth) {
    unsigned n = std::max(1u, std::min(depth, kMaxThreads));
    done_.reserve(std::max(1u, depth));  // so a worker's push_back never allocates (or throws)
    workers_.reserve(n);
    // Fewer threads than asked (the system refused more) only cost parallelism. With none,
    // throw: no thread has started, so there is nothing to join.
    for (unsigned i = 0; i < n; ++i) {
      try {
        workers_.emplace_back([this] { run(); });
      } catch (const std::exception& e) {
        if (!workers_.empty()) break;
        if (auto* se = dynamic_cast<const std::system_error*>(&e))
          throw IoError(se->code().value(), "starting an I/O thread");
        throw;
      }
    }
  }

  ~ThreadsEngine() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  void prepare(Request* r) override { prepared_.push_back(r); }

  void flush() override {
    if (prepared_.empty()) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // All or nothing: if the queue cannot grow, the requests stay prepared for next time.
      size_t added = 0;
      try {
        for (Request* r : prepared_) {
          queue_.push_back(r);
          ++added;
        }
      } catch (...) {
        for (; added > 0; --added) queue_.pop_back();
        throw;
      }
    }
    prepared_.clear();
    work_cv_.notify_all();
  }

  void reap(size_t min_complete, std::vector<Completion>& out) override {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return done_.size() >= min_complete; });
    out.insert(out.end(), done_.begin(), done_.end());
    done_.clear();
  }

 private:
  void run() {
    for (;;) {
      Request* r;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        r = queue_.front();
        queue_.pop_front();
      }
      ssize_t n = r->write ? pwrite(r->fd, r->buf, r->len, static_cast<off_t>(r->offset))
                           : pread(r->fd, r->buf, r->len, static_cast<off_t>(r->offset));
      int64_t result = n < 0 ? -errno : n;
      {
        std::lock_guard<std::mutex> lock(mu_);
        done_.push_back({r, result});
      }
      done_cv_.notify_one();
    }
  }

  std::vector<std::thread> workers_;
  std::vector<Request*> prepared_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Request*> queue_;
  std::vector<Completion> done_;
  bool stopping_ = false;
};

}  // namespace

std::unique_ptr<Engine> make_threads(unsigned depth) {
  return std::make_unique<ThreadsEngine>(depth);
}

namespace {

class FailingEngine final : public Engine {
 public:
  explicit FailingEngine(unsigned depth) : inner_(depth) {}
  void prepare(Request* r) override { inner_.prepare(r); }
  void flush() override { inner_.flush(); }
  void reap(size_t, std::vector<Completion>&) override {
    throw IoError(EIO, "reaping completions (an engine failure injected for tests)");
  }

 private:
  ThreadsEngine inner_;
};

}  // namespace

std::unique_ptr<Engine> make_failing(unsigned depth) {
  return std::make_unique<FailingEngine>(depth);
}

EngineKind parse_engine_kind(const std::string& name) {
  if (name == "io_uring") return EngineKind::io_uring;
  if (name == "libaio") return EngineKind::libaio;
  if (name == "threads") return EngineKind::threads;
  if (name == "_failing") return EngineKind::failing;
  throw std::invalid_argument("unknown engine '" + name + "' (io_uring, libaio, threads)");
}

std::unique_ptr<Engine> make_engine(EngineKind kind, unsigned depth) {
  switch (kind) {
    case EngineKind::io_uring:
      return make_io_uring(depth);
    case EngineKind::libaio:
      return make_libaio(depth);
    case EngineKind::threads:
      return make_threads(depth);
    case EngineKind::failing:
      return make_failing(depth);
  }
  throw std::invalid_argument("bad engine kind");
}

}  // namespace fastckpt

#include "executor.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <system_error>

#include "alignment.h"
#include "io_error.h"

namespace fastckpt {

struct Executor::Op {
  OpSpec spec;
  unsigned parts_left = 0;
  bool done = false;
  int err = 0;  // first error met by any part
  std::string err_what;
};

struct Executor::Task {
  std::shared_ptr<Op> op;
  uint64_t begin = 0;  // byte range of the op, relative to spec.ptr / spec.offset
  uint64_t end = 0;
};

namespace {

// Bounce buffers cost block_size each; cap how many a worker keeps in flight.
constexpr unsigned kMaxBounceSlots = 8;
// A request answered EINTR/EAGAIN this many times in a row fails with that errno.
constexpr unsigned kMaxRetries = 64;
// An engine whose flush/reap fails this many rounds in a row (about 2 s of backoff) is
// given up: the op fails with the engine's errno instead of waiting forever.
constexpr unsigned kMaxFailedRounds = 24;

uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }
uint64_t round_down(uint64_t x, uint64_t a) { return x / a * a; }

// The file range that O_DIRECT and buffered requests of one op never share: a page at
// least. A device may take O_DIRECT at 512 bytes, but a buffered head or tail dirties a
// whole page of the page cache; an O_DIRECT write into the rest of that page at the same
// time then fails to invalidate it ("Page cache invalidation failure on direct I/O"), and
// the stale page is what reads see and writeback stores (the O_DIRECT bytes lost).
uint64_t page_granule(uint64_t a) {
  static const uint64_t page = [] {
    const long p = sysconf(_SC_PAGESIZE);
    return p > 0 ? static_cast<uint64_t>(p) : kDirectIoAlignment;
  }();
  return a >= page && a % page == 0 ? a : round_up(std::max(a, page), a);
}

struct Slot {
  Request req;
  uint64_t rel = 0;         // position of the chunk within the op
  uint64_t len = 0;         // chunk length
  uint64_t done = 0;        // bytes already moved
  bool direct = false;      // through the O_DIRECT descriptor
  bool use_bounce = false;  // staged through `bounce` (memory not aligned)
  char* bounce = nullptr;   // owned by the slot, allocated on first use
  unsigned retries = 0;     // EINTR/EAGAIN results in a row
};

std::string describe(const OpSpec& s, uint64_t len, uint64_t offset) {
  return std::string(s.write ? "write of " : "read of ") + std::to_string(len) +
         " bytes at offset " + std::to_string(offset);
}

// After the engine itself failed (flush/reap threw) with requests still in flight: those
// requests may still write into memory the executor owns or was lent, so the only safe way
// out is to collect them. Wait a little before each new try, so a persistent failure costs
// sleep, not CPU.
void backoff(unsigned failed_rounds, unsigned in_flight) {
  if (in_flight == 0) return;
  const unsigned ms = std::min(100u, 1u << std::min(failed_rounds, 7u));
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

// `make()`'s text, or "" where building it runs out of memory: the errno says enough then.
template <typename F>
std::string message_or_empty(F make) noexcept {
  try {
    return make();
  } catch (...) {
    return std::string();
  }
}

}  // namespace

Executor::Executor(const ExecutorConfig& config) : config_(config) {
  if (config_.parallelism == 0) config_.parallelism = 1;
  if (config_.queue_depth == 0) config_.queue_depth = 1;
  // Engines are built here, on the caller's thread, so a failure surfaces as an exception.
  for (unsigned i = 0; i < config_.parallelism; ++i)
    engines_.push_back(make_engine(config_.engine, config_.queue_depth));
  // Any worker runs any part of any op, so fewer threads than asked (the system refused
  // more) only cost parallelism. With none, throw: nothing has started that needs joining.
  workers_.reserve(config_.parallelism);
  for (unsigned i = 0; i < config_.parallelism; ++i) {
    try {
      workers_.emplace_back([this, i] { worker_main(i); });
    } catch (const std::exception& e) {
      if (!workers_.empty()) break;
      if (auto* se = dynamic_cast<const std::system_error*>(&e))
        throw IoError(se->code().value(), "starting an I/O worker thread");
      throw;
    }
  }
}

Executor::~Executor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

uint64_t Executor::submit(const OpSpec& spec) {
  auto op = std::make_shared<Op>();
  op->spec = spec;
  const uint64_t a = spec.alignment ? spec.alignment : kDirectIoAlignment;
  op->spec.alignment = a;
  // Every file offset of the op, rounded up to the alignment, must fit an off_t; so must
  // the memory range. Checked here so the arithmetic below cannot wrap.
  constexpr uint64_t kMaxOff = static_cast<uint64_t>(INT64_MAX);
  if (a > kMaxOff || spec.len > kMaxOff - a || spec.offset > kMaxOff - a - spec.len) {
    throw IoError(EOVERFLOW,
                  "the byte range of a " + describe(spec, spec.len, spec.offset) +
                      " goes past the largest file offset",
                  spec.path);
  }
  if (spec.len > UINTPTR_MAX - reinterpret_cast<uintptr_t>(spec.ptr)) {
    throw IoError(EINVAL,
                  "the memory of a " + describe(spec, spec.len, spec.offset) +
                      " wraps around the address space",
                  spec.path);
  }
  const unsigned parts =
      spec.max_parts ? std::min(spec.max_parts, config_.parallelism) : config_.parallelism;
  // Parts end on page-granule file offsets so that each keeps its blocks O_DIRECT-able and
  // no two parts share a page (one buffered, the other direct).
  const uint64_t g = page_granule(a);
  const uint64_t share = spec.len / parts + (spec.len % parts != 0);
  std::vector<Task> tasks;
  uint64_t begin = 0;
  for (unsigned k = 1; k <= parts && begin < spec.len; ++k) {
    // k * share < len + parts, and offset + len + a <= INT64_MAX: nothing below wraps.
    uint64_t end = k == parts
                       ? spec.len
                       : std::min(spec.len, round_up(spec.offset + k * share, g) - spec.offset);
    if (end <= begin) continue;
    tasks.push_back({op, begin, end});
    begin = end;
  }
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_id_;
  op->parts_left = static_cast<unsigned>(tasks.size());
  op->done = tasks.empty();
  auto slot = ops_.emplace(id, op).first;
  // All or nothing (workers cannot take a task while the lock is held): an op with only
  // some of its parts queued would never finish.
  size_t queued = 0;
  try {
    for (auto& t : tasks) {
      tasks_.push_back(t);
      ++queued;
    }
  } catch (...) {
    for (; queued > 0; --queued) tasks_.pop_back();
    ops_.erase(slot);
    throw;
  }
  ++next_id_;
  if (!tasks.empty()) work_cv_.notify_all();
  return id;
}

void Executor::wait(uint64_t id) {
  std::shared_ptr<Op> op;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = ops_.find(id);
    if (it == ops_.end()) {
      throw std::invalid_argument("no pending op with id " + std::to_string(id) +
                                  " (never submitted, or already waited for)");
    }
    op = it->second;
    done_cv_.wait(lock, [&] { return op->done; });
    // Another thread may have collected the op (wait(id), wait_all()) while this one slept,
    // which invalidates `it`: look the id up again. Only the collector raises its error.
    it = ops_.find(id);
    if (it == ops_.end() || it->second != op) return;
    ops_.erase(it);
  }
  if (op->err) throw IoError(op->err, op->err_what, op->spec.path);
}

size_t Executor::wait_all() {
  std::map<uint64_t, std::shared_ptr<Op>> finished;
  {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] {
      for (auto& kv : ops_)
        if (!kv.second->done) return false;
      return true;
    });
    finished.swap(ops_);
  }
  for (auto& kv : finished) {
    const Op& op = *kv.second;
    if (op.err) throw IoError(op.err, op.err_what, op.spec.path);
  }
  return finished.size();
}

bool Executor::cancel(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ops_.find(id);
  if (it == ops_.end()) return false;
  const std::shared_ptr<Op> op = it->second;
  unsigned dropped = 0;
  for (auto t = tasks_.begin(); t != tasks_.end();) {
    if (t->op == op) {
      t = tasks_.erase(t);
      ++dropped;
    } else {
      ++t;
    }
  }
  if (dropped == 0) return false;
  if (!op->err) op->err = ECANCELED;  // err_what stays empty: strerror says it
  op->parts_left -= dropped;
  if (op->parts_left == 0) {
    op->done = true;
    done_cv_.notify_all();
  }
  return true;
}

bool Executor::is_pending(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  return ops_.count(id) != 0;
}

size_t Executor::pending() {
  std::lock_guard<std::mutex> lock(mu_);
  return ops_.size();
}

void Executor::worker_main(unsigned index) {
  int broken = 0;  // errno of an engine given up and not replaced: every later part fails
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    // Nothing here may throw: the part must be counted finished, or wait() never returns.
    int err = 0;
    std::string what;
    bool engine_lost = false;
    try {
      if (broken) throw IoError(broken, "the I/O engine of this worker failed earlier");
      engines_[index]->use_memory(task.op->spec.ptr + task.begin, task.end - task.begin);
      run_task(*engines_[index], task, engine_lost);
    } catch (const IoError& e) {
      err = e.err();
      what = message_or_empty([&] { return e.message(); });
    } catch (const std::bad_alloc&) {
      err = ENOMEM;
    } catch (const std::exception& e) {
      err = EIO;
      what = message_or_empty([&] { return std::string(e.what()); });
    }
    if (err) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!task.op->err) {
        task.op->err = err;
        task.op->err_what = std::move(what);  // wait() throws a new IoError: it adds strerror
      }
    }
    if (engine_lost) {
      // Requests it never returned may still complete into it: never destroy it.
      (void)engines_[index].release();
      try {
        engines_[index] = make_engine(config_.engine, config_.queue_depth);
      } catch (...) {
        broken = err ? err : EIO;
      }
    }
    finish_part(task.op);
  }
}

void Executor::finish_part(const std::shared_ptr<Op>& op) {
  std::lock_guard<std::mutex> lock(mu_);
  if (--op->parts_left == 0) {
    op->done = true;
    done_cv_.notify_all();
  }
}

void Executor::run_task(Engine& engine, Task& task, bool& engine_lost) {
  Op& op = *task.op;
  const OpSpec& s = op.spec;
  const uint64_t a = s.alignment;
  const uint64_t g = page_granule(a);  // heads, tails and direct blocks end on these
  const uint64_t block = std::max(g, round_down(config_.block_size, g));
  // Chunks start on aligned file offsets, so memory misalignment is the same for all.
  const bool needs_bounce = reinterpret_cast<uintptr_t>(s.ptr - s.offset) % a != 0;
  bool direct_ok = s.fd_direct >= 0;
  unsigned depth = config_.queue_depth;
  if (needs_bounce && direct_ok) depth = std::min(depth, kMaxBounceSlots);

  std::vector<Slot> slots(depth);
  std::vector<Slot*> free_slots;
  free_slots.reserve(depth);
  for (auto& sl : slots) {
    sl.req.owner = &sl;
    free_slots.push_back(&sl);
  }
  struct BounceGuard {
    std::vector<Slot>& slots;
    ~BounceGuard() {
      for (auto& sl : slots) std::free(sl.bounce);
    }
  } guard{slots};

  uint64_t pos = task.begin;
  // Requests handed to the engine and not yet reaped. The loop below only ends when this is
  // 0: a request still in flight writes into `slots`, its bounce buffer and the caller's
  // memory, so none of them may go away before its completion has been collected.
  unsigned in_flight = 0;
  int err = 0;
  std::string err_what;
  std::vector<Completion> completions;
  completions.reserve(depth);
  auto fail = [&](int e, std::string what) {
    if (err) return;
    err = e;
    err_what = std::move(what);
  };
  // For the handlers below, which must not throw while requests are in flight: the errno is
  // recorded first; the message is best effort.
  auto fail_in_handler = [&](int e, const char* what) noexcept {
    if (err) return;
    err = e;
    err_what = message_or_empty([&] { return describe(s, s.len, s.offset) + ": " + what; });
  };

  auto issue = [&](Slot* sl) {
    char* base = sl->use_bounce ? sl->bounce : s.ptr + sl->rel;
    sl->req.fd = sl->direct ? s.fd_direct : s.fd_buffered;
    sl->req.buf = base + sl->done;
    sl->req.len = sl->len - sl->done;
    sl->req.offset = s.offset + sl->rel + sl->done;
    sl->req.write = s.write;
    engine.prepare(&sl->req);
    ++in_flight;  // counted once the engine holds it, so a throwing prepare() leaks no count
    if (config_.single_submit) engine.flush();
  };

  // Starts new chunks while slots are free; stops at the first error.
  auto start_chunks = [&] {
    while (!err && !free_slots.empty() && pos < task.end) {
      Slot* sl = free_slots.back();
      const uint64_t abs = s.offset + pos;
      const uint64_t left = task.end - pos;
      sl->rel = pos;
      sl->done = 0;
      sl->retries = 0;
      if (direct_ok && abs % g != 0) {  // unaligned head, to the page's end: page cache
        sl->len = std::min(left, g - abs % g);
        sl->direct = false;
      } else if (direct_ok && left < g) {  // unaligned tail, its page: page cache
        sl->len = left;
        sl->direct = false;
      } else if (direct_ok) {
        sl->len = std::min(block, round_down(left, g));
        sl->direct = true;
      } else {
        sl->len = std::min(block, left);
        sl->direct = false;
      }
      sl->use_bounce = sl->direct && needs_bounce;
      if (sl->use_bounce) {
        if (!sl->bounce && posix_memalign(reinterpret_cast<void**>(&sl->bounce), a, block) != 0) {
          sl->bounce = nullptr;
          fail(ENOMEM, "allocating an aligned bounce buffer of " + std::to_string(block) +
                           " bytes for a " + describe(s, s.len, s.offset));
          return;  // the requests already in flight are collected before run_task returns
        }
        if (s.write) std::memcpy(sl->bounce, s.ptr + sl->rel, sl->len);
      }
      free_slots.pop_back();
      issue(sl);
      pos += sl->len;
    }
  };

  // Checks one completion: continues, retries or retires its slot.
  auto complete = [&](const Completion& c) {
    Slot* sl = static_cast<Slot*>(c.req->owner);
    if (err) {  // the op has failed: collect what is in flight, start nothing more
      free_slots.push_back(sl);
      return;
    }
    if (c.result < 0) {
      const int e = static_cast<int>(-c.result);
      if ((e == EINTR || e == EAGAIN) && ++sl->retries <= kMaxRetries) {
        issue(sl);
        return;
      }
      if (e == EINVAL && sl->direct) {
        // The file system took O_DIRECT at open but not for this I/O: stop using it.
        direct_ok = false;
        sl->direct = false;
        issue(sl);
        return;
      }
      fail(e, describe(s, sl->len - sl->done, s.offset + sl->rel + sl->done) + " failed");
    } else if (c.result == 0 && sl->done < sl->len) {
      fail(s.write ? EIO : ENODATA,
           describe(s, sl->len - sl->done, s.offset + sl->rel + sl->done) +
               (s.write ? " made no progress" : " hit the end of the file"));
    } else {
      sl->done += static_cast<uint64_t>(c.result);
      sl->retries = 0;
      if (sl->done < sl->len) {
        // Short transfer: continue where it stopped; an unaligned resume point cannot
        // stay O_DIRECT.
        if (sl->done % a != 0) sl->direct = false;
        issue(sl);
        return;
      }
      if (sl->use_bounce && !s.write) std::memcpy(s.ptr + sl->rel, sl->bounce, sl->len);
    }
    free_slots.push_back(sl);
  };

  unsigned failed_rounds = 0;
  for (;;) {
    try {
      start_chunks();
      if (in_flight == 0) break;
      engine.flush();
      completions.clear();
      engine.reap(config_.overlap_events ? 1 : in_flight, completions);
      // Reaped requests are out of the engine whatever happens to them below.
      in_flight -= static_cast<unsigned>(completions.size());
      for (const Completion& c : completions) complete(c);
      failed_rounds = 0;
      continue;
    } catch (const IoError& e) {
      fail_in_handler(e.err(), e.message().c_str());
    } catch (const std::bad_alloc&) {
      fail_in_handler(ENOMEM, "out of memory");
    } catch (const std::exception& e) {
      fail_in_handler(EIO, e.what());
    }
    if (in_flight == 0) break;
    if (++failed_rounds > kMaxFailedRounds) {
      // The engine keeps failing with requests in flight: they cannot be collected, so the
      // slots (their requests and bounce buffers) and the engine are kept for the process's
      // life, and the op fails with the engine's errno rather than wait() hanging. (Moving
      // the vector keeps every slot's address; the guard then frees nothing.)
      if (new (std::nothrow) std::vector<Slot>(std::move(slots)) != nullptr) {
        engine_lost = true;
        break;
      }
    }
    backoff(failed_rounds, in_flight);
  }
  if (err) throw IoError(err, err_what, s.path);
}

}  // namespace fastckpt

#include "executor.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

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

uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }
uint64_t round_down(uint64_t x, uint64_t a) { return x / a * a; }

struct Slot {
  Request req;
  uint64_t rel = 0;         // position of the chunk within the op
  uint64_t len = 0;         // chunk length
  uint64_t done = 0;        // bytes already moved
  bool direct = false;      // through the O_DIRECT descriptor
  bool use_bounce = false;  // staged through `bounce` (memory not aligned)
  char* bounce = nullptr;   // owned by the slot, allocated on first use
};

std::string describe(const OpSpec& s, uint64_t len, uint64_t offset) {
  return std::string(s.write ? "write of " : "read of ") + std::to_string(len) +
         " bytes at offset " + std::to_string(offset);
}

}  // namespace

Executor::Executor(const ExecutorConfig& config) : config_(config) {
  if (config_.parallelism == 0) config_.parallelism = 1;
  if (config_.queue_depth == 0) config_.queue_depth = 1;
  // Engines are built here, on the caller's thread, so a failure surfaces as an exception.
  for (unsigned i = 0; i < config_.parallelism; ++i)
    engines_.push_back(make_engine(config_.engine, config_.queue_depth));
  for (unsigned i = 0; i < config_.parallelism; ++i)
    workers_.emplace_back([this, i] { worker_main(i); });
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
  const uint64_t a = spec.alignment ? spec.alignment : 4096;
  op->spec.alignment = a;
  const unsigned parts =
      spec.max_parts ? std::min(spec.max_parts, config_.parallelism) : config_.parallelism;
  // Parts end on aligned file offsets so that each keeps its blocks O_DIRECT-able.
  const uint64_t share = (spec.len + parts - 1) / parts;
  std::vector<Task> tasks;
  uint64_t begin = 0;
  for (unsigned k = 1; k <= parts && begin < spec.len; ++k) {
    uint64_t end = k == parts
                       ? spec.len
                       : std::min(spec.len, round_up(spec.offset + k * share, a) - spec.offset);
    if (end <= begin) continue;
    tasks.push_back({op, begin, end});
    begin = end;
  }
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t id = next_id_++;
  ops_[id] = op;
  op->parts_left = static_cast<unsigned>(tasks.size());
  if (tasks.empty()) {
    op->done = true;
  } else {
    for (auto& t : tasks) tasks_.push_back(std::move(t));
    work_cv_.notify_all();
  }
  return id;
}

void Executor::wait(uint64_t id) {
  std::shared_ptr<Op> op;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = ops_.find(id);
    if (it == ops_.end()) return;  // already collected
    op = it->second;
    done_cv_.wait(lock, [&] { return op->done; });
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

size_t Executor::pending() {
  std::lock_guard<std::mutex> lock(mu_);
  return ops_.size();
}

void Executor::worker_main(unsigned index) {
  Engine& engine = *engines_[index];
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    try {
      run_task(engine, task);
    } catch (const IoError& e) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!task.op->err) {
        task.op->err = e.err();
        task.op->err_what = e.what();
      }
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!task.op->err) {
        task.op->err = EIO;
        task.op->err_what = e.what();
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

void Executor::run_task(Engine& engine, Task& task) {
  Op& op = *task.op;
  const OpSpec& s = op.spec;
  const uint64_t a = s.alignment;
  const uint64_t block = std::max(a, round_down(config_.block_size, a));
  // Chunks start on aligned file offsets, so memory misalignment is the same for all.
  const bool needs_bounce = reinterpret_cast<uintptr_t>(s.ptr - s.offset) % a != 0;
  bool direct_ok = s.fd_direct >= 0;
  unsigned depth = config_.queue_depth;
  if (needs_bounce && direct_ok) depth = std::min(depth, kMaxBounceSlots);

  std::vector<Slot> slots(depth);
  std::vector<Slot*> free_slots;
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

  auto issue = [&](Slot* sl) {
    char* base = sl->use_bounce ? sl->bounce : s.ptr + sl->rel;
    sl->req.fd = sl->direct ? s.fd_direct : s.fd_buffered;
    sl->req.buf = base + sl->done;
    sl->req.len = sl->len - sl->done;
    sl->req.offset = s.offset + sl->rel + sl->done;
    sl->req.write = s.write;
    engine.prepare(&sl->req);
    if (config_.single_submit) engine.flush();
  };

  uint64_t pos = task.begin;
  unsigned in_flight = 0;
  int err = 0;
  std::string err_what;
  std::vector<Completion> completions;

  for (;;) {
    while (!err && !free_slots.empty() && pos < task.end) {
      Slot* sl = free_slots.back();
      free_slots.pop_back();
      const uint64_t abs = s.offset + pos;
      const uint64_t left = task.end - pos;
      sl->rel = pos;
      sl->done = 0;
      if (direct_ok && abs % a != 0) {  // unaligned head: page cache
        sl->len = std::min(left, a - abs % a);
        sl->direct = false;
      } else if (direct_ok && left < a) {  // unaligned tail: page cache
        sl->len = left;
        sl->direct = false;
      } else if (direct_ok) {
        sl->len = std::min(block, round_down(left, a));
        sl->direct = true;
      } else {
        sl->len = std::min(block, left);
        sl->direct = false;
      }
      sl->use_bounce = sl->direct && needs_bounce;
      if (sl->use_bounce) {
        if (!sl->bounce && posix_memalign(reinterpret_cast<void**>(&sl->bounce), a, block) != 0)
          throw IoError(ENOMEM, "allocating an aligned bounce buffer", s.path);
        if (s.write) std::memcpy(sl->bounce, s.ptr + sl->rel, sl->len);
      }
      issue(sl);
      pos += sl->len;
      ++in_flight;
    }
    if (in_flight == 0) break;
    engine.flush();
    completions.clear();
    engine.reap(config_.overlap_events ? 1 : in_flight, completions);
    for (const Completion& c : completions) {
      Slot* sl = static_cast<Slot*>(c.req->owner);
      if (c.result < 0) {
        const int e = static_cast<int>(-c.result);
        if (e == EINTR || e == EAGAIN) {
          issue(sl);
          continue;
        }
        if (e == EINVAL && sl->direct) {
          // The file system took O_DIRECT at open but not for this I/O: stop using it.
          direct_ok = false;
          sl->direct = false;
          issue(sl);
          continue;
        }
        if (!err) {
          err = e;
          err_what = describe(s, sl->len - sl->done, s.offset + sl->rel + sl->done) + " failed";
        }
      } else if (c.result == 0 && sl->done < sl->len) {
        if (!err) {
          err = s.write ? EIO : ENODATA;
          err_what = describe(s, sl->len - sl->done, s.offset + sl->rel + sl->done) +
                     (s.write ? " made no progress" : " hit the end of the file");
        }
      } else {
        sl->done += static_cast<uint64_t>(c.result);
        if (sl->done < sl->len) {
          // Short transfer: continue where it stopped; an unaligned resume point cannot
          // stay O_DIRECT.
          if (sl->done % a != 0) sl->direct = false;
          issue(sl);
          continue;
        }
        if (sl->use_bounce && !s.write) std::memcpy(s.ptr + sl->rel, sl->bounce, sl->len);
      }
      free_slots.push_back(sl);
      --in_flight;
    }
  }
  if (err) throw IoError(err, err_what, s.path);
}

}  // namespace fastckpt

// The executor turns one logical transfer ("move len bytes between ptr and path at
// offset") into engine requests, and checks every completion.
//
// - It splits an op into `parallelism` contiguous parts, one per worker thread, each worker
//   with its own engine instance and up to `queue_depth` requests of `block_size` in flight.
// - O_DIRECT is used for every block whose file offset and length are aligned; unaligned
//   heads and tails go through the buffered descriptor, each up to its page's boundary (a
//   page never takes buffered and O_DIRECT requests at once: the kernel cannot invalidate
//   a page a buffered write dirtied, and the O_DIRECT bytes would be lost), and memory that
//   is not aligned is staged through aligned bounce buffers.
// - A short transfer is continued; EINTR/EAGAIN are retried (a bounded number of times);
//   EINVAL from an O_DIRECT request (a file system that accepted O_DIRECT at open but not
//   for this I/O) is retried buffered; anything else becomes the op's error, raised by
//   wait() once every part of the op has finished, so no request still touches the caller's
//   memory when it returns.
// - A part that fails (an I/O error, no memory for a bounce buffer, an engine call that
//   throws) starts nothing more and collects every request it has in flight before it
//   returns: those requests write into its slots and bounce buffers and the caller's memory.
//   Only an engine that keeps failing to return them (flush/reap failing round after round)
//   is given up after a bounded backoff: the op fails with its errno, and the engine and
//   slots are kept alive for good instead of freed under requests still in the kernel.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "alignment.h"
#include "engine.h"

namespace fastckpt {

struct OpSpec {
  int fd_direct = -1;    // O_DIRECT descriptor, or -1 where the file system refuses it
  int fd_buffered = -1;  // ordinary descriptor of the same file
  char* ptr = nullptr;
  uint64_t len = 0;
  uint64_t offset = 0;
  bool write = false;
  std::string path;                         // for error messages
  uint64_t alignment = kDirectIoAlignment;  // O_DIRECT granularity of offsets, lengths, memory
  unsigned max_parts = 0;                   // 0: the executor's parallelism
};

struct ExecutorConfig {
  EngineKind engine = EngineKind::threads;
  uint64_t block_size = 1 << 20;
  unsigned queue_depth = 32;
  bool single_submit = false;
  bool overlap_events = true;
  unsigned parallelism = 1;
};

class Executor {
 public:
  explicit Executor(const ExecutorConfig& config);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Queues an op; returns its id. Never blocks on I/O.
  uint64_t submit(const OpSpec& spec);
  // Blocks until op `id` has finished; throws IoError if it failed, std::invalid_argument if
  // `id` is not pending (never submitted, or already collected).
  void wait(uint64_t id);
  // Drops the parts of op `id` that no worker has started (they never touch the memory);
  // the op then fails with ECANCELED once the parts already running finish, and must still
  // be collected by wait(). Returns whether any part was dropped.
  bool cancel(uint64_t id);
  // Whether op `id` was submitted and is not yet collected by wait()/wait_all().
  bool is_pending(uint64_t id);
  // Blocks until every op submitted so far has finished; returns how many finished since
  // the last wait_all(); throws the first failed op's error (in submission order).
  size_t wait_all();
  // Ops submitted and not yet collected by wait()/wait_all().
  size_t pending();

  const ExecutorConfig& config() const { return config_; }

 private:
  struct Op;
  struct Task;
  void worker_main(unsigned index);
  void run_task(Engine& engine, Task& task, bool& engine_lost);
  void finish_part(const std::shared_ptr<Op>& op);

  ExecutorConfig config_;
  std::vector<std::unique_ptr<Engine>> engines_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Task> tasks_;
  std::map<uint64_t, std::shared_ptr<Op>> ops_;
  uint64_t next_id_ = 1;
  bool stopping_ = false;
};

}  // namespace fastckpt

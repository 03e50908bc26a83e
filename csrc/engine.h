// The interface every I/O engine implements, and the factory that builds them.
//
// An engine moves bytes between memory and a file descriptor; it knows nothing of
// tensors, alignment policy or retries. The executor (executor.h) hands it requests,
// asks it to submit them and collects raw results: bytes moved or -errno. Continuing
// short transfers and turning errors into exceptions is the executor's job, so that every
// engine gets the same checks.
#pragma once
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace fastckpt {

struct Request {
  int fd = -1;
  char* buf = nullptr;
  uint64_t len = 0;     // bytes still to move in this submission
  uint64_t offset = 0;  // file offset of buf[0]
  bool write = false;
  struct iovec iov{};     // scratch for engines that submit vectored requests
  bool fixed = false;     // scratch: submitted from memory registered with the engine
  void* owner = nullptr;  // the executor's bookkeeping
};

struct Completion {
  Request* req;
  int64_t result;  // bytes transferred, or -errno
};

class Engine {
 public:
  virtual ~Engine() = default;
  // Queues a request. It may stay in user space until flush().
  virtual void prepare(Request* r) = 0;
  // Hands every prepared request to the kernel (or the workers).
  virtual void flush() = 0;
  // Blocks until at least `min_complete` requests have completed; appends them to `out`.
  virtual void reap(size_t min_complete, std::vector<Completion>& out) = 0;
  // Requests moving [p, p + len) come next: an engine that can register memory with the
  // kernel registers the reused buffer holding it (RegisteredMemory, memory.h), if any and
  // not yet done. Never throws: unregistered memory works as before.
  virtual void use_memory(char* p, uint64_t len) noexcept {
    (void)p;
    (void)len;
  }
};

// `failing` is for tests only: the threads engine whose reap() always fails, as a kernel
// interface gone bad would (requests stay in flight, never returned). Named "_failing".
enum class EngineKind { io_uring, libaio, threads, failing };

struct EngineStatus {
  bool available;
  std::string reason;  // why not, when unavailable
};

EngineStatus probe_io_uring();
EngineStatus probe_libaio();
std::unique_ptr<Engine> make_io_uring(unsigned depth);
std::unique_ptr<Engine> make_libaio(unsigned depth);
std::unique_ptr<Engine> make_threads(unsigned depth);
std::unique_ptr<Engine> make_failing(unsigned depth);

EngineKind parse_engine_kind(const std::string& name);  // throws std::invalid_argument
std::unique_ptr<Engine> make_engine(EngineKind kind, unsigned depth);

}  // namespace fastckpt

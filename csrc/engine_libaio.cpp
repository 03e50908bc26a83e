// Linux native AIO through <linux/aio_abi.h> and raw syscalls: the interface DeepNVMe
// uses, without libaio at build or run time.
#include <linux/aio_abi.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>

#include "engine.h"
#include "io_error.h"

namespace fastckpt {
namespace {

long sys_io_setup(unsigned nr, aio_context_t* ctx) { return syscall(__NR_io_setup, nr, ctx); }
long sys_io_destroy(aio_context_t ctx) { return syscall(__NR_io_destroy, ctx); }
long sys_io_submit(aio_context_t ctx, long n, iocb** iocbs) {
  return syscall(__NR_io_submit, ctx, n, iocbs);
}
long sys_io_getevents(aio_context_t ctx, long min_nr, long nr, io_event* events) {
  return syscall(__NR_io_getevents, ctx, min_nr, nr, events, nullptr);
}

class LibaioEngine final : public Engine {
 public:
  explicit LibaioEngine(unsigned depth) : depth_(depth), events_(depth) {
    ready_.reserve(depth);  // collecting never allocates, so it cannot drop an event
    if (sys_io_setup(depth, &ctx_) < 0) throw IoError(errno, "io_setup");
  }
  ~LibaioEngine() override { sys_io_destroy(ctx_); }

  void prepare(Request* r) override {
    auto cb = std::make_unique<iocb>();
    std::memset(cb.get(), 0, sizeof(iocb));
    cb->aio_lio_opcode = r->write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
    cb->aio_fildes = static_cast<uint32_t>(r->fd);
    cb->aio_buf = reinterpret_cast<uint64_t>(r->buf);
    cb->aio_nbytes = r->len;
    cb->aio_offset = static_cast<int64_t>(r->offset);
    cb->aio_data = reinterpret_cast<uint64_t>(r);
    pending_.push_back(std::move(cb));
  }

  // Never leaves a request in limbo: each prepared request is either taken by the kernel or
  // handed back through reap() with the submission's -errno as its result.
  void flush() override {
    std::vector<iocb*> batch;
    batch.reserve(pending_.size());
    for (auto& cb : pending_) batch.push_back(cb.get());
    ready_.reserve(ready_.size() + batch.size());
    size_t done = 0;
    unsigned busy_rounds = 0;
    try {
      while (done < batch.size()) {
        long n = sys_io_submit(ctx_, static_cast<long>(batch.size() - done), batch.data() + done);
        if (n > 0) {
          done += static_cast<size_t>(n);
          in_kernel_ += n;
          continue;
        }
        const int err = n == 0 ? EAGAIN : errno;  // none taken without an error: treat as busy
        if (err == EINTR) continue;
        if (err == EAGAIN && in_kernel_ > 0 && ++busy_rounds <= kMaxBusyRounds) {
          // Out of kernel resources: collecting a completion frees some; retrying without
          // that could spin.
          collect(1);
          continue;
        }
        // The kernel refused the first iocb outright: report it as that request's result
        // so the executor applies its usual policy (e.g. retry without O_DIRECT).
        ready_.push_back({reinterpret_cast<Request*>(batch[done]->aio_data), -err});
        ++done;
      }
    } catch (...) {  // collect() failed: keep only what the kernel has not seen, for next time
      pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(done));
      throw;
    }
    pending_.clear();  // the kernel copied each iocb at submission
  }

  void reap(size_t min_complete, std::vector<Completion>& out) override {
    // Collected into ready_ first: if waiting throws, nothing is lost, the next reap() has it.
    if (ready_.size() < min_complete) collect(min_complete - ready_.size());
    out.insert(out.end(), ready_.begin(), ready_.end());
    ready_.clear();
  }

 private:
  static constexpr unsigned kMaxBusyRounds = 1000;

  // Waits for `want` completions and moves them to ready_.
  void collect(size_t want) {
    size_t got = 0;
    while (got < want) {
      long n = sys_io_getevents(ctx_, static_cast<long>(want - got), depth_, events_.data());
      if (n < 0) {
        if (errno == EINTR) continue;
        throw IoError(errno, "io_getevents");
      }
      for (long i = 0; i < n; ++i)
        ready_.push_back({reinterpret_cast<Request*>(events_[i].data), events_[i].res});
      got += static_cast<size_t>(n);
      in_kernel_ -= n;
    }
  }

  aio_context_t ctx_ = 0;
  long depth_;
  std::vector<io_event> events_;
  std::vector<std::unique_ptr<iocb>> pending_;
  long in_kernel_ = 0;             // submitted and not yet collected
  std::vector<Completion> ready_;  // collected or refused, not yet handed out by reap()
};

}  // namespace

EngineStatus probe_libaio() {
  aio_context_t ctx = 0;
  if (sys_io_setup(1, &ctx) < 0) {
    int err = errno;
    return {false, std::string("io_setup failed: ") + std::strerror(err) +
                       (err == ENOSYS ? " (kernel without AIO support)" : "")};
  }
  sys_io_destroy(ctx);
  return {true, ""};
}

std::unique_ptr<Engine> make_libaio(unsigned depth) {
  return std::make_unique<LibaioEngine>(depth);
}

}  // namespace fastckpt

// io_uring through the kernel's own interface (<linux/io_uring.h> + syscall), as fio
// does: no liburing at build or run time. READV/WRITEV are used because they exist since
// the first io_uring kernel (5.1); the iovec lives in the Request.
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "engine.h"
#include "io_error.h"
#include "memory.h"

namespace fastckpt {
namespace {

int sys_setup(unsigned entries, io_uring_params* p) {
  return static_cast<int>(syscall(__NR_io_uring_setup, entries, p));
}

int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  return static_cast<int>(
      syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0));
}

template <typename T>
T load_acquire(const T* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
template <typename T>
void store_release(T* p, T v) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}

class UringEngine final : public Engine {
 public:
  explicit UringEngine(unsigned depth) {
    io_uring_params p;
    std::memset(&p, 0, sizeof(p));
    fd_ = sys_setup(depth, &p);
    if (fd_ < 0) throw IoError(errno, "io_uring_setup");
    sq_len_ = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    cq_len_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    single_mmap_ = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single_mmap_) sq_len_ = cq_len_ = std::max(sq_len_, cq_len_);
    sqes_len_ = p.sq_entries * sizeof(io_uring_sqe);
    try {  // a constructor that throws gets no destructor call: undo by hand
      sq_ring_ = map(sq_len_, IORING_OFF_SQ_RING);
      cq_ring_ = single_mmap_ ? sq_ring_ : map(cq_len_, IORING_OFF_CQ_RING);
      sqes_ = static_cast<io_uring_sqe*>(map(sqes_len_, IORING_OFF_SQES));
    } catch (...) {
      release();
      throw;
    }
    char* sq = static_cast<char*>(sq_ring_);
    sq_head_ = reinterpret_cast<unsigned*>(sq + p.sq_off.head);
    sq_tail_ = reinterpret_cast<unsigned*>(sq + p.sq_off.tail);
    sq_mask_ = *reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
    sq_array_ = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
    char* cq = static_cast<char*>(cq_ring_);
    cq_head_ = reinterpret_cast<unsigned*>(cq + p.cq_off.head);
    cq_tail_ = reinterpret_cast<unsigned*>(cq + p.cq_off.tail);
    cq_mask_ = *reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
    cqes_ = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
    local_tail_ = *sq_tail_;
    ready_.reserve(depth);
  }

  ~UringEngine() override { release(); }

  void release() {
    if (sqes_) unmap_or_report(sqes_, sqes_len_, "io_uring submission entries");
    if (cq_ring_ && !single_mmap_) unmap_or_report(cq_ring_, cq_len_, "io_uring completion ring");
    if (sq_ring_) unmap_or_report(sq_ring_, sq_len_, "io_uring submission ring");
    if (fd_ >= 0) close(fd_);
    sqes_ = nullptr;
    cq_ring_ = sq_ring_ = nullptr;
    fd_ = -1;
  }

  void prepare(Request* r) override {
    // The executor never has more than `depth` requests in flight, so a slot is free.
    unsigned index = local_tail_ & sq_mask_;
    io_uring_sqe* sqe = &sqes_[index];
    std::memset(sqe, 0, sizeof(*sqe));
    r->iov.iov_base = r->buf;
    r->iov.iov_len = r->len;
    sqe->opcode = r->write ? IORING_OP_WRITEV : IORING_OP_READV;
    sqe->fd = r->fd;
    sqe->off = r->offset;
    sqe->addr = reinterpret_cast<uint64_t>(&r->iov);
    sqe->len = 1;
    sqe->user_data = reinterpret_cast<uint64_t>(r);
    sq_array_[index] = index;
    ++local_tail_;
    ++unsubmitted_;
  }

  // Never leaves a request in limbo: each prepared request is either taken by the kernel or
  // handed back through reap() with the submission's -errno as its result.
  void flush() override {
    if (unsubmitted_ == 0) return;
    store_release(sq_tail_, local_tail_);
    unsigned busy_rounds = 0;
    while (unsubmitted_ > 0) {
      int n = sys_enter(fd_, unsubmitted_, 0, 0);
      if (n > 0) {
        unsubmitted_ -= static_cast<unsigned>(n);
        in_kernel_ += static_cast<unsigned>(n);
        continue;
      }
      const int err = n == 0 ? EAGAIN : errno;  // none taken without an error: treat as busy
      if (err == EINTR) continue;
      if ((err == EAGAIN || err == EBUSY) && ++busy_rounds <= kMaxBusyRounds) {
        // The kernel is short of request memory (EAGAIN) or its completion queue is full
        // (EBUSY): collecting completions frees both; retrying without that could spin.
        collect(in_kernel_ > 0 ? 1 : 0);
        continue;
      }
      refuse_unsubmitted(-err);
    }
  }

  void reap(size_t min_complete, std::vector<Completion>& out) override {
    // Collected into ready_ first: if waiting throws, nothing is lost, the next reap() has it.
    if (ready_.size() < min_complete) collect(min_complete - ready_.size());
    out.insert(out.end(), ready_.begin(), ready_.end());
    ready_.clear();
  }

 private:
  static constexpr unsigned kMaxBusyRounds = 1000;

  // Moves completions from the ring to ready_ until `want` have arrived (0: only those there).
  void collect(size_t want) {
    size_t got = 0;
    for (;;) {
      unsigned head = *cq_head_;
      unsigned tail = load_acquire(cq_tail_);
      ready_.reserve(ready_.size() + (tail - head));
      while (head != tail) {
        const io_uring_cqe& cqe = cqes_[head & cq_mask_];
        ready_.push_back({reinterpret_cast<Request*>(cqe.user_data), cqe.res});
        ++head;
        ++got;
        --in_kernel_;
      }
      store_release(cq_head_, head);
      if (got >= want) return;
      int n = sys_enter(fd_, 0, static_cast<unsigned>(want - got), IORING_ENTER_GETEVENTS);
      if (n < 0 && errno != EINTR && errno != EAGAIN && errno != EBUSY)
        throw IoError(errno, "io_uring_enter (wait)");
    }
  }

  // Takes the requests the kernel has not consumed back out of the submission queue (only
  // io_uring_enter consumes them, and only this thread calls it) and fails each with `res`.
  void refuse_unsubmitted(int res) {
    const unsigned head = load_acquire(sq_head_);
    for (unsigned i = head; i != local_tail_; ++i)
      ready_.push_back({reinterpret_cast<Request*>(sqes_[i & sq_mask_].user_data), res});
    local_tail_ = head;
    store_release(sq_tail_, local_tail_);
    unsubmitted_ = 0;
  }

  void* map(size_t len, off_t what) {
    void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, what);
    if (p == MAP_FAILED) throw IoError(errno, "mmap io_uring ring");
    return p;
  }

  int fd_ = -1;
  size_t sq_len_ = 0, cq_len_ = 0, sqes_len_ = 0;
  bool single_mmap_ = false;
  void* sq_ring_ = nullptr;
  void* cq_ring_ = nullptr;
  io_uring_sqe* sqes_ = nullptr;
  unsigned *sq_head_ = nullptr, *sq_tail_ = nullptr, *sq_array_ = nullptr;
  unsigned *cq_head_ = nullptr, *cq_tail_ = nullptr;
  unsigned sq_mask_ = 0, cq_mask_ = 0;
  io_uring_cqe* cqes_ = nullptr;
  unsigned local_tail_ = 0;
  unsigned unsubmitted_ = 0;
  unsigned in_kernel_ = 0;         // submitted and not yet collected
  std::vector<Completion> ready_;  // collected, not yet handed out by reap()
};

}  // namespace

EngineStatus probe_io_uring() {
  io_uring_params p;
  std::memset(&p, 0, sizeof(p));
  int fd = sys_setup(2, &p);
  if (fd < 0) {
    int err = errno;
    std::string why = std::string("io_uring_setup failed: ") + std::strerror(err);
    if (err == ENOSYS) why += " (kernel without io_uring)";
    if (err == EPERM) why += " (disabled by kernel.io_uring_disabled or a seccomp policy)";
    return {false, why};
  }
  close(fd);
  return {true, ""};
}

std::unique_ptr<Engine> make_io_uring(unsigned depth) {
  return std::make_unique<UringEngine>(depth);
}

}  // namespace fastckpt

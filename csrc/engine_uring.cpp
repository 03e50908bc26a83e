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
#include <iterator>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "engine.h"
#include "io_error.h"
#include "memory.h"

namespace fastckpt {
namespace {

int sys_setup(unsigned entries, io_uring_params* p) {
  return static_cast<int>(syscall(__NR_io_uring_setup, entries, p));
}

int sys_register(int fd, unsigned opcode, const void* arg, unsigned nr_args) {
  return static_cast<int>(syscall(__NR_io_uring_register, fd, opcode, arg, nr_args));
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

class UringEngine final : public Engine, private RegisteredMemory::Holder {
  // A piece of a reused buffer registered with the ring: where it ends, its slot, and where
  // the buffer it is part of starts.
  struct Piece {
    char* end;
    unsigned slot;
    char* buffer;  // the start of the buffer it is part of
  };

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
    retry_.reserve(depth);
  }

  ~UringEngine() override {
    if (table_ == Table::made) RegisteredMemory::remove_holder(this);
    release();
  }

  void release() {
    if (sqes_) unmap_or_report(sqes_, sqes_len_, "io_uring submission entries");
    if (cq_ring_ && !single_mmap_) unmap_or_report(cq_ring_, cq_len_, "io_uring completion ring");
    if (sq_ring_) unmap_or_report(sq_ring_, sq_len_, "io_uring submission ring");
    if (fd_ >= 0) close(fd_);
    sqes_ = nullptr;
    cq_ring_ = sq_ring_ = nullptr;
    fd_ = -1;
  }

  void prepare(Request* r) override { prepare_sqe(r, true); }

  // `allow_fixed`: a request from registered memory names its slot (WRITE_FIXED, READ_FIXED).
  void prepare_sqe(Request* r, bool allow_fixed) {
    // The executor never has more than `depth` requests in flight, so a slot is free.
    unsigned index = local_tail_ & sq_mask_;
    io_uring_sqe* sqe = &sqes_[index];
    std::memset(sqe, 0, sizeof(*sqe));
    const int slot = allow_fixed ? registered_slot(r->buf, r->len) : -1;
    r->fixed = slot >= 0;
    if (slot >= 0) {
      // Registered memory: its pages were pinned once, not for every request (fio's
      // fixedbufs: 2.9 against 2.5 GB/s of 1 MiB O_DIRECT writes on our VM).
      sqe->opcode = r->write ? IORING_OP_WRITE_FIXED : IORING_OP_READ_FIXED;
      sqe->addr = reinterpret_cast<uint64_t>(r->buf);
      sqe->len = static_cast<uint32_t>(r->len);
      sqe->buf_index = static_cast<uint16_t>(slot);
    } else {
      r->iov.iov_base = r->buf;
      r->iov.iov_len = r->len;
      sqe->opcode = r->write ? IORING_OP_WRITEV : IORING_OP_READV;
      sqe->addr = reinterpret_cast<uint64_t>(&r->iov);
      sqe->len = 1;
    }
    sqe->fd = r->fd;
    sqe->off = r->offset;
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
    for (;;) {
      if (ready_.size() < min_complete) collect(min_complete - ready_.size());
      if (retry_.empty()) break;
      resubmit_unfixed();
    }
    out.insert(out.end(), ready_.begin(), ready_.end());
    ready_.clear();
  }

  void use_memory(char* p, uint64_t len) noexcept override {
#ifdef IORING_RSRC_REGISTER_SPARSE
    const auto [begin, end] = RegisteredMemory::find(p, len);
    if (!begin) return;
    if (!make_table()) return;
    std::lock_guard<std::mutex> g(registered_mu_);
    if (registered_.count(begin)) return;
    // One slot per piece of at most kMaxPieceBytes; a request across two pieces pins as
    // before. Refused (the locked-memory limit of an unprivileged user, no slot left): the
    // pieces registered so far stay, the others pin per request.
    for (char* at = begin; at < end;) {
      char* const stop = at + std::min<uint64_t>(kMaxPieceBytes, static_cast<uint64_t>(end - at));
      const auto free_slot = std::find(slots_.begin(), slots_.end(), nullptr);
      if (free_slot == slots_.end()) return;
      const auto slot = static_cast<unsigned>(free_slot - slots_.begin());
      iovec iov{at, static_cast<size_t>(stop - at)};
      if (!update_slot(slot, &iov)) return;
      *free_slot = at;
      registered_[at] = {stop, slot, begin};
      RegisteredMemory::count(1);
      at = stop;
    }
#else
    (void)p;
    (void)len;
#endif
  }

 private:
  static constexpr unsigned kMaxBusyRounds = 1000;
  // Registration slots of a ring (32 MiB staging buffers: 128 GiB), and io_uring's largest
  // registered buffer.
  static constexpr unsigned kSlots = 4096;
  static constexpr uint64_t kMaxPieceBytes = uint64_t{1} << 30;
  enum class Table { none, made, refused };

  // The slot of the registered buffer holding [buf, buf + len), or -1.
  int registered_slot(const char* buf, uint64_t len) {
    std::lock_guard<std::mutex> g(registered_mu_);
    if (registered_.empty() || len > UINT32_MAX) return -1;
    auto it = registered_.upper_bound(const_cast<char*>(buf));
    if (it == registered_.begin()) return -1;
    --it;
    const char* end = it->second.end;
    if (buf >= end || static_cast<uint64_t>(end - buf) < len) return -1;
    return static_cast<int>(it->second.slot);
  }

  using Pieces = std::map<char*, Piece>::iterator;

  // The registered pieces of the buffer starting at `begin`, as [first, last) of
  // registered_; the caller holds registered_mu_.
  std::pair<Pieces, Pieces> pieces_locked(char* begin) {
    auto first = registered_.lower_bound(begin), last = first;
    while (last != registered_.end() && last->second.buffer == begin) ++last;
    return {first, last};
  }

  long pieces_of(char* begin) noexcept override {
    std::lock_guard<std::mutex> g(registered_mu_);
    const auto [first, last] = pieces_locked(begin);
    return static_cast<long>(std::distance(first, last));
  }

  void forget_all() noexcept override {
    std::lock_guard<std::mutex> g(registered_mu_);
    forget_locked(registered_.begin(), registered_.end());
  }

  void forget(char* begin) noexcept override {
    std::lock_guard<std::mutex> g(registered_mu_);
    const auto [first, last] = pieces_locked(begin);
    forget_locked(first, last);
  }

  // Empties the slots of the pieces [first, last) of registered_ and forgets them; the
  // caller holds registered_mu_.
  void forget_locked(Pieces first, Pieces last) noexcept {
    for (auto it = first; it != last;) {
      iovec empty{nullptr, 0};
      // Emptying a slot only fails for a bad slot number; then the kernel keeps its pages
      // until the ring closes, and the slot is not handed out again.
      if (update_slot(it->second.slot, &empty)) slots_[it->second.slot] = nullptr;
      it = registered_.erase(it);
      RegisteredMemory::count(-1);
    }
  }

#ifdef IORING_RSRC_REGISTER_SPARSE
  // An empty table of kSlots buffers for this ring (once); false where the kernel has none.
  // Only this engine's thread calls it. The engine is listed as a holder outside
  // registered_mu_: RegisteredMemory's lock is always taken before an engine's.
  bool make_table() {
    if (table_ != Table::none) return table_ == Table::made;
    io_uring_rsrc_register table;
    std::memset(&table, 0, sizeof(table));
    table.nr = kSlots;
    table.flags = IORING_RSRC_REGISTER_SPARSE;
    {
      std::lock_guard<std::mutex> g(registered_mu_);
      const bool made = sys_register(fd_, IORING_REGISTER_BUFFERS2, &table, sizeof(table)) == 0;
      if (made) slots_.assign(kSlots, nullptr);
      table_ = made ? Table::made : Table::refused;
    }
    if (table_ != Table::made) return false;
    RegisteredMemory::add_holder(this);  // before anything is registered in the table
    return true;
  }
#endif

  bool update_slot(unsigned slot, iovec* iov) {
#ifdef IORING_RSRC_REGISTER_SPARSE
    io_uring_rsrc_update2 update;
    std::memset(&update, 0, sizeof(update));
    update.offset = slot;
    update.data = reinterpret_cast<uint64_t>(iov);
    update.nr = 1;
    return sys_register(fd_, IORING_REGISTER_BUFFERS_UPDATE, &update, sizeof(update)) == 1;
#else
    (void)slot;
    (void)iov;
    return false;
#endif
  }

  // Moves completions from the ring to ready_ until `want` have arrived (0: only those there).
  void collect(size_t want) {
    size_t got = 0;
    for (;;) {
      unsigned head = *cq_head_;
      unsigned tail = load_acquire(cq_tail_);
      ready_.reserve(ready_.size() + (tail - head));
      while (head != tail) {
        const io_uring_cqe& cqe = cqes_[head & cq_mask_];
        auto* req = reinterpret_cast<Request*>(cqe.user_data);
        // A registered request fails with EFAULT when its slot was emptied between its
        // preparation and its issue (a fork drops every registration): it goes again,
        // pinning its pages itself, instead of failing.
        if (cqe.res == -EFAULT && req->fixed) {
          retry_.push_back(req);
        } else {
          ready_.push_back({req, cqe.res});
        }
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

  // Submits again, without registered memory, the requests collect() set aside for it.
  void resubmit_unfixed() {
    std::vector<Request*> again;
    again.swap(retry_);
    for (Request* r : again) prepare_sqe(r, false);
    flush();
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
  std::vector<Request*> retry_;    // collected, to be submitted again unregistered
  // Pieces of reused buffers registered with the ring, by start, and each slot's piece
  // (nullptr: free). Used by this engine's thread and by threads freeing buffers (forget()),
  // hence the lock.
  std::mutex registered_mu_;
  std::map<char*, Piece> registered_;
  std::vector<char*> slots_;
  Table table_ = Table::none;
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

// Page-aligned (optionally page-locked) host memory, a multi-threaded memcpy and the
// O_DIRECT alignment a file asks for.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fastckpt {

// Owns `nbytes` of page-aligned memory from mmap; mlock()ed when asked.
class AlignedBuffer {
 public:
  // lock: try mlock(); strict: a failed mlock() throws IoError instead of leaving it unlocked.
  // reused: the buffer serves many transfers (a staging buffer, a locked tensor), so an I/O
  // engine may register it with the kernel once (see RegisteredMemory); only if locked.
  AlignedBuffer(size_t nbytes, bool lock, bool strict, bool reused = false);
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  char* data() const { return data_; }
  size_t size() const { return size_; }
  bool locked() const { return locked_; }

 private:
  char* data_ = nullptr;
  size_t size_ = 0;
  size_t mapped_ = 0;
  bool locked_ = false;
  bool reused_ = false;  // listed in RegisteredMemory
};

// Page-locked buffers made to be reused (AlignedBuffer's `reused`) and the I/O engines that
// register them with the kernel, so that the kernel pins their pages once instead of for
// every request (io_uring's fixed buffers).
//
// Engines register a buffer lazily, when a transfer first uses it; a buffer that goes is
// taken out of every engine's registration before its memory is unmapped, so a registration
// never outlives its buffer (its pages would stay pinned, and a new buffer at the same
// address would be mistaken for it). Thread-safe.
class RegisteredMemory {
 public:
  class Holder {  // an engine that registers buffers
   public:
    // Drops the registration of the buffer starting at `begin`, if it has one.
    virtual void forget(char* begin) noexcept = 0;
    // How many pieces of the buffer starting at `begin` it has registered.
    virtual long pieces_of(char* begin) noexcept = 0;
    // Drops every registration (before a fork; made again at the buffers' next use).
    virtual void forget_all() noexcept = 0;

   protected:
    ~Holder() = default;
  };
  // The reused buffer holding [p, p + len) as (begin, end), or (nullptr, nullptr).
  static std::pair<char*, char*> find(const char* p, uint64_t len);
  static void add_holder(Holder* h);
  static void remove_holder(Holder* h);  // a holder not listed (a forked child's) is ignored
  // Registrations alive in all engines (one per engine and buffer piece), or those of the
  // buffer starting at `begin`: what tests see.
  static void count(long delta);
  static long registrations();
  static long registrations_of(char* begin);
};

// munmap() for callers that cannot throw; a failure (a leak, not a corruption) is reported on
// stderr. `what` names the mapping in that report.
void unmap_or_report(void* addr, size_t len, const char* what);

// Whether `ptr` lies in a live AlignedBuffer that is page-locked.
bool is_locked(const void* ptr);

// memcpy split over `threads` threads (1: plain memcpy). Safe to call without the GIL.
void parallel_memcpy(void* dst, const void* src, size_t n, unsigned threads);

// parallel_memcpy that also returns the CRC32C of each segment of the copied bytes (`cuts`,
// ascending within (0, n), split them), computed in the same pass: each step is checksummed
// as it is read for the copy, so no second pass over memory is made. (The source must not
// change during the call, as for any copy that is to be checksummed.) Throws
// std::invalid_argument for bad cuts.
std::vector<uint32_t> parallel_memcpy_crc(void* dst, const void* src, size_t n,
                                          const std::vector<size_t>& cuts, unsigned threads);

// (memory alignment, file offset alignment) for O_DIRECT on fd, from statx(STATX_DIOALIGN);
// (0, 0) when the kernel does not say.
std::pair<uint32_t, uint32_t> dio_alignment(int fd);

// Reserves the first `nbytes` of fd's file with fallocate(2), so parallel direct writes land in
// one contiguous run of blocks instead of being allocated out of order. Returns false where
// the file system cannot (EOPNOTSUPP); throws IoError when it refuses (ENOSPC, EFBIG, ...).
bool preallocate(int fd, uint64_t nbytes, const std::string& path);

}  // namespace fastckpt

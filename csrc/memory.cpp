#include "memory.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "crc32c.h"
#include "io_error.h"
#include "thread_pool.h"

namespace fastckpt {
namespace {

std::mutex g_locked_mu;
std::map<uintptr_t, size_t>& locked_ranges() {  // start -> length, of locked buffers
  static std::map<uintptr_t, size_t> ranges;
  return ranges;
}

// Reused buffers (start -> end) and the engines holding registrations of them. Locked
// before any engine's own lock, never after.
std::mutex g_reused_mu;
std::map<uintptr_t, uintptr_t>& reused_ranges() {
  static std::map<uintptr_t, uintptr_t> ranges;
  return ranges;
}
std::vector<RegisteredMemory::Holder*>& holders() {
  static std::vector<RegisteredMemory::Holder*> list;
  return list;
}
// fork() copies every page pinned for DMA into the child at once (the kernel cannot share
// them copy-on-write): 224 MiB of registered staging buffers made each fork 0.1 s slower
// and cost every child (a DataLoader worker) their memory. So registrations are dropped
// just before a fork, leaving the buffers only locked (shared copy-on-write as before), and
// made again at their next use. Both registries' locks are held across the fork: none is
// made meanwhile, and a child never inherits one that another thread held at fork() (it
// would stay held forever, and the child frees its copies of the parent's staging buffers
// under them: fastckpt.io.staging_pool drops its pools in a child).
void drop_registrations_before_fork() {
  g_reused_mu.lock();
  for (auto* h : holders()) h->forget_all();
  g_locked_mu.lock();
}
void after_fork_in_parent() {
  g_locked_mu.unlock();
  g_reused_mu.unlock();
}
// A forked child has none of its parent's engines (their rings are the parent's): forget them.
void after_fork_in_child() {
  holders().clear();
  g_locked_mu.unlock();  // the child's only thread is the one that locked them
  g_reused_mu.unlock();
}
[[maybe_unused]] const int g_atfork =
    pthread_atfork(drop_registrations_before_fork, after_fork_in_parent, after_fork_in_child);

constexpr size_t kHugePage = 2u << 20;

size_t page_size() {
  static const size_t size = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return size;
}

}  // namespace

AlignedBuffer::AlignedBuffer(size_t nbytes, bool lock, bool strict, bool reused) : size_(nbytes) {
  if (nbytes == 0) return;
  mapped_ = (nbytes + page_size() - 1) / page_size() * page_size();
  // Large buffers start on a huge-page boundary, so a system whose transparent huge pages are
  // "always" on can back them with huge pages. We do not madvise(MADV_HUGEPAGE) them: where
  // huge pages are "madvise"-only, faults then compact memory synchronously, which measured
  // 0.8-1.2 GB/s of first touch against 1.5-1.7 GB/s for plain pages on our 2-core VM.
  const bool huge = mapped_ >= 2 * kHugePage;
  const size_t reserve = huge ? mapped_ + kHugePage : mapped_;
  void* p = mmap(nullptr, reserve, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    throw IoError(errno, "allocating " + std::to_string(nbytes) + " bytes of aligned memory");
  char* start = static_cast<char*>(p);
  if (huge) {
    char* aligned = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(start) + kHugePage - 1) /
                                            kHugePage * kHugePage);
    const size_t head = static_cast<size_t>(aligned - start);
    const size_t tail = reserve - head - mapped_;
    // munmap can fail (ENOMEM where it would split a mapping past vm.max_map_count); then
    // give all of it back rather than keep a half-trimmed reservation.
    if ((head && munmap(start, head) != 0) || (tail && munmap(aligned + mapped_, tail) != 0)) {
      const int err = errno;
      unmap_or_report(aligned, mapped_ + tail, "an aligned buffer");
      if (head) unmap_or_report(start, head, "an aligned buffer");
      throw IoError(err, "trimming a " + std::to_string(reserve) + "-byte reservation");
    }
    start = aligned;
  }
  data_ = start;
  // A reused buffer is backed by huge pages where the system has them: physically contiguous
  // memory makes each direct-I/O request a few large DMA segments instead of one per 4 KiB
  // page. On our VM's virtio disk, 32 MiB staging buffers allocated once memory was
  // fragmented (8,192 runs each) wrote at 1.9 GB/s against 2.3 in huge pages (16 runs), and
  // 1 MiB requests of scattered pages exceed its 254 segments and are split. The first touch
  // may compact memory (300 ms for 224 MiB here), paid once, when a pool first grows.
  if (reused && huge) (void)madvise(data_, mapped_, MADV_HUGEPAGE);
  if (!lock) return;
  if (mlock(data_, mapped_) == 0) {
    locked_ = true;
    {
      std::lock_guard<std::mutex> g(g_locked_mu);
      locked_ranges()[reinterpret_cast<uintptr_t>(data_)] = mapped_;
    }
    if (reused) {
      std::lock_guard<std::mutex> g(g_reused_mu);
      const auto start = reinterpret_cast<uintptr_t>(data_);
      reused_ranges()[start] = start + mapped_;
      reused_ = true;
    }
  } else if (strict) {
    int err = errno;
    unmap_or_report(data_, mapped_, "an aligned buffer");
    data_ = nullptr;
    throw IoError(err, "mlock of " + std::to_string(nbytes) +
                           " bytes failed (the locked-memory limit, `ulimit -l`, may be too low)");
  }
}

AlignedBuffer::~AlignedBuffer() {
  if (!data_) return;
  if (reused_) {  // out of every engine's registration before the memory goes
    std::lock_guard<std::mutex> g(g_reused_mu);
    reused_ranges().erase(reinterpret_cast<uintptr_t>(data_));
    for (auto* h : holders()) h->forget(data_);
  }
  if (locked_) {
    std::lock_guard<std::mutex> g(g_locked_mu);
    locked_ranges().erase(reinterpret_cast<uintptr_t>(data_));
  }
  unmap_or_report(data_, mapped_, "an aligned buffer");  // also unlocks
}

void unmap_or_report(void* addr, size_t len, const char* what) {
  if (munmap(addr, len) == 0) return;
  // Only callers that cannot throw (destructors, clean-up after an error) come here. The
  // mapping stays: a leak of address space, not a corruption; say so rather than stay silent.
  const int err = errno;
  std::fprintf(stderr, "fastckpt: munmap of %s (%zu bytes at %p) failed: %s; it stays mapped\n",
               what, len, addr, std::strerror(err));
}

std::pair<char*, char*> RegisteredMemory::find(const char* p, uint64_t len) {
  const auto at = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> g(g_reused_mu);
  auto& ranges = reused_ranges();
  auto it = ranges.upper_bound(at);
  if (it == ranges.begin()) return {nullptr, nullptr};
  --it;
  if (at >= it->second || it->second - at < len) return {nullptr, nullptr};
  return {reinterpret_cast<char*>(it->first), reinterpret_cast<char*>(it->second)};
}

namespace {
std::atomic<long> g_registrations{0};
}  // namespace

void RegisteredMemory::count(long delta) { g_registrations += delta; }

long RegisteredMemory::registrations() { return g_registrations.load(); }

long RegisteredMemory::registrations_of(char* begin) {
  std::lock_guard<std::mutex> g(g_reused_mu);
  long n = 0;
  for (auto* h : holders()) n += h->pieces_of(begin);
  return n;
}

void RegisteredMemory::add_holder(Holder* h) {
  std::lock_guard<std::mutex> g(g_reused_mu);
  holders().push_back(h);
}

void RegisteredMemory::remove_holder(Holder* h) {
  std::lock_guard<std::mutex> g(g_reused_mu);
  auto& list = holders();
  list.erase(std::remove(list.begin(), list.end(), h), list.end());
}

bool is_locked(const void* ptr) {
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> g(g_locked_mu);
  auto& ranges = locked_ranges();
  auto it = ranges.upper_bound(p);
  if (it == ranges.begin()) return false;
  --it;
  return p < it->first + it->second;
}

namespace {

// Large copies store with non-temporal (streaming) stores: the destination lines are not read
// first and do not evict the cache. glibc switches to them only for single copies over ~3/4
// of the L3 (240 MiB here), so the 16-32 MiB copies of a save used plain stores: 0.16-0.21 s
// per 2 GiB against 0.11 s streaming.
constexpr size_t kMinStreaming = 1u << 20;

void copy_block(char* dst, const char* src, size_t n) {
#if defined(__x86_64__)
  if (n >= kMinStreaming) {
    const size_t head = (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16;
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    const size_t body = n / 64 * 64;
    for (size_t i = 0; i < body; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    _mm_sfence();  // streaming stores are weakly ordered: publish them before returning
    std::memcpy(dst + body, src + body, n - body);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

}  // namespace

void parallel_memcpy(void* dst, const void* src, size_t n, unsigned threads) {
  auto* out = static_cast<char*>(dst);
  const auto* in = static_cast<const char*>(src);
  // Below a few MiB, handing parts to other threads costs more than it saves.
  constexpr size_t kMinPerThread = 4u << 20;
  threads =
      static_cast<unsigned>(std::max<size_t>(1, std::min<size_t>(threads, n / kMinPerThread)));
  if (threads <= 1) {
    copy_block(out, in, n);
    return;
  }
  const size_t share = (n + threads - 1) / threads / 64 * 64 + 64;
  run_parts(threads, [=](unsigned i) {
    const size_t begin = std::min(n, i * share), end = std::min(n, (i + 1) * share);
    if (begin < end) copy_block(out + begin, in + begin, end - begin);
  });
}

std::vector<uint32_t> parallel_memcpy_crc(void* dst, const void* src, size_t n,
                                          const std::vector<size_t>& cuts, unsigned threads) {
  std::vector<size_t> bounds{0};
  for (size_t cut : cuts) {
    if (cut <= bounds.back() || cut >= n)
      throw std::invalid_argument("segment cuts must ascend strictly within the range");
    bounds.push_back(cut);
  }
  bounds.push_back(n);
  const size_t segments = bounds.size() - 1;
  auto* out = static_cast<char*>(dst);
  const auto* in = static_cast<const char*>(src);
  // A step is checksummed from the source, which brings it into L2, then copied from there
  // with copy_block's streaming stores: memory is read once and written once (checksumming
  // the destination after an ordinary copy measured 4.0 GB/s here against 7+ for this).
  constexpr size_t kStep = 1u << 20;
  constexpr size_t kMinPerThread = 4u << 20;
  threads =
      static_cast<unsigned>(std::max<size_t>(1, std::min<size_t>(threads, n / kMinPerThread)));
  const size_t share = threads <= 1 ? n : (n + threads - 1) / threads / 64 * 64 + 64;
  // partial[part * segments + s]: the CRC32C of the part's bytes of segment s (0 if none)
  std::vector<uint32_t> partial(static_cast<size_t>(threads) * segments, 0);
  auto copy_part = [&](unsigned part) {
    const size_t begin = std::min(n, part * share), end = std::min(n, (part + 1) * share);
    size_t s = std::upper_bound(bounds.begin(), bounds.end(), begin) - bounds.begin() - 1;
    for (size_t at = begin; at < end; ++s) {
      const size_t stop = std::min(end, bounds[s + 1]);
      uint32_t crc = 0;
      for (; at < stop; at += std::min(kStep, stop - at)) {
        const size_t m = std::min(kStep, stop - at);
        crc = crc32c_extend(crc, in + at, m);
        copy_block(out + at, in + at, m);
      }
      partial[static_cast<size_t>(part) * segments + s] = crc;
    }
  };
  if (threads <= 1) {
    copy_part(0);
  } else {
    run_parts(threads, copy_part);
  }
  // Each segment's CRC joined from its parts' in order (CRCs are linear in the bytes).
  std::vector<uint32_t> crcs(segments, 0);
  for (unsigned part = 0; part < threads; ++part) {
    const size_t begin = std::min(n, part * share), end = std::min(n, (part + 1) * share);
    for (size_t s = 0; s < segments; ++s) {
      const size_t lo = std::max(begin, bounds[s]), hi = std::min(end, bounds[s + 1]);
      if (hi > lo) crcs[s] = crc32c_combine(crcs[s], partial[part * segments + s], hi - lo);
    }
  }
  return crcs;
}

std::pair<uint32_t, uint32_t> dio_alignment(int fd) {
#if defined(STATX_DIOALIGN)
  struct statx stx;
  std::memset(&stx, 0, sizeof(stx));
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0 && (stx.stx_mask & STATX_DIOALIGN))
    return {stx.stx_dio_mem_align, stx.stx_dio_offset_align};
#else
  (void)fd;
#endif
  return {0, 0};
}

bool preallocate(int fd, uint64_t nbytes, const std::string& path) {
  if (nbytes == 0) return true;
  for (;;) {
    if (fallocate(fd, 0, 0, static_cast<off_t>(nbytes)) == 0) return true;
    if (errno == EINTR) continue;
    if (errno == EOPNOTSUPP || errno == ENOSYS) return false;
    throw IoError(errno, "reserving " + std::to_string(nbytes) + " bytes", path);
  }
}

}  // namespace fastckpt

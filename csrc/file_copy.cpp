#include "file_copy.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <limits>

#include "crc32c.h"
#include "io_error.h"

namespace fastckpt {
namespace {

// Small enough that a step's bytes are still in L2 when they are checksummed, large enough
// that the system call costs nothing next to the copy.
constexpr size_t kStep = size_t{1} << 20;

void check_range(size_t nbytes, uint64_t offset, const std::vector<size_t>& cuts,
                 const std::string& path) {
  if (offset > static_cast<uint64_t>(std::numeric_limits<off_t>::max()) ||
      nbytes > static_cast<uint64_t>(std::numeric_limits<off_t>::max()) - offset) {
    throw IoError(EOVERFLOW, "byte range past the largest file offset", path);
  }
  size_t last = 0;
  for (size_t cut : cuts) {
    if (cut <= last || cut >= nbytes) {
      throw IoError(EINVAL, "segment cuts must ascend strictly within the range", path);
    }
    last = cut;
  }
}

// Folds bytes [pos, pos + n) of the range into the per-segment CRCs.
class SegmentCrcs {
 public:
  SegmentCrcs(const std::vector<size_t>& cuts, bool enabled) : cuts_(cuts), enabled_(enabled) {
    if (enabled_) crcs_.assign(cuts.size() + 1, 0);
  }
  void feed(const char* base, size_t pos, size_t n) {
    if (!enabled_) return;
    size_t end = pos + n;
    while (pos < end) {
      size_t stop = segment_ < cuts_.size() ? std::min(end, cuts_[segment_]) : end;
      crcs_[segment_] = crc32c_extend(crcs_[segment_], base + pos, stop - pos);
      pos = stop;
      if (segment_ < cuts_.size() && pos == cuts_[segment_]) ++segment_;
    }
  }
  std::vector<uint32_t> take() { return std::move(crcs_); }

 private:
  const std::vector<size_t>& cuts_;
  bool enabled_;
  size_t segment_ = 0;
  std::vector<uint32_t> crcs_;
};

}  // namespace

std::vector<uint32_t> pread_crc(int fd, char* dst, size_t nbytes, uint64_t offset,
                                const std::vector<size_t>& cuts, bool checksum,
                                const std::string& path) {
  check_range(nbytes, offset, cuts, path);
  SegmentCrcs crcs(cuts, checksum);
  size_t pos = 0;
  while (pos < nbytes) {
    size_t want = std::min(kStep, nbytes - pos);
    ssize_t got = ::pread(fd, dst + pos, want, static_cast<off_t>(offset + pos));
    if (got < 0) {
      if (errno == EINTR) continue;
      throw IoError(
          errno,
          "read of " + std::to_string(want) + " bytes at offset " + std::to_string(offset + pos),
          path);
    }
    if (got == 0) {
      throw IoError(ENODATA,
                    "the file ended at byte " + std::to_string(offset + pos) + ", before the " +
                        std::to_string(offset + nbytes) +
                        " the header promises (truncated while being read?)",
                    path);
    }
    crcs.feed(dst, pos, static_cast<size_t>(got));
    pos += static_cast<size_t>(got);
  }
  return crcs.take();
}

std::vector<uint32_t> pwrite_crc(int fd, const char* src, size_t nbytes, uint64_t offset,
                                 const std::vector<size_t>& cuts, bool checksum,
                                 const std::string& path) {
  check_range(nbytes, offset, cuts, path);
  SegmentCrcs crcs(cuts, checksum);
  size_t pos = 0;
  while (pos < nbytes) {
    size_t want = std::min(kStep, nbytes - pos);
    crcs.feed(src, pos, want);  // before the write: the bytes are then hot for the copy
    size_t done = 0;
    while (done < want) {
      ssize_t put =
          ::pwrite(fd, src + pos + done, want - done, static_cast<off_t>(offset + pos + done));
      if (put < 0) {
        if (errno == EINTR) continue;
        throw IoError(errno,
                      "write of " + std::to_string(want - done) + " bytes at offset " +
                          std::to_string(offset + pos + done),
                      path);
      }
      if (put == 0) {
        throw IoError(
            EIO, "write made no progress at offset " + std::to_string(offset + pos + done), path);
      }
      done += static_cast<size_t>(put);
    }
    pos += want;
  }
  return crcs.take();
}

}  // namespace fastckpt

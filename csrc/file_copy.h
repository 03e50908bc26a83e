// Buffered transfers between a file and memory, with a CRC32C per segment computed in the
// same pass (each step's bytes are checksummed while they are still in the CPU's cache).
// Used where the bytes come from or go to memory-speed storage (the page cache, tmpfs):
// there a plain pread/pwrite per thread is the fastest path, and the checksum is nearly free.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace fastckpt {

// Reads exactly `nbytes` at file `offset` into `dst`. `cuts` (ascending, within (0, nbytes))
// split the range into segments; with `checksum`, returns one CRC32C per segment, else an
// empty vector. A short read is continued; end of file before `nbytes` is IoError(ENODATA).
std::vector<uint32_t> pread_crc(int fd, char* dst, size_t nbytes, uint64_t offset,
                                const std::vector<size_t>& cuts, bool checksum,
                                const std::string& path);

// Writes exactly `nbytes` from `src` at file `offset`, checksumming like pread_crc.
std::vector<uint32_t> pwrite_crc(int fd, const char* src, size_t nbytes, uint64_t offset,
                                 const std::vector<size_t>& cuts, bool checksum,
                                 const std::string& path);

}  // namespace fastckpt

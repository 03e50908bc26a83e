// The one direct-I/O alignment fastckpt assumes where the kernel does not report one
// (statx STATX_DIOALIGN): a page. Offsets, lengths and memory of O_DIRECT requests are
// multiples of it. Exposed to Python as fastckpt._C.DIRECT_IO_ALIGNMENT.
#pragma once
#include <cstdint>

namespace fastckpt {

constexpr uint64_t kDirectIoAlignment = 4096;

}  // namespace fastckpt

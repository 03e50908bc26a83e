// CRC32C (Castagnoli), the checksum of iSCSI, ext4 and fastckpt's tensor table.
// Uses the SSE4.2 crc32 instruction when the CPU has it, else a table-driven fallback.
#pragma once
#include <cstddef>
#include <cstdint>

namespace fastckpt {

// Extends `crc` (the CRC32C of earlier bytes; 0 to start) with n bytes at data.
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n);
// The CRC32C of bytes A + B from crc_a, crc_b and B's length (pieces checksummed apart).
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);
bool crc32c_hardware();

}  // namespace fastckpt

// CRC32C (Castagnoli), the checksum of iSCSI, ext4 and fastckpt's tensor table.
// Uses the SSE4.2 crc32 instruction when the CPU has it, else a table-driven fallback.
#pragma once
#include <cstddef>
#include <cstdint>

namespace fastckpt {

// Extends `crc` (the CRC32C of earlier bytes; 0 to start) with n bytes at data.
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n);
bool crc32c_hardware();

}  // namespace fastckpt

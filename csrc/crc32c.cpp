#include "crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define FASTCKPT_X86 1
#endif

namespace fastckpt {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // CRC32C, reflected

struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1) ? kPoly : 0);
      t[0][i] = c;
    }
    for (int s = 1; s < 8; ++s)
      for (uint32_t i = 0; i < 256; ++i) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
  }
};

uint32_t crc_software(uint32_t c, const unsigned char* p, size_t n) {
  static const Tables tables;
  const auto& t = tables.t;
  while (n >= 8) {  // slicing-by-8
    uint64_t v;
    std::memcpy(&v, p, 8);
    v ^= c;
    c = t[7][v & 0xff] ^ t[6][(v >> 8) & 0xff] ^ t[5][(v >> 16) & 0xff] ^ t[4][(v >> 24) & 0xff] ^
        t[3][(v >> 32) & 0xff] ^ t[2][(v >> 40) & 0xff] ^ t[1][(v >> 48) & 0xff] ^ t[0][v >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xff];
  return c;
}

#ifdef FASTCKPT_X86
__attribute__((target("sse4.2"))) uint32_t crc_hardware(uint32_t c, const unsigned char* p,
                                                        size_t n) {
  uint64_t c64 = c;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c64 = _mm_crc32_u64(c64, v);
    p += 8;
    n -= 8;
  }
  c = static_cast<uint32_t>(c64);
  while (n--) c = _mm_crc32_u8(c, *p++);
  return c;
}
#endif

bool detect_hardware() {
#ifdef FASTCKPT_X86
  return __builtin_cpu_supports("sse4.2");
#else
  return false;
#endif
}

const bool g_hardware = detect_hardware();

uint32_t crc_raw(uint32_t c, const unsigned char* p, size_t n) {
#ifdef FASTCKPT_X86
  if (g_hardware) return crc_hardware(c, p, n);
#endif
  return crc_software(c, p, n);
}

}  // namespace

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n) {
  return ~crc_raw(~crc, static_cast<const unsigned char*>(data), n);
}

bool crc32c_hardware() { return g_hardware; }

}  // namespace fastckpt

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

// Carry-less product of a and b modulo the CRC polynomial (both reflected).
uint32_t multiply_mod_poly(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t bit = 1u << 31; bit; bit >>= 1) {
    if (a & bit) product ^= b;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return product;
}

// x^(8 n) modulo the polynomial: multiplying a CRC register by it appends n zero bytes.
uint32_t x_pow_8n(uint64_t n) {
  uint32_t result = 1u << 31;  // x^0
  uint32_t square = 1u << 23;  // x^8
  for (; n; n >>= 1) {
    if (n & 1) result = multiply_mod_poly(square, result);
    square = multiply_mod_poly(square, square);
  }
  return result;
}

#ifdef FASTCKPT_X86
__attribute__((target("sse4.2"))) uint32_t crc_hardware_serial(uint64_t c, const unsigned char* p,
                                                               size_t n) {
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}

// The crc32 instruction has a latency of 3 cycles but issues every cycle: three independent
// lanes over adjacent stripes keep it busy, and their registers are joined by shifting the
// earlier lanes past the later stripes (CRC registers are linear in the data).
constexpr size_t kStripe = 8192;

__attribute__((target("sse4.2"))) uint32_t crc_hardware(uint32_t c, const unsigned char* p,
                                                        size_t n) {
  static const uint32_t shift_one = x_pow_8n(kStripe);
  static const uint32_t shift_two = x_pow_8n(2 * kStripe);
  uint64_t c0 = c;
  while (n >= 3 * kStripe) {
    uint64_t c1 = 0, c2 = 0;
    const unsigned char* p1 = p + kStripe;
    const unsigned char* p2 = p + 2 * kStripe;
    for (size_t i = 0; i < kStripe; i += 8) {
      uint64_t v0, v1, v2;
      std::memcpy(&v0, p + i, 8);
      std::memcpy(&v1, p1 + i, 8);
      std::memcpy(&v2, p2 + i, 8);
      c0 = _mm_crc32_u64(c0, v0);
      c1 = _mm_crc32_u64(c1, v1);
      c2 = _mm_crc32_u64(c2, v2);
    }
    c0 = multiply_mod_poly(shift_two, static_cast<uint32_t>(c0)) ^
         multiply_mod_poly(shift_one, static_cast<uint32_t>(c1)) ^ static_cast<uint32_t>(c2);
    p += 3 * kStripe;
    n -= 3 * kStripe;
  }
  return crc_hardware_serial(c0, p, n);
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

uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  // Appending len_b zero bytes multiplies a register by x^(8 len_b); the pre- and
  // post-inversions of A's and B's CRCs cancel, as in zlib's crc32_combine.
  return len_b ? multiply_mod_poly(x_pow_8n(len_b), crc_a) ^ crc_b : crc_a;
}

bool crc32c_hardware() { return g_hardware; }

}  // namespace fastckpt

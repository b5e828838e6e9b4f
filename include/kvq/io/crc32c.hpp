#pragma once
/// \file crc32c.hpp
/// CRC-32C (Castagnoli, polynomial 0x1EDC6F41, reflected 0x82F63B78, initial value and final
/// xor 0xFFFFFFFF): the checksum of iSCSI, ext4, LevelDB and kvq archives (io/archive.hpp). It
/// detects every burst of up to 32 flipped bits and every odd number of flipped bits.
///
/// Two implementations, one answer:
///   crc32c_portable  table-driven, slicing by 8 (eight 256-entry tables built at compile
///                    time): any CPU, the oracle the tests compare the fast path against;
///   crc32c_hw        the SSE4.2 CRC32 instruction (8 bytes per _mm_crc32_u64), on x86-64 with
///                    GCC or Clang, compiled with a target attribute so it exists without
///                    -msse4.2 and used only when the CPU reports SSE4.2 (or the build targets
///                    it). KVQ_NO_SIMD (and nvcc translation units) leave it out.
/// crc32c() picks the fast one. All three take a running value, so the checksum of a stream is
/// computed piece by piece: crc32c(b, nb, crc32c(a, na)) == crc32c(a ++ b).
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvq/config.hpp"
#include "kvq/core/endian.hpp"

#if !defined(KVQ_NO_SIMD) && !defined(__CUDACC__) && (defined(__x86_64__) || defined(_M_X64)) && \
    (defined(__GNUC__) || defined(__clang__))
#define KVQ_CRC32C_HW 1
#include <nmmintrin.h>
#else
#define KVQ_CRC32C_HW 0
#endif

namespace kvq::io {

namespace detail {

/// The eight slicing tables: t[0] is the byte table, t[k][b] the CRC of byte b followed by k
/// zero bytes.
struct Crc32cTables {
  uint32_t t[8][256];
};

constexpr Crc32cTables make_crc32c_tables() {
  Crc32cTables c{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t r = b;
    for (int k = 0; k < 8; ++k) r = (r >> 1) ^ (0x82F63B78u & (0u - (r & 1u)));
    c.t[0][b] = r;
  }
  for (uint32_t b = 0; b < 256; ++b)
    for (int k = 1; k < 8; ++k) c.t[k][b] = (c.t[k - 1][b] >> 8) ^ c.t[0][c.t[k - 1][b] & 0xFFu];
  return c;
}

inline constexpr Crc32cTables kCrc32cTables = make_crc32c_tables();

}  // namespace detail

/// CRC-32C of data[0, n) continuing from `crc` (0 for a fresh checksum): table-driven, any CPU.
inline uint32_t crc32c_portable(const void* data, std::size_t n, uint32_t crc = 0) {
  const auto& T = detail::kCrc32cTables.t;
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  for (; n > 0 && (reinterpret_cast<std::uintptr_t>(p) & 7u) != 0; --n) c = (c >> 8) ^ T[0][(c ^ *p++) & 0xFFu];
  for (; n >= 8; n -= 8, p += 8) {
    const uint32_t lo = endian::get_u32(p) ^ c, hi = endian::get_u32(p + 4);
    c = T[7][lo & 0xFFu] ^ T[6][(lo >> 8) & 0xFFu] ^ T[5][(lo >> 16) & 0xFFu] ^ T[4][lo >> 24] ^
        T[3][hi & 0xFFu] ^ T[2][(hi >> 8) & 0xFFu] ^ T[1][(hi >> 16) & 0xFFu] ^ T[0][hi >> 24];
  }
  for (; n > 0; --n) c = (c >> 8) ^ T[0][(c ^ *p++) & 0xFFu];
  return ~c;
}

#if KVQ_CRC32C_HW
/// True when this CPU executes SSE4.2 (the CRC32 instruction).
inline bool crc32c_hw_available() {
#if defined(__SSE4_2__)
  return true;
#else
  static const bool ok = __builtin_cpu_supports("sse4.2");
  return ok;
#endif
}

/// CRC-32C with the SSE4.2 CRC32 instruction (call only when crc32c_hw_available()).
__attribute__((target("sse4.2"))) inline uint32_t crc32c_hw(const void* data, std::size_t n,
                                                            uint32_t crc = 0) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t c = ~crc;
  for (; n > 0 && (reinterpret_cast<std::uintptr_t>(p) & 7u) != 0; --n)
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);  // little-endian x86: the instruction consumes bytes in order
    c = _mm_crc32_u64(c, w);
  }
  for (; n > 0; --n) c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
  return ~static_cast<uint32_t>(c);
}
#else
inline bool crc32c_hw_available() { return false; }
/// Without a hardware path this is the portable implementation.
inline uint32_t crc32c_hw(const void* data, std::size_t n, uint32_t crc = 0) {
  return crc32c_portable(data, n, crc);
}
#endif

/// CRC-32C of data[0, n) continuing from `crc`: the hardware path where the CPU has one.
inline uint32_t crc32c(const void* data, std::size_t n, uint32_t crc = 0) {
  if (n == 0) return crc;
  return crc32c_hw_available() ? crc32c_hw(data, n, crc) : crc32c_portable(data, n, crc);
}

/// Name of the implementation crc32c() uses on this machine ("sse4.2" or "table").
inline const char* crc32c_impl() { return crc32c_hw_available() ? "sse4.2" : "table"; }

}  // namespace kvq::io

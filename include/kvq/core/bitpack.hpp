#pragma once
/// \file bitpack.hpp
/// Dense bit packing of b-bit codes (b = 1..8) into a little-endian bitstream: code i occupies
/// bits [i*b, (i+1)*b) counted from bit 0 of byte 0, least significant bit first. 3-, 5-, 6- and
/// 7-bit codes are packed densely (8 codes of 3 bits in 3 bytes), never padded to a nibble.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvq/core/error.hpp"

namespace kvq {

/// Bytes needed for n codes of `bits` bits: ceil(n * bits / 8).
constexpr std::size_t packed_bytes(std::size_t n, int bits) {
  return (n * static_cast<std::size_t>(bits) + 7) / 8;
}

namespace detail {
inline void check_bits(int bits) {
  KVQ_REQUIRE(bits >= 1 && bits <= 8, kInvalidArgument, "code width must be 1..8 bits, got ",
              bits);
}
}  // namespace detail

/// Writes n codes (each < 2^bits; higher bits are masked off) into `out` starting at bit
/// `bit_offset`. Bits of `out` outside [bit_offset, bit_offset + n*bits) are preserved.
inline void pack_bits(const uint8_t* codes, std::size_t n, int bits, uint8_t* out,
                      std::size_t bit_offset = 0) {
  detail::check_bits(bits);
  if (n == 0) return;
  const uint32_t mask = (1u << bits) - 1u;
  if (bit_offset % 8 == 0) {
    uint8_t* o = out + bit_offset / 8;
    std::size_t i = 0;
    if (bits == 8) {
      std::memcpy(o, codes, n);
      return;
    }
    if (bits == 4) {
      for (; i + 2 <= n; i += 2) *o++ = static_cast<uint8_t>((codes[i] & 15u) | (codes[i + 1] << 4));
      if (i < n) *o = static_cast<uint8_t>((*o & 0xf0u) | (codes[i] & 15u));
      return;
    }
    if (bits == 2) {
      for (; i + 4 <= n; i += 4)
        *o++ = static_cast<uint8_t>((codes[i] & 3u) | ((codes[i + 1] & 3u) << 2) |
                                    ((codes[i + 2] & 3u) << 4) | ((codes[i + 3] & 3u) << 6));
      if (i == n) return;
      bit_offset = static_cast<std::size_t>(o - out) * 8;
      codes += i;
      n -= i;
    }
  }
  // General path: accumulate into a 64-bit window.
  std::size_t byte = bit_offset / 8;
  unsigned shift = static_cast<unsigned>(bit_offset % 8);
  uint64_t acc = out[byte] & ((1u << shift) - 1u);  // keep the bits before bit_offset
  for (std::size_t i = 0; i < n; ++i) {
    acc |= static_cast<uint64_t>(codes[i] & mask) << shift;
    shift += static_cast<unsigned>(bits);
    while (shift >= 8) {
      out[byte++] = static_cast<uint8_t>(acc);
      acc >>= 8;
      shift -= 8;
    }
  }
  if (shift > 0) {  // partial last byte: merge with the bits that follow
    const uint8_t keep = static_cast<uint8_t>(~((1u << shift) - 1u));
    out[byte] = static_cast<uint8_t>((out[byte] & keep) | (acc & ~keep & 0xffu));
  }
}

/// Reads n codes of `bits` bits starting at bit `bit_offset` of `in`.
inline void unpack_bits(const uint8_t* in, std::size_t n, int bits, uint8_t* codes,
                        std::size_t bit_offset = 0) {
  detail::check_bits(bits);
  if (n == 0) return;
  const uint32_t mask = (1u << bits) - 1u;
  if (bit_offset % 8 == 0) {
    const uint8_t* p = in + bit_offset / 8;
    std::size_t i = 0;
    if (bits == 8) {
      std::memcpy(codes, p, n);
      return;
    }
    if (bits == 4) {
      for (; i + 2 <= n; i += 2, ++p) {
        codes[i] = *p & 15u;
        codes[i + 1] = *p >> 4;
      }
      if (i < n) codes[i] = *p & 15u;
      return;
    }
    if (bits == 2) {
      for (; i + 4 <= n; i += 4, ++p) {
        codes[i] = *p & 3u;
        codes[i + 1] = (*p >> 2) & 3u;
        codes[i + 2] = (*p >> 4) & 3u;
        codes[i + 3] = *p >> 6;
      }
      for (unsigned s = 0; i < n; ++i, s += 2) codes[i] = (*p >> s) & 3u;
      return;
    }
  }
  std::size_t byte = bit_offset / 8;
  unsigned avail = 8 - static_cast<unsigned>(bit_offset % 8);
  uint64_t acc = static_cast<uint64_t>(in[byte++]) >> (bit_offset % 8);
  for (std::size_t i = 0; i < n; ++i) {
    while (avail < static_cast<unsigned>(bits)) {
      acc |= static_cast<uint64_t>(in[byte++]) << avail;
      avail += 8;
    }
    codes[i] = static_cast<uint8_t>(acc & mask);
    acc >>= bits;
    avail -= static_cast<unsigned>(bits);
  }
}

}  // namespace kvq

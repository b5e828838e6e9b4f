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
/// Packs the 8 codes in the bytes of c (byte j = code j, each < 2^bits, bits <= 8) LSB-first
/// into the low 8 * bits bits of the result: three shift-and-mask steps instead of 8 shifts.
constexpr uint64_t pack8_codes(uint64_t c, int bits) {
  c = (c & 0x00ff00ff00ff00ffull) | (((c >> 8) & 0x00ff00ff00ff00ffull) << bits);
  c = (c & 0x0000ffff0000ffffull) | (((c >> 16) & 0x0000ffff0000ffffull) << (2 * bits));
  return (c & 0xffffffffull) | ((c >> 32) << (4 * bits));
}

/// The whole 8-code chunks of codes[i..n) at B = 3, 5, 6 or 7 bits, from the byte-aligned o:
/// 8 codes are exactly B bytes, packed in a 64-bit word (pack8_codes). A chunk is stored as 8
/// bytes while 8 bytes of the range remain (the extra bytes belong to the chunks after it,
/// which rewrite them), otherwise as exactly B bytes. Advances i; returns the next byte.
template <int B>
inline uint8_t* pack8_chunks(const uint8_t* codes, std::size_t n, std::size_t& i, uint8_t* o) {
  constexpr uint64_t m8 = 0x0101010101010101ull * ((1u << B) - 1u);
  for (; i + 8 <= n; i += 8, o += B) {
    uint64_t c = 0;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    std::memcpy(&c, codes + i, 8);
#else
    for (int j = 0; j < 8; ++j) c |= static_cast<uint64_t>(codes[i + j]) << (8 * j);
#endif
    const uint64_t p = pack8_codes(c & m8, B);
    if ((n - i) * B >= 64) {  // 8 whole bytes of the range remain from o
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
      std::memcpy(o, &p, 8);
#else
      for (int j = 0; j < 8; ++j) o[j] = static_cast<uint8_t>(p >> (8 * j));
#endif
    } else {
      for (int j = 0; j < B; ++j) o[j] = static_cast<uint8_t>(p >> (8 * j));
    }
  }
  return o;
}

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
    } else if (bits >= 3) {
      // 3, 5, 6, 7 bits: 8 codes at a time (pack8_chunks).
      switch (bits) {
        case 3: o = detail::pack8_chunks<3>(codes, n, i, o); break;
        case 5: o = detail::pack8_chunks<5>(codes, n, i, o); break;
        case 6: o = detail::pack8_chunks<6>(codes, n, i, o); break;
        default: o = detail::pack8_chunks<7>(codes, n, i, o); break;
      }
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

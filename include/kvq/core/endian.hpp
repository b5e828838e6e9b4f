#pragma once
/// \file endian.hpp
/// The one little-endian helper of kvq: the host's byte order, and loads and stores of
/// little-endian integers and IEEE floats at unaligned byte addresses, independent of the host's
/// byte order. Every file format (io/archive, io/crc32c, the model runners' readers) uses these.
#include <cstdint>
#include <cstring>

namespace kvq {
namespace endian {

/// True on a little-endian host (x86, ARM as used): the file formats' byte order.
inline bool host_little_endian() {
  const uint32_t x = 1;
  unsigned char b;
  std::memcpy(&b, &x, 1);
  return b == 1;
}

inline uint16_t get_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | p[1] << 8); }
inline uint32_t get_u32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}
inline uint64_t get_u64(const uint8_t* p) {
  return static_cast<uint64_t>(get_u32(p)) | static_cast<uint64_t>(get_u32(p + 4)) << 32;
}
inline int32_t get_i32(const uint8_t* p) {
  const uint32_t u = get_u32(p);
  int32_t v;
  std::memcpy(&v, &u, 4);
  return v;
}
inline int64_t get_i64(const uint8_t* p) {
  const uint64_t u = get_u64(p);
  int64_t v;
  std::memcpy(&v, &u, 8);
  return v;
}
inline float get_f32(const uint8_t* p) {
  const uint32_t u = get_u32(p);
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}
inline double get_f64(const uint8_t* p) {
  const uint64_t u = get_u64(p);
  double v;
  std::memcpy(&v, &u, 8);
  return v;
}
inline void put_u16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}
inline void put_u32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
inline void put_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
inline void put_i32(uint8_t* p, int32_t v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  put_u32(p, u);
}
inline void put_i64(uint8_t* p, int64_t v) {
  uint64_t u;
  std::memcpy(&u, &v, 8);
  put_u64(p, u);
}
inline void put_f32(uint8_t* p, float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  put_u32(p, u);
}
inline void put_f64(uint8_t* p, double v) {
  uint64_t u;
  std::memcpy(&u, &v, 8);
  put_u64(p, u);
}

}  // namespace endian
}  // namespace kvq

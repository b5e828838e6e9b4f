#pragma once
/// \file fuzz_util.hpp
/// Shared pieces of kvq's fuzz targets (tests/fuzz/fuzz_*.cpp).
///
/// Every target defines LLVMFuzzerTestOneInput and follows one rule: hostile bytes may only
/// end in a value or in a kvq::Error. The targets catch kvq::Error and nothing else, so any
/// other exception (std::bad_alloc from an unchecked size, std::out_of_range, ...) escapes and
/// libFuzzer reports it as a crash, like a sanitizer report or a failed KVQ_FUZZ_CHECK. Where
/// an input is accepted, each target also checks a property of the result (a round trip, an
/// oracle, finiteness), so a parser that returns garbage fails as loudly as one that crashes.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

/// Aborts (a crash libFuzzer records with its input) when `cond` is false.
#define KVQ_FUZZ_CHECK(cond)                                                                \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      std::fprintf(stderr, "%s:%d: fuzz property failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                         \
    }                                                                                       \
  } while (0)

namespace kvq::fuzz {

/// Takes typed values off the front of the input (zero when exhausted), so a target can derive
/// its parameters from the first bytes and use the rest as payload.
class ByteReader {
 public:
  ByteReader(const uint8_t* data, size_t size) : p_(data), n_(size) {}
  uint8_t u8() {
    if (n_ == 0) return 0;
    --n_;
    return *p_++;
  }
  uint16_t u16() { return static_cast<uint16_t>(u8() | (u8() << 8)); }
  uint64_t u64() {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(u8()) << (8 * i);
    return v;
  }
  /// Fills dst[0, n) from the input, then with zeros once it is exhausted.
  void fill(uint8_t* dst, size_t n) {
    const size_t k = n < n_ ? n : n_;
    if (k) std::memcpy(dst, p_, k);
    if (n > k) std::memset(dst + k, 0, n - k);
    p_ += k;
    n_ -= k;
  }
  size_t left() const { return n_; }

 private:
  const uint8_t* p_;
  size_t n_;
};

/// Bitwise equality of two floats, with every NaN equal to every other NaN (payloads may
/// legitimately differ between a vectorized and a scalar path).
inline bool same_float(float a, float b) {
  if (std::isnan(a) && std::isnan(b)) return true;
  uint32_t x, y;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  return x == y;
}

}  // namespace kvq::fuzz

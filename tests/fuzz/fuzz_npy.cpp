/// \file fuzz_npy.cpp
/// Fuzz target: kvq::io::read_npy_bytes (the .npy reader, every header version).
/// Property on success: the array is self-consistent, and encoding it with kvq's writer and
/// reading it back gives the same dtype, shape and bytes (fortran_order data comes back in C
/// order, which is what the reader returned).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fuzz_util.hpp"
#include "kvq/io/npy.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvq::io::Array a;
  kvq::io::NpyReadOptions opt;
  // The last byte picks the reader option, so both ways of reading '<u2'/'<i2' get fuzzed.
  opt.raw_u16_as_bf16 = size > 0 && (data[size - 1] & 1);
  try {
    a = kvq::io::read_npy_bytes(data, size, opt, "fuzz.npy");
  } catch (const kvq::Error&) {
    return 0;
  }
  a.validate("fuzz_npy result");  // throws (escapes: a crash) when bytes and shape disagree
  const std::vector<uint8_t> again = kvq::io::encode_npy(a);
  const kvq::io::Array b = kvq::io::read_npy_bytes(again.data(), again.size(), {}, "re-encoded");
  KVQ_FUZZ_CHECK(b.dtype == a.dtype);
  KVQ_FUZZ_CHECK(b.shape == a.shape);
  KVQ_FUZZ_CHECK(b.bytes == a.bytes);
  return 0;
}

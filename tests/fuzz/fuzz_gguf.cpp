/// \file fuzz_gguf.cpp
/// Fuzz target: kvq::io::GgufFile::parse (GGUF v2/v3 header, metadata of every value type,
/// nested arrays, tensor infos, alignment and the bounds of the data section), then the typed
/// metadata getters and the dequantization of every tensor (F32, F16, BF16, Q4_0, Q4_1, Q5_0,
/// Q5_1, Q8_0, Q4_K, Q5_K, Q6_K).
/// Properties on success: every tensor's bytes lie inside the buffer (ASan checks the reads:
/// the parser works on an exact-size copy), unsupported types are refused with kvq::Error, and
/// F32/F16/BF16 tensors dequantize to exactly their stored values.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fuzz_util.hpp"
#include "kvq/core/half.hpp"
#include "kvq/io/gguf.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvq::io::GgufFile f;
  try {
    f = kvq::io::GgufFile::parse(data, size, "fuzz.gguf");
  } catch (const kvq::Error& e) {
    KVQ_FUZZ_CHECK(e.kind() == kvq::ErrorKind::kIo);
    return 0;
  }
  // Typed getters on every key: a value or a kvq::Error, never anything else.
  for (const std::string& k : f.metadata_keys()) {
    try {
      (void)f.get_int(k);
    } catch (const kvq::Error&) {
    }
    try {
      (void)f.get_float(k);
    } catch (const kvq::Error&) {
    }
    try {
      (void)f.get_string(k);
    } catch (const kvq::Error&) {
    }
    try {
      (void)f.get_strings(k);
    } catch (const kvq::Error&) {
    }
    try {
      (void)f.get_ints(k);
    } catch (const kvq::Error&) {
    }
    try {
      (void)f.get_bool_or(k, false);
    } catch (const kvq::Error&) {
    }
  }
  for (const kvq::io::GgufTensorInfo& t : f.tensors()) {
    KVQ_FUZZ_CHECK(f.data_offset() + t.offset + t.n_bytes <= size);
    std::vector<float> v;
    try {
      v = f.dequantize_tensor(t.name);
    } catch (const kvq::Error&) {
      KVQ_FUZZ_CHECK(!kvq::io::ggml_type_traits(t.type).dequantizable);
      continue;
    }
    KVQ_FUZZ_CHECK(static_cast<int64_t>(v.size()) == t.n_elements);
    const uint8_t* raw = f.tensor_data(t);
    for (size_t i = 0; i < v.size(); ++i) {
      if (t.type == 0) {
        float x;
        std::memcpy(&x, raw + 4 * i, 4);
        KVQ_FUZZ_CHECK(kvq::fuzz::same_float(v[i], x));
      } else if (t.type == 1 || t.type == 30) {
        uint16_t h;
        std::memcpy(&h, raw + 2 * i, 2);
        KVQ_FUZZ_CHECK(kvq::fuzz::same_float(
            v[i], t.type == 1 ? kvq::half_bits_to_float(h) : kvq::bf16_bits_to_float(h)));
      }
    }
  }
  return 0;
}

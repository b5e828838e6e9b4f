/// \file fuzz_safetensors.cpp
/// Fuzz target: kvq::io::read_safetensors_bytes (length prefix, JSON header, entry checks,
/// exact tiling of the data buffer, tensor reads).
/// Property on success: every tensor is self-consistent, and re-encoding the file with kvq's
/// writer and reading it back gives the same tensors and metadata.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fuzz_util.hpp"
#include "kvq/io/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvq::io::SafetensorsFile f;
  try {
    f = kvq::io::read_safetensors_bytes(data, size, "fuzz.safetensors");
  } catch (const kvq::Error&) {
    return 0;
  }
  for (const auto& [name, a] : f.tensors) a.validate("fuzz_safetensors tensor " + name);
  const std::vector<uint8_t> again = kvq::io::encode_safetensors(f.tensors, f.metadata);
  const kvq::io::SafetensorsFile g =
      kvq::io::read_safetensors_bytes(again.data(), again.size(), "re-encoded");
  KVQ_FUZZ_CHECK(g.metadata == f.metadata);
  KVQ_FUZZ_CHECK(g.tensors.size() == f.tensors.size());
  for (const auto& [name, a] : f.tensors) {
    const auto it = g.tensors.find(name);
    KVQ_FUZZ_CHECK(it != g.tensors.end());
    KVQ_FUZZ_CHECK(it->second.dtype == a.dtype);
    KVQ_FUZZ_CHECK(it->second.shape == a.shape);
    KVQ_FUZZ_CHECK(it->second.bytes == a.bytes);
  }
  return 0;
}

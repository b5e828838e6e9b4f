/// \file fuzz_kv_dump.cpp
/// Fuzz target: kvq::io::load_kv_dump_bytes (a .safetensors KV dump: the safetensors reader,
/// then tensor-name parsing, layer assembly and the dump convention's shape rules).
/// Properties on success: the dump passes validate_kv_dump, every layer covers the same
/// tokens, and each tensor converts to floats of exactly numel elements.
#include <cstddef>
#include <cstdint>

#include "fuzz_util.hpp"
#include "kvq/io/kv_dump.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvq::io::KVDump d;
  try {
    d = kvq::io::load_kv_dump_bytes(data, size, "fuzz-dump.safetensors");
  } catch (const kvq::Error& e) {
    KVQ_FUZZ_CHECK(e.kind() == kvq::ErrorKind::kIo);
    return 0;
  }
  kvq::io::validate_kv_dump(d, "fuzzed dump");  // a throw escapes: accepted but invalid
  KVQ_FUZZ_CHECK(d.num_layers() > 0 && d.tokens() > 0);
  for (const auto& l : d.layers) {
    KVQ_FUZZ_CHECK(l.k.shape[0] == d.tokens());
    KVQ_FUZZ_CHECK(static_cast<int64_t>(l.k.to_float().size()) == l.k.numel());
    KVQ_FUZZ_CHECK(static_cast<int64_t>(l.v.to_float().size()) == l.v.numel());
  }
  return 0;
}

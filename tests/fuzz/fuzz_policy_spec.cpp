/// \file fuzz_policy_spec.cpp
/// Fuzz target: kvq::parse_policies / parse_policy (the --policy grammar, presets, skip,
/// skipas, per-layer overrides) and parse_quant_config.
/// Properties on success: the parsed policy validates (the parser never accepts what the
/// cache would refuse), its canonical spec() parses back to an equal policy, and spec() is a
/// fixed point (canonical twice gives the same text).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_util.hpp"
#include "kvq/policy/spec.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  bool parsed = false;
  kvq::QuantConfig c;
  try {
    c = kvq::parse_quant_config(text);
    kvq::validate_config(c, "fuzzed term", true);
    parsed = true;
  } catch (const kvq::Error& e) {
    KVQ_FUZZ_CHECK(e.kind() == kvq::ErrorKind::kParse);
  }
  // Outside the try: the canonical term of an accepted config must parse (a throw escapes).
  if (parsed) KVQ_FUZZ_CHECK(kvq::same_config(kvq::parse_quant_config(kvq::config_spec(c)), c));
  std::vector<kvq::Policy> ps;
  try {
    ps = kvq::parse_policies(text);
  } catch (const kvq::Error& e) {
    KVQ_FUZZ_CHECK(e.kind() == kvq::ErrorKind::kParse);
    return 0;
  }
  for (const kvq::Policy& p : ps) {
    p.validate();  // a throw escapes: the parser accepted a policy the cache would refuse
    const std::string s = p.spec();
    const kvq::Policy back = kvq::parse_policy(s);
    KVQ_FUZZ_CHECK(back == p);
    KVQ_FUZZ_CHECK(back.spec() == s);
  }
  return 0;
}

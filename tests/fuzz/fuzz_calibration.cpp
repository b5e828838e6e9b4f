/// \file fuzz_calibration.cpp
/// Fuzz target: kvq::parse_calibration (the JSON calibration files of nuq codebooks: format,
/// version, spec, layer count, per-(layer, K/V) codebooks).
/// Properties on success: the policy is calibrated for its layer count (check_calibrated), and
/// writing it back with calibration_json and parsing that gives an equal policy with equal
/// codebooks.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fuzz_util.hpp"
#include "kvq/io/calibration_file.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  kvq::CalibrationFile f;
  try {
    f = kvq::parse_calibration(text, "fuzz.json");
  } catch (const kvq::Error& e) {
    KVQ_FUZZ_CHECK(e.kind() == kvq::ErrorKind::kParse);
    return 0;
  }
  kvq::check_calibrated(f.policy, f.n_layers);  // a throw escapes: accepted but unusable
  const std::string again = kvq::calibration_json(f.policy, f.n_layers, "fuzz");
  const kvq::CalibrationFile g = kvq::parse_calibration(again, "re-written");
  KVQ_FUZZ_CHECK(g.n_layers == f.n_layers);
  KVQ_FUZZ_CHECK(g.policy == f.policy);
  for (int l = 0; l < f.n_layers; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      const kvq::QuantConfig a =
          kv ? f.policy.value_for(l, f.n_layers) : f.policy.key_for(l, f.n_layers);
      const kvq::QuantConfig b =
          kv ? g.policy.value_for(l, f.n_layers) : g.policy.key_for(l, f.n_layers);
      if (a.format != kvq::Format::kNuq) continue;
      for (int i = 0; i < (1 << a.bits); ++i)
        KVQ_FUZZ_CHECK(kvq::fuzz::same_float(a.nuq_levels[static_cast<std::size_t>(i)],
                                             b.nuq_levels[static_cast<std::size_t>(i)]));
    }
  }
  return 0;
}

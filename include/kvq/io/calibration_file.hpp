#pragma once
/// \file calibration_file.hpp
/// Calibration from a KV dump and the calibration file of a calibrated policy (policy/calibrate.hpp
/// learns the nuq codebooks; this header reads and writes what it learned).
///
/// File format (JSON, UTF-8):
///   {"format": "kvq-calibration", "version": 1,
///    "spec": "<Policy::spec() of the calibrated policy: per-layer overrides included>",
///    "n_layers": L, "weights": "sensitivity" | "uniform", "source": "<free text>",
///    "codebooks": [{"layer": l, "tensor": "k" | "v", "bits": b, "levels": [2^b numbers]}, ...],
///    "tensor_scales": [{"layer": l, "tensor": "k" | "v", "scale": g}, ...]}
/// "tensor_scales" (optional; NVFP4 layers whose scale differs from 1) holds the calibrated
/// per-tensor decode scales, which the spec grammar does not spell.
/// Levels are written with 9 significant digits (float round trip is exact). load_calibration
/// rejects, with a kParse error naming the file and the field: other formats or versions,
/// missing or mistyped fields, a spec that does not parse, layers outside [0, L), a codebook for
/// a (layer, tensor) whose config is not nuq or has other bits, duplicates, a level count other
/// than 2^b, non-finite or non-ascending levels, and a nuq (layer, tensor) without a codebook.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvq/core/error.hpp"
#include "kvq/format/nuq.hpp"
#include "kvq/io/json.hpp"
#include "kvq/io/kv_dump.hpp"
#include "kvq/policy/calibrate.hpp"
#include "kvq/policy/spec.hpp"

namespace kvq {

/// A calibration set from a KV dump (one sequence). `prerope_keys`: learn key codebooks on the
/// dump's pre-RoPE keys (k_prerope, required then), as a pre-RoPE cache quantizes them.
inline CalibrationSet calibration_set_from_dump(const io::KVDump& dump, bool prerope_keys) {
  io::validate_kv_dump(dump);
  CalibrationSet s;
  s.n_layers = static_cast<int>(dump.num_layers());
  KVQ_REQUIRE(s.n_layers > 0, kInvalidArgument, "calibrate: the KV dump has no layers");
  const auto& l0 = dump.layers[0];
  s.kv_heads = static_cast<int>(l0.k.shape[1]);
  s.head_dim = static_cast<int>(l0.k.shape[2]);
  s.q_heads = l0.q ? static_cast<int>(l0.q->shape[1]) : 0;
  CalibrationSet::Sequence seq;
  seq.tokens = dump.tokens();
  for (const auto& L : dump.layers) {
    CalibrationSet::Layer cl;
    KVQ_REQUIRE(!prerope_keys || L.k_prerope, kInvalidArgument,
                "calibrate: pre-RoPE keys requested but the KV dump has no k_prerope arrays");
    cl.k = prerope_keys ? L.k_prerope->to_float() : L.k.to_float();
    cl.k_attn = L.k.to_float();
    cl.v = L.v.to_float();
    if (L.q && s.q_heads > 0) cl.q = L.q->to_float();
    seq.layers.push_back(std::move(cl));
  }
  s.sequences.push_back(std::move(seq));
  return s;
}

/// Calibrates on a KV dump (see calibration_set_from_dump).
inline Policy calibrate(const Policy& policy, const io::KVDump& dump, bool prerope_keys,
                        const CalibrationOptions& opt = {}) {
  return calibrate(policy, calibration_set_from_dump(dump, prerope_keys), opt);
}

/// The JSON text of a calibrated policy for an n_layers model (format in the file comment).
inline std::string calibration_json(const Policy& p, int n_layers, const std::string& source = "",
                                    CalibrationWeights weights = CalibrationWeights::kSensitivity) {
  check_calibrated(p, n_layers);
  std::ostringstream o;
  o << "{\n  \"format\": \"kvq-calibration\",\n  \"version\": 1,\n  \"spec\": "
    << io::json_quote(p.spec()) << ",\n  \"n_layers\": " << n_layers << ",\n  \"weights\": \""
    << (weights == CalibrationWeights::kSensitivity ? "sensitivity" : "uniform")
    << "\",\n  \"source\": " << io::json_quote(source) << ",\n  \"codebooks\": [";
  bool first = true;
  for (int l = 0; l < n_layers; ++l)
    for (int kv = 0; kv < 2; ++kv) {
      const QuantConfig c = kv == 0 ? p.key_for(l, n_layers) : p.value_for(l, n_layers);
      if (c.format != Format::kNuq) continue;
      o << (first ? "\n" : ",\n") << "    {\"layer\": " << l << ", \"tensor\": \""
        << (kv == 0 ? "k" : "v") << "\", \"bits\": " << c.bits << ", \"levels\": [";
      for (int i = 0; i < (1 << c.bits); ++i) {
        char b[32];
        std::snprintf(b, sizeof b, "%.9g", static_cast<double>(c.nuq_levels[static_cast<std::size_t>(i)]));
        o << (i ? ", " : "") << b;
      }
      o << "]}";
      first = false;
    }
  o << "\n  ],\n  \"tensor_scales\": [";
  first = true;
  for (int l = 0; l < n_layers; ++l)
    for (int kv = 0; kv < 2; ++kv) {
      const QuantConfig c = kv == 0 ? p.key_for(l, n_layers) : p.value_for(l, n_layers);
      if (c.format != Format::kNvfp4 || c.fp4_tensor_scale == 1.0f) continue;
      char b[32];
      std::snprintf(b, sizeof b, "%.9g", static_cast<double>(c.fp4_tensor_scale));
      o << (first ? "\n" : ",\n") << "    {\"layer\": " << l << ", \"tensor\": \""
        << (kv == 0 ? "k" : "v") << "\", \"scale\": " << b << "}";
      first = false;
    }
  o << "\n  ]\n}\n";
  return o.str();
}

/// A loaded calibration file.
struct CalibrationFile {
  Policy policy;     ///< calibrated: nuq configs carry their codebooks
  int n_layers = 0;  ///< the model depth it was learned for
};

/// Parses calibration JSON text (`source` names it in errors). See the file comment.
inline CalibrationFile parse_calibration(std::string_view text, const std::string& source) {
  const io::Json j = io::parse_json(text, source);
  auto bad = [&](const std::string& why) {
    fail(ErrorKind::kParse, "calibration file ", source, ": ", why);
  };
  if (!j.is_object()) bad("the document is not a JSON object");
  auto field = [&](const io::Json& obj, const char* name) -> const io::Json& {
    const io::Json* f = obj.find(name);
    if (!f) bad(std::string("missing field \"") + name + "\"");
    return *f;
  };
  const io::Json& fmt = field(j, "format");
  if (!fmt.is_string() || fmt.as_string() != "kvq-calibration")
    bad("\"format\" must be \"kvq-calibration\"");
  const io::Json& ver = field(j, "version");
  if (!ver.is_number() || ver.as_int64() != std::optional<int64_t>(1))
    bad("unsupported \"version\" (this kvq reads version 1)");
  const io::Json& spec = field(j, "spec");
  if (!spec.is_string()) bad("\"spec\" must be a string");
  const io::Json& nl = field(j, "n_layers");
  const auto n_layers = nl.is_number() ? nl.as_int64() : std::nullopt;
  if (!n_layers || *n_layers < 1 || *n_layers > kMaxSpecNumber)
    bad("\"n_layers\" must be an integer in [1, " + std::to_string(kMaxSpecNumber) + "]");
  CalibrationFile out;
  out.n_layers = static_cast<int>(*n_layers);
  try {
    out.policy = parse_policy(spec.as_string());
  } catch (const Error& e) {
    bad(std::string("\"spec\" does not parse: ") + e.what());
  }
  if (out.policy.has_kind_terms())  // a calibrated policy is bound to its model's layers
    bad("\"spec\" has k@local / v@local / k@global / v@global terms; a calibration file holds "
        "the policy bound to its model (per-layer terms)");
  // The (layer, 0 keys / 1 values) an entry names ("layer", "tensor"), each at most once.
  auto slot = [&](const io::Json& e, const std::string& at, std::vector<uint8_t>& seen) {
    if (!e.is_object()) bad(at + " is not an object");
    const io::Json& lj = field(e, "layer");
    const auto layer = lj.is_number() ? lj.as_int64() : std::nullopt;
    if (!layer || *layer < 0 || *layer >= out.n_layers)
      bad(at + ".layer must be an integer in [0, " + std::to_string(out.n_layers) + ")");
    const io::Json& tj = field(e, "tensor");
    if (!tj.is_string() || (tj.as_string() != "k" && tj.as_string() != "v"))
      bad(at + ".tensor must be \"k\" or \"v\"");
    const int kv = tj.as_string() == "k" ? 0 : 1;
    const int l = static_cast<int>(*layer);
    if (seen[static_cast<std::size_t>(2 * l + kv)]++)
      bad(at + " duplicates layer " + std::to_string(l) + " " + tj.as_string());
    return std::pair<int, int>(l, kv);
  };
  const io::Json& cbs = field(j, "codebooks");
  if (!cbs.is_array()) bad("\"codebooks\" must be an array");
  std::vector<uint8_t> seen(static_cast<std::size_t>(2 * out.n_layers), 0);
  for (std::size_t i = 0; i < cbs.size(); ++i) {
    const io::Json& e = cbs.items()[i];
    const std::string at = "codebooks[" + std::to_string(i) + "]";
    const auto [l, kv] = slot(e, at, seen);
    const io::Json& tj = field(e, "tensor");
    QuantConfig kc = out.policy.key_for(l, out.n_layers), vc = out.policy.value_for(l, out.n_layers);
    QuantConfig& c = kv == 0 ? kc : vc;
    if (c.format != Format::kNuq)
      bad(at + ": layer " + std::to_string(l) + " " + tj.as_string() + " uses " + c.name() +
          ", not a nuq format");
    const io::Json& bj = field(e, "bits");
    if (!bj.is_number() || bj.as_int64() != std::optional<int64_t>(c.bits))
      bad(at + ".bits must be " + std::to_string(c.bits) + " (the spec's " + c.name() + ")");
    const io::Json& lv = field(e, "levels");
    if (!lv.is_array() || lv.size() != static_cast<std::size_t>(1 << c.bits))
      bad(at + ".levels must be an array of " + std::to_string(1 << c.bits) + " numbers");
    for (std::size_t m = 0; m < lv.size(); ++m) {
      const io::Json& x = lv.items()[m];
      if (!x.is_number()) bad(at + ".levels[" + std::to_string(m) + "] is not a number");
      const double d = std::strtod(x.number_text().c_str(), nullptr);
      if (!std::isfinite(d) || std::fabs(d) > 3.0e38) bad(at + ".levels[" + std::to_string(m) + "] is out of range");
      c.nuq_levels[m] = static_cast<float>(d);
    }
    try {
      check_nuq_levels(c.nuq_levels.data(), c.bits);
    } catch (const Error& err) {
      bad(at + ": " + err.what());
    }
    c.nuq_ready = true;
    out.policy.overrides[l] = {kc, vc};
  }
  if (const io::Json* tss = j.find("tensor_scales")) {
    if (!tss->is_array()) bad("\"tensor_scales\" must be an array");
    std::vector<uint8_t> seen_ts(static_cast<std::size_t>(2 * out.n_layers), 0);
    for (std::size_t i = 0; i < tss->size(); ++i) {
      const io::Json& e = tss->items()[i];
      const std::string at = "tensor_scales[" + std::to_string(i) + "]";
      const auto [l, kv] = slot(e, at, seen_ts);
      const io::Json& tj = field(e, "tensor");
      QuantConfig kc = out.policy.key_for(l, out.n_layers), vc = out.policy.value_for(l, out.n_layers);
      QuantConfig& c = kv == 0 ? kc : vc;
      if (c.format != Format::kNvfp4)
        bad(at + ": layer " + std::to_string(l) + " " + tj.as_string() + " uses " + c.name() +
            ", not nvfp4");
      const io::Json& gj = field(e, "scale");
      const double g = gj.is_number() ? std::strtod(gj.number_text().c_str(), nullptr) : NAN;
      if (!(std::isfinite(g) && g >= 1.2e-38 && g <= 3.0e38))
        bad(at + ".scale must be a positive normal float, got " +
            (gj.is_number() ? gj.number_text() : std::string("a non-number")));
      c.fp4_tensor_scale = static_cast<float>(g);
      out.policy.overrides[l] = {kc, vc};
    }
  }
  try {
    check_calibrated(out.policy, out.n_layers);
  } catch (const Error& e) {
    bad(std::string("incomplete: ") + e.what());
  }
  return out;
}

/// `policy` with the codebooks and NVFP4 tensor scales of a calibration file: every nuq
/// (layer, K/V) of `policy` takes the file's codebook for it, which must have been learned
/// under the same normalization (nuq bits, axis, group, metadata type and outliers); every
/// NVFP4 (layer, K/V) left at the default scale 1 takes the file's scale where the file's
/// config there is NVFP4 too. Throws kInvalidArgument naming the first nuq mismatch, or when
/// the file was made for another depth.
inline Policy apply_calibration(const Policy& policy, const CalibrationFile& file, int n_layers) {
  KVQ_REQUIRE(file.n_layers == n_layers, kInvalidArgument, "the calibration file is for ",
              file.n_layers, " layers but the model has ", n_layers);
  Policy out = policy;
  if (!calibrates(policy, n_layers)) return out;
  for (int l = 0; l < n_layers; ++l) {
    QuantConfig kc = policy.key_for(l, n_layers), vc = policy.value_for(l, n_layers);
    for (int kv = 0; kv < 2; ++kv) {
      QuantConfig& c = kv == 0 ? kc : vc;
      const QuantConfig f = kv == 0 ? file.policy.key_for(l, n_layers)
                                    : file.policy.value_for(l, n_layers);
      if (nvfp4_scale_calibrates(c) && f.format == Format::kNvfp4)
        c.fp4_tensor_scale = f.fp4_tensor_scale;
      if (c.format != Format::kNuq) continue;
      KVQ_REQUIRE(f.format == Format::kNuq && f.nuq_ready && f.bits == c.bits &&
                      f.axis == c.axis && f.group == c.group && f.meta == c.meta &&
                      f.outliers == c.outliers && f.outlier_pct == c.outlier_pct,
                  kInvalidArgument, "layer ", l, kv == 0 ? " keys" : " values", " use ", c.name(),
                  " but the calibration file holds ", f.name(),
                  " there (a codebook is learned for one normalization: calibrate this policy)");
      c.nuq_levels = f.nuq_levels;
      c.nuq_ready = true;
    }
    out.overrides[l] = {kc, vc};
  }
  out.validate();
  return out;
}

/// Writes the calibration file of `p` (calibrated for n_layers).
inline void save_calibration(const std::filesystem::path& path, const Policy& p, int n_layers,
                             const std::string& source = "",
                             CalibrationWeights weights = CalibrationWeights::kSensitivity) {
  const std::string text = calibration_json(p, n_layers, source, weights);
  std::ofstream f(path, std::ios::binary);
  KVQ_REQUIRE(f.good(), kIo, "cannot write calibration file ", path.string());
  f << text;
  f.close();
  KVQ_REQUIRE(f.good(), kIo, "writing calibration file ", path.string(), " failed");
}

/// Reads a calibration file (at most 64 MiB).
inline CalibrationFile load_calibration(const std::filesystem::path& path) {
  std::ifstream f(path, std::ios::binary);
  KVQ_REQUIRE(f.good(), kIo, "cannot open calibration file ", path.string());
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  KVQ_REQUIRE(text.size() <= (64u << 20), kParse, "calibration file ", path.string(),
              " is larger than 64 MiB");
  return parse_calibration(text, path.string());
}

}  // namespace kvq

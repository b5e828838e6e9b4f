#pragma once
/// \file calibrate.hpp
/// Calibration of nuq codebooks (KVQuant): kvq::calibrate(policy, source) learns, for every
/// layer and for keys and values whose config is nuq<b>, a codebook of 2^b levels by weighted
/// k-means (format/nuq.hpp) on the normalized values the quantizer will see, and returns the
/// calibrated policy: a Policy whose per-layer overrides carry the codebooks
/// (QuantConfig::nuq_levels). save_calibration / load_calibration write and read it as a
/// JSON file, so an engine calibrates once and loads at start.
///
/// What is learned on. Exactly what quantize() normalizes: the stream's blocks (G tokens for
/// token-spanning axes, after the policy's sinks; incomplete trailing blocks are skipped, the
/// cache keeps them in full precision), outliers isolated first when the config has /out (their
/// entries are stored exactly and are not coded), u = (x - zero) * inv per group with the
/// metadata rounding of the quantizer.
///
/// Weights (the sensitivity proxy, CalibrationWeights::kSensitivity, used when queries are
/// available; otherwise uniform):
///   keys   : per (kv head, channel), the mean squared query magnitude of that channel over
///            the query heads that read the kv head and all calibration tokens (a diagonal
///            Fisher proxy: the score error of a key channel scales with q_d^2);
///   values : per token, the mean attention weight the token receives (softmax(q k / sqrt(d))
///            causal, averaged over query positions and heads): values that are attended to more
///            cost more when wrong.
///
/// File format (JSON, UTF-8):
///   {"format": "kvq-calibration", "version": 1,
///    "spec": "<Policy::spec() of the calibrated policy: per-layer overrides included>",
///    "n_layers": L, "weights": "sensitivity" | "uniform", "source": "<free text>",
///    "codebooks": [{"layer": l, "tensor": "k" | "v", "bits": b, "levels": [2^b numbers]}, ...]}
/// Levels are written with 9 significant digits (float round trip is exact). load_calibration
/// rejects, with a kParse error naming the file and the field: other formats or versions,
/// missing or mistyped fields, a spec that does not parse, layers outside [0, L), a codebook for
/// a (layer, tensor) whose config is not nuq or has other bits, duplicates, a level count other
/// than 2^b, non-finite or non-ascending levels, and a nuq (layer, tensor) without a codebook.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/core/error.hpp"
#include "kvq/format/nuq.hpp"
#include "kvq/geometry/outliers.hpp"
#include "kvq/io/json.hpp"
#include "kvq/io/kv_dump.hpp"
#include "kvq/policy/spec.hpp"
#include "kvq/quant/nuq_quant.hpp"

namespace kvq {

/// Keys, values and (optionally) queries of calibration sequences, per layer.
struct CalibrationSet {
  struct Layer {
    std::vector<float> k;       ///< [tokens, kv_heads, head_dim], the keys as they are quantized
    std::vector<float> k_attn;  ///< [tokens, kv_heads, head_dim] post-RoPE (value weights); may be empty
    std::vector<float> v;       ///< [tokens, kv_heads, head_dim]
    std::vector<float> q;       ///< [tokens, q_heads, head_dim] post-RoPE; may be empty
  };
  struct Sequence {
    int64_t tokens = 0;
    std::vector<Layer> layers;  ///< [n_layers]
  };
  int n_layers = 0;
  int kv_heads = 0;
  int q_heads = 0;  ///< 0 when no queries were recorded
  int head_dim = 0;
  std::vector<Sequence> sequences;
};

enum class CalibrationWeights { kSensitivity, kUniform };

struct CalibrationOptions {
  CalibrationWeights weights = CalibrationWeights::kSensitivity;
  int max_iterations = 1000;              ///< Lloyd iterations cap (k-means)
  std::size_t max_samples = 4u << 20;     ///< per (layer, K/V): larger sets are strided down
};

namespace detail {

inline void check_calibration_set(const CalibrationSet& s) {
  KVQ_REQUIRE(s.n_layers > 0 && s.kv_heads > 0 && s.head_dim > 0, kInvalidArgument,
              "calibration data: empty geometry (layers ", s.n_layers, ", kv heads ", s.kv_heads,
              ", head_dim ", s.head_dim, ")");
  KVQ_REQUIRE(!s.sequences.empty(), kInvalidArgument, "calibration data: no sequences");
  KVQ_REQUIRE(s.q_heads == 0 || s.q_heads % s.kv_heads == 0, kInvalidArgument,
              "calibration data: ", s.q_heads, " query heads is not a multiple of ", s.kv_heads,
              " kv heads");
  for (const auto& seq : s.sequences) {
    KVQ_REQUIRE(static_cast<int>(seq.layers.size()) == s.n_layers, kInvalidArgument,
                "calibration data: a sequence has ", seq.layers.size(), " layers, expected ",
                s.n_layers);
    const auto kv = static_cast<std::size_t>(seq.tokens * s.kv_heads * s.head_dim);
    for (const auto& l : seq.layers) {
      KVQ_REQUIRE(l.k.size() == kv && l.v.size() == kv &&
                      (l.k_attn.empty() || l.k_attn.size() == kv) &&
                      (l.q.empty() || l.q.size() == static_cast<std::size_t>(
                                                       seq.tokens * s.q_heads * s.head_dim)),
                  kInvalidArgument, "calibration data: array sizes do not match ", seq.tokens,
                  " tokens x ", s.kv_heads, " kv heads x ", s.head_dim);
    }
  }
}

/// Per (kv head, channel) mean squared query magnitude of one layer; empty without queries.
inline std::vector<float> key_weights(const CalibrationSet& s, int layer) {
  if (s.q_heads == 0) return {};
  const int D = s.head_dim, Hq = s.q_heads, rep = s.q_heads / s.kv_heads;
  std::vector<double> acc(static_cast<std::size_t>(s.kv_heads * D), 0.0);
  double n = 0;
  for (const auto& seq : s.sequences) {
    const auto& q = seq.layers[static_cast<std::size_t>(layer)].q;
    if (q.empty()) return {};
    for (int64_t t = 0; t < seq.tokens; ++t)
      for (int h = 0; h < Hq; ++h)
        for (int d = 0; d < D; ++d) {
          const double x = q[static_cast<std::size_t>((t * Hq + h) * D + d)];
          acc[static_cast<std::size_t>((h / rep) * D + d)] += x * x;
        }
    n += static_cast<double>(seq.tokens * rep);
  }
  std::vector<float> w(acc.size());
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(acc[i] / std::max(n, 1.0));
  return w;
}

/// Per token of one sequence: the mean causal attention weight it receives (over query
/// positions and query heads); empty without queries or post-RoPE keys.
inline std::vector<float> value_weights(const CalibrationSet& s, const CalibrationSet::Sequence& seq,
                                        int layer) {
  const auto& L = seq.layers[static_cast<std::size_t>(layer)];
  if (s.q_heads == 0 || L.q.empty() || L.k_attn.empty()) return {};
  const int D = s.head_dim, Hq = s.q_heads, Hk = s.kv_heads, rep = Hq / Hk;
  const int64_t T = seq.tokens;
  std::vector<double> mass(static_cast<std::size_t>(T), 0.0), p(static_cast<std::size_t>(T));
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  for (int64_t i = 0; i < T; ++i)
    for (int h = 0; h < Hq; ++h) {
      const float* q = L.q.data() + (i * Hq + h) * D;
      double mx = -INFINITY;
      for (int64_t j = 0; j <= i; ++j) {
        const float* k = L.k_attn.data() + (j * Hk + h / rep) * D;
        double dot = 0;
        for (int d = 0; d < D; ++d) dot += static_cast<double>(q[d]) * k[d];
        p[static_cast<std::size_t>(j)] = dot * scale;
        mx = std::max(mx, p[static_cast<std::size_t>(j)]);
      }
      double z = 0;
      for (int64_t j = 0; j <= i; ++j) z += (p[static_cast<std::size_t>(j)] = std::exp(p[static_cast<std::size_t>(j)] - mx));
      for (int64_t j = 0; j <= i; ++j) mass[static_cast<std::size_t>(j)] += p[static_cast<std::size_t>(j)] / z;
    }
  std::vector<float> w(static_cast<std::size_t>(T));
  for (int64_t t = 0; t < T; ++t)
    w[static_cast<std::size_t>(t)] = static_cast<float>(mass[static_cast<std::size_t>(t)] / static_cast<double>(T * Hq));
  return w;
}

/// The config a streaming cache quantizes blocks with: group 0 on a token-spanning axis means a
/// block of 32 tokens there (the cache's kStreamGroupTokens, docs/cache.md).
inline QuantConfig calibration_config(QuantConfig c) {
  if (c.axis != Axis::kToken && c.group == 0) c.group = 32;
  return c;
}

/// Learns the codebook of one (layer, K or V) config.
inline NuqCodebook calibrate_one(const CalibrationSet& s, int layer, bool is_key,
                                 const QuantConfig& cfg_in, int sinks,
                                 const CalibrationOptions& opt) {
  const QuantConfig cfg = calibration_config(cfg_in);
  const int64_t H = s.kv_heads, D = s.head_dim;
  const int64_t k = outlier_count(cfg, D);
  const bool sens = opt.weights == CalibrationWeights::kSensitivity;
  const std::vector<float> wk = is_key && sens ? key_weights(s, layer) : std::vector<float>{};
  std::vector<float> u, w;
  std::vector<float> buf, vals;
  std::vector<int32_t> sel;
  std::vector<uint8_t> is_out;
  OutlierScratch sc;
  bool weighted = is_key ? !wk.empty() : false;
  for (const auto& seq : s.sequences) {
    const auto& L = seq.layers[static_cast<std::size_t>(layer)];
    const std::vector<float>& X = is_key ? L.k : L.v;
    const std::vector<float> wv =
        !is_key && sens ? value_weights(s, seq, layer) : std::vector<float>{};
    if (!is_key) weighted = !wv.empty();
    const int64_t B = cfg.axis == Axis::kToken ? std::max<int64_t>(seq.tokens - sinks, 0) : cfg.group;
    if (B == 0) continue;
    for (int64_t t0 = sinks; t0 + B <= seq.tokens; t0 += B) {
      const Shape sh{B, H, D};
      buf.assign(X.begin() + t0 * H * D, X.begin() + (t0 + B) * H * D);
      is_out.assign(buf.size(), 0);
      if (k > 0) {
        sel.resize(static_cast<std::size_t>(B * H * k));
        vals.resize(sel.size());
        isolate_outliers(sh, cfg.axis, cfg.group, k, buf.data(), sel.data(), vals.data(), sc);
        for (int64_t v = 0; v < B * H; ++v)
          for (int64_t j = 0; j < k; ++j) is_out[static_cast<std::size_t>(v * D + sel[static_cast<std::size_t>(v * k + j)])] = 1;
      }
      const GroupBox box = group_box(cfg.axis, cfg.group, sh);
      std::vector<float> lo(static_cast<std::size_t>(box.count()), INFINITY),
          hi(static_cast<std::size_t>(box.count()), -INFINITY);
      for (int64_t t = 0; t < B; ++t)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < D; ++d) {
            const float x = buf[static_cast<std::size_t>((t * H + h) * D + d)];
            KVQ_REQUIRE(std::isfinite(x), kNonFinite, "calibrate: layer ", layer,
                        is_key ? " keys" : " values", " hold a non-finite value");
            const auto g = static_cast<std::size_t>(box.index(t, h, d));
            lo[g] = std::min(lo[g], x);
            hi[g] = std::max(hi[g], x);
          }
      std::vector<UniformParams> prm(lo.size());
      for (std::size_t g = 0; g < lo.size(); ++g)
        prm[g] = nuq_params(lo[g], hi[g], cfg.meta, static_cast<int64_t>(g));
      for (int64_t t = 0; t < B; ++t)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < D; ++d) {
            const auto i = static_cast<std::size_t>((t * H + h) * D + d);
            if (is_out[i]) continue;
            const UniformParams& pg = prm[static_cast<std::size_t>(box.index(t, h, d))];
            if (pg.inv == 0.f) continue;  // constant group: decoded exactly whatever the levels
            u.push_back((buf[i] - pg.zero) * pg.inv);
            if (is_key && weighted) w.push_back(wk[static_cast<std::size_t>(h * D + d)]);
            if (!is_key && weighted) w.push_back(wv[static_cast<std::size_t>(t0 + t)]);
          }
    }
  }
  KVQ_REQUIRE(!u.empty(), kInvalidArgument, "calibrate: layer ", layer,
              is_key ? " keys" : " values", " (", cfg.name(),
              ") have no complete block to learn from (too few calibration tokens)");
  if (w.size() != u.size()) w.clear();
  if (u.size() > opt.max_samples) {  // deterministic stride
    const std::size_t stride = (u.size() + opt.max_samples - 1) / opt.max_samples;
    std::size_t o = 0;
    for (std::size_t i = 0; i < u.size(); i += stride, ++o) {
      u[o] = u[i];
      if (!w.empty()) w[o] = w[i];
    }
    u.resize(o);
    if (!w.empty()) w.resize(o);
  }
  double wsum = 0;
  for (float x : w) wsum += x;
  KMeansOptions ko;
  ko.max_iterations = opt.max_iterations;
  return learn_nuq_codebook(u, w.empty() || !(wsum > 0) ? nullptr : &w, cfg.bits, ko);
}

}  // namespace detail

/// True when some layer of an n_layers model stores keys or values as nuq.
inline bool needs_calibration(const Policy& p, int n_layers) {
  for (int l = 0; l < n_layers; ++l)
    if (p.key_for(l, n_layers).format == Format::kNuq ||
        p.value_for(l, n_layers).format == Format::kNuq)
      return true;
  return false;
}

/// Throws kInvalidArgument naming the first (layer, K/V) whose nuq config has no codebook.
inline void check_calibrated(const Policy& p, int n_layers) {
  for (int l = 0; l < n_layers; ++l)
    for (int kv = 0; kv < 2; ++kv) {
      const QuantConfig c = kv == 0 ? p.key_for(l, n_layers) : p.value_for(l, n_layers);
      KVQ_REQUIRE(c.format != Format::kNuq || c.nuq_ready, kInvalidArgument, "layer ", l,
                  kv == 0 ? " keys" : " values", " use ", c.name(),
                  ", which needs a calibrated codebook: run kvq::calibrate or load a calibration "
                  "file (tools: --calibrate PATH)");
    }
}

/// Learns every nuq codebook the policy needs on `data` and returns the calibrated policy
/// (per-layer overrides for every layer, carrying the codebooks). A policy without nuq comes
/// back unchanged. Deterministic.
inline Policy calibrate(const Policy& policy, const CalibrationSet& data,
                        const CalibrationOptions& opt = {}) {
  policy.validate();
  detail::check_calibration_set(data);
  const int L = data.n_layers;
  if (!needs_calibration(policy, L)) return policy;
  Policy out = policy;
  for (int l = 0; l < L; ++l) {
    QuantConfig kc = policy.key_for(l, L), vc = policy.value_for(l, L);
    for (int kv = 0; kv < 2; ++kv) {
      QuantConfig& c = kv == 0 ? kc : vc;
      if (c.format != Format::kNuq) continue;
      const NuqCodebook cb = detail::calibrate_one(data, l, kv == 0, c, policy.sinks, opt);
      c.nuq_levels = cb.levels;
      c.nuq_ready = true;
    }
    out.overrides[l] = {kc, vc};
  }
  out.validate();
  return out;
}

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
  const io::Json& cbs = field(j, "codebooks");
  if (!cbs.is_array()) bad("\"codebooks\" must be an array");
  std::vector<uint8_t> seen(static_cast<std::size_t>(2 * out.n_layers), 0);
  for (std::size_t i = 0; i < cbs.size(); ++i) {
    const io::Json& e = cbs.items()[i];
    const std::string at = "codebooks[" + std::to_string(i) + "]";
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
    if (seen[static_cast<std::size_t>(2 * l + kv)]++) bad(at + " duplicates layer " + std::to_string(l) + " " + tj.as_string());
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
  try {
    check_calibrated(out.policy, out.n_layers);
  } catch (const Error& e) {
    bad(std::string("incomplete: ") + e.what());
  }
  return out;
}

/// `policy` with the codebooks of a calibration file: every nuq (layer, K/V) of `policy` takes
/// the file's codebook for it, which must have been learned under the same normalization (nuq
/// bits, axis, group, metadata type and outliers); throws kInvalidArgument naming the first
/// mismatch, or when the file was made for another depth.
inline Policy apply_calibration(const Policy& policy, const CalibrationFile& file, int n_layers) {
  KVQ_REQUIRE(file.n_layers == n_layers, kInvalidArgument, "the calibration file is for ",
              file.n_layers, " layers but the model has ", n_layers);
  Policy out = policy;
  if (!needs_calibration(policy, n_layers)) return out;
  for (int l = 0; l < n_layers; ++l) {
    QuantConfig kc = policy.key_for(l, n_layers), vc = policy.value_for(l, n_layers);
    for (int kv = 0; kv < 2; ++kv) {
      QuantConfig& c = kv == 0 ? kc : vc;
      if (c.format != Format::kNuq) continue;
      const QuantConfig f = kv == 0 ? file.policy.key_for(l, n_layers)
                                    : file.policy.value_for(l, n_layers);
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

#pragma once
/// \file calibrate.hpp (policy/)
/// Calibration of nuq codebooks (KVQuant) and NVFP4 tensor scales: kvq::calibrate(policy,
/// source) sets, for every NVFP4 (layer, K/V) left at the default tensor scale 1, the scale
/// amax / (6 x 448) of that layer's calibration data, and learns, for every
/// layer and for keys and values whose config is nuq<b>, a codebook of 2^b levels by weighted
/// k-means (format/nuq.hpp) on the normalized values the quantizer will see, and returns the
/// calibrated policy: a Policy whose per-layer overrides carry the codebooks
/// (QuantConfig::nuq_levels). io/calibration_file.hpp calibrates from a KV dump and writes and
/// reads the result as a JSON file (save_calibration / load_calibration), so an engine
/// calibrates once and loads at start.
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
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/core/error.hpp"
#include "kvq/format/fp4.hpp"
#include "kvq/format/nuq.hpp"
#include "kvq/geometry/outliers.hpp"
#include "kvq/policy/spec.hpp"
#include "kvq/quant/nuq_quant.hpp"
#include "kvq/quant/rotated_quant.hpp"

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
  /// NVFP4 layers whose tensor scale is the uncalibrated default (1): set it from the data
  /// (nvfp4_tensor_scale below). A scale given in code (any other value) is kept.
  bool nvfp4_tensor_scale = true;
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

/// Largest magnitude of one layer's keys or values over the calibration sequences, after the
/// policy's sinks (which stay f32), as the quantizer of `cfg` sees them: every head vector
/// rotated first when cfg rotates (/rot). Throws kNonFinite on NaN/Inf.
inline float calibration_amax(const CalibrationSet& s, int layer, bool is_key, int sinks,
                              const QuantConfig& cfg) {
  const int64_t D = s.head_dim;
  const Rotation* rot = rotated_plain(cfg) ? &hadamard_rotation_for(D, cfg.seed) : nullptr;
  std::vector<float> row(static_cast<std::size_t>(D));
  float amax = 0.f;
  for (const auto& seq : s.sequences) {
    const auto& L = seq.layers[static_cast<std::size_t>(layer)];
    const std::vector<float>& X = is_key ? L.k : L.v;
    for (int64_t v = std::min<int64_t>(sinks, seq.tokens) * s.kv_heads; v < seq.tokens * s.kv_heads; ++v) {
      const float* x = X.data() + v * D;
      for (int64_t d = 0; d < D; ++d)
        KVQ_REQUIRE(std::isfinite(x[d]), kNonFinite, "calibrate: layer ", layer,
                    is_key ? " keys" : " values", " hold a non-finite value");
      if (rot != nullptr) {
        std::copy(x, x + D, row.begin());
        rot->apply(row.data());
        x = row.data();
      }
      for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
    }
  }
  return amax;
}

}  // namespace detail

/// True when `c` is an NVFP4 config whose tensor scale kvq::calibrate sets from the data: the
/// uncalibrated default 1 (TensorRT-LLM's and vLLM's uncalibrated KV scale).
inline bool nvfp4_scale_calibrates(const QuantConfig& c) {
  return c.format == Format::kNvfp4 && c.fp4_tensor_scale == 1.0f;
}

/// The NVFP4 tensor scale of data whose largest magnitude is amax: amax / (6 x 448)
/// (fp4::nv_tensor_scale_from_amax: the largest block of the calibration data takes the largest
/// e4m3 block scale, so no calibrated block saturates and small blocks keep normal e4m3
/// scales), 1 for all-zero data.
inline float nvfp4_tensor_scale(float amax) { return fp4::nv_tensor_scale_from_amax(amax); }

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

/// True when kvq::calibrate (with default options) changes something in `p` on an n_layers
/// model: a nuq codebook to learn or an NVFP4 tensor scale to set (nvfp4_scale_calibrates).
inline bool calibrates(const Policy& p, int n_layers) {
  if (needs_calibration(p, n_layers)) return true;
  for (int l = 0; l < n_layers; ++l)
    if (nvfp4_scale_calibrates(p.key_for(l, n_layers)) ||
        nvfp4_scale_calibrates(p.value_for(l, n_layers)))
      return true;
  return false;
}

/// Learns every nuq codebook the policy needs on `data`, sets the tensor scale of every NVFP4
/// layer left at the default 1 from the data's largest magnitude of that layer's keys or values
/// (nvfp4_tensor_scale; opt.nvfp4_tensor_scale), and returns the calibrated policy (per-layer
/// overrides for every layer, carrying the codebooks and scales). A policy with neither comes
/// back unchanged. Deterministic.
inline Policy calibrate(const Policy& policy, const CalibrationSet& data,
                        const CalibrationOptions& opt = {}) {
  policy.validate();
  detail::check_calibration_set(data);
  const int L = data.n_layers;
  const bool scales = opt.nvfp4_tensor_scale && calibrates(policy, L);
  if (!needs_calibration(policy, L) && !scales) return policy;
  Policy out = policy;
  for (int l = 0; l < L; ++l) {
    QuantConfig kc = policy.key_for(l, L), vc = policy.value_for(l, L);
    for (int kv = 0; kv < 2; ++kv) {
      QuantConfig& c = kv == 0 ? kc : vc;
      if (opt.nvfp4_tensor_scale && nvfp4_scale_calibrates(c))
        c.fp4_tensor_scale =
            nvfp4_tensor_scale(detail::calibration_amax(data, l, kv == 0, policy.sinks, c));
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

}  // namespace kvq

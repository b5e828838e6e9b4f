#pragma once
/// \file spec.hpp
/// Runtime KV-cache policies and their spec strings.
///
/// A Policy says how a whole model's cache is stored: one QuantConfig for keys and one for
/// values, the full-precision residual window and sinks, which boundary layers are left
/// unquantized, and per-layer overrides. Tools take it as a spec string, engines build it from a
/// compile-time KVPolicy<...> (policy.hpp); both produce this one struct, so the cache and the
/// accountant see a single representation and there is no second code path.
///
/// The spec grammar is a contract with checks outside kvq; docs/policy.md is its reference:
///
///   spec   := item (',' item)*          the first item may be a preset name
///   item   := preset | field '=' value
///   field  := k | v | residual | sinks | skip | skipas | k@<layer> | v@<layer>
///             | k@local | v@local | k@global | v@global
///   term   := fmt ('/' option)*          (k, v, skipas, k@L, v@L, k@local, ...)
///   fmt    := f32 f16 bf16 e4m3 e5m2 int2 int3 int4 int8 sint2 sint3 sint4 sint8 lm1..lm4
///             nuq2 nuq3 nuq4
///   option := token | channel | head | tensor | g<N> | rot | qjl | f32meta | out<N> | out<P>%
///   skip   := <N> | <N>:<M>                 first N and last M layers (N alone: M = N)
///
/// Defaults for omitted parts: int/sint axis token, group 32; fp8 axis head, group 0 (all
/// tokens of a stream block; per-head scale); Lloyd-Max takes no axis or group (one norm per
/// vector) and always rotates; metadata fp16; residual, sinks and skip 0; skipped layers f32.
/// nuq<b> (KVQuant non-uniform codebook, format/nuq.hpp) takes the int options (default axis
/// token, group 32) and needs a calibrated codebook before it can quantize (kvq::calibrate /
/// a calibration file: policy/calibrate.hpp, io/calibration_file.hpp); the spec names the format, not the codebook.
/// out<N> / out<P>% (int, fp8, nuq) keep N, or ceil(P% x head_dim), outliers per vector exactly
/// (quant/outlier_quant.hpp, docs/outliers.md).
/// k@local / v@local apply to a model's sliding-window ("local") layers, k@global / v@global to
/// its other layers; which layers those are is the model's, so such a policy is bound to the
/// model's layer kinds (Policy::bind_layer_kinds) before a cache uses it.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <map>
#include <numeric>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvq/core/error.hpp"
#include "kvq/geometry/grouping.hpp"
#include "kvq/quant/qtensor.hpp"

namespace kvq {

/// Group size an int/sint term gets when the spec gives no g<N> (32: the KIVI and llama.cpp
/// block size, whose metadata costs 1 bit per value with fp16 scale + zero point).
inline constexpr int64_t kDefaultIntGroup = 32;

/// Largest number a spec accepts anywhere (residual, sinks, skip, layer index, group). Keeps
/// every later product of token counts far from integer overflow.
inline constexpr int64_t kMaxSpecNumber = int64_t{1} << 24;

// ---------------------------------------------------------------------------------------------
// QuantConfig builders: the one place where a format name turns into a QuantConfig, used by the
// spec parser and the compile-time quantizer tags alike.

/// Unquantized storage: f32, f16 or bf16.
inline QuantConfig raw_config(Format f) {
  KVQ_REQUIRE(f == Format::kF32 || f == Format::kF16 || f == Format::kBF16, kInvalidArgument,
              "raw_config: format ", to_string(f), " is not an unquantized format");
  QuantConfig c;
  c.format = f;
  c.bits = f == Format::kF32 ? 32 : 16;
  c.axis = Axis::kToken;
  c.group = 0;
  return c;
}

/// Grouped uniform integer (asymmetric min/scale, or symmetric absmax when `symmetric`).
inline QuantConfig int_config(int bits, Axis axis = Axis::kToken, int64_t group = kDefaultIntGroup,
                              bool symmetric = false) {
  QuantConfig c;
  c.format = Format::kInt;
  c.bits = bits;
  c.symmetric = symmetric;
  c.axis = axis;
  c.group = group;
  return c;
}

/// Scaled FP8 (kE4M3 or kE5M2), one scale per group box of `axis`.
inline QuantConfig fp8_config(Format f, Axis axis = Axis::kHead, int64_t group = 0) {
  KVQ_REQUIRE(f == Format::kE4M3 || f == Format::kE5M2, kInvalidArgument, "fp8_config: format ",
              to_string(f), " is not an fp8 format");
  QuantConfig c;
  c.format = f;
  c.bits = 8;
  c.axis = axis;
  c.group = group;
  return c;
}

/// Rotate-then-Lloyd-Max with a per-vector norm (TurboQuant style); `qjl` adds the 1-bit QJL
/// residual (keys only).
inline QuantConfig lm_config(int bits, bool qjl = false) {
  QuantConfig c;
  c.format = Format::kLloydMax;
  c.bits = bits;
  c.axis = Axis::kToken;
  c.group = 0;
  c.qjl = qjl;
  return c;
}

/// KVQuant non-uniform codebook of 2^bits levels (uncalibrated: kvq::calibrate fills it).
inline QuantConfig nuq_config(int bits, Axis axis = Axis::kToken,
                              int64_t group = kDefaultIntGroup) {
  QuantConfig c;
  c.format = Format::kNuq;
  c.bits = bits;
  c.axis = axis;
  c.group = group;
  return c;
}

/// FP4 block format (kNvfp4: e2m1 + e4m3 per 16 channels + the fp32 tensor decode scale
/// `tensor_scale`; kMxfp4: e2m1 + e8m0 per 32 channels). The block is part of the format: axis
/// token, group = the block (quant/fp4_quant.hpp).
inline QuantConfig fp4_config(Format f, float tensor_scale = 1.0f) {
  KVQ_REQUIRE(is_fp4(f), kInvalidArgument, "fp4_config: format ", to_string(f),
              " is not an FP4 format (nvfp4, mxfp4)");
  QuantConfig c;
  c.format = f;
  c.bits = 4;
  c.axis = Axis::kToken;
  c.group = fp4_block(f);
  c.fp4_tensor_scale = tensor_scale;
  return c;
}

/// Throws kInvalidArgument unless `c` is a configuration the spec grammar can express (the
/// domain of every Policy): int bits 2/3/4/8 with group >= 1; fp8 on the token, head or tensor
/// axis with group >= 0; Lloyd-Max bits 1..4; QJL only where `allow_qjl` (keys). `role` names
/// the config in messages ("key", "value", ...).
inline void validate_config(const QuantConfig& c, const std::string& role, bool allow_qjl) {
  const bool sparse_ok = c.format == Format::kInt || c.format == Format::kNuq ||
                         c.format == Format::kE4M3 || c.format == Format::kE5M2;
  KVQ_REQUIRE(c.outliers >= 0 && c.outliers <= kMaxSpecNumber && std::isfinite(c.outlier_pct) &&
                  c.outlier_pct >= 0.f && c.outlier_pct <= 100.f,
              kInvalidArgument, role, " config: outliers must be in [0, ", kMaxSpecNumber,
              "] and outlier_pct in [0, 100], got ", c.outliers, " and ", c.outlier_pct);
  KVQ_REQUIRE(sparse_ok || (c.outliers == 0 && c.outlier_pct == 0.f), kInvalidArgument, role,
              " config: outliers apply to int, fp8 and nuq formats, not ", to_string(c.format));
  KVQ_REQUIRE(!c.rotate || c.format == Format::kLloydMax || rotation_format(c.format),
              kInvalidArgument, role, " config: rotation applies to int, fp8 and FP4 formats (and "
              "Lloyd-Max, which always rotates), not ", to_string(c.format));
  KVQ_REQUIRE(!(c.rotate && c.format != Format::kLloydMax) ||
                  (c.outliers == 0 && c.outlier_pct == 0.f),
              kInvalidArgument, role, " config: rotation with dense-and-sparse outliers is not "
              "supported (", c.name(), ")");
  switch (c.format) {
    case Format::kNuq:
      check_nuq_bits(c.bits);
      KVQ_REQUIRE(c.group >= 1 && c.group <= kMaxSpecNumber, kInvalidArgument, role,
                  " config: nuq group size must be in [1, ", kMaxSpecNumber, "], got ", c.group);
      if (c.nuq_ready) check_nuq_levels(c.nuq_levels.data(), c.bits, "nuq codebook");
      return;
    case Format::kF32:
    case Format::kF16:
    case Format::kBF16:
      return;
    case Format::kInt:
      KVQ_REQUIRE(c.bits == 2 || c.bits == 3 || c.bits == 4 || c.bits == 8, kInvalidArgument, role,
                  " config: integer formats support 2, 3, 4 or 8 bits, got ", c.bits);
      KVQ_REQUIRE(c.group >= 1 && c.group <= kMaxSpecNumber, kInvalidArgument, role,
                  " config: int group size must be in [1, ", kMaxSpecNumber, "], got ", c.group,
                  " (a policy has no 'whole extent' int group; give the extent, e.g. g128)");
      return;
    case Format::kE4M3:
    case Format::kE5M2:
      KVQ_REQUIRE(c.axis != Axis::kChannel, kInvalidArgument, role,
                  " config: ", to_string(c.format),
                  " scales are per token, per head or per tensor; the channel axis is not "
                  "supported for fp8");
      KVQ_REQUIRE(c.group >= 0 && c.group <= kMaxSpecNumber, kInvalidArgument, role,
                  " config: fp8 group size must be in [0, ", kMaxSpecNumber, "], got ", c.group);
      return;
    case Format::kLloydMax:
      KVQ_REQUIRE(c.bits >= 1 && c.bits <= 4, kInvalidArgument, role,
                  " config: Lloyd-Max codebooks have 1 to 4 bits, got ", c.bits);
      KVQ_REQUIRE(allow_qjl || !c.qjl, kInvalidArgument, role,
                  " config: QJL is an inner-product estimator for keys; ", role, "s cannot use it");
      return;
    case Format::kNvfp4:
    case Format::kMxfp4:
      KVQ_REQUIRE(c.bits == 4 && c.axis == Axis::kToken && c.group == fp4_block(c.format),
                  kInvalidArgument, role, " config: ", to_string(c.format),
                  " stores 4-bit e2m1 codes in blocks of ", fp4_block(c.format),
                  " channels (bits 4, token axis, group ", fp4_block(c.format), "), got bits ",
                  c.bits, ", axis ", to_string(c.axis), ", group ", c.group);
      KVQ_REQUIRE(std::isfinite(c.fp4_tensor_scale) && c.fp4_tensor_scale > 0.f,
                  kInvalidArgument, role, " config: ", to_string(c.format),
                  " tensor scale must be finite and > 0, got ", c.fp4_tensor_scale);
      return;
  }
  fail(ErrorKind::kInvalidArgument, role, " config: unknown format ", static_cast<int>(c.format));
}

/// True when a and b store tensors identically. Fields a format ignores are not compared
/// (bits of raw and fp8 formats, axis and group of raw and Lloyd-Max, the seed of non-rotating
/// formats, ...), so a hand-built config equals its parsed twin.
inline bool same_config(const QuantConfig& a, const QuantConfig& b) {
  if (a.format != b.format) return false;
  if (a.outliers != b.outliers || a.outlier_pct != b.outlier_pct) return false;
  if (rotation_format(a.format) &&
      (a.rotate != b.rotate || (a.rotate && a.seed != b.seed)))
    return false;  // the seed of a rotating int / fp8 / FP4 config matters, as Lloyd-Max's
  switch (a.format) {
    case Format::kNuq:  // codebooks compared when both are calibrated
      return a.bits == b.bits && a.axis == b.axis && a.group == b.group && a.meta == b.meta &&
             a.nuq_ready == b.nuq_ready && (!a.nuq_ready || a.nuq_levels == b.nuq_levels);
    case Format::kF32:
    case Format::kF16:
    case Format::kBF16:
      return true;
    case Format::kInt:
      return a.bits == b.bits && a.symmetric == b.symmetric && a.axis == b.axis &&
             a.group == b.group && a.meta == b.meta;
    case Format::kE4M3:
    case Format::kE5M2:
      return a.axis == b.axis && a.group == b.group && a.meta == b.meta &&
             a.fp8_margin == b.fp8_margin;
    case Format::kLloydMax:
      return a.bits == b.bits && a.qjl == b.qjl && a.meta == b.meta && a.seed == b.seed;
    case Format::kNvfp4:
      return a.fp4_tensor_scale == b.fp4_tensor_scale;
    case Format::kMxfp4:
      return true;  // the block and its e8m0 scales are the format
  }
  return false;
}

/// Canonical spec term of a config, e.g. "int2/channel/g32", "e4m3/head", "lm4/rot/qjl".
/// Every part is written (no defaults left implicit) except an fp8 group of 0. The seed, the
/// fp8 margin and NVFP4's tensor scale are not part of the grammar: a parsed config always has
/// their defaults (nvfp4 and mxfp4 are written bare: their block is part of the format).
inline std::string config_spec(const QuantConfig& c) {
  std::string s;
  switch (c.format) {
    case Format::kF32:
      return "f32";
    case Format::kF16:
      return "f16";
    case Format::kBF16:
      return "bf16";
    case Format::kInt:
      s = (c.symmetric ? "sint" : "int") + std::to_string(c.bits) + "/" + to_string(c.axis) + "/g" +
          std::to_string(c.group);
      break;
    case Format::kE4M3:
    case Format::kE5M2:
      s = std::string(to_string(c.format)) + "/" + to_string(c.axis);
      if (c.group > 0) s += "/g" + std::to_string(c.group);
      break;
    case Format::kLloydMax:
      s = "lm" + std::to_string(c.bits) + "/rot";
      if (c.qjl) s += "/qjl";
      break;
    case Format::kNuq:
      s = "nuq" + std::to_string(c.bits) + "/" + to_string(c.axis) + "/g" + std::to_string(c.group);
      break;
    case Format::kNvfp4:
    case Format::kMxfp4:
      s = to_string(c.format);
      break;
  }
  if (c.rotate && rotation_format(c.format)) s += "/rot";
  if (c.outlier_pct > 0.f) {
    // The shortest fixed-point decimal (the grammar has no exponent, at most 12 characters)
    // that parses back to the same float: "%g" wrote 1.2345678 as 1.23457 (another float)
    // and 0.00001 as 1e-05 (not a term).
    char buf[32] = {0};
    for (int decimals = 0; decimals <= 10; ++decimals) {
      std::snprintf(buf, sizeof buf, "%.*f", decimals, static_cast<double>(c.outlier_pct));
      if (std::strlen(buf) <= 12 &&
          static_cast<float>(std::strtod(buf, nullptr)) == c.outlier_pct)
        break;
    }
    char* end = buf + std::strlen(buf);
    if (std::strchr(buf, '.') != nullptr) {
      while (end > buf && end[-1] == '0') --end;
      if (end > buf && end[-1] == '.') --end;
      *end = '\0';
    }
    s += "/out" + std::string(buf) + "%";
  } else if (c.outliers > 0) {
    s += "/out" + std::to_string(c.outliers);
  }
  if (c.meta == MetaDType::kF32 && !is_fp4(c.format)) s += "/f32meta";  // FP4: byte scales
  return s;
}

// ---------------------------------------------------------------------------------------------
// Stream blocks: how many tokens a streaming cache (cache/kv_cache.hpp) packs at once under a
// (key, value) pair. Defined here so that a spec whose block could not be streamed fails when
// it is parsed, not when the cache first flushes.

/// Token extent of a "whole extent" (group 0) scale group on the channel, head or tensor axis
/// inside a streaming cache (a stream cannot wait for "all tokens").
inline constexpr int64_t kStreamGroupTokens = 32;
/// Smallest packed block, in tokens (docs/cache.md).
inline constexpr int64_t kMinBlockTokens = 16;
/// Largest packed block, in tokens: the lcm of the key and value token groups must not exceed
/// it. Without a cap `k=int4/channel/g16777216` would make one block (and its f32 staging) of
/// 2^24 tokens, 64 GiB at 8 x 128; KIVI-style groups are 32..128 tokens.
inline constexpr int64_t kMaxBlockTokens = 4096;

namespace detail {

/// Tokens one scale group spans in a stream (Gt in docs/cache.md).
inline int64_t group_token_extent(const QuantConfig& c) {
  if (c.is_raw() || c.format == Format::kLloydMax || c.axis == Axis::kToken) return 1;
  return c.group > 0 ? c.group : kStreamGroupTokens;
}

/// The config a layer's blocks are quantized with: group 0 on a token-spanning axis becomes
/// kStreamGroupTokens, so that every block holds whole groups of a fixed, documented size.
inline QuantConfig streaming_config(QuantConfig c) {
  const bool spans = !c.is_raw() && c.format != Format::kLloydMax && c.axis != Axis::kToken;
  if (spans && c.group == 0) c.group = kStreamGroupTokens;
  return c;
}

/// B: lcm of both token extents, rounded up to a multiple >= kMinBlockTokens. Throws
/// `kind` when B would exceed kMaxBlockTokens.
inline int64_t stream_block_tokens(const QuantConfig& k, const QuantConfig& v,
                                   ErrorKind kind = ErrorKind::kInvalidArgument) {
  const int64_t gk = group_token_extent(k), gv = group_token_extent(v);
  if (gk > kMaxBlockTokens || gv > kMaxBlockTokens)
    fail(kind, "a streamed block would span ", std::max(gk, gv), " tokens (key ", config_spec(k),
              ", value ", config_spec(v), "), more than kvq's limit of ", kMaxBlockTokens,
              " tokens per block; use a token group of at most ", kMaxBlockTokens);
  const int64_t l = std::lcm(gk, gv);
  if (l > kMaxBlockTokens)
    fail(kind, "key ", config_spec(k), " and value ", config_spec(v),
              " need blocks of lcm(", gk, ", ", gv, ") = ", l, " tokens, more than kvq's limit of ",
              kMaxBlockTokens, " tokens per block; choose token groups whose lcm is at most ",
              kMaxBlockTokens);
  return l * ((kMinBlockTokens + l - 1) / l);
}

}  // namespace detail

/// A whole model's KV-cache storage policy (runtime form; see the file comment for the spec).
struct Policy {
  QuantConfig key = raw_config(Format::kF32);    ///< keys of non-skipped layers
  QuantConfig value = raw_config(Format::kF32);  ///< values of non-skipped layers
  int residual = 0;    ///< newest tokens kept in f32 until a whole block can be quantized
  int sinks = 0;       ///< first tokens of the sequence, kept in f32 forever
  int skip_first = 0;  ///< layers [0, skip_first) use skip_config
  int skip_last = 0;   ///< layers [n_layers - skip_last, n_layers) use skip_config
  /// Storage of skipped layers, keys and values alike (f32 unless the spec says skipas=...).
  QuantConfig skip_config = raw_config(Format::kF32);
  /// Per-layer (key, value) configs; they win over skip and over the base configs.
  std::map<int, std::pair<QuantConfig, QuantConfig>> overrides;
  /// Terms for one kind of layer (k@local=, v@global=, ...): each half set applies to every
  /// layer of that kind, winning over skip and the base configs; k@L / v@L win over it.
  struct KindTerms {
    bool has_key = false, has_value = false;
    QuantConfig key = raw_config(Format::kF32), value = raw_config(Format::kF32);
    bool any() const { return has_key || has_value; }
  };
  KindTerms local;   ///< sliding-window layers (Gemma's local layers)
  KindTerms global;  ///< every other layer

  /// True when the policy has k@local / v@local / k@global / v@global terms (it must be bound
  /// to the model's layer kinds before a cache can use it).
  bool has_kind_terms() const { return local.any() || global.any(); }

  /// This policy for a model whose layer l is a sliding-window layer when sliding[l] != 0
  /// (empty: no such layers, every layer global): the kind terms become per-layer overrides
  /// (layers with an explicit k@L / v@L keep theirs) and are cleared. A policy without kind
  /// terms comes back unchanged.
  Policy bind_layer_kinds(const std::vector<char>& sliding, int n_layers) const {
    KVQ_REQUIRE(n_layers > 0 && (sliding.empty() || static_cast<int>(sliding.size()) == n_layers),
                kInvalidArgument, "policy: layer kinds for ", sliding.size(), " layers, model has ",
                n_layers);
    Policy p = *this;
    p.local = KindTerms{};
    p.global = KindTerms{};
    if (!has_kind_terms()) return p;
    for (int l = 0; l < n_layers; ++l) {
      if (overrides.count(l) != 0) continue;
      const KindTerms& t = !sliding.empty() && sliding[static_cast<size_t>(l)] != 0 ? local : global;
      if (!t.any()) continue;
      p.overrides[l] = {t.has_key ? t.key : p.key_for(l, n_layers),
                        t.has_value ? t.value : p.value_for(l, n_layers)};
    }
    return p;
  }

  /// True when `layer` of an n_layers model is a skipped boundary layer (overrides aside).
  /// Ranges may overlap: skip=3:3 on a 4-layer model skips every layer.
  bool skips(int layer, int n_layers) const {
    check_layer(layer, n_layers);
    return layer < skip_first || layer >= n_layers - skip_last;
  }
  /// Key config of `layer`: its override, else skip_config when skipped, else `key`.
  QuantConfig key_for(int layer, int n_layers) const {
    check_layer(layer, n_layers);
    check_bound();
    if (auto it = overrides.find(layer); it != overrides.end()) return it->second.first;
    return skips(layer, n_layers) ? skip_config : key;
  }
  /// Value config of `layer`: its override, else skip_config when skipped, else `value`.
  QuantConfig value_for(int layer, int n_layers) const {
    check_layer(layer, n_layers);
    check_bound();
    if (auto it = overrides.find(layer); it != overrides.end()) return it->second.second;
    return skips(layer, n_layers) ? skip_config : value;
  }

  /// Throws kInvalidArgument unless every field is inside the spec grammar's domain (the cache
  /// calls this, so hand-built policies get the same checks as parsed ones).
  void validate() const {
    validate_config(key, "key", true);
    validate_config(value, "value", false);
    validate_config(skip_config, "skip (skipas)", false);
    auto count = [](int v, const char* what) {
      KVQ_REQUIRE(v >= 0 && v <= kMaxSpecNumber, kInvalidArgument, "policy: ", what,
                  " must be in [0, ", kMaxSpecNumber, "], got ", v);
    };
    count(residual, "residual");
    count(sinks, "sinks");
    count(skip_first, "skip_first");
    count(skip_last, "skip_last");
    for (const auto& [layer, kv] : overrides) {
      count(layer, "override layer index");
      const std::string at = "layer " + std::to_string(layer) + " override ";
      validate_config(kv.first, at + "key", true);
      validate_config(kv.second, at + "value", false);
    }
    for (const auto* t : {&local, &global}) {
      const std::string at = t == &local ? "k@local/v@local " : "k@global/v@global ";
      if (t->has_key) validate_config(t->key, at + "key", true);
      if (t->has_value) validate_config(t->value, at + "value", false);
    }
    check_blocks(ErrorKind::kInvalidArgument);
  }

  /// Throws `kind` when a (key, value) pair a layer can use needs stream blocks of more than
  /// kMaxBlockTokens tokens.
  void check_blocks(ErrorKind kind) const {
    detail::stream_block_tokens(key, value, kind);
    detail::stream_block_tokens(skip_config, skip_config, kind);
    for (const auto& kv : overrides) detail::stream_block_tokens(kv.second.first, kv.second.second, kind);
    for (const auto* t : {&local, &global}) {
      if (t->any()) {
        detail::stream_block_tokens(t->has_key ? t->key : key, t->has_value ? t->value : value,
                                    kind);
      }
    }
  }

  /// Canonical spec: every field explicit, in the order
  ///   k=..,v=..,residual=R,sinks=S,skip=N:M[,skipas=..][,k@local=..][,v@local=..]
  ///   [,k@global=..][,v@global=..][,k@L=..,v@L=.. for each override]
  /// (skipas only when not f32). parse_policy(spec()) == *this for every valid policy whose
  /// seeds and fp8 margins are the defaults. Throws kInvalidArgument for an invalid policy.
  std::string spec() const {
    validate();
    std::string s = "k=" + config_spec(key) + ",v=" + config_spec(value) +
                    ",residual=" + std::to_string(residual) + ",sinks=" + std::to_string(sinks) +
                    ",skip=" + std::to_string(skip_first) + ":" + std::to_string(skip_last);
    if (!same_config(skip_config, raw_config(Format::kF32)))
      s += ",skipas=" + config_spec(skip_config);
    for (const auto* t : {&local, &global}) {
      const std::string kind = t == &local ? "local" : "global";
      if (t->has_key) s += ",k@" + kind + "=" + config_spec(t->key);
      if (t->has_value) s += ",v@" + kind + "=" + config_spec(t->value);
    }
    for (const auto& [layer, kv] : overrides) {
      s += ",k@" + std::to_string(layer) + "=" + config_spec(kv.first);
      s += ",v@" + std::to_string(layer) + "=" + config_spec(kv.second);
    }
    return s;
  }

 private:
  void check_bound() const {
    KVQ_REQUIRE(!has_kind_terms(), kInvalidArgument,
                "policy: k@local / v@local / k@global / v@global terms apply once the model's "
                "layer kinds are bound (Policy::bind_layer_kinds; the tools bind them for the "
                "model they run)");
  }
  static void check_layer(int layer, int n_layers) {
    KVQ_REQUIRE(n_layers > 0 && layer >= 0 && layer < n_layers, kInvalidArgument, "policy: layer ",
                layer, " out of range for a model with ", n_layers, " layers");
  }
};

inline bool operator==(const Policy& a, const Policy& b) {
  if (!same_config(a.key, b.key) || !same_config(a.value, b.value) ||
      !same_config(a.skip_config, b.skip_config) || a.residual != b.residual ||
      a.sinks != b.sinks || a.skip_first != b.skip_first || a.skip_last != b.skip_last ||
      a.overrides.size() != b.overrides.size())
    return false;
  const auto same_kind = [](const Policy::KindTerms& x, const Policy::KindTerms& y) {
    return x.has_key == y.has_key && x.has_value == y.has_value &&
           (!x.has_key || same_config(x.key, y.key)) &&
           (!x.has_value || same_config(x.value, y.value));
  };
  if (!same_kind(a.local, b.local) || !same_kind(a.global, b.global)) return false;
  auto ia = a.overrides.begin();
  for (auto ib = b.overrides.begin(); ib != b.overrides.end(); ++ia, ++ib) {
    if (ia->first != ib->first || !same_config(ia->second.first, ib->second.first) ||
        !same_config(ia->second.second, ib->second.second))
      return false;
  }
  return true;
}
inline bool operator!=(const Policy& a, const Policy& b) { return !(a == b); }

/// A named policy: `spec` is what the name expands to (parsed by the same parser).
struct Preset {
  const char* name;
  const char* spec;
  const char* description;
};

/// Every preset, in documentation order.
inline const std::vector<Preset>& policy_presets() {
  static const std::vector<Preset> kPresets = {
      {"f32", "k=f32,v=f32", "no quantization (the fp32 baseline)"},
      {"f16", "k=f16,v=f16", "fp16 storage, no scales"},
      {"fp8", "k=e4m3/head,v=e4m3/head", "e4m3 keys and values, one scale per head and block"},
      {"k8v4", "k=e4m3/head,v=int4/token/g32",
       "e4m3 keys (per-head scale), int4 values per token in groups of 32 channels"},
      {"kivi2", "k=int2/channel/g32,v=int2/token/g32,residual=32",
       "KIVI 2-bit: keys per channel over 32 tokens, values per token, 32-token residual"},
      {"kivi4", "k=int4/channel/g32,v=int4/token/g32,residual=32", "KIVI 4-bit"},
      {"kivi2-flip", "k=int2/token/g32,v=int2/channel/g32,residual=32",
       "kivi2 with the axes swapped (the geometry that breaks models; for comparison)"},
      {"kivi4-flip", "k=int4/token/g32,v=int4/channel/g32,residual=32",
       "kivi4 with the axes swapped"},
      {"turbo3", "k=lm3,v=lm3", "rotate + 3-bit Lloyd-Max, per-vector norm (TurboQuant)"},
      {"turbo4", "k=lm4,v=lm4", "rotate + 4-bit Lloyd-Max, per-vector norm (TurboQuant)"},
  };
  return kPresets;
}

namespace detail {

inline constexpr const char* kSpecFormats =
    "f32, f16, bf16, e4m3, e5m2, int2, int3, int4, int8, sint2, sint3, sint4, sint8, lm1, lm2, "
    "lm3, lm4, nuq2, nuq3, nuq4, nvfp4, mxfp4";
inline constexpr const char* kSpecOptions =
    "an axis (token, channel, head, tensor), g<N>, rot, qjl, f32meta, out<N> or out<P>%";
inline constexpr const char* kSpecFields =
    "k, v, residual, sinks, skip, skipas, k@<layer>, v@<layer>, k@local, v@local, k@global, "
    "v@global";

inline std::string preset_list() {
  std::string s;
  for (const Preset& p : policy_presets()) s += (s.empty() ? "" : ", ") + std::string(p.name);
  return s;
}

inline const Preset* find_preset(std::string_view name) {
  for (const Preset& p : policy_presets())
    if (name == p.name) return &p;
  return nullptr;
}

inline std::string_view trim(std::string_view s) {
  const auto ws = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  while (!s.empty() && ws(s.front())) s.remove_prefix(1);
  while (!s.empty() && ws(s.back())) s.remove_suffix(1);
  return s;
}

inline std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  std::size_t start = 0;
  for (;;) {
    const std::size_t p = s.find(sep, start);
    out.push_back(s.substr(start, p == std::string_view::npos ? s.size() - start : p - start));
    if (p == std::string_view::npos) return out;
    start = p + 1;
  }
}

/// A non-negative decimal number in [0, kMaxSpecNumber]: digits only (no sign, no spaces, no
/// suffix). `what` names the number and `item` the spec item, for the message.
inline int64_t parse_spec_number(std::string_view digits, std::string_view what,
                                 std::string_view item) {
  KVQ_REQUIRE(!digits.empty(), kParse, "missing number for ", what, " in '", item,
              "' (expected a non-negative integer)");
  int64_t v = 0;
  for (char c : digits) {
    KVQ_REQUIRE(c >= '0' && c <= '9', kParse, "expected a non-negative integer for ", what, " in '",
                item, "', got '", digits, "'");
    v = v * 10 + (c - '0');
    KVQ_REQUIRE(v <= kMaxSpecNumber, kParse, "number '", digits, "' for ", what, " in '", item,
                "' is too large (at most ", kMaxSpecNumber, ")");
  }
  return v;
}

/// The format part of a term, with the defaults of its family; false when `f` names none.
inline bool lookup_format(std::string_view f, QuantConfig& c) {
  if (f == "f32" || f == "f16" || f == "bf16") {
    c = raw_config(f == "f32" ? Format::kF32 : (f == "f16" ? Format::kF16 : Format::kBF16));
    return true;
  }
  if (f == "e4m3" || f == "e5m2") {
    c = fp8_config(f == "e4m3" ? Format::kE4M3 : Format::kE5M2);
    return true;
  }
  if (f == "nvfp4" || f == "mxfp4") {
    c = fp4_config(f == "nvfp4" ? Format::kNvfp4 : Format::kMxfp4);
    return true;
  }
  const bool sym = f.substr(0, 4) == "sint";
  if (sym || f.substr(0, 3) == "int") {
    const std::string_view b = f.substr(sym ? 4 : 3);
    if (b != "2" && b != "3" && b != "4" && b != "8") return false;
    c = int_config(b[0] - '0', Axis::kToken, kDefaultIntGroup, sym);
    return true;
  }
  if (f.size() == 3 && f.substr(0, 2) == "lm" && f[2] >= '1' && f[2] <= '4') {
    c = lm_config(f[2] - '0');
    return true;
  }
  if (f.size() == 4 && f.substr(0, 3) == "nuq" && f[3] >= '2' && f[3] <= '4') {
    c = nuq_config(f[3] - '0');
    return true;
  }
  return false;
}

/// The axis named by `o`; false when `o` is not an axis name.
inline bool lookup_axis(std::string_view o, Axis& axis) {
  for (Axis a : {Axis::kToken, Axis::kChannel, Axis::kHead, Axis::kTensor}) {
    if (o == to_string(a)) {
      axis = a;
      return true;
    }
  }
  return false;
}

/// Parses one quantizer term ("int4/channel/g32"); `item` is the whole spec item for messages.
inline QuantConfig parse_term(std::string_view term, std::string_view item, bool allow_qjl) {
  const std::vector<std::string_view> parts = split(term, '/');
  const std::string_view fmt = parts[0];
  KVQ_REQUIRE(!fmt.empty(), kParse, "empty format in '", item, "' (expected one of ", kSpecFormats,
              ")");
  QuantConfig c;
  KVQ_REQUIRE(lookup_format(fmt, c), kParse, "unknown format '", fmt, "' in '", item,
              "' (expected one of ", kSpecFormats, ")");
  const bool raw = c.is_raw();
  const bool lm = c.format == Format::kLloydMax;
  const bool fp8 = c.format == Format::kE4M3 || c.format == Format::kE5M2;
  const bool fp4 = is_fp4(c.format);
  std::string_view axis_seen, group_seen, out_seen;
  bool rot = false, qjl = false, meta = false;
  for (std::size_t i = 1; i < parts.size(); ++i) {
    const std::string_view o = parts[i];
    KVQ_REQUIRE(!o.empty(), kParse, "empty option after '/' in '", item, "' (expected ",
                kSpecOptions, ")");
    Axis axis{};
    if (lookup_axis(o, axis)) {
      KVQ_REQUIRE(!raw, kParse, "format '", fmt, "' takes no axis ('", o, "' in '", item,
                  "'): unquantized formats have no scale groups");
      KVQ_REQUIRE(!lm, kParse, "format '", fmt, "' takes no axis ('", o, "' in '", item,
                  "'): Lloyd-Max stores one norm per vector");
      KVQ_REQUIRE(!fp4, kParse, "format '", fmt, "' takes no axis ('", o, "' in '", item,
                  "'): its scales cover blocks of ", fp4_block(c.format),
                  " channels along head_dim, part of the format");
      KVQ_REQUIRE(axis_seen.empty(), kParse, "axis given twice ('", axis_seen, "' and '", o,
                  "') in '", item, "'");
      KVQ_REQUIRE(!(fp8 && axis == Axis::kChannel), kParse, "format '", fmt,
                  "' cannot use axis 'channel' in '", item,
                  "' (expected token, head or tensor: fp8 scales are per token, head or "
                  "tensor)");
      axis_seen = o;
      c.axis = axis;
    } else if (o.substr(0, 3) == "out") {
      KVQ_REQUIRE(c.format == Format::kInt || c.format == Format::kNuq || fp8, kParse, "'", o,
                  "' in '", item, "': outliers apply to the int, fp8 and nuq formats, not '", fmt,
                  "'");
      KVQ_REQUIRE(out_seen.empty(), kParse, "outliers given twice ('", out_seen, "' and '", o,
                  "') in '", item, "'");
      out_seen = o;
      std::string_view num = o.substr(3);
      if (!num.empty() && num.back() == '%') {
        num.remove_suffix(1);
        // A decimal number: digits with at most one '.', in (0, 100].
        bool ok = !num.empty() && num.size() <= 12 && num.front() != '.' && num.back() != '.';
        int dots = 0;
        for (char ch : num) {
          if (ch == '.') ++dots;
          else if (ch < '0' || ch > '9') ok = false;
        }
        KVQ_REQUIRE(ok && dots <= 1, kParse, "expected a percentage like out1% or out0.5% in '",
                    item, "', got '", o, "'");
        const double pct = std::strtod(std::string(num).c_str(), nullptr);
        KVQ_REQUIRE(pct > 0.0 && pct <= 100.0, kParse, "outlier percentage must be in (0, 100] in '",
                    item, "', got '", o, "'");
        c.outlier_pct = static_cast<float>(pct);
      } else {
        const int64_t n = parse_spec_number(num, "the outlier count out<N>", item);
        KVQ_REQUIRE(n >= 1, kParse, "outlier count must be >= 1 in '", o, "' of '", item, "'");
        c.outliers = static_cast<int>(n);
      }
    } else if (o[0] == 'g') {
      KVQ_REQUIRE(!raw, kParse, "format '", fmt, "' takes no group size ('", o, "' in '", item,
                  "'): unquantized formats have no scale groups");
      KVQ_REQUIRE(!lm, kParse, "format '", fmt, "' takes no group size ('", o, "' in '", item,
                  "'): Lloyd-Max stores one norm per vector");
      KVQ_REQUIRE(!fp4, kParse, "format '", fmt, "' takes no group size ('", o, "' in '", item,
                  "'): its block of ", fp4_block(c.format), " channels is part of the format");
      KVQ_REQUIRE(group_seen.empty(), kParse, "group size given twice ('", group_seen, "' and '", o,
                  "') in '", item, "'");
      const int64_t g = parse_spec_number(o.substr(1), "the group size g<N>", item);
      KVQ_REQUIRE(g >= 1, kParse, "group size must be >= 1 in '", o, "' of '", item, "'");
      group_seen = o;
      c.group = g;
    } else if (o == "rot") {
      KVQ_REQUIRE(lm || rotation_format(c.format), kParse, "'rot' in '", item, "': format '", fmt,
                  "' cannot rotate (rotation applies to the int, sint, e4m3, e5m2, nvfp4 and "
                  "mxfp4 formats; the Lloyd-Max formats lm1..lm4 always rotate)");
      KVQ_REQUIRE(!rot, kParse, "'rot' given twice in '", item, "'");
      rot = true;
      if (!lm) c.rotate = true;
    } else if (o == "qjl") {
      KVQ_REQUIRE(lm, kParse, "'qjl' in '", item, "': format '", fmt,
                  "' has no QJL residual (only the Lloyd-Max formats lm1..lm4 do)");
      KVQ_REQUIRE(allow_qjl, kParse, "'qjl' in '", item,
                  "': QJL is an inner-product estimator for keys; only k= (or k@<layer>=) "
                  "terms may use it");
      KVQ_REQUIRE(!qjl, kParse, "'qjl' given twice in '", item, "'");
      qjl = true;
      c.qjl = true;
    } else if (o == "f32meta") {
      KVQ_REQUIRE(!raw, kParse, "format '", fmt, "' has no metadata ('f32meta' in '", item, "')");
      KVQ_REQUIRE(!fp4, kParse, "format '", fmt, "' stores its block scales as one ",
                  c.format == Format::kNvfp4 ? "e4m3" : "e8m0", " byte each ('f32meta' in '",
                  item, "')");
      KVQ_REQUIRE(!meta, kParse, "'f32meta' given twice in '", item, "'");
      meta = true;
      c.meta = MetaDType::kF32;
    } else {
      fail(ErrorKind::kParse, "unknown option '", o, "' in '", item, "' (expected ", kSpecOptions,
           ")");
    }
  }
  KVQ_REQUIRE(!(c.rotate && !out_seen.empty()), kParse, "'rot' and '", out_seen, "' in '", item,
              "': rotation with dense-and-sparse outliers is not supported (the rotation spreads "
              "an outlier channel over the whole vector); use one or the other");
  return c;
}

/// Parses the value of skipas=: a term, or a preset whose keys and values are stored alike.
inline QuantConfig parse_skipas(std::string_view value, std::string_view item);

inline Policy parse_policy_impl(std::string_view spec_in, bool allow_presets) {
  const std::string_view spec = trim(spec_in);
  KVQ_REQUIRE(!spec.empty(), kParse,
              "empty policy spec (expected a preset such as kivi2, or fields k=<fmt>,v=<fmt>; "
              "presets: ",
              preset_list(), ")");
  Policy p;
  bool have_base = false, k_set = false, v_set = false;
  std::vector<std::string> seen;
  std::map<int, std::pair<std::pair<bool, QuantConfig>, std::pair<bool, QuantConfig>>> pending;
  const std::vector<std::string_view> items = split(spec, ',');
  for (std::size_t idx = 0; idx < items.size(); ++idx) {
    const std::string_view item = trim(items[idx]);
    KVQ_REQUIRE(!item.empty(), kParse, "empty item ", idx + 1, " in '", spec,
                "' (two commas in a row, or a comma at an end)");
    const std::size_t eq = item.find('=');
    if (eq == std::string_view::npos) {
      const Preset* pr = allow_presets ? find_preset(item) : nullptr;
      KVQ_REQUIRE(pr != nullptr, kParse, "unknown preset '", item, "' in '", spec,
                  "' (expected one of ", preset_list(), ", or a field ", kSpecFields,
                  " followed by '=')");
      KVQ_REQUIRE(idx == 0, kParse, "preset '", item, "' must be the first item of '", spec,
                  "' (fields after it override the preset's)");
      p = parse_policy_impl(pr->spec, false);
      have_base = true;
      continue;
    }
    const std::string_view name = trim(item.substr(0, eq));
    const std::string_view value = trim(item.substr(eq + 1));
    for (const std::string& s : seen)
      KVQ_REQUIRE(s != name, kParse, "field '", name, "' given twice in '", spec, "'");
    seen.emplace_back(name);
    if (name == "k") {
      p.key = parse_term(value, item, true);
      k_set = true;
    } else if (name == "v") {
      p.value = parse_term(value, item, false);
      v_set = true;
    } else if (name == "residual") {
      p.residual = static_cast<int>(parse_spec_number(value, "residual", item));
    } else if (name == "sinks") {
      p.sinks = static_cast<int>(parse_spec_number(value, "sinks", item));
    } else if (name == "skip") {
      const std::size_t colon = value.find(':');
      p.skip_first = static_cast<int>(
          parse_spec_number(value.substr(0, colon), "the first-layer count of skip", item));
      p.skip_last = colon == std::string_view::npos
                        ? p.skip_first
                        : static_cast<int>(parse_spec_number(value.substr(colon + 1),
                                                             "the last-layer count of skip", item));
    } else if (name == "skipas") {
      p.skip_config = parse_skipas(value, item);
    } else if (name == "k@local") {
      p.local.key = parse_term(value, item, true);
      p.local.has_key = true;
    } else if (name == "v@local") {
      p.local.value = parse_term(value, item, false);
      p.local.has_value = true;
    } else if (name == "k@global") {
      p.global.key = parse_term(value, item, true);
      p.global.has_key = true;
    } else if (name == "v@global") {
      p.global.value = parse_term(value, item, false);
      p.global.has_value = true;
    } else if (name.size() > 2 && (name[0] == 'k' || name[0] == 'v') && name[1] == '@') {
      const int layer = static_cast<int>(
          parse_spec_number(name.substr(2), "the layer index of an override", item));
      auto& slot = pending[layer];
      if (name[0] == 'k') {
        slot.first = {true, parse_term(value, item, true)};
      } else {
        slot.second = {true, parse_term(value, item, false)};
      }
    } else {
      fail(ErrorKind::kParse, "unknown field '", name, "' in '", item, "' (expected ", kSpecFields,
           ")");
    }
  }
  KVQ_REQUIRE(have_base || k_set, kParse, "spec '", spec,
              "' sets no key format: give k=<fmt> or start from a preset (", preset_list(), ")");
  KVQ_REQUIRE(have_base || v_set, kParse, "spec '", spec,
              "' sets no value format: give v=<fmt> or start from a preset (", preset_list(), ")");
  for (const auto& [layer, kv] : pending) {
    // A half not given follows the final base config, whatever the field order was.
    p.overrides[layer] = {kv.first.first ? kv.first.second : p.key,
                          kv.second.first ? kv.second.second : p.value};
  }
  p.check_blocks(ErrorKind::kParse);  // a block too long to stream is a spec error
  return p;
}

inline QuantConfig parse_skipas(std::string_view value, std::string_view item) {
  if (const Preset* pr = find_preset(value)) {
    const Policy pp = parse_policy_impl(pr->spec, false);
    KVQ_REQUIRE(same_config(pp.key, pp.value), kParse, "skipas preset '", value, "' in '", item,
                "' stores keys and values differently; skipas takes one format for both (e.g. "
                "skipas=fp8 or skipas=e4m3/head)");
    return pp.key;
  }
  return parse_term(value, item, false);
}

}  // namespace detail

/// Parses one policy spec (see the file comment and docs/policy.md). Errors throw
/// kvq::Error(kParse) naming the offending token and what was expected there.
inline Policy parse_policy(std::string_view spec) { return detail::parse_policy_impl(spec, true); }

/// Parses a standalone quantizer term such as "int4/channel/g32" (the k= grammar).
inline QuantConfig parse_quant_config(std::string_view term) {
  return detail::parse_term(detail::trim(term), term, true);
}

/// Parses "spec1;spec2;..." (the tools' --policy SPEC[;SPEC...]): one Policy per spec, in
/// order. An empty element (";;" or a leading/trailing ';') is an error.
inline std::vector<Policy> parse_policies(std::string_view specs) {
  std::vector<Policy> out;
  const std::vector<std::string_view> parts = detail::split(specs, ';');
  for (std::size_t i = 0; i < parts.size(); ++i) {
    KVQ_REQUIRE(!detail::trim(parts[i]).empty(), kParse, "empty policy ", i + 1, " in '", specs,
                "' (policies are separated by single ';')");
    out.push_back(parse_policy(parts[i]));
  }
  return out;
}

}  // namespace kvq

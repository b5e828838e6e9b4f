#pragma once
/// \file kv_cache.hpp
/// Streaming quantized KV cache for a whole model, stored under a Policy.
///
/// Per layer and for K and V alike, the tokens [0, n) live in three consecutive regions:
///
///   [0, s)            sinks: the first min(n, policy.sinks) tokens, f32, never quantized
///   [s, s + P)        packed: P / B blocks of B tokens, each a QTensor [B, kv_heads, head_dim]
///                     made by quantize() under the layer's key (value) config
///   [s + P, n)        residual window: the newest r = n - s - P tokens, f32
///
/// Block size. Let Gt(cfg) be the token extent of one scale group: 1 for the token axis,
/// Lloyd-Max and raw formats; G for the channel, head and tensor axes (kStreamGroupTokens = 32
/// when the config says group 0, "all tokens", which a stream cannot wait for). Then
///   B = lcm(Gt(key), Gt(value)) rounded up to a multiple >= kMinBlockTokens (16).
/// The floor of 16 tokens keeps per-block bookkeeping (a 288-byte QTensor header plus its heap
/// allocations, Lloyd-Max's 8-byte seed) small next to the data: one-token blocks of 4-bit
/// Lloyd-Max with 8 x 128 values (536 bytes of data) would carry ~60% bookkeeping. Per-token groups
/// quantize each token on its own, so the larger block changes no stored value, only how long a
/// token stays f32.
///
/// Flush rule (KIVI). After every append, while r >= R + B (R = policy.residual), the oldest B
/// residual tokens are quantized into one block. Hence, once a layer holds at least R tokens
/// after its sinks, R <= r <= R + B - 1: the newest R tokens are always full precision and at
/// most B - 1 more are waiting for their block to fill. Starting from an empty cache the split
/// depends only on n (not on how appends were chunked):
///   P = B * floor(max(0, n - s - R) / B).
///
/// Truncation (rollback). truncate(n) keeps the tokens [0, n). Packed blocks that end at or
/// before n stay untouched, blocks after n are dropped, sinks and residual are cut. A cut that
/// falls in the sinks, in the residual or on a block boundary is exact: appending the dropped
/// tokens again reproduces the bytes of a cache that never dropped them. A cut strictly inside a
/// packed block cannot restore the full-precision originals (they were never kept): the block
/// is dequantized and its kept tokens become the residual, holding the values attention already
/// saw; when that block fills again it is quantized from those values (a second rounding of
/// fewer than B tokens), so its bytes can differ from a cache that never saw the dropped tokens.
/// truncate_is_exact() tells which case a cut is. No block other than the cut one is ever
/// unpacked, so after a truncation r may be below R until the window refills.
///
/// Errors. Every operation validates its whole input before it changes anything and quantizes
/// into scratch blocks that are committed only on success, so a throwing call leaves the cache
/// exactly as it was. append() rejects NaN/Inf (naming layer, token, head and channel) and,
/// because the token would only fail later when its block is flushed, values a layer's formats
/// cannot store: |x| > 65504 when the layer stores f16 values or fp16 metadata, and a vector
/// norm > 65504 for Lloyd-Max with fp16 norms (use f32meta for such data). Sink tokens are f32
/// and only need to be finite.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvq/accounting/accountant.hpp"
#include "kvq/core/error.hpp"
#include "kvq/core/half.hpp"
#include "kvq/core/rows.hpp"
#include "kvq/core/tensor.hpp"
#include "kvq/policy/spec.hpp"
#include "kvq/quant/packed_view.hpp"
#include "kvq/quant/qtensor.hpp"
#include "kvq/quant/quantize.hpp"

namespace kvq {

/// Token extent of a "whole extent" (group 0) scale group on the channel, head or tensor axis
/// inside a streaming cache (a stream cannot wait for "all tokens").
inline constexpr int64_t kStreamGroupTokens = 32;
/// Smallest packed block, in tokens (see the file comment).
inline constexpr int64_t kMinBlockTokens = 16;
/// Largest magnitude accepted for data stored as f16 or with fp16 metadata (the fp16 maximum).
inline constexpr float kMaxF16Magnitude = 65504.f;

namespace detail {

/// Tokens one scale group spans in a stream (Gt in the file comment).
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

/// B: lcm of both token extents, rounded up to a multiple >= kMinBlockTokens.
inline int64_t stream_block_tokens(const QuantConfig& k, const QuantConfig& v) {
  const int64_t l = std::lcm(group_token_extent(k), group_token_extent(v));
  return l * ((kMinBlockTokens + l - 1) / l);
}

/// True when data stored under `c` must stay within the fp16 range.
inline bool needs_f16_range(const QuantConfig& c) {
  return c.format == Format::kF16 || (!c.is_raw() && c.meta == MetaDType::kF16);
}

inline std::size_t capacity_slack(const std::vector<uint8_t>& v) { return v.capacity() - v.size(); }

}  // namespace detail

/// One region of a layer's tokens, as for_each_segment() hands it out.
struct CacheSegment {
  enum class Kind : uint8_t { kSinks, kPacked, kResidual };
  Kind kind = Kind::kSinks;
  int64_t begin = 0;  ///< first token position
  int64_t end = 0;    ///< one past the last token position
  /// kPacked: the quantized blocks, each [end - begin, kv_heads, head_dim].
  const QTensor* key = nullptr;
  const QTensor* value = nullptr;
  /// kPacked: the same blocks as views (what kernels read; pages give the same views).
  PackedView key_view;
  PackedView value_view;
  /// kSinks / kResidual: f32 rows, contiguous [end - begin, kv_heads, head_dim].
  KVView<const float> key_rows;
  KVView<const float> value_rows;
  int64_t tokens() const { return end - begin; }
  bool packed() const { return kind == Kind::kPacked; }
};

/// Bytes of one layer's keys (or values), by kind.
struct StreamBytes {
  /// The packed blocks: sum of QTensor::breakdown() (packed.residual is QJL bits + norms).
  ByteBreakdown packed;
  std::size_t sinks = 0;     ///< f32 sink tokens
  std::size_t residual = 0;  ///< f32 residual window
  std::size_t total() const { return packed.total() + sinks + residual; }
  StreamBytes& operator+=(const StreamBytes& o) {
    packed += o.packed;
    sinks += o.sinks;
    residual += o.residual;
    return *this;
  }
  bool operator==(const StreamBytes& o) const {
    return packed == o.packed && sinks == o.sinks && residual == o.residual;
  }
};

/// One layer's share of the cache.
struct LayerMemory {
  int layer = 0;
  int64_t tokens = 0;
  int64_t sink_tokens = 0;
  int64_t packed_tokens = 0;
  int64_t residual_tokens = 0;
  int64_t blocks = 0;        ///< packed blocks (each of K and V)
  int64_t block_tokens = 0;  ///< B
  QuantConfig key_config, value_config;
  StreamBytes key, value;
  std::size_t total() const { return key.total() + value.total(); }
};

/// What the cache stores, by layer and kind. total() counts stored data only (codes,
/// metadata, f32 sinks and residual); `overhead` is the bookkeeping around it (block headers,
/// vector capacity not in use, the cache object) and excludes allocator headers.
struct MemoryReport {
  int kv_heads = 0;
  int head_dim = 0;
  std::vector<LayerMemory> layers;
  std::size_t overhead = 0;

  StreamBytes key_total() const {
    StreamBytes s;
    for (const LayerMemory& l : layers) s += l.key;
    return s;
  }
  StreamBytes value_total() const {
    StreamBytes s;
    for (const LayerMemory& l : layers) s += l.value;
    return s;
  }
  std::size_t total() const { return key_total().total() + value_total().total(); }
  /// K and V elements held (2 * tokens * kv_heads * head_dim summed over layers).
  int64_t elements() const {
    int64_t n = 0;
    for (const LayerMemory& l : layers) n += 2 * l.tokens * kv_heads * head_dim;
    return n;
  }
  /// 8 * total() / elements(): bits per cached value, metadata and f32 windows included.
  double effective_bits() const {
    const int64_t n = elements();
    return n > 0 ? 8.0 * static_cast<double>(total()) / static_cast<double>(n) : 0.0;
  }
  /// Bytes an f16 cache of the same tokens would take, divided by total() (0 when empty).
  double compression_vs_f16() const {
    const std::size_t t = total();
    return t > 0 ? 2.0 * static_cast<double>(elements()) / static_cast<double>(t) : 0.0;
  }

  /// A table: one row per layer, bytes by kind (K and V summed), totals and ratios. "seeds"
  /// are rotation seeds; "other" is outliers + codebooks (formats that store them).
  std::string str() const {
    std::string s;
    char line[256];
    std::snprintf(line, sizeof line, "%5s %7s %6s %10s %9s %9s %8s %8s %6s %6s %9s %10s %11s %6s\n",
                  "layer", "tokens", "blocks", "codes", "scales", "zeros", "norms", "qjl", "pad",
                  "other", "sinks", "residual", "total", "bits");
    s += line;
    auto row = [&](const char* name, int64_t tokens, int64_t blocks, const StreamBytes& b) {
      const int64_t n = 2 * tokens * kv_heads * head_dim;
      std::snprintf(line, sizeof line,
                    "%5s %7lld %6lld %10zu %9zu %9zu %8zu %8zu %6zu %6zu %9zu %10zu %11zu %6.2f\n",
                    name, static_cast<long long>(tokens), static_cast<long long>(blocks),
                    b.packed.codes, b.packed.scales, b.packed.zeros, b.packed.norms,
                    b.packed.residual, b.packed.padding, b.packed.outliers + b.packed.codebooks,
                    b.sinks, b.residual, b.total(),
                    n > 0 ? 8.0 * static_cast<double>(b.total()) / static_cast<double>(n) : 0.0);
      s += line;
    };
    StreamBytes all;
    int64_t tokens = 0, blocks = 0;
    for (const LayerMemory& l : layers) {
      StreamBytes b = l.key;
      b += l.value;
      all += b;
      tokens += l.tokens;
      blocks += l.blocks;
      row(std::to_string(l.layer).c_str(), l.tokens, l.blocks, b);
    }
    row("all", tokens, blocks, all);
    std::snprintf(line, sizeof line,
                  "keys %zu B, values %zu B, data %zu B + bookkeeping %zu B; %.3f bits/value, "
                  "%.2fx smaller than f16\n",
                  key_total().total(), value_total().total(), total(), overhead, effective_bits(),
                  compression_vs_f16());
    s += line;
    return s;
  }
};

/// The streaming quantized KV cache (see the file comment for the storage rules).
class KVCache {
 public:
  /// A cache for `n_layers` layers of `n_kv_heads` x `head_dim` keys and values under `policy`.
  /// max_tokens > 0 bounds the tokens of every layer (0 = unbounded). Throws for an invalid
  /// policy, an override of a layer that does not exist, a token-axis group that does not divide
  /// head_dim, or a format this build cannot store (each layer's formats are tried on a small
  /// block here, so such errors surface at construction, not at the first flush).
  KVCache(Policy policy, int n_layers, int n_kv_heads, int head_dim, int max_tokens = 0)
      : policy_(std::move(policy)),
        n_layers_(n_layers),
        kv_heads_(n_kv_heads),
        head_dim_(head_dim),
        max_tokens_(max_tokens) {
    KVQ_REQUIRE(n_layers > 0 && n_kv_heads > 0 && head_dim > 0 && max_tokens >= 0, kInvalidArgument,
                "KVCache: n_layers, n_kv_heads and head_dim must be > 0 and "
                "max_tokens >= 0, got n_layers=",
                n_layers, ", n_kv_heads=", n_kv_heads, ", head_dim=", head_dim,
                ", max_tokens=", max_tokens);
    policy_.validate();
    for (const auto& kv : policy_.overrides)
      KVQ_REQUIRE(kv.first < n_layers, kInvalidArgument, "KVCache: the policy overrides layer ",
                  kv.first, " but the model has ", n_layers, " layers");
    row_ = int64_t{n_kv_heads} * head_dim;
    layers_.resize(static_cast<std::size_t>(n_layers));
    std::vector<QuantConfig> tried;
    for (int l = 0; l < n_layers; ++l) {
      Layer& L = layers_[static_cast<std::size_t>(l)];
      L.kcfg = detail::streaming_config(policy_.key_for(l, n_layers));
      L.vcfg = detail::streaming_config(policy_.value_for(l, n_layers));
      L.block = detail::stream_block_tokens(L.kcfg, L.vcfg);
      L.skipped = policy_.skips(l, n_layers) && policy_.overrides.count(l) == 0;
      check_config(l, "key", L.kcfg, L.block, tried);
      check_config(l, "value", L.vcfg, L.block, tried);
    }
  }

  /// Appends k and v, each [tokens, kv_heads, head_dim] (any strides), to `layer`: a prefill
  /// chunk or one decode token. Full blocks are quantized as the flush rule says.
  void append(int layer, KVView<const float> k, KVView<const float> v) { append_impl(layer, k, v); }
  void append(int layer, KVView<const f16> k, KVView<const f16> v) { append_impl(layer, k, v); }
  void append(int layer, KVView<const bf16> k, KVView<const bf16> v) { append_impl(layer, k, v); }

  /// Dequantizes tokens [begin, end) of `layer` into k_out and v_out ([end - begin, kv_heads,
  /// head_dim], any strides). At most one packed block is materialized at a time (blocks wholly
  /// inside the range are dequantized straight into the output).
  void read(int layer, int64_t begin, int64_t end, KVView<float> k_out, KVView<float> v_out) const {
    const Layer& L = at(layer, "read");
    KVQ_REQUIRE(0 <= begin && begin <= end && end <= L.tokens, kOutOfRange,
                "KVCache::read: range [", begin, ", ", end, ") is outside the ", L.tokens,
                " tokens of layer ", layer);
    const Shape want{end - begin, kv_heads_, head_dim_};
    KVQ_REQUIRE(k_out.shape() == want && v_out.shape() == want, kShapeMismatch,
                "KVCache::read: outputs must be ", want.str(), ", got keys ", k_out.shape().str(),
                " and values ", v_out.shape().str());
    std::vector<float> kbuf, vbuf;  // [B, kv_heads, head_dim] one partially read block
    for_each_segment(layer, [&](const CacheSegment& s) {
      const int64_t a = std::max(begin, s.begin), b = std::min(end, s.end);
      if (a >= b) return;
      const KVView<float> ko = k_out.slice_tokens(a - begin, b - a);
      const KVView<float> vo = v_out.slice_tokens(a - begin, b - a);
      if (!s.packed()) {
        copy_rows(s.key_rows.slice_tokens(a - s.begin, b - a), ko);
        copy_rows(s.value_rows.slice_tokens(a - s.begin, b - a), vo);
        return;
      }
      if (a == s.begin && b == s.end) {
        dequantize(*s.key, ko);
        dequantize(*s.value, vo);
        return;
      }
      const auto n = static_cast<std::size_t>(s.tokens() * row_);
      kbuf.resize(n);
      vbuf.resize(n);
      const auto kb = KVView<float>::nhd(kbuf.data(), s.tokens(), kv_heads_, head_dim_);
      const auto vb = KVView<float>::nhd(vbuf.data(), s.tokens(), kv_heads_, head_dim_);
      dequantize(*s.key, kb);
      dequantize(*s.value, vb);
      copy_rows(KVView<const float>(kb).slice_tokens(a - s.begin, b - a), ko);
      copy_rows(KVView<const float>(vb).slice_tokens(a - s.begin, b - a), vo);
    });
  }

  /// Calls fn(const CacheSegment&) for the sinks, every packed block and the residual of
  /// `layer`, in token order (empty regions are skipped). Views and pointers stay valid until
  /// the next non-const call.
  template <class Fn>
  void for_each_segment(int layer, Fn&& fn) const {
    const Layer& L = at(layer, "for_each_segment");
    const int64_t s = sink_count(L);
    CacheSegment seg;
    if (s > 0) {
      seg.kind = CacheSegment::Kind::kSinks;
      seg.begin = 0;
      seg.end = s;
      seg.key_rows = KVView<const float>::nhd(L.sink_k.data(), s, kv_heads_, head_dim_);
      seg.value_rows = KVView<const float>::nhd(L.sink_v.data(), s, kv_heads_, head_dim_);
      fn(static_cast<const CacheSegment&>(seg));
    }
    for (std::size_t j = 0; j < L.kblocks.size(); ++j) {
      CacheSegment p;
      p.kind = CacheSegment::Kind::kPacked;
      p.begin = s + static_cast<int64_t>(j) * L.block;
      p.end = p.begin + L.block;
      p.key = &L.kblocks[j];
      p.value = &L.vblocks[j];
      p.key_view = view_of(L.kblocks[j]);
      p.value_view = view_of(L.vblocks[j]);
      fn(static_cast<const CacheSegment&>(p));
    }
    const int64_t r = residual_count(L);
    if (r > 0) {
      CacheSegment w;
      w.kind = CacheSegment::Kind::kResidual;
      w.begin = L.tokens - r;
      w.end = L.tokens;
      w.key_rows = KVView<const float>::nhd(L.res_k.data(), r, kv_heads_, head_dim_);
      w.value_rows = KVView<const float>::nhd(L.res_v.data(), r, kv_heads_, head_dim_);
      fn(static_cast<const CacheSegment&>(w));
    }
  }

  /// Keeps tokens [0, n) of every layer (see the file comment for exactness). Throws
  /// kOutOfRange, changing nothing, when a layer holds fewer than n tokens.
  void truncate(int64_t n) {
    for (int l = 0; l < n_layers_; ++l) check_truncate(l, n);
    // Dequantize every cut block first, so that nothing changes unless all layers can commit.
    std::vector<std::pair<std::vector<float>, std::vector<float>>> cut(layers_.size());
    for (int l = 0; l < n_layers_; ++l) cut[static_cast<std::size_t>(l)] = cut_block_rows(l, n);
    for (int l = 0; l < n_layers_; ++l)
      commit_truncate(l, n, std::move(cut[static_cast<std::size_t>(l)]));
  }
  /// Keeps tokens [0, n) of `layer` only.
  void truncate(int layer, int64_t n) {
    check_truncate(layer, n);
    commit_truncate(layer, n, cut_block_rows(layer, n));
  }
  /// True when truncate(layer, n) is exact: the cut falls in the sinks, in the residual or on a
  /// packed block boundary (then re-appending the dropped tokens reproduces the same bytes).
  bool truncate_is_exact(int layer, int64_t n) const {
    check_truncate(layer, n);
    const Layer& L = layers_[static_cast<std::size_t>(layer)];
    const int64_t s = sink_count(L);
    const int64_t packed_end = s + packed_count(L);
    return n <= s || n >= packed_end || (n - s) % L.block == 0;
  }

  /// Drops every token of every layer (configs and reserved capacity stay).
  void clear() {
    for (Layer& L : layers_) {
      L.tokens = 0;
      L.sink_k.clear();
      L.sink_v.clear();
      L.kblocks.clear();
      L.vblocks.clear();
      L.res_k.clear();
      L.res_v.clear();
    }
  }

  int64_t tokens(int layer) const { return at(layer, "tokens").tokens; }
  int64_t sink_tokens(int layer) const { return sink_count(at(layer, "sink_tokens")); }
  int64_t packed_tokens(int layer) const { return packed_count(at(layer, "packed_tokens")); }
  int64_t residual_tokens(int layer) const { return residual_count(at(layer, "residual_tokens")); }
  /// B of `layer` (tokens per packed block).
  int64_t block_tokens(int layer) const { return at(layer, "block_tokens").block; }
  /// The config `layer`'s key blocks are quantized with (the policy's, with group 0 on a
  /// token-spanning axis resolved to kStreamGroupTokens).
  const QuantConfig& key_config(int layer) const { return at(layer, "key_config").kcfg; }
  const QuantConfig& value_config(int layer) const { return at(layer, "value_config").vcfg; }
  /// True when `layer` is a skipped boundary layer stored under policy().skip_config.
  bool skipped(int layer) const { return at(layer, "skipped").skipped; }

  const Policy& policy() const { return policy_; }
  int n_layers() const { return n_layers_; }
  int kv_heads() const { return kv_heads_; }
  int head_dim() const { return head_dim_; }
  int max_tokens() const { return max_tokens_; }

  /// Bytes by layer and kind. For every layer, key.packed equals the sum over its blocks of
  /// account(key_config(layer), block shape) (and likewise for values).
  MemoryReport memory_report() const {
    MemoryReport m;
    m.kv_heads = kv_heads_;
    m.head_dim = head_dim_;
    m.overhead = sizeof(KVCache) + layers_.capacity() * sizeof(Layer);
    for (int l = 0; l < n_layers_; ++l) {
      const Layer& L = layers_[static_cast<std::size_t>(l)];
      LayerMemory lm;
      lm.layer = l;
      lm.tokens = L.tokens;
      lm.sink_tokens = sink_count(L);
      lm.packed_tokens = packed_count(L);
      lm.residual_tokens = residual_count(L);
      lm.blocks = static_cast<int64_t>(L.kblocks.size());
      lm.block_tokens = L.block;
      lm.key_config = L.kcfg;
      lm.value_config = L.vcfg;
      for (const QTensor& q : L.kblocks) lm.key.packed += q.breakdown();
      for (const QTensor& q : L.vblocks) lm.value.packed += q.breakdown();
      lm.key.sinks = L.sink_k.size() * sizeof(float);
      lm.value.sinks = L.sink_v.size() * sizeof(float);
      lm.key.residual = L.res_k.size() * sizeof(float);
      lm.value.residual = L.res_v.size() * sizeof(float);
      m.overhead += (L.kblocks.capacity() + L.vblocks.capacity()) * sizeof(QTensor);
      for (const auto* blocks : {&L.kblocks, &L.vblocks}) {
        for (const QTensor& q : *blocks) {
          m.overhead +=
              detail::capacity_slack(q.codes) + detail::capacity_slack(q.scales.raw()) +
              detail::capacity_slack(q.zeros.raw()) + detail::capacity_slack(q.norms.raw()) +
              detail::capacity_slack(q.qjl_signs) + detail::capacity_slack(q.qjl_norms.raw());
        }
      }
      for (const auto* v : {&L.sink_k, &L.sink_v, &L.res_k, &L.res_v})
        m.overhead += (v->capacity() - v->size()) * sizeof(float);
      m.layers.push_back(lm);
    }
    return m;
  }

 private:
  struct Layer {
    QuantConfig kcfg, vcfg;  // streaming configs
    int64_t block = 1;       // B
    bool skipped = false;
    int64_t tokens = 0;
    std::vector<float> sink_k, sink_v;      // [sink tokens, kv_heads, head_dim]
    std::vector<QTensor> kblocks, vblocks;  // each [B, kv_heads, head_dim]
    std::vector<float> res_k, res_v;        // [residual tokens, kv_heads, head_dim]
  };

  const Layer& at(int layer, const char* what) const {
    KVQ_REQUIRE(layer >= 0 && layer < n_layers_, kInvalidArgument, "KVCache::", what, ": layer ",
                layer, " does not exist (the cache has ", n_layers_, " layers)");
    return layers_[static_cast<std::size_t>(layer)];
  }
  Layer& at(int layer, const char* what) {
    return const_cast<Layer&>(static_cast<const KVCache*>(this)->at(layer, what));
  }
  int64_t sink_count(const Layer& L) const { return static_cast<int64_t>(L.sink_k.size()) / row_; }
  int64_t packed_count(const Layer& L) const {
    return static_cast<int64_t>(L.kblocks.size()) * L.block;
  }
  int64_t residual_count(const Layer& L) const {
    return static_cast<int64_t>(L.res_k.size()) / row_;
  }

  static void copy_rows(const KVView<const float>& src, const KVView<float>& dst) {
    for (int64_t t = 0; t < src.tokens(); ++t)
      for (int64_t h = 0; h < src.heads(); ++h) detail::store_row(dst, t, h, src.row(t, h));
  }

  /// Construction-time checks of one layer config: token-axis groups must divide head_dim, and
  /// the format must quantize a block of this geometry in this build (tried once per config).
  void check_config(int layer, const char* role, const QuantConfig& c, int64_t block,
                    std::vector<QuantConfig>& tried) const {
    if (!c.is_raw() && c.format != Format::kLloydMax && c.axis == Axis::kToken && c.group > 0 &&
        c.group < head_dim_ && head_dim_ % c.group != 0) {
      fail(ErrorKind::kShapeMismatch, "KVCache: layer ", layer, " ", role, " format ",
           config_spec(c), " groups ", c.group, " channels, which does not divide head_dim ",
           head_dim_,
           " (choose a group that divides head_dim, or >= head_dim for one group per "
           "head)");
    }
    for (const QuantConfig& t : tried)
      if (same_config(t, c)) return;
    std::vector<float> probe(static_cast<std::size_t>(block * row_));
    for (std::size_t i = 0; i < probe.size(); ++i)
      probe[i] = static_cast<float>(static_cast<int>(i * 7 % 5) - 2) * 0.5f;
    try {
      QTensor q;
      quantize(c, KVView<const float>::nhd(probe.data(), block, kv_heads_, head_dim_), q);
    } catch (const Error& e) {
      fail(e.kind(), "KVCache: layer ", layer, " ", role, " format ", config_spec(c),
           " cannot be stored with kv_heads=", kv_heads_, ", head_dim=", head_dim_, ": ", e.what());
    }
    tried.push_back(c);
  }

  /// Converts `x` into `dst` ([tokens, kv_heads, head_dim] f32), checking every value first.
  template <class T>
  void stage(int layer, const char* what, const KVView<const T>& x, const QuantConfig& cfg,
             int64_t first_quantized, std::vector<float>& dst) const {
    const int64_t m = x.tokens();
    const int64_t pos0 = layers_[static_cast<std::size_t>(layer)].tokens;
    dst.resize(static_cast<std::size_t>(m * row_));
    const bool f16_range = detail::needs_f16_range(cfg);
    const bool norm_range = cfg.format == Format::kLloydMax && cfg.meta == MetaDType::kF16;
    for (int64_t t = 0; t < m; ++t) {
      const bool quantized = t >= first_quantized;
      for (int64_t h = 0; h < kv_heads_; ++h) {
        float* o = dst.data() + (t * kv_heads_ + h) * head_dim_;
        const float* r = detail::load_row(x, t, h, o);
        if (r != o) std::copy(r, r + head_dim_, o);
        double norm2 = 0.0;
        for (int64_t d = 0; d < head_dim_; ++d) {
          const float v = o[d];
          if (!std::isfinite(v))
            fail(ErrorKind::kNonFinite, "KVCache::append: layer ", layer, " ", what, " token ", t,
                 " of the chunk (position ", pos0 + t, "), head ", h, ", channel ", d, " is ", v,
                 "; the cache stores finite values only (nothing was appended)");
          if (quantized && f16_range && std::fabs(v) > kMaxF16Magnitude)
            fail(ErrorKind::kOutOfRange, "KVCache::append: layer ", layer, " ", what, " token ", t,
                 " of the chunk (position ", pos0 + t, "), head ", h, ", channel ", d, " is ", v,
                 ", beyond the fp16 range (", kMaxF16Magnitude, ") that format ", config_spec(cfg),
                 " stores; use f32meta (nothing was appended)");
          norm2 += static_cast<double>(v) * v;
        }
        if (quantized && norm_range && std::sqrt(norm2) > kMaxF16Magnitude)
          fail(ErrorKind::kOutOfRange, "KVCache::append: layer ", layer, " ", what, " token ", t,
               " of the chunk (position ", pos0 + t, "), head ", h, " has norm ", std::sqrt(norm2),
               ", beyond the fp16 range of the norms of format ", config_spec(cfg),
               "; use f32meta (nothing was appended)");
      }
    }
  }

  template <class T>
  void append_impl(int layer, const KVView<const T>& k, const KVView<const T>& v) {
    const Layer& C = at(layer, "append");
    for (const auto* x : {&k, &v}) {
      KVQ_REQUIRE(x->heads() == kv_heads_ && x->head_dim() == head_dim_, kShapeMismatch,
                  "KVCache::append: layer ", layer, " ", x == &k ? "keys" : "values",
                  " have shape ", x->shape().str(), " but the cache holds kv_heads=", kv_heads_,
                  ", head_dim=", head_dim_);
    }
    KVQ_REQUIRE(k.tokens() == v.tokens(), kShapeMismatch, "KVCache::append: layer ", layer, " got ",
                k.tokens(), " key tokens but ", v.tokens(), " value tokens");
    const int64_t m = k.tokens();
    if (m == 0) return;
    KVQ_REQUIRE(max_tokens_ == 0 || C.tokens + m <= max_tokens_, kOutOfRange,
                "KVCache::append: layer ", layer, " holds ", C.tokens, " tokens; ", m,
                " more would exceed max_tokens=", max_tokens_);

    // 1. Validate and convert the chunk (no cache state is touched until step 3).
    const int64_t S = policy_.sinks;
    const int64_t take_sinks = C.tokens < S ? std::min(m, S - C.tokens) : 0;
    std::vector<float> in_k, in_v;  // [m, kv_heads, head_dim]
    stage(layer, "key", k, C.kcfg, take_sinks, in_k);
    stage(layer, "value", v, C.vcfg, take_sinks, in_v);

    // 2. Quantize the blocks this append completes into scratch.
    const int64_t B = C.block, R = policy_.residual;
    const int64_t r = residual_count(C);
    const int64_t total = r + (m - take_sinks);  // residual + incoming, in token order
    const int64_t flush = total > R ? (total - R) / B : 0;
    std::vector<QTensor> new_k(static_cast<std::size_t>(flush));
    std::vector<QTensor> new_v(static_cast<std::size_t>(flush));
    std::vector<float> gather_k, gather_v;  // [B, kv_heads, head_dim] a block straddling both
    for (int64_t j = 0; j < flush; ++j) {
      const float* bk = block_source(C.res_k, in_k, r, take_sinks, j * B, B, gather_k);
      const float* bv = block_source(C.res_v, in_v, r, take_sinks, j * B, B, gather_v);
      quantize(C.kcfg, KVView<const float>::nhd(bk, B, kv_heads_, head_dim_),
               new_k[static_cast<std::size_t>(j)]);
      quantize(C.vcfg, KVView<const float>::nhd(bv, B, kv_heads_, head_dim_),
               new_v[static_cast<std::size_t>(j)]);
    }

    // 3. Commit.
    Layer& L = at(layer, "append");
    const auto sink_end = static_cast<std::ptrdiff_t>(take_sinks * row_);
    const int64_t sinks_after = sink_count(L) + take_sinks;
    const int64_t residual_after = total - flush * B;
    for (auto* w : {&L.sink_k, &L.sink_v}) reserve_window(*w, sinks_after, S);
    for (auto* w : {&L.res_k, &L.res_v}) reserve_window(*w, residual_after, R + B - 1);
    L.sink_k.insert(L.sink_k.end(), in_k.begin(), in_k.begin() + sink_end);
    L.sink_v.insert(L.sink_v.end(), in_v.begin(), in_v.begin() + sink_end);
    for (int64_t j = 0; j < flush; ++j) {
      L.kblocks.push_back(std::move(new_k[static_cast<std::size_t>(j)]));
      L.vblocks.push_back(std::move(new_v[static_cast<std::size_t>(j)]));
    }
    const int64_t consumed = flush * B;  // tokens of (residual ++ incoming) now packed
    for (auto [res, in] : {std::pair{&L.res_k, &in_k}, std::pair{&L.res_v, &in_v}}) {
      if (consumed <= r) {
        res->erase(res->begin(), res->begin() + static_cast<std::ptrdiff_t>(consumed * row_));
        res->insert(res->end(), in->begin() + sink_end, in->end());
      } else {
        res->clear();
        res->insert(res->end(),
                    in->begin() + sink_end + static_cast<std::ptrdiff_t>((consumed - r) * row_),
                    in->end());
      }
    }
    L.tokens += m;
  }

  /// Grows an f32 window to hold `tokens` rows: geometrically, but never beyond `limit` rows,
  /// the most the window can ever hold (S for sinks, R + B - 1 for the residual), so its unused
  /// capacity stays below its high-water mark without reserving a huge window up front.
  void reserve_window(std::vector<float>& w, int64_t tokens, int64_t limit) const {
    const auto need = static_cast<std::size_t>(tokens * row_);
    if (w.capacity() >= need) return;
    const int64_t grown = std::max<int64_t>(tokens, 2 * static_cast<int64_t>(w.capacity()) / row_);
    w.reserve(static_cast<std::size_t>(std::max(tokens, std::min(grown, limit)) * row_));
  }

  /// Start of the B tokens at index `first` of (residual ++ incoming after the sinks): a
  /// pointer into one of them, or `gather` filled when the block straddles both.
  const float* block_source(const std::vector<float>& res, const std::vector<float>& in, int64_t r,
                            int64_t take_sinks, int64_t first, int64_t B,
                            std::vector<float>& gather) const {
    if (first + B <= r) return res.data() + first * row_;
    if (first >= r) return in.data() + (take_sinks + first - r) * row_;
    gather.resize(static_cast<std::size_t>(B * row_));
    const int64_t from_res = r - first;
    std::copy(res.begin() + first * row_, res.end(), gather.begin());
    std::copy(in.begin() + take_sinks * row_, in.begin() + (take_sinks + B - from_res) * row_,
              gather.begin() + from_res * row_);
    return gather.data();
  }

  void check_truncate(int layer, int64_t n) const {
    const Layer& L = at(layer, "truncate");
    KVQ_REQUIRE(n >= 0 && n <= L.tokens, kOutOfRange, "KVCache::truncate: cannot keep ", n,
                " tokens of layer ", layer, ", which holds ", L.tokens);
  }

  /// For a cut strictly inside a packed block: the kept tokens of that block, dequantized
  /// (keys, values), else empty vectors.
  std::pair<std::vector<float>, std::vector<float>> cut_block_rows(int layer, int64_t n) const {
    const Layer& L = layers_[static_cast<std::size_t>(layer)];
    std::pair<std::vector<float>, std::vector<float>> rows;
    if (truncate_is_exact(layer, n)) return rows;
    const int64_t rel = n - sink_count(L);
    const auto j = static_cast<std::size_t>(rel / L.block);
    const int64_t keep = rel % L.block;
    std::vector<float> kb(static_cast<std::size_t>(L.block * row_));
    std::vector<float> vb(kb.size());
    dequantize(L.kblocks[j], KVView<float>::nhd(kb.data(), L.block, kv_heads_, head_dim_));
    dequantize(L.vblocks[j], KVView<float>::nhd(vb.data(), L.block, kv_heads_, head_dim_));
    kb.resize(static_cast<std::size_t>(keep * row_));
    vb.resize(static_cast<std::size_t>(keep * row_));
    rows.first = std::move(kb);
    rows.second = std::move(vb);
    return rows;
  }

  void commit_truncate(int layer, int64_t n,
                       std::pair<std::vector<float>, std::vector<float>> cut) {
    Layer& L = layers_[static_cast<std::size_t>(layer)];
    const int64_t s = sink_count(L);
    if (n <= s) {
      L.sink_k.resize(static_cast<std::size_t>(n * row_));
      L.sink_v.resize(static_cast<std::size_t>(n * row_));
      L.kblocks.clear();
      L.vblocks.clear();
      L.res_k.clear();
      L.res_v.clear();
    } else if (n >= s + packed_count(L)) {
      const auto keep = static_cast<std::size_t>((n - s - packed_count(L)) * row_);
      L.res_k.resize(keep);
      L.res_v.resize(keep);
    } else {
      const auto blocks = static_cast<std::size_t>((n - s) / L.block);
      L.kblocks.resize(blocks);
      L.vblocks.resize(blocks);
      L.res_k.assign(cut.first.begin(), cut.first.end());
      L.res_v.assign(cut.second.begin(), cut.second.end());
    }
    L.tokens = n;
  }

  Policy policy_;
  int n_layers_ = 0;
  int kv_heads_ = 0;
  int head_dim_ = 0;
  int max_tokens_ = 0;
  int64_t row_ = 0;  // kv_heads * head_dim: floats per token
  std::vector<Layer> layers_;
};

}  // namespace kvq

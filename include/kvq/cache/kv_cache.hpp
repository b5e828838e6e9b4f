#pragma once
/// \file kv_cache.hpp
/// Streaming quantized KV cache for a whole model, stored under a Policy, in pages.
///
/// Per layer and for K and V alike, the tokens [0, n) live in three consecutive regions:
///
///   [0, s)            sinks: the first min(n, policy.sinks) tokens, f32, never quantized
///   [s, s + P)        packed: P / B pages of B tokens; page j holds the keys AND values of
///                     tokens [s + jB, s + (j+1)B), each quantized under the layer's key (value)
///                     config, laid out as layout/page_layout.hpp says (docs/layout.md)
///   [s + P, n)        residual window: the newest r = n - s - P tokens, f32
///
/// Pages come from one PageArena per layer (cache/page_arena.hpp): fixed-size, 64-byte aligned,
/// never moved once allocated. page_table(layer) exposes them (page pointers, token count,
/// PageLayout) so an engine can run kvq's kernels over them, or over pages it allocated itself
/// and filled with quantize_page(). reserve(tokens) allocates everything a layer needs up to
/// `tokens`; after it, append() allocates nothing (tests/cache/test_paged_cache.cpp counts).
///
/// Block size. Let Gt(cfg) be the token extent of one scale group: 1 for the token axis,
/// Lloyd-Max and raw formats; G for the channel, head and tensor axes (kStreamGroupTokens = 32
/// when the config says group 0, "all tokens", which a stream cannot wait for). Then
///   B = lcm(Gt(key), Gt(value)) rounded up to a multiple >= kMinBlockTokens (16),
/// and B <= kMaxBlockTokens (4096; larger is a spec error, policy/spec.hpp). The floor of 16
/// tokens keeps a page's alignment padding (at most 63 bytes per region) small next to its
/// data. Per-token groups quantize each token on its own, so the larger block changes no
/// stored value, only how long a token stays f32.
///
/// Flush rule (KIVI). After every append, while r >= R + B (R = policy.residual), the oldest B
/// residual tokens are quantized into one page. Hence, once a layer holds at least R tokens
/// after its sinks, R <= r <= R + B - 1: the newest R tokens are always full precision and at
/// most B - 1 more are waiting for their block to fill. Starting from an empty cache the split
/// depends only on n (not on how appends were chunked):
///   P = B * floor(max(0, n - s - R) / B).
///
/// Truncation (rollback). truncate(n) keeps the tokens [0, n). The cache keeps the f32
/// originals of the most recently packed block until the next flush (KVCacheOptions::
/// exact_rollback, off by default, opt-in; their bytes are reported as StreamBytes::rollback). So:
///  - if the newest page [b, b + B) was packed at a moment when the layer held more than n
///    tokens (that is, n < b + B + R), truncate(n) unpacks it from those originals: its kept
///    tokens go back to the residual window exactly as they were. Hence any append of k <= B
///    tokens (speculative drafts; one append flushes at most one block then) followed by
///    truncate back to n leaves the layer byte for byte as a cache that was only ever fed the
///    first n tokens: same pages, same f32 windows, same attention;
///  - otherwise pages that end at or before n stay untouched, pages after n are dropped, sinks
///    and residual are cut. A cut strictly inside an older page (whose originals are gone)
///    cannot restore the full-precision originals: that page is dequantized and its kept tokens
///    become the residual, holding the values attention already saw; when that block fills
///    again it is quantized from those values (a second rounding), so its bytes can differ
///    from a cache that never saw the dropped tokens. truncate_is_exact() tells which case a
///    cut is. After a truncation r may be below R until the window refills.
///
/// Errors. Every operation validates its whole input before it changes anything and quantizes
/// into free page slots that are published only on success, so a throwing call leaves the cache
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
#include "kvq/cache/page_arena.hpp"
#include "kvq/layout/page_layout.hpp"
#include "kvq/policy/spec.hpp"
#include "kvq/quant/packed_view.hpp"
#include "kvq/quant/qtensor.hpp"
#include "kvq/quant/quantize.hpp"

namespace kvq {

/// Largest magnitude accepted for data stored as f16 or with fp16 metadata (the fp16 maximum).
inline constexpr float kMaxF16Magnitude = 65504.f;

namespace detail {

/// True when data stored under `c` must stay within the fp16 range (the FP4 formats keep no
/// fp16 metadata: their block scales are e4m3 / e8m0 codes that saturate).
inline bool needs_f16_range(const QuantConfig& c) {
  return c.format == Format::kF16 || (!c.is_raw() && !is_fp4(c.format) && c.meta == MetaDType::kF16);
}

}  // namespace detail

// CacheSegment (one region of a layer's tokens, as for_each_segment() hands it out) lives in
// layout/page_layout.hpp, below the attention kernels that read it.

/// Bytes of one layer's keys (or values), by kind.
struct StreamBytes {
  /// The pages: per page, the accountant's figure for this tensor's B tokens
  /// (account(config, [B, kv_heads, head_dim])) plus the alignment padding of its page regions
  /// (packed.padding); packed.residual is QJL bits + norms. Keys own the page bytes before the
  /// value codes, values the rest, so key + value packed bytes == pages x page bytes.
  ByteBreakdown packed;
  std::size_t sinks = 0;     ///< f32 sink tokens
  std::size_t residual = 0;  ///< f32 residual window
  std::size_t rollback = 0;  ///< f32 originals of the newest page (exact rollback), or 0
  std::size_t total() const { return packed.total() + sinks + residual + rollback; }
  StreamBytes& operator+=(const StreamBytes& o) {
    packed += o.packed;
    sinks += o.sinks;
    residual += o.residual;
    rollback += o.rollback;
    return *this;
  }
  bool operator==(const StreamBytes& o) const {
    return packed == o.packed && sinks == o.sinks && residual == o.residual &&
           rollback == o.rollback;
  }
};

/// One layer's share of the cache.
struct LayerMemory {
  int layer = 0;
  int64_t tokens = 0;
  int64_t sink_tokens = 0;
  int64_t packed_tokens = 0;
  int64_t residual_tokens = 0;
  int64_t released_tokens = 0;  ///< positions whose pages were released (sliding window)
  int64_t blocks = 0;        ///< pages in use (each holds B tokens of K and V)
  /// Of `blocks`, the pages another cache (a fork, KVCache::fork()) also holds at the time of
  /// the report. They are counted in full in `key` and `value` of every cache that holds them;
  /// unique_total() counts each page once over several caches.
  int64_t shared_blocks = 0;
  int64_t block_tokens = 0;  ///< B
  std::size_t page_bytes = 0;  ///< bytes of one page (PageLayout::bytes)
  QuantConfig key_config, value_config;
  StreamBytes key, value;
  std::size_t total() const { return key.total() + value.total(); }
};

/// What the cache stores, by layer and kind. total() counts the bytes that hold tokens: pages
/// in use (codes, metadata and their alignment padding), f32 sinks and residual, and the f32
/// rollback originals. `overhead` is the memory around them (free page slots, page tables,
/// vector capacity not in use, the cache object; allocator headers excluded); `scratch` is the
/// per-call working memory (staging of the largest chunk appended, the quantizer workspace).
struct MemoryReport {
  int kv_heads = 0;
  int head_dim = 0;
  std::vector<LayerMemory> layers;
  std::size_t overhead = 0;
  std::size_t scratch = 0;

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
  /// Bytes of total() in pages that another cache (a fork) also holds: shared_blocks x
  /// page_bytes summed over layers. total() - shared() is what this cache alone holds.
  std::size_t shared() const {
    std::size_t n = 0;
    for (const LayerMemory& l : layers)
      n += static_cast<std::size_t>(l.shared_blocks) * l.page_bytes;
    return n;
  }
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

  /// A table: one row per layer, bytes by kind (K and V summed), totals and ratios. "pad" is
  /// page alignment padding; "other" is outliers + codebooks (formats that store them);
  /// "rollback" the f32 originals kept for exact rollback.
  std::string str() const {
    std::string s;
    char line[256];
    std::snprintf(line, sizeof line,
                  "%5s %7s %6s %10s %9s %9s %8s %8s %6s %6s %9s %10s %9s %11s %6s\n", "layer",
                  "tokens", "pages", "codes", "scales", "zeros", "norms", "qjl", "pad", "other",
                  "sinks", "residual", "rollback", "total", "bits");
    s += line;
    auto row = [&](const char* name, int64_t tokens, int64_t blocks, const StreamBytes& b) {
      const int64_t n = 2 * tokens * kv_heads * head_dim;
      std::snprintf(line, sizeof line,
                    "%5s %7lld %6lld %10zu %9zu %9zu %8zu %8zu %6zu %6zu %9zu %10zu %9zu %11zu "
                    "%6.2f\n",
                    name, static_cast<long long>(tokens), static_cast<long long>(blocks),
                    b.packed.codes, b.packed.scales, b.packed.zeros, b.packed.norms,
                    b.packed.residual, b.packed.padding, b.packed.outliers + b.packed.codebooks,
                    b.sinks, b.residual, b.rollback, b.total(),
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
                  "keys %zu B, values %zu B, data %zu B + bookkeeping %zu B + scratch %zu B; "
                  "%.3f bits/value, %.2fx smaller than f16\n",
                  key_total().total(), value_total().total(), total(), overhead, scratch,
                  effective_bits(), compression_vs_f16());
    s += line;
    if (shared() > 0) {
      std::snprintf(line, sizeof line,
                    "of which %zu B in pages shared with a fork (%zu B held by this cache alone)\n",
                    shared(), total() - shared());
      s += line;
    }
    return s;
  }
};


namespace detail {
/// The cache's own state export/import (cache/state.hpp): reads and restores its stored state
/// (pages, f32 windows, rollback rows), e.g. for io/archive.hpp, which rebuilds a cache byte for
/// byte from a file. Part of the cache layer; no io/ type is a friend of KVCache.
struct KVCacheAccess;
}  // namespace detail

/// Options of a KVCache beyond its policy.
struct KVCacheOptions {
  /// Keep the f32 originals of the newest page until the next flush, so that a rollback of up
  /// to one block (speculative decoding) is exact (file comment). Costs B rows of f32 keys and
  /// values per layer, reported as StreamBytes::rollback: at 300 tokens of k8v4 (B = 32) it
  /// takes the effective bits from 8.5 to 11.6. Off by default (memory is what a quantized
  /// cache is for); an engine that verifies speculative drafts turns it on.
  bool exact_rollback = false;
  /// Where the pages come from: an engine's pool (cache/page_arena.hpp's PageAllocator; it
  /// must outlive the cache and its copies), or nullptr for kvq's own chunks. A copy of the
  /// cache takes its pages from the same allocator; release_unused_pages() gives pages freed
  /// by clear() or truncate() back to it (the destructor gives back all).
  PageAllocator* page_allocator = nullptr;
};

/// The streaming quantized KV cache (see the file comment for the storage rules).
class KVCache {
 public:
  /// A cache for `n_layers` layers of `n_kv_heads` x `head_dim` keys and values under `policy`.
  /// max_tokens > 0 bounds the tokens of every layer (0 = unbounded). Throws for an invalid
  /// policy, an override of a layer that does not exist, a token-axis group that does not divide
  /// head_dim, a block beyond kMaxBlockTokens or a page beyond kMaxPageBytes, or a format this
  /// build cannot store (each layer's formats are tried on a small page here, so such errors
  /// surface at construction, not at the first flush).
  KVCache(Policy policy, int n_layers, int n_kv_heads, int head_dim, int max_tokens = 0,
          KVCacheOptions options = {})
      : policy_(std::move(policy)),
        n_layers_(n_layers),
        kv_heads_(n_kv_heads),
        head_dim_(head_dim),
        max_tokens_(max_tokens),
        options_(options) {
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
    std::vector<std::pair<QuantConfig, QuantConfig>> tried;
    for (int l = 0; l < n_layers; ++l) {
      Layer& L = layers_[static_cast<std::size_t>(l)];
      L.kcfg = detail::streaming_config(policy_.key_for(l, n_layers));
      L.vcfg = detail::streaming_config(policy_.value_for(l, n_layers));
      L.block = detail::stream_block_tokens(L.kcfg, L.vcfg);
      L.skipped = policy_.skips(l, n_layers) && policy_.overrides.count(l) == 0;
      check_config(l, "key", L.kcfg);
      check_config(l, "value", L.vcfg);
      L.layout = make_layout(l, L);
      L.pages = PageArena(L.layout.bytes, options_.page_allocator);
      probe(l, L, tried);
    }
  }

  /// Appends k and v, each [tokens, kv_heads, head_dim] (any strides), to `layer`: a prefill
  /// chunk or one decode token. Full blocks are quantized into pages as the flush rule says.
  void append(int layer, KVView<const float> k, KVView<const float> v) { append_impl(layer, k, v); }
  void append(int layer, KVView<const f16> k, KVView<const f16> v) { append_impl(layer, k, v); }
  void append(int layer, KVView<const bf16> k, KVView<const bf16> v) { append_impl(layer, k, v); }

  /// A new cache holding this cache's tokens that shares its pages (prefix sharing): no page
  /// is copied or allocated, each is reference-counted, and an engine's PageAllocator gets a
  /// page back once, when the last cache holding it drops it. What can still change is copied
  /// at once: the f32 sinks, the f32 residual window (which holds the block not yet packed:
  /// a page is only ever written whole, when its block is flushed) and the rollback
  /// originals. Published pages are never written (a flush fills a free slot of the cache
  /// that flushes; a truncation into a page dequantizes it into the residual and drops it), and
  /// a shared page that leaves a cache's use is dropped by that cache instead of recycled, so
  /// no later call on either cache (append, truncate, release_before, clear, destruction)
  /// changes the other's bytes or attention. Each then behaves exactly as a cache that was fed
  /// the same tokens alone (same pages, windows and attention, bit for bit). Options (exact
  /// rollback, the allocator) and max_tokens are the source's. Throws bad_alloc (host memory
  /// for the page tables and f32 rows; no engine page is needed), leaving the source as it
  /// was. Reads the source only: it may run while other threads read the source, not while
  /// one writes it.
  KVCache fork() const { return KVCache(*this, ForkTag{}); }
  /// A fork of the first n tokens of every layer: fork() followed by truncate(n) on the fork,
  /// so it is exact where truncate(n) is (truncate_is_exact(): a cut on a page boundary, in
  /// the sinks or the residual, or in the newest page while its originals are kept). Throws
  /// kOutOfRange, creating nothing, when a layer holds fewer than n tokens.
  KVCache fork(int64_t n) const {
    for (int l = 0; l < n_layers_; ++l) check_truncate(l, n);
    KVCache f = fork();
    f.truncate(n);
    return f;
  }

  /// Turns exact rollback (KVCacheOptions::exact_rollback) on or off from now on, e.g. for
  /// one fork of a family that verifies speculative drafts. Off: the originals kept are
  /// dropped and their memory freed. On: the originals of every page flushed from now on are
  /// kept, so a rollback of drafts appended after this call is exact; for tokens appended
  /// before it, truncate_is_exact() tells. No allocation, no throw.
  void set_exact_rollback(bool on) noexcept {
    options_.exact_rollback = on;
    if (on) return;
    for (Layer& L : layers_) {
      L.roll = false;
      std::vector<float>().swap(L.roll_k);
      std::vector<float>().swap(L.roll_v);
    }
  }

  /// Allocates what every layer needs to hold `tokens` tokens (pages, page table, f32 windows,
  /// rollback rows, single-token staging and the quantizer workspace), so that appending up to
  /// `tokens` tokens one at a time allocates nothing. Changes no token; may throw bad_alloc.
  void reserve(int64_t tokens) {
    KVQ_REQUIRE(tokens >= 0 && (max_tokens_ == 0 || tokens <= max_tokens_), kOutOfRange,
                "KVCache::reserve: ", tokens, " tokens is outside [0, max_tokens=", max_tokens_,
                "]");
    const int64_t S = policy_.sinks, R = policy_.residual;
    for (Layer& L : layers_) {
      const int64_t after_sinks = std::max<int64_t>(0, tokens - S);
      L.pages.reserve(static_cast<std::size_t>(std::max<int64_t>(0, after_sinks - R) / L.block));
      for (auto* w : {&L.sink_k, &L.sink_v}) reserve_rows(*w, std::min(tokens, S));
      for (auto* w : {&L.res_k, &L.res_v})
        reserve_rows(*w, std::min(after_sinks, R + L.block - 1));
      if (options_.exact_rollback && after_sinks >= L.block + R)
        for (auto* w : {&L.roll_k, &L.roll_v}) reserve_rows(*w, L.block);
      for (auto* w : {&gather_k_, &gather_v_})
        if (after_sinks >= L.block + R) reserve_rows(*w, L.block);
    }
    if (tokens > 0)
      for (auto* w : {&stage_k_, &stage_v_}) reserve_rows(*w, 1);
  }

  /// Dequantizes tokens [begin, end) of `layer` into k_out and v_out ([end - begin, kv_heads,
  /// head_dim], any strides), straight from the pages (any token range of a page).
  void read(int layer, int64_t begin, int64_t end, KVView<float> k_out, KVView<float> v_out) const {
    const Layer& L = at(layer, "read");
    KVQ_REQUIRE(0 <= begin && begin <= end && end <= L.tokens, kOutOfRange,
                "KVCache::read: range [", begin, ", ", end, ") is outside the ", L.tokens,
                " tokens of layer ", layer);
    KVQ_REQUIRE(L.dropped == 0 || begin >= packed_begin(L) || end <= sink_count(L), kOutOfRange,
                "KVCache::read: range [", begin, ", ", end, ") of layer ", layer,
                " reaches tokens [", sink_count(L), ", ", packed_begin(L),
                "), whose pages were released (release_before)");
    const Shape want{end - begin, kv_heads_, head_dim_};
    KVQ_REQUIRE(k_out.shape() == want && v_out.shape() == want, kShapeMismatch,
                "KVCache::read: outputs must be ", want.str(), ", got keys ", k_out.shape().str(),
                " and values ", v_out.shape().str());
    QuantWorkspace ws;
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
      dequantize_tokens(s.key_view, a - s.begin, ko, ws);
      dequantize_tokens(s.value_view, a - s.begin, vo, ws);
    });
  }

  /// Calls fn(const CacheSegment&) for the sinks, every page and the residual of `layer`, in
  /// token order (empty regions are skipped). Views stay valid until the next non-const call.
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
    for (std::size_t j = 0; j < L.pages.size(); ++j) {
      CacheSegment p;
      p.kind = CacheSegment::Kind::kPacked;
      p.begin = packed_begin(L) + static_cast<int64_t>(j) * L.block;
      p.end = p.begin + L.block;
      p.key_view = L.layout.key_view(L.pages.page(j));
      p.value_view = L.layout.value_view(L.pages.page(j));
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

  /// `layer`'s packed tokens as a page table (valid until the next non-const call): the page
  /// pointers, their layout, and the packed token range [first_token, first_token + tokens).
  /// Sinks and the residual window are f32 rows (for_each_segment()).
  PageTable page_table(int layer) const {
    const Layer& L = at(layer, "page_table");
    PageTable t;
    t.layout = L.layout;
    t.pages = L.pages.table();
    t.n_pages = static_cast<int64_t>(L.pages.size());
    t.first_token = packed_begin(L);
    t.tokens = packed_count(L);
    return t;
  }
  /// The layout of `layer`'s pages.
  const PageLayout& page_layout(int layer) const { return at(layer, "page_layout").layout; }

  /// Keeps tokens [0, n) of every layer (see the file comment for exactness). Throws
  /// kOutOfRange, changing nothing, when a layer holds fewer than n tokens.
  void truncate(int64_t n) {
    for (int l = 0; l < n_layers_; ++l) check_truncate(l, n);
    // Dequantize every cut page first, so that nothing changes unless all layers can commit.
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
  /// True when truncate(layer, n) is exact: every kept token keeps its original value and bytes
  /// (the cut falls in the sinks, in the residual, on a page boundary, or in the newest page
  /// while its f32 originals are kept), so re-appending the dropped tokens reproduces the same
  /// bytes. False when the cut falls strictly inside an older page (it is re-rounded).
  bool truncate_is_exact(int layer, int64_t n) const {
    check_truncate(layer, n);
    const Layer& L = layers_[static_cast<std::size_t>(layer)];
    const int64_t s = sink_count(L);
    const int64_t packed_end = packed_begin(L) + packed_count(L);
    return n <= s || n >= packed_end || (n - s) % L.block == 0 ||
           (L.roll && n >= packed_end - L.block);
  }

  /// Drops every token of every layer (configs and reserved capacity stay).
  /// Gives every page slot not holding tokens (after clear() or truncate(), or reserved ahead)
  /// back to the engine's PageAllocator; does nothing for kvq's own pages.
  void release_unused_pages() noexcept {
    for (Layer& L : layers_) L.pages.release_unused();
  }

  /// Releases the pages of `layer` whose tokens all lie before `position`: a sliding-window
  /// layer whose queries from now on see only positions >= `position` (CacheBackend calls it
  /// after each windowed attention). Only whole pages go; the sinks and the f32 residual stay.
  /// The slots become free (reused by later flushes; release_unused_pages() gives them back to
  /// an engine's PageAllocator), memory_report() counts only what is held, tokens() still
  /// counts every position appended. Released tokens can no longer be read or truncated to,
  /// and attention over the layer needs a window that excludes them. Returns the pages
  /// released. No allocation, no throw.
  int64_t release_before(int layer, int64_t position) noexcept {
    if (layer < 0 || layer >= n_layers_) return 0;
    Layer& L = layers_[static_cast<std::size_t>(layer)];
    const int64_t first = packed_begin(L);
    if (position <= first) return 0;
    const int64_t n = std::min<int64_t>((position - first) / L.block,
                                        static_cast<int64_t>(L.pages.size()));
    if (n <= 0) return 0;
    if (n == static_cast<int64_t>(L.pages.size())) L.roll = false;  // the newest page's originals
    L.pages.drop_front(static_cast<std::size_t>(n));
    L.dropped += n;
    return n;
  }
  /// Tokens of `layer` whose pages were released (release_before).
  int64_t released_tokens(int layer) const {
    const Layer& L = at(layer, "released_tokens");
    return L.dropped * L.block;
  }

  void clear() {
    for (Layer& L : layers_) {
      L.tokens = 0;
      L.dropped = 0;
      L.sink_k.clear();
      L.sink_v.clear();
      L.pages.resize(0);
      L.res_k.clear();
      L.res_v.clear();
      L.roll = false;
    }
  }

  int64_t tokens(int layer) const { return at(layer, "tokens").tokens; }
  int64_t sink_tokens(int layer) const { return sink_count(at(layer, "sink_tokens")); }
  int64_t packed_tokens(int layer) const { return packed_count(at(layer, "packed_tokens")); }
  int64_t residual_tokens(int layer) const { return residual_count(at(layer, "residual_tokens")); }
  /// B of `layer` (tokens per page).
  int64_t block_tokens(int layer) const { return at(layer, "block_tokens").block; }
  /// The config `layer`'s key pages are quantized with (the policy's, with group 0 on a
  /// token-spanning axis resolved to kStreamGroupTokens).
  const QuantConfig& key_config(int layer) const { return at(layer, "key_config").kcfg; }
  const QuantConfig& value_config(int layer) const { return at(layer, "value_config").vcfg; }
  /// True when `layer` is a skipped boundary layer stored under policy().skip_config.
  bool skipped(int layer) const { return at(layer, "skipped").skipped; }

  const Policy& policy() const { return policy_; }
  const KVCacheOptions& options() const { return options_; }
  int n_layers() const { return n_layers_; }
  int kv_heads() const { return kv_heads_; }
  int head_dim() const { return head_dim_; }
  int max_tokens() const { return max_tokens_; }

  /// Bytes by layer and kind. For every layer, key.packed + value.packed equals pages in use x
  /// page bytes, and key.packed minus its padding equals pages x account(key_config(layer),
  /// [B, kv_heads, head_dim]) (likewise for values).
  MemoryReport memory_report() const {
    MemoryReport m;
    m.kv_heads = kv_heads_;
    m.head_dim = head_dim_;
    m.overhead = sizeof(KVCache) + layers_.capacity() * sizeof(Layer);
    auto slack = [](const std::vector<float>& v) { return (v.capacity() - v.size()) * sizeof(float); };
    for (int l = 0; l < n_layers_; ++l) {
      const Layer& L = layers_[static_cast<std::size_t>(l)];
      LayerMemory lm;
      lm.layer = l;
      lm.tokens = L.tokens - L.dropped * L.block;  // held
      lm.released_tokens = L.dropped * L.block;
      lm.sink_tokens = sink_count(L);
      lm.packed_tokens = packed_count(L);
      lm.residual_tokens = residual_count(L);
      lm.blocks = static_cast<int64_t>(L.pages.size());
      lm.shared_blocks = static_cast<int64_t>(L.pages.shared_pages());
      lm.block_tokens = L.block;
      lm.page_bytes = L.layout.bytes;
      lm.key_config = L.kcfg;
      lm.value_config = L.vcfg;
      const auto pages = L.pages.size();
      lm.key.packed = scaled(key_page_bytes(L.layout), pages);
      lm.value.packed = scaled(value_page_bytes(L.layout), pages);
      lm.key.sinks = L.sink_k.size() * sizeof(float);
      lm.value.sinks = L.sink_v.size() * sizeof(float);
      lm.key.residual = L.res_k.size() * sizeof(float);
      lm.value.residual = L.res_v.size() * sizeof(float);
      lm.key.rollback = L.roll ? L.roll_k.size() * sizeof(float) : 0;
      lm.value.rollback = L.roll ? L.roll_v.size() * sizeof(float) : 0;
      m.overhead += L.pages.allocated_bytes() - pages * L.layout.bytes;
      for (const auto* v : {&L.sink_k, &L.sink_v, &L.res_k, &L.res_v}) m.overhead += slack(*v);
      for (const auto* v : {&L.roll_k, &L.roll_v})
        m.overhead += L.roll ? slack(*v) : v->capacity() * sizeof(float);
      m.layers.push_back(lm);
    }
    for (const auto* v : {&stage_k_, &stage_v_, &gather_k_, &gather_v_})
      m.scratch += v->capacity() * sizeof(float);
    for (const auto* v : {&ws_.buf, &ws_.u, &ws_.r, &ws_.lo, &ws_.hi, &ws_.zv, &ws_.iv})
      m.scratch += v->capacity() * sizeof(float);
    m.scratch += ws_.codes.capacity() + ws_.signs.capacity();
    return m;
  }

 private:
  friend struct detail::KVCacheAccess;

  struct ForkTag {};
  /// fork(): every member as the copy constructor copies it, but the pages shared.
  KVCache(const KVCache& o, ForkTag)
      : policy_(o.policy_),
        n_layers_(o.n_layers_),
        kv_heads_(o.kv_heads_),
        head_dim_(o.head_dim_),
        max_tokens_(o.max_tokens_),
        options_(o.options_),
        row_(o.row_) {
    layers_.resize(o.layers_.size());
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      const Layer& s = o.layers_[l];
      Layer& d = layers_[l];
      d.kcfg = s.kcfg;
      d.vcfg = s.vcfg;
      d.block = s.block;
      d.skipped = s.skipped;
      d.tokens = s.tokens;
      d.dropped = s.dropped;
      d.layout = s.layout;
      d.pages = s.pages.share();
      d.sink_k = s.sink_k;
      d.sink_v = s.sink_v;
      d.res_k = s.res_k;
      d.res_v = s.res_v;
      if (s.roll) {
        d.roll_k = s.roll_k;
        d.roll_v = s.roll_v;
      }
      d.roll = s.roll;
    }
  }

  struct Layer {
    QuantConfig kcfg, vcfg;  // streaming configs
    int64_t block = 1;       // B
    bool skipped = false;
    int64_t tokens = 0;
    int64_t dropped = 0;                    // pages released from the front (release_before)
    PageLayout layout;                      // pages of B tokens
    PageArena pages;                        // pages in use: [0, pages.size())
    std::vector<float> sink_k, sink_v;      // [sink tokens, kv_heads, head_dim]
    std::vector<float> res_k, res_v;        // [residual tokens, kv_heads, head_dim]
    std::vector<float> roll_k, roll_v;      // [B, kv_heads, head_dim] originals of the newest page
    bool roll = false;                      // roll_k / roll_v hold the newest page's originals
  };

  /// Key bytes of one page: the accountant's figure for the page's keys and the padding up to
  /// the value codes (so every region kind a format stores is counted by its own name).
  static ByteBreakdown key_page_bytes(const PageLayout& p) {
    ByteBreakdown b = account(p.key, p.page_shape());
    b.padding = p.v.codes.offset - b.total();
    return b;
  }
  /// Value bytes of one page: the accountant's figure and the padding to the end of the page.
  static ByteBreakdown value_page_bytes(const PageLayout& p) {
    ByteBreakdown b = account(p.value, p.page_shape());
    b.padding = p.bytes - p.v.codes.offset - b.total();
    return b;
  }
  static ByteBreakdown scaled(ByteBreakdown b, std::size_t n) {
    b.codes *= n;
    b.scales *= n;
    b.zeros *= n;
    b.norms *= n;
    b.residual *= n;
    b.outliers *= n;
    b.codebooks *= n;
    b.padding *= n;
    return b;
  }

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
    return static_cast<int64_t>(L.pages.size()) * L.block;
  }
  /// Position of the first packed token held (after the sinks and the released pages).
  int64_t packed_begin(const Layer& L) const { return sink_count(L) + L.dropped * L.block; }
  int64_t residual_count(const Layer& L) const {
    return static_cast<int64_t>(L.res_k.size()) / row_;
  }

  static void copy_rows(const KVView<const float>& src, const KVView<float>& dst) {
    for (int64_t t = 0; t < src.tokens(); ++t)
      for (int64_t h = 0; h < src.heads(); ++h) detail::store_row(dst, t, h, src.row(t, h));
  }

  /// Grows `w` to hold `tokens` rows (reserve; no change of size).
  void reserve_rows(std::vector<float>& w, int64_t tokens) const {
    w.reserve(static_cast<std::size_t>(std::max<int64_t>(0, tokens) * row_));
  }

  /// Token-axis groups must divide head_dim.
  void check_config(int layer, const char* role, const QuantConfig& c) const {
    if (!c.is_raw() && c.format != Format::kLloydMax && c.axis == Axis::kToken && c.group > 0 &&
        c.group < head_dim_ && head_dim_ % c.group != 0) {
      fail(ErrorKind::kShapeMismatch, "KVCache: layer ", layer, " ", role, " format ",
           config_spec(c), " groups ", c.group, " channels, which does not divide head_dim ",
           head_dim_,
           " (choose a group that divides head_dim, or >= head_dim for one group per "
           "head)");
    }
  }

  /// The page layout of a layer, with the byte limits (a page, and the f32 staging of a block,
  /// must stay within kMaxPageBytes).
  PageLayout make_layout(int layer, const Layer& L) const {
    const double staging = static_cast<double>(L.block) * static_cast<double>(row_) * 4.0;
    KVQ_REQUIRE(staging <= static_cast<double>(kMaxPageBytes), kOutOfRange, "KVCache: layer ",
                layer, " packs blocks of ", L.block, " tokens x ", kv_heads_, " heads x ",
                head_dim_, ", whose f32 staging would take ", staging, " bytes (limit ",
                kMaxPageBytes, "); use smaller token groups");
    try {
      return make_page_layout(L.kcfg, L.vcfg, L.block, kv_heads_, head_dim_);
    } catch (const Error& e) {
      fail(e.kind(), "KVCache: layer ", layer, " cannot lay out pages of ", L.block, " tokens x ",
           kv_heads_, " x ", head_dim_, " under key ", config_spec(L.kcfg), " and value ",
           config_spec(L.vcfg), ": ", e.what());
    }
  }

  /// Tries each distinct (key, value) pair on one page of this geometry (also grows the
  /// quantizer workspace to the geometry).
  void probe(int layer, const Layer& L, std::vector<std::pair<QuantConfig, QuantConfig>>& tried) {
    for (const auto& t : tried)
      if (same_config(t.first, L.kcfg) && same_config(t.second, L.vcfg)) return;
    std::vector<float> data(static_cast<std::size_t>(L.block * row_));
    for (std::size_t i = 0; i < data.size(); ++i)
      data[i] = static_cast<float>(static_cast<int>(i * 7 % 5) - 2) * 0.5f;
    const auto x = KVView<const float>::nhd(data.data(), L.block, kv_heads_, head_dim_);
    PageArena scratch(L.layout.bytes);
    scratch.reserve(1);
    for (int kv = 0; kv < 2; ++kv) {
      const QuantConfig& c = kv == 0 ? L.kcfg : L.vcfg;
      try {
        quantize_into(c, x, kv == 0 ? L.layout.key_span(scratch.page(0), 0, L.block)
                                    : L.layout.value_span(scratch.page(0), 0, L.block), ws_);
      } catch (const Error& e) {
        fail(e.kind(), "KVCache: layer ", layer, " ", kv == 0 ? "key" : "value", " format ",
             config_spec(c), " cannot be stored with kv_heads=", kv_heads_, ", head_dim=",
             head_dim_, ": ", e.what());
      }
    }
    tried.emplace_back(L.kcfg, L.vcfg);
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
    std::vector<float>& in_k = stage_k_;  // [m, kv_heads, head_dim]
    std::vector<float>& in_v = stage_v_;
    stage(layer, "key", k, C.kcfg, take_sinks, in_k);
    stage(layer, "value", v, C.vcfg, take_sinks, in_v);

    // 2. Quantize the blocks this append completes into free page slots (unpublished).
    Layer& L = at(layer, "append");
    const int64_t B = L.block, R = policy_.residual;
    const int64_t r = residual_count(L);
    const int64_t total = r + (m - take_sinks);  // residual + incoming, in token order
    const int64_t flush = total > R ? (total - R) / B : 0;
    const std::size_t used = L.pages.size();
    const int64_t sinks_after = sink_count(L) + take_sinks;
    const int64_t residual_after = total - flush * B;
    // Capacity first (may allocate; nothing visible changes).
    L.pages.grow_for(used + static_cast<std::size_t>(flush));
    for (auto* w : {&L.sink_k, &L.sink_v}) reserve_window(*w, sinks_after, S);
    for (auto* w : {&L.res_k, &L.res_v}) reserve_window(*w, residual_after, R + B - 1);
    if (flush > 0 && options_.exact_rollback)
      for (auto* w : {&L.roll_k, &L.roll_v}) reserve_rows(*w, B);
    const float* last_k = nullptr;  // sources of the newest flushed block
    const float* last_v = nullptr;
    for (int64_t j = 0; j < flush; ++j) {
      const float* bk = block_source(L.res_k, in_k, r, take_sinks, j * B, B, gather_k_);
      const float* bv = block_source(L.res_v, in_v, r, take_sinks, j * B, B, gather_v_);
      quantize_page(L.layout, L.pages.page(used + static_cast<std::size_t>(j)), 0,
                    KVView<const float>::nhd(bk, B, kv_heads_, head_dim_),
                    KVView<const float>::nhd(bv, B, kv_heads_, head_dim_), ws_);
      last_k = bk;
      last_v = bv;
    }

    // 3. Commit (no allocation, nothing throws).
    if (flush > 0 && options_.exact_rollback) {  // before the residual moves under last_k
      L.roll_k.assign(last_k, last_k + B * row_);
      L.roll_v.assign(last_v, last_v + B * row_);
      L.roll = true;
    }
    const auto sink_end = static_cast<std::ptrdiff_t>(take_sinks * row_);
    L.sink_k.insert(L.sink_k.end(), in_k.begin(), in_k.begin() + sink_end);
    L.sink_v.insert(L.sink_v.end(), in_v.begin(), in_v.begin() + sink_end);
    L.pages.resize(used + static_cast<std::size_t>(flush));
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
    KVQ_REQUIRE(L.dropped == 0 || n >= packed_begin(L), kOutOfRange, "KVCache::truncate: cannot "
                "keep ", n, " tokens of layer ", layer, ": its pages before token ",
                packed_begin(L), " were released (release_before)");
  }

  /// True when truncate(n) unpacks the newest page from its kept originals: the page was
  /// flushed when the layer reached b + B + R tokens, so a layer of n < b + B + R tokens
  /// never packed it.
  bool unflushes(const Layer& L, int64_t n) const {
    if (!L.roll || L.pages.size() == 0) return false;
    const int64_t b = packed_begin(L) + packed_count(L) - L.block;  // newest page's first token
    return n >= b && n < b + L.block + policy_.residual;
  }

  /// For a cut strictly inside an older page (no originals): the kept tokens of that page,
  /// dequantized (keys, values), else empty vectors.
  std::pair<std::vector<float>, std::vector<float>> cut_block_rows(int layer, int64_t n) const {
    const Layer& L = layers_[static_cast<std::size_t>(layer)];
    std::pair<std::vector<float>, std::vector<float>> rows;
    if (truncate_is_exact(layer, n)) return rows;
    const int64_t rel = n - packed_begin(L);
    const auto j = static_cast<std::size_t>(rel / L.block);
    const int64_t keep = rel % L.block;
    rows.first.resize(static_cast<std::size_t>(keep * row_));
    rows.second.resize(rows.first.size());
    QuantWorkspace ws;
    dequantize_page(L.layout, L.pages.page(j), L.block, 0, keep,
                    KVView<float>::nhd(rows.first.data(), keep, kv_heads_, head_dim_),
                    KVView<float>::nhd(rows.second.data(), keep, kv_heads_, head_dim_), ws);
    return rows;
  }

  void commit_truncate(int layer, int64_t n,
                       std::pair<std::vector<float>, std::vector<float>> cut) {
    Layer& L = layers_[static_cast<std::size_t>(layer)];
    const int64_t s = sink_count(L);
    if (unflushes(L, n)) {
      // Back to the state before the newest flush: its originals, then the residual, up to n.
      const int64_t b = packed_begin(L) + packed_count(L) - L.block;
      const int64_t from_roll = std::min(n - b, L.block);
      const auto keep_res = static_cast<std::ptrdiff_t>((n - b - from_roll) * row_);
      for (auto* res : {&L.res_k, &L.res_v})  // may throw bad_alloc: before any change
        res->reserve(static_cast<std::size_t>((n - b) * row_));
      for (auto [res, roll] : {std::pair{&L.res_k, &L.roll_k}, std::pair{&L.res_v, &L.roll_v}}) {
        res->resize(static_cast<std::size_t>(keep_res));  // residual rows that stay, in front
        res->insert(res->begin(), roll->begin(), roll->begin() + from_roll * row_);
      }
      L.pages.resize(L.pages.size() - 1);
      L.roll = false;  // the page before it has no originals
      L.tokens = n;
      return;
    }
    if (n <= s) {
      L.sink_k.resize(static_cast<std::size_t>(n * row_));
      L.sink_v.resize(static_cast<std::size_t>(n * row_));
      L.pages.resize(0);
      L.res_k.clear();
      L.res_v.clear();
      L.roll = false;
    } else if (n >= packed_begin(L) + packed_count(L)) {
      const auto keep = static_cast<std::size_t>((n - packed_begin(L) - packed_count(L)) * row_);
      L.res_k.resize(keep);
      L.res_v.resize(keep);
    } else {  // a cut inside an older page: its kept tokens come back dequantized
      L.res_k.assign(cut.first.begin(), cut.first.end());
      L.res_v.assign(cut.second.begin(), cut.second.end());
      L.pages.resize(static_cast<std::size_t>((n - packed_begin(L)) / L.block));
      L.roll = false;
    }
    L.tokens = n;
  }

  Policy policy_;
  int n_layers_ = 0;
  int kv_heads_ = 0;
  int head_dim_ = 0;
  int max_tokens_ = 0;
  KVCacheOptions options_;
  int64_t row_ = 0;  // kv_heads * head_dim: floats per token
  std::vector<Layer> layers_;
  // Per-call scratch, kept so that a decode loop allocates nothing.
  std::vector<float> stage_k_, stage_v_;    // [chunk tokens, kv_heads, head_dim] staged input
  std::vector<float> gather_k_, gather_v_;  // [B, kv_heads, head_dim] a block straddling both
  QuantWorkspace ws_;
};

/// The stored bytes of several caches together (MemoryReport::total() of each), every page
/// counted once however many of them hold it (forks share pages; KVCache::fork()). A cache
/// listed twice counts once. Reads the caches: not while one of them is written.
inline std::size_t unique_total(const std::vector<const KVCache*>& caches) {
  std::vector<const KVCache*> cs(caches);
  std::sort(cs.begin(), cs.end());
  cs.erase(std::unique(cs.begin(), cs.end()), cs.end());
  std::size_t total = 0;
  std::vector<std::pair<const std::byte*, std::size_t>> pages;  // (page, its bytes)
  for (const KVCache* c : cs) {
    if (c == nullptr) continue;
    const MemoryReport m = c->memory_report();
    total += m.total();
    for (int l = 0; l < c->n_layers(); ++l) {
      const PageTable t = c->page_table(l);
      for (int64_t j = 0; j < t.n_pages; ++j) pages.emplace_back(t.pages[j], t.layout.bytes);
      total -= static_cast<std::size_t>(t.n_pages) * t.layout.bytes;
    }
  }
  std::sort(pages.begin(), pages.end());
  pages.erase(std::unique(pages.begin(), pages.end()), pages.end());
  for (const auto& p : pages) total += p.second;
  return total;
}

}  // namespace kvq

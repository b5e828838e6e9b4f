#pragma once
/// \file cache_backend.hpp
/// KVBackend adapter: lets the real-model evaluator (eval/llama2c.hpp) keep its KV cache in a
/// KVCache under a Policy, so a policy is measured by perplexity / KL on exactly the tokens the
/// Fp32Backend baseline sees.
///
/// It lives in eval/ (beside the stack, above attention/) because it joins eval's backend
/// interface, the cache and attention; every include here points down. kvq/cache/
/// cache_backend.hpp forwards to it for code written against the old path.
///
/// The evaluator never truncates, so the cache keeps no rollback rows (KVCacheOptions::
/// exact_rollback off): its effective bits are those of the stored tokens alone.
///
/// Keys are stored post-RoPE (the `k` argument) by default. With prerope_keys the cache holds
/// the pre-RoPE keys (`k_prerope`) and attention rotates them after dequantization
/// (core/rope.hpp, llama2.c's convention) — KVQuant's pre-RoPE key quantization in a real
/// streaming cache.
#include <utility>
#include <vector>

#include "kvq/attention/attention.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/core/error.hpp"
#include "kvq/eval/kv_backend.hpp"
#include "kvq/policy/spec.hpp"

namespace kvq {

/// A KVBackend that stores every layer's keys and values in a KVCache under `policy`.
class CacheBackend final : public eval::KVBackend {
 public:
  CacheBackend(Policy policy, const eval::KVGeometry& g, bool prerope_keys = false,
               RopeConfig rope = {})
      : cache_(std::move(policy), g.n_layers, g.n_kv_heads, g.head_dim, g.max_tokens,
               KVCacheOptions{/*exact_rollback=*/false}),
        prerope_(prerope_keys),
        rope_(rope) {
    KVQ_REQUIRE(!prerope_keys || g.head_dim % 2 == 0, kInvalidArgument,
                "CacheBackend: pre-RoPE keys need an even head_dim, got ", g.head_dim);
  }

  void reset() override { cache_.clear(); }

  void append(int layer, int pos, const float* k_prerope, const float* k,
              const float* v) override {
    if (prerope_) k = k_prerope;
    const int64_t t = cache_.tokens(layer);
    KVQ_REQUIRE(pos == t, kInvalidArgument, "CacheBackend::append: layer ", layer, " holds ", t,
                " tokens, so the next position must be ", t, ", got ", pos);
    const int H = cache_.kv_heads(), D = cache_.head_dim();
    cache_.append(layer, KVView<const float>::nhd(k, 1, H, D),
                  KVView<const float>::nhd(v, 1, H, D));
  }

  void attend(int layer, int pos, const float* q, int n_heads, float* out) override {
    attend_window(layer, pos, q, n_heads, out, 0);
  }

  /// Attention over the last `window` tokens only (AttentionOptions::window; 0 = all).
  void attend_window(int layer, int pos, const float* q, int n_heads, float* out,
                     int window) override {
    const int64_t t = cache_.tokens(layer);
    KVQ_REQUIRE(t > 0 && pos == t - 1, kInvalidArgument, "CacheBackend::attend: layer ", layer,
                " holds ", t, " tokens; a query at position ", pos,
                " must come right after appending its own token");
    AttentionOptions opt;
    opt.window = window > 0 ? window : 0;
    opt.dot = dot_;
    attend_one(cache_, layer, q, n_heads, out, ws_, layer_rope(layer), opt);
    release(layer, pos, window);
  }

  /// Sliding-window release (on by default): after a windowed attention whose newest query
  /// sits at position p, the pages of that layer wholly before p - window + 2 (the first
  /// position a later query can see) are released (KVCache::release_before), so a local layer
  /// holds about its window and memory_report() counts only that. Off keeps every token (a
  /// cache to be archived whole, or read back).
  void set_release_window(bool on) { release_window_ = on; }
  bool release_window() const { return release_window_; }

  /// Chunked mode (off by default): a forward call of several tokens appends them all, then
  /// runs one causal attention for all their queries (the cache's batched prefill attention),
  /// as an engine does. Tokens that a token-by-token run would still hold in the f32 residual
  /// window when attended may already be quantized then, so perplexity can differ slightly
  /// from the default mode (which the evaluation tools keep).
  void set_chunked(bool on) { chunked_ = on; }
  /// The attention's dot products (AttentionOptions::dot; exact by default).
  void set_dot(DotProduct d) { dot_ = d; }
  bool chunked() const override { return chunked_; }

  void append_chunk(int layer, int pos0, int n, const float* k_prerope, const float* k,
                    const float* v) override {
    if (prerope_) k = k_prerope;
    const int64_t t = cache_.tokens(layer);
    KVQ_REQUIRE(pos0 == t && n > 0, kInvalidArgument, "CacheBackend::append_chunk: layer ", layer,
                " holds ", t, " tokens, so the next position must be ", t, ", got ", pos0,
                " (", n, " tokens)");
    const int H = cache_.kv_heads(), D = cache_.head_dim();
    cache_.append(layer, KVView<const float>::nhd(k, n, H, D), KVView<const float>::nhd(v, n, H, D));
  }

  void attend_chunk(int layer, int pos0, int n, const float* q, int n_heads, float* out,
                    int window) override {
    const int64_t t = cache_.tokens(layer);
    KVQ_REQUIRE(n > 0 && pos0 + n == t, kInvalidArgument, "CacheBackend::attend_chunk: layer ",
                layer, " holds ", t, " tokens; queries at positions [", pos0, ", ", pos0 + n,
                ") must be its newest");
    AttentionOptions opt;
    opt.window = window > 0 ? window : 0;
    opt.dot = dot_;
    const int D = cache_.head_dim();
    kvq::attend(cache_, layer, KVView<const float>::nhd(q, n, n_heads, D),
                KVView<float>::nhd(out, n, n_heads, D), true, ws_, layer_rope(layer), opt);
    release(layer, pos0 + n - 1, window);
  }

  /// Per-layer RoPE of pre-RoPE keys (models whose layers rotate with different bases, e.g.
  /// Gemma 3's local and global layers); one entry per layer, replaces the constructor's.
  void set_layer_ropes(std::vector<RopeConfig> ropes) {
    KVQ_REQUIRE(ropes.empty() || static_cast<int>(ropes.size()) == cache_.n_layers(),
                kInvalidArgument, "CacheBackend::set_layer_ropes: ", ropes.size(),
                " ropes for ", cache_.n_layers(), " layers");
    layer_ropes_ = std::move(ropes);
  }

  const KVCache& cache() const { return cache_; }
  /// The cache itself, e.g. to restore a saved sequence into it (io/archive.hpp load_into).
  KVCache& mutable_cache() { return cache_; }

 private:
  /// After a windowed attention whose newest query is at `pos`: pages no later query sees go.
  void release(int layer, int pos, int window) {
    if (release_window_ && window > 0) cache_.release_before(layer, int64_t{pos} - window + 2);
  }

  /// The RoPE attention applies to `layer`'s keys (nullptr: they are stored post-RoPE).
  const RopeConfig* layer_rope(int layer) const {
    if (!prerope_) return nullptr;
    return layer_ropes_.empty() ? &rope_ : &layer_ropes_[static_cast<size_t>(layer)];
  }

  KVCache cache_;
  bool prerope_;
  bool chunked_ = false;
  DotProduct dot_ = DotProduct::kExact;
  bool release_window_ = true;
  RopeConfig rope_;
  std::vector<RopeConfig> layer_ropes_;
  AttentionWorkspace ws_;
};

}  // namespace kvq

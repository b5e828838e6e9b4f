#pragma once
/// \file attention.hpp
/// Attention over a KVCache (or over any sequence of cache segments: pages an engine owns),
/// for every policy, with GQA/MQA, computed by the fused kernels of
/// kernels/cpu/attention_cpu.hpp straight from the packed codes.
///
/// Queries are the newest positions of the layer: query i of n_q sits at position
/// tokens - n_q + i and, when causal, attends to the tokens [0, position]; otherwise to all
/// tokens. Query head h reads kv head h / (n_heads / kv_heads). Scores are q.k / sqrt(head_dim),
/// followed by a max-subtracted softmax and the weighted sum of values. n_q = 1 is decode;
/// n_q > 1 is a (chunked) prefill step.
///
/// Precision: fp32 throughout (online softmax per 64-token tile, fp32 exp); the double
/// precision oracle is reference/attention_ref.hpp and the tests hold the two within 2e-5
/// relative output error for every format. Long contexts are split into chunks of
/// AttentionOptions::split_tokens (default 4096) merged in a fixed order: the result depends
/// on the split, never on the number of threads.
#include <cstdint>
#include <vector>

#include "kvq/cache/kv_cache.hpp"
#include "kvq/core/error.hpp"
#include "kvq/core/rope.hpp"
#include "kvq/core/tensor.hpp"
#include "kvq/kernels/cpu/attention_cpu.hpp"

namespace kvq {

/// Scratch reused across attend() calls: once a call of some shape (tokens, queries, heads,
/// threads) has run, a later call of the same or smaller shape allocates nothing (a decode loop
/// allocates only when the context outgrows every earlier one; tests count allocations).
struct AttentionWorkspace {
  kernels::attn::Workspace w;
};

/// Attention of the queries `q` ([n_q, n_heads, head_dim]) over the segments `segs` (in token
/// order, covering [0, tokens) without gaps: f32 row segments and packed views, as
/// KVCache::for_each_segment hands them out or as an engine builds them over its own pages),
/// written to `out` (same shape, any strides). kv_heads x head_dim per token. Only the
/// segments' kind/begin/end, key_view/value_view and key_rows/value_rows are read.
/// `key_rope`: the segments hold keys *before* RoPE; every key row is rotated at its position
/// after decoding (queries are taken as given). Throws (writing nothing) on shape errors, a
/// gap in the segments, no tokens, or a non-finite query.
inline void attend_segments(const CacheSegment* segs, std::size_t n_segs, int64_t kv_heads,
                            int64_t head_dim, KVView<const float> q, KVView<float> out,
                            bool causal, AttentionWorkspace& ws,
                            const RopeConfig* key_rope = nullptr,
                            const AttentionOptions& opt = {}) {
  ws.w.segs.assign(segs, segs + n_segs);
  const int64_t T = n_segs > 0 ? segs[n_segs - 1].end : 0;
  kernels::attn::attend_segments(ws.w, T, kv_heads, head_dim, q, out, causal, key_rope, opt, 0);
}

/// Attention of the queries `q` ([n_q, n_heads, head_dim], the newest n_q positions of `layer`)
/// over `cache`, written to `out` (same shape, any strides). n_heads must be a multiple of the
/// cache's kv_heads; with `causal`, n_q must not exceed the layer's tokens. Throws (writing
/// nothing) on shape errors, an empty layer, or a non-finite query.
/// `key_rope`: the cache holds keys *before* RoPE (KVQuant); every key row is rotated
/// (core/rope.hpp) at its position after decoding, before scoring. Queries are taken as given
/// (already rotated). `opt`: threads and the flash-decoding split.
inline void attend(const KVCache& cache, int layer, KVView<const float> q, KVView<float> out,
                   bool causal, AttentionWorkspace& ws, const RopeConfig* key_rope = nullptr,
                   const AttentionOptions& opt = {}) {
  const int64_t T = cache.tokens(layer);
  ws.w.segs.clear();
  cache.for_each_segment(layer, [&](const CacheSegment& s) { ws.w.segs.push_back(s); });
  kernels::attn::attend_segments(ws.w, T, cache.kv_heads(), cache.head_dim(), q, out, causal,
                                 key_rope, opt, layer);
}

/// attend() with a workspace of its own (convenient; allocates per call).
inline void attend(const KVCache& cache, int layer, KVView<const float> q, KVView<float> out,
                   bool causal = true, const RopeConfig* key_rope = nullptr) {
  AttentionWorkspace ws;
  attend(cache, layer, q, out, causal, ws, key_rope);
}

/// Single-query decode attention: q and out are [n_heads, head_dim] floats for the newest
/// position of `layer`.
inline void attend_one(const KVCache& cache, int layer, const float* q, int n_heads, float* out,
                       AttentionWorkspace& ws, const RopeConfig* key_rope = nullptr,
                       const AttentionOptions& opt = {}) {
  const int D = cache.head_dim();
  attend(cache, layer, KVView<const float>::nhd(q, 1, n_heads, D),
         KVView<float>::nhd(out, 1, n_heads, D), true, ws, key_rope, opt);
}

}  // namespace kvq

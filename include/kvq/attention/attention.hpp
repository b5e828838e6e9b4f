#pragma once
/// \file attention.hpp
/// Attention over a KVCache (or over any sequence of cache segments: pages an engine owns),
/// for every policy, with GQA/MQA, computed by the fused kernels of
/// attention/cpu/attention_cpu.hpp straight from the packed codes.
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
#include "kvq/attention/cpu/attention_cpu.hpp"

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

/// Attention over an engine's page table (layout/page_layout.hpp: pages it allocated and
/// filled with quantize_page, or KVCache::page_table): f32 sink rows for the positions before
/// table.first_token (`sink_k`/`sink_v`, [first_token, kv_heads, head_dim], empty when
/// first_token == 0), the table's pages, then f32 rows after them (`tail_k`/`tail_v`: the
/// residual window, may be empty). Same semantics, errors and options as attend().
inline void attend_pages(const PageTable& table, KVView<const float> sink_k,
                         KVView<const float> sink_v, KVView<const float> tail_k,
                         KVView<const float> tail_v, KVView<const float> q, KVView<float> out,
                         bool causal, AttentionWorkspace& ws, const RopeConfig* key_rope = nullptr,
                         const AttentionOptions& opt = {}) {
  const int64_t H = table.layout.kv_heads, D = table.layout.head_dim;
  KVQ_REQUIRE(sink_k.tokens() == table.first_token && sink_v.tokens() == table.first_token,
              kShapeMismatch, "attend_pages: ", table.first_token,
              " sink tokens precede the pages, but the sink rows hold ", sink_k.tokens(), " and ",
              sink_v.tokens());
  KVQ_REQUIRE(tail_k.tokens() == tail_v.tokens(), kShapeMismatch,
              "attend_pages: tail keys and values differ in tokens (", tail_k.tokens(), " vs ",
              tail_v.tokens(), ")");
  auto& segs = ws.w.segs;
  segs.clear();
  int64_t pos = 0;
  if (table.first_token > 0) {
    CacheSegment s;
    s.kind = CacheSegment::Kind::kSinks;
    s.begin = 0;
    s.end = table.first_token;
    s.key_rows = sink_k;
    s.value_rows = sink_v;
    segs.push_back(s);
    pos = s.end;
  }
  for (int64_t i = 0; i < table.n_pages; ++i) {
    CacheSegment s;
    s.kind = CacheSegment::Kind::kPacked;
    s.begin = pos;
    s.end = pos + table.page_fill(i);
    s.key_view = table.key_view(i);
    s.value_view = table.value_view(i);
    if (s.end > s.begin) segs.push_back(s);
    pos = s.end;
  }
  if (tail_k.tokens() > 0) {
    CacheSegment s;
    s.kind = CacheSegment::Kind::kResidual;
    s.begin = pos;
    s.end = pos + tail_k.tokens();
    s.key_rows = tail_k;
    s.value_rows = tail_v;
    segs.push_back(s);
    pos = s.end;
  }
  kernels::attn::attend_segments(ws.w, pos, H, D, q, out, causal, key_rope, opt, 0);
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

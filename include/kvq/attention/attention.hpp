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
/// AttentionOptions::split_tokens (default: T / 8 rounded up to a multiple of 256, within
/// [256, 4096]) merged in a fixed order: the result depends
/// on the split, never on the number of threads.
///
/// Queries and outputs may also be f16 or bf16 (the overloads at the end of this file, for
/// attend, attend_pages and attend_batch): queries are widened to f32 exactly, the f32 path
/// runs, and each output is rounded to nearest even, so a half-precision call returns the f32
/// call's output rounded, bit for bit. The conversion costs O(n_q x n_heads x head_dim) and
/// reuses the workspace.
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kvq/cache/kv_cache.hpp"
#include "kvq/core/error.hpp"
#include "kvq/core/rope.hpp"
#include "kvq/core/tensor.hpp"
#include "kvq/policy/spec.hpp"
#include "kvq/attention/cpu/attention_cpu.hpp"

namespace kvq {

/// Scratch reused across attend() calls: once a call of some shape (tokens, queries, heads,
/// threads) has run, a later call of the same or smaller shape allocates nothing (a decode loop
/// allocates only when the context outgrows every earlier one; tests count allocations).
struct AttentionWorkspace {
  kernels::attn::Workspace w;
  std::vector<float> q_f32, out_f32;  ///< f16/bf16 calls: the widened queries and f32 output
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

namespace detail {

/// Appends the segments of one sequence to `segs`: f32 sink rows [0, sink_k.tokens()), then
/// `tokens` packed tokens in pages page(0), page(1), ... of `layout` (all full but the last),
/// then the f32 tail rows. Returns the sequence's tokens.
template <class PageAt>
int64_t page_segments(std::vector<CacheSegment>& segs, const PageLayout& layout,
                      const PageAt& page, int64_t tokens, KVView<const float> sink_k,
                      KVView<const float> sink_v, KVView<const float> tail_k,
                      KVView<const float> tail_v) {
  int64_t pos = 0;
  if (sink_k.tokens() > 0) {
    CacheSegment s;
    s.kind = CacheSegment::Kind::kSinks;
    s.begin = 0;
    s.end = sink_k.tokens();
    s.key_rows = sink_k;
    s.value_rows = sink_v;
    segs.push_back(s);
    pos = s.end;
  }
  const int64_t P = layout.page_tokens;
  for (int64_t i = 0; i * P < tokens; ++i) {
    const int64_t fill = std::min(P, tokens - i * P);
    CacheSegment s;
    s.kind = CacheSegment::Kind::kPacked;
    s.begin = pos;
    s.end = pos + fill;
    s.key_view = layout.key_view(page(i), fill);
    s.value_view = layout.value_view(page(i), fill);
    segs.push_back(s);
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
  return pos;
}

}  // namespace detail

/// Attention over an engine's page table (layout/page_layout.hpp: pages it allocated and
/// filled with quantize_page, or KVCache::page_table): f32 sink rows for the positions before
/// table.first_token (`sink_k`/`sink_v`, [first_token, kv_heads, head_dim], empty when
/// first_token == 0), the table's pages, then f32 rows after them (`tail_k`/`tail_v`: the
/// residual window, may be empty). Same semantics, errors and options as attend(). One
/// sequence of attend_batch: the same segments (detail::page_segments) and the same scheduler
/// and merge (attention/cpu/merge.hpp), so the results are bit-identical.
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
  KVQ_REQUIRE(table.tokens >= 0 && table.tokens <= table.n_pages * table.layout.page_tokens,
              kInvalidArgument, "attend_pages: the table holds ", table.tokens, " tokens but its ",
              table.n_pages, " pages hold at most ", table.n_pages * table.layout.page_tokens);
  ws.w.segs.clear();
  const int64_t T = detail::page_segments(
      ws.w.segs, table.layout, [&](int64_t i) { return table.pages[i]; }, table.tokens, sink_k,
      sink_v, tail_k, tail_v);
  kernels::attn::attend_segments(ws.w, T, H, D, q, out, causal, key_rope, opt, 0);
}

/// A batch of sequences over one page pool, FlashInfer-style (paged KV with indptr arrays).
/// Sequence s (s < batch) holds, in token order: f32 sink rows (sink_k[s] / sink_v[s], may be
/// empty or absent), tokens[s] packed tokens in the pages page_ids[page_indptr[s] ..
/// page_indptr[s + 1]) (each page_tokens tokens, the last one partly filled; pages beyond
/// ceil(tokens[s] / page_tokens) are not read), then f32 tail rows (tail_k[s] / tail_v[s]: the
/// residual window, may be empty or absent). Its queries are the rows [query_indptr[s],
/// query_indptr[s + 1]) of the call's queries. Page id p lives at pages[p] when `pages` is
/// given, else at pool + p * page_stride (page_stride 0: layout.bytes).
struct PagedKVBatch {
  PageLayout layout;                        ///< every page's layout (kv_heads, head_dim, formats)
  const std::byte* pool = nullptr;          ///< base of the page pool ...
  std::size_t page_stride = 0;              ///< ... bytes between pages (0: layout.bytes)
  const std::byte* const* pages = nullptr;  ///< or page pointers by id ([pool_pages])
  int64_t pool_pages = 0;                   ///< valid page ids are [0, pool_pages)
  int64_t batch = 0;                        ///< sequences B
  const int64_t* page_indptr = nullptr;     ///< [B + 1], starts at 0, non-decreasing
  const int32_t* page_ids = nullptr;        ///< [page_indptr[B]]
  const int64_t* tokens = nullptr;          ///< [B] packed tokens per sequence
  const int64_t* query_indptr = nullptr;    ///< [B + 1], starts at 0, ends at the query rows
  const KVView<const float>* sink_k = nullptr;  ///< [B] or null: f32 rows before the pages
  const KVView<const float>* sink_v = nullptr;
  const KVView<const float>* tail_k = nullptr;  ///< [B] or null: f32 rows after the pages
  const KVView<const float>* tail_v = nullptr;
};

/// Scratch of attend_batch (reused: a later call with no larger shape allocates nothing).
struct BatchAttentionWorkspace {
  kernels::attn::BatchWorkspace w;
  std::vector<float> q_f32, out_f32;  ///< f16/bf16 calls: the widened queries and f32 output
};

/// Decode or chunked prefill of a batch of sequences in one call: the queries `q`
/// ([total_queries, n_heads, head_dim]; sequence s's rows are [query_indptr[s],
/// query_indptr[s + 1])) attend over their sequence's tokens (PagedKVBatch), written to `out`
/// (same shape). Per sequence the semantics of attend() (query i of n_q at position
/// tokens - n_q + i unless opt.positions; causal; options indexed by the global query row). A
/// sequence with no tokens yields zeros (no error); a sequence with no queries is skipped.
///
/// Work split: every sequence is cut into token chunks of opt.split_tokens (0: by length, 256-4096) x blocks
/// of 16 queries; the units of all sequences are run largest first on opt.threads workers
/// (opt.parallel_for or std::threads) and merged per row in chunk order, so the output is
/// bit-identical for any thread count, and each sequence's rows equal attend_pages over it.
/// Throws (writing nothing) on a bad table (an indptr that does not start at 0 or decreases,
/// a page id outside the pool, more tokens than a sequence's pages hold, sink/tail rows that
/// do not match), shape errors and bad options, naming the problem.
inline void attend_batch(const PagedKVBatch& b, KVView<const float> q, KVView<float> out,
                         bool causal, BatchAttentionWorkspace& ws,
                         const RopeConfig* key_rope = nullptr, const AttentionOptions& opt = {}) {
  const int64_t B = b.batch, P = b.layout.page_tokens;
  const int64_t H = b.layout.kv_heads, D = b.layout.head_dim;
  KVQ_REQUIRE(B >= 0, kInvalidArgument, "attend_batch: batch must be >= 0, got ", B);
  KVQ_REQUIRE(B == 0 || (b.page_indptr != nullptr && b.tokens != nullptr &&
                         b.query_indptr != nullptr),
              kInvalidArgument, "attend_batch: page_indptr, tokens and query_indptr must be given");
  KVQ_REQUIRE(B == 0 || b.page_indptr[0] == 0, kInvalidArgument,
              "attend_batch: page_indptr[0] must be 0, got ", b.page_indptr[0]);
  const std::size_t stride = b.page_stride != 0 ? b.page_stride : b.layout.bytes;
  for (int64_t s = 0; s < B; ++s) {
    const int64_t p0 = b.page_indptr[s], p1 = b.page_indptr[s + 1];
    KVQ_REQUIRE(p1 >= p0, kInvalidArgument, "attend_batch: page_indptr is not monotone: page_indptr[",
                s + 1, "]=", p1, " < page_indptr[", s, "]=", p0);
    KVQ_REQUIRE(b.tokens[s] >= 0 && b.tokens[s] <= (p1 - p0) * P, kInvalidArgument,
                "attend_batch: sequence ", s, " holds ", b.tokens[s], " tokens but its ", p1 - p0,
                " pages of ", P, " tokens hold at most ", (p1 - p0) * P);
    const int64_t used = (b.tokens[s] + P - 1) / P;
    KVQ_REQUIRE(used == 0 || b.page_ids != nullptr, kInvalidArgument,
                "attend_batch: page_ids is null");
    KVQ_REQUIRE(used == 0 || b.pages != nullptr || b.pool != nullptr, kInvalidArgument,
                "attend_batch: neither a page pool nor page pointers are given");
    for (int64_t j = p0; j < p0 + used; ++j)
      KVQ_REQUIRE(b.page_ids[j] >= 0 && b.page_ids[j] < b.pool_pages, kInvalidArgument,
                  "attend_batch: page id ", b.page_ids[j], " (page_ids[", j, "], sequence ", s,
                  ") is outside the pool's ", b.pool_pages, " pages");
    const KVView<const float> none;
    const KVView<const float>& sk = b.sink_k ? b.sink_k[s] : none;
    const KVView<const float>& sv = b.sink_v ? b.sink_v[s] : none;
    const KVView<const float>& tk = b.tail_k ? b.tail_k[s] : none;
    const KVView<const float>& tv = b.tail_v ? b.tail_v[s] : none;
    KVQ_REQUIRE(sk.tokens() == sv.tokens() && tk.tokens() == tv.tokens(), kShapeMismatch,
                "attend_batch: sequence ", s, ": sink rows hold ", sk.tokens(), " keys and ",
                sv.tokens(), " values, tail rows ", tk.tokens(), " keys and ", tv.tokens(),
                " values");
  }
  auto& w = ws.w;
  if (static_cast<int64_t>(w.seq.size()) < B) w.seq.resize(static_cast<std::size_t>(B));
  w.T.resize(static_cast<std::size_t>(B));
  for (int64_t s = 0; s < B; ++s) {
    const auto us = static_cast<std::size_t>(s);
    const int64_t p0 = b.page_indptr[s];
    const KVView<const float> none;
    auto& segs = w.seq[us].segs;
    segs.clear();
    w.T[us] = detail::page_segments(
        segs, b.layout,
        [&](int64_t i) {
          const int32_t id = b.page_ids[p0 + i];
          return b.pages != nullptr ? b.pages[id] : b.pool + static_cast<std::size_t>(id) * stride;
        },
        b.tokens[s], b.sink_k ? b.sink_k[s] : none, b.sink_v ? b.sink_v[s] : none,
        b.tail_k ? b.tail_k[s] : none, b.tail_v ? b.tail_v[s] : none);
  }
  static const int64_t kZero[1] = {0};
  kernels::attn::attend_batch_segments(w, B, H, D, B > 0 ? b.query_indptr : kZero, q, out,
                                       causal, key_rope, opt);
}

/// A PagedKVBatch over several KVCaches (one sequence each; e.g. an engine's sequences whose
/// caches take pages from one PageAllocator): gather() collects one layer of every cache — its
/// page table by pointer, its f32 sink rows and residual (tail) rows — and keeps the arrays
/// the batch points into. The batch reads the caches' memory: it is valid until one of them is
/// written (append, truncate, release, ...), so gather again per layer and step (the arrays are
/// reused; a gather of no more pages and sequences allocates nothing). attend_batch over it
/// gives each sequence bit for bit what attend() gives over its cache with the same options.
class CacheBatch {
 public:
  /// One query row per sequence (decode): query row s belongs to caches[s].
  const PagedKVBatch& gather(const std::vector<const KVCache*>& caches, int layer) {
    ones_.assign(caches.size(), 1);
    return gather(caches, layer, ones_);
  }
  /// queries[s] query rows for caches[s] (>= 0; rows in sequence order). Throws, leaving the
  /// previous batch in place, for a null cache, a queries list of another length, a negative
  /// count, a layer a cache does not have, or caches whose layer is laid out differently
  /// (configs, page tokens, kv_heads, head_dim), naming the sequence.
  const PagedKVBatch& gather(const std::vector<const KVCache*>& caches, int layer,
                             const std::vector<int64_t>& queries) {
    const std::size_t B = caches.size();
    KVQ_REQUIRE(queries.size() == B, kShapeMismatch, "CacheBatch: ", B, " caches but ",
                queries.size(), " query counts");
    for (std::size_t s = 0; s < B; ++s) {
      KVQ_REQUIRE(caches[s] != nullptr, kInvalidArgument, "CacheBatch: cache of sequence ", s,
                  " is null");
      KVQ_REQUIRE(queries[s] >= 0, kInvalidArgument, "CacheBatch: sequence ", s, " has ",
                  queries[s], " query rows");
      KVQ_REQUIRE(layer >= 0 && layer < caches[s]->n_layers(), kInvalidArgument,
                  "CacheBatch: layer ", layer, " does not exist in the cache of sequence ", s,
                  " (", caches[s]->n_layers(), " layers)");
      if (s == 0) continue;
      const PageLayout& a = caches[0]->page_layout(layer);
      const PageLayout& b = caches[s]->page_layout(layer);
      KVQ_REQUIRE(same_config(a.key, b.key) && same_config(a.value, b.value) &&
                      a.page_tokens == b.page_tokens && a.kv_heads == b.kv_heads &&
                      a.head_dim == b.head_dim && a.bytes == b.bytes,
                  kShapeMismatch, "CacheBatch: layer ", layer, " of sequence ", s, " (k=",
                  b.key.name(), ", v=", b.value.name(), ", ", b.page_tokens, "-token pages, ",
                  b.kv_heads, "x", b.head_dim, ") is laid out unlike sequence 0's (k=",
                  a.key.name(), ", v=", a.value.name(), ", ", a.page_tokens, "-token pages, ",
                  a.kv_heads, "x", a.head_dim, ")");
    }
    pages_.clear();
    ids_.clear();
    page_indptr_.assign(1, 0);
    query_indptr_.assign(1, 0);
    tokens_.clear();
    sk_.clear();
    sv_.clear();
    tk_.clear();
    tv_.clear();
    b_ = PagedKVBatch{};
    for (std::size_t s = 0; s < B; ++s) {
      const KVCache& c = *caches[s];
      const PageTable pt = c.page_table(layer);
      if (s == 0) b_.layout = pt.layout;
      for (int64_t j = 0; j < pt.n_pages; ++j) {
        ids_.push_back(static_cast<int32_t>(pages_.size()));
        pages_.push_back(pt.pages[j]);
      }
      page_indptr_.push_back(static_cast<int64_t>(ids_.size()));
      query_indptr_.push_back(query_indptr_.back() + queries[s]);
      tokens_.push_back(pt.tokens);
      const KVView<const float> none(nullptr, Shape{0, c.kv_heads(), c.head_dim()});
      KVView<const float> k0 = none, v0 = none, k1 = none, v1 = none;
      c.for_each_segment(layer, [&](const CacheSegment& g) {
        if (g.kind == CacheSegment::Kind::kSinks) {
          k0 = g.key_rows;
          v0 = g.value_rows;
        } else if (g.kind == CacheSegment::Kind::kResidual) {
          k1 = g.key_rows;
          v1 = g.value_rows;
        }
      });
      sk_.push_back(k0);
      sv_.push_back(v0);
      tk_.push_back(k1);
      tv_.push_back(v1);
    }
    b_.pages = pages_.data();
    b_.pool_pages = static_cast<int64_t>(pages_.size());
    b_.batch = static_cast<int64_t>(B);
    b_.page_indptr = page_indptr_.data();
    b_.page_ids = ids_.data();
    b_.tokens = tokens_.data();
    b_.query_indptr = query_indptr_.data();
    b_.sink_k = sk_.data();
    b_.sink_v = sv_.data();
    b_.tail_k = tk_.data();
    b_.tail_v = tv_.data();
    return b_;
  }
  /// The batch of the last gather().
  const PagedKVBatch& batch() const { return b_; }
  /// Query rows of the last gather() in all: the first dimension of attend_batch's queries.
  int64_t total_queries() const { return query_indptr_.empty() ? 0 : query_indptr_.back(); }

 private:
  PagedKVBatch b_;
  std::vector<const std::byte*> pages_;
  std::vector<int32_t> ids_;
  std::vector<int64_t> page_indptr_, query_indptr_, tokens_, ones_;
  std::vector<KVView<const float>> sk_, sv_, tk_, tv_;
};

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

// ---- f16 / bf16 queries and outputs -----------------------------------------------------

namespace detail {

template <class T>
inline constexpr bool is_half_v = std::is_same_v<T, f16> || std::is_same_v<T, bf16>;

/// Widens `q` into `qb` (exact), runs call(q32, out32) into `ob`, rounds `ob` into `out` (to
/// nearest even). Shapes are checked first; when the call throws, `out` is untouched.
template <class T, class Call>
void with_f32_io(KVView<const T> q, KVView<T> out, std::vector<float>& qb, std::vector<float>& ob,
                 const char* what, Call&& call) {
  KVQ_REQUIRE(out.shape() == q.shape(), kShapeMismatch, what, ": output ", out.shape().str(),
              " does not match the queries ", q.shape().str());
  const int64_t n = q.tokens(), h = q.heads(), d = q.head_dim();
  const auto count = static_cast<std::size_t>(n * h * d);
  qb.resize(count);
  ob.resize(count);
  std::size_t k = 0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < h; ++j)
      for (int64_t c = 0; c < d; ++c) qb[k++] = static_cast<float>(q.at(i, j, c));
  call(KVView<const float>::nhd(qb.data(), n, h, d), KVView<float>::nhd(ob.data(), n, h, d));
  k = 0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < h; ++j)
      for (int64_t c = 0; c < d; ++c) out.at(i, j, c) = T(ob[k++]);
}

}  // namespace detail

/// attend() with f16 or bf16 queries and outputs (see the file comment).
template <class T, std::enable_if_t<detail::is_half_v<T>, int> = 0>
inline void attend(const KVCache& cache, int layer, KVView<const T> q, KVView<T> out, bool causal,
                   AttentionWorkspace& ws, const RopeConfig* key_rope = nullptr,
                   const AttentionOptions& opt = {}) {
  detail::with_f32_io(q, out, ws.q_f32, ws.out_f32, "attend",
                      [&](KVView<const float> q32, KVView<float> o32) {
                        attend(cache, layer, q32, o32, causal, ws, key_rope, opt);
                      });
}

/// attend_pages() with f16 or bf16 queries and outputs (the sink/tail rows stay f32).
template <class T, std::enable_if_t<detail::is_half_v<T>, int> = 0>
inline void attend_pages(const PageTable& table, KVView<const float> sink_k,
                         KVView<const float> sink_v, KVView<const float> tail_k,
                         KVView<const float> tail_v, KVView<const T> q, KVView<T> out, bool causal,
                         AttentionWorkspace& ws, const RopeConfig* key_rope = nullptr,
                         const AttentionOptions& opt = {}) {
  detail::with_f32_io(q, out, ws.q_f32, ws.out_f32, "attend_pages",
                      [&](KVView<const float> q32, KVView<float> o32) {
                        attend_pages(table, sink_k, sink_v, tail_k, tail_v, q32, o32, causal, ws,
                                     key_rope, opt);
                      });
}

/// attend_batch() with f16 or bf16 queries and outputs.
template <class T, std::enable_if_t<detail::is_half_v<T>, int> = 0>
inline void attend_batch(const PagedKVBatch& b, KVView<const T> q, KVView<T> out, bool causal,
                         BatchAttentionWorkspace& ws, const RopeConfig* key_rope = nullptr,
                         const AttentionOptions& opt = {}) {
  detail::with_f32_io(q, out, ws.q_f32, ws.out_f32, "attend_batch",
                      [&](KVView<const float> q32, KVView<float> o32) {
                        attend_batch(b, q32, o32, causal, ws, key_rope, opt);
                      });
}

}  // namespace kvq

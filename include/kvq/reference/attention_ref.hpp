#pragma once
/// \file attention_ref.hpp
/// Reference (oracle) attention over a KVCache or over any sequence of cache segments, for
/// every policy, with GQA/MQA. Written to be obviously right, not fast: the fused kernels of
/// attention/attention.hpp (attention/cpu/attention_cpu.hpp) are tested against it.
///
/// Queries are the newest positions of the layer: query i of n_q sits at position
/// tokens - n_q + i and, when causal, attends to the tokens [0, position]; otherwise to all
/// tokens. Query head h reads kv head h / (n_heads / kv_heads). Scores are q.k / sqrt(head_dim),
/// followed by a max-subtracted softmax and the weighted sum of values.
///
/// The segments are walked in order (sinks, each packed block, the residual), with one packed
/// block dequantized at a time into a scratch buffer, and the online (running-max) form of
/// softmax: each segment rescales the running sum and output by exp(old max - new max) before
/// adding its own terms, which is the same softmax in exact arithmetic. Dot products,
/// exponentials and sums are taken in double, so the result equals fp32 attention over the
/// dequantized tensors within fp32 rounding, whatever the segment boundaries.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvq/attention/attention.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/core/error.hpp"
#include "kvq/core/rope.hpp"
#include "kvq/core/rows.hpp"
#include "kvq/core/softmax.hpp"
#include "kvq/core/tensor.hpp"
#include "kvq/quant/quantize.hpp"

namespace kvq {
namespace reference {

/// Scratch of the oracle (reused across calls).
struct RefAttentionWorkspace {
  std::vector<float> q;         // [n_q, n_heads, head_dim] queries as contiguous floats
  std::vector<float> kblock;    // [B, kv_heads, head_dim] one dequantized key block
  std::vector<float> vblock;    // [B, kv_heads, head_dim] one dequantized value block
  std::vector<double> acc;      // [n_q, n_heads, head_dim] running weighted sum of values
  std::vector<SoftmaxState<double>> run;  // [n_q, n_heads] running maximum and denominator
  std::vector<double> scores;   // [segment tokens] one head's scores
  std::vector<float> out_row;   // [head_dim]
};

/// Oracle attention over the segments that `for_each(fn)` hands to fn (CacheSegment, in
/// token order, covering [0, total_tokens)); kv_heads x head_dim per token. Packed segments
/// are dequantized from their QTensors (`key`, `value`). `layer` only names the layer in
/// error messages.
///
/// `opt`: the logit and masking options of AttentionOptions (threads and the split are
/// ignored), written out plainly: logit = scale * q.k (scale 0: 1/sqrt(head_dim)), then
/// softcap * tanh(logit / softcap) when softcap > 0; query i (global row q_base + i for
/// positions and masks) at p = positions[q_base + i], else tokens - n_q + i (causal) or the last
/// token; kv position t is seen when (not causal or t <= p), (no window or t >= p - window + 1)
/// and the custom mask (bits or callback) allows it; the sink logit of the query head adds
/// exp(sink - max) to the denominator only. A row that sees no token is zeros. opt.lse, when
/// given, receives each row's log-sum-exp (sink included; -inf when nothing weighs).
template <class ForEach>
void attend_ref_segments(ForEach&& for_each, int64_t total_tokens, int64_t kv_heads,
                         int64_t head_dim, KVView<const float> q, KVView<float> out, bool causal,
                         RefAttentionWorkspace& ws, const RopeConfig* key_rope = nullptr,
                         int layer = 0, const AttentionOptions& opt = AttentionOptions(),
                         int64_t q_base = 0) {
  const int64_t T = total_tokens;
  const int64_t nq = q.tokens(), nh = q.heads(), D = head_dim;
  const int64_t H = kv_heads;
  KVQ_REQUIRE(q.head_dim() == D, kShapeMismatch, "attend_ref: queries have head_dim ",
              q.head_dim(), " but the cache has ", D);
  KVQ_REQUIRE(nh > 0 && nh % H == 0, kShapeMismatch, "attend_ref: n_heads=", nh,
              " is not a positive multiple of the cache's kv_heads=", H);
  KVQ_REQUIRE(out.shape() == q.shape(), kShapeMismatch, "attend_ref: output ",
              out.shape().str(), " does not match the queries ", q.shape().str());
  if (nq == 0) return;
  KVQ_REQUIRE(T > 0, kInvalidArgument, "attend_ref: layer ", layer, " holds no tokens");
  KVQ_REQUIRE(!causal || opt.positions != nullptr || nq <= T, kInvalidArgument, "attend_ref: ", nq,
              " causal queries at the newest positions need at least as many tokens, but layer ",
              layer, " holds ", T);
  const int64_t group = nh / H;
  const double scale =
      opt.scale > 0.f ? static_cast<double>(opt.scale) : 1.0 / std::sqrt(static_cast<double>(D));
  const double cap = static_cast<double>(opt.softcap);
  auto query_position = [&](int64_t i) -> int64_t {
    if (opt.positions != nullptr) return opt.positions[q_base + i];
    return causal ? T - nq + i : T - 1;
  };
  auto sees = [&](int64_t i, int64_t t) {
    const int64_t p = query_position(i);
    if (causal && t > p) return false;
    if (opt.window > 0 && t < p - opt.window + 1) return false;
    const int64_t gi = q_base + i;
    if (opt.mask_bits != nullptr &&
        ((opt.mask_bits[gi * opt.mask_words + t / 64] >> (t % 64)) & 1u) == 0)
      return false;
    if (opt.mask_fn && !opt.mask_fn(gi, t)) return false;
    return true;
  };

  ws.q.resize(static_cast<std::size_t>(nq * nh * D));
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t h = 0; h < nh; ++h) {
      float* dst = ws.q.data() + (i * nh + h) * D;
      const float* r = detail::load_row(q, i, h, dst);
      if (r != dst) std::copy(r, r + D, dst);
      for (int64_t d = 0; d < D; ++d)
        if (!std::isfinite(dst[d])) detail::throw_non_finite_row(q, i, h, "attend: query");
    }
  ws.acc.assign(static_cast<std::size_t>(nq * nh * D), 0.0);
  ws.run.assign(static_cast<std::size_t>(nq * nh), SoftmaxState<double>::empty());

  for_each([&](const CacheSegment& s) {
    const int64_t len = s.tokens();
    const float* kp;  // [len, kv_heads, head_dim]
    const float* vp;
    if (s.packed()) {
      ws.kblock.resize(static_cast<std::size_t>(len * H * D));
      ws.vblock.resize(ws.kblock.size());
      dequantize(s.key_view, KVView<float>::nhd(ws.kblock.data(), len, H, D));
      dequantize(s.value_view, KVView<float>::nhd(ws.vblock.data(), len, H, D));
      kp = ws.kblock.data();
      vp = ws.vblock.data();
    } else {
      kp = s.key_rows.data();
      vp = s.value_rows.data();
    }
    if (key_rope != nullptr) {  // pre-RoPE cache: rotate this segment's keys at their positions
      if (kp != ws.kblock.data()) {
        ws.kblock.assign(kp, kp + len * H * D);
        kp = ws.kblock.data();
      }
      apply_rope_pairs(ws.kblock.data(), len, H, D, s.begin, *key_rope);
    }
    ws.scores.resize(static_cast<std::size_t>(len));
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t kvh = h / group;
        const float* qr = ws.q.data() + (i * nh + h) * D;
        double seg_max = -std::numeric_limits<double>::infinity();
        bool any = false;
        for (int64_t t = 0; t < len; ++t) {
          double& sc = ws.scores[static_cast<std::size_t>(t)];
          if (!sees(i, s.begin + t)) {
            sc = -std::numeric_limits<double>::infinity();
            continue;
          }
          const float* kr = kp + (t * H + kvh) * D;
          double dot = 0.0;
          for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(qr[d]) * kr[d];
          sc = dot * scale;
          if (cap > 0.0) sc = cap * std::tanh(sc / cap);
          seg_max = std::max(seg_max, sc);
          any = true;
        }
        if (!any) continue;
        const std::size_t qi = static_cast<std::size_t>(i * nh + h);
        SoftmaxState<double>& run = ws.run[qi];
        double* acc = ws.acc.data() + qi * static_cast<std::size_t>(D);
        double rescale;  // exp(old max - new max); 0 at first (exp(-inf))
        if (run.raise(seg_max, [](double x) { return std::exp(x); }, &rescale))
          for (int64_t d = 0; d < D; ++d) acc[d] *= rescale;
        const double new_max = run.m;
        double sum = run.l;
        for (int64_t t = 0; t < len; ++t) {
          const double sc = ws.scores[static_cast<std::size_t>(t)];
          if (sc == -std::numeric_limits<double>::infinity()) continue;
          const double w = std::exp(sc - new_max);
          sum += w;
          const float* vr = vp + (t * H + kvh) * D;
          for (int64_t d = 0; d < D; ++d) acc[d] += w * vr[d];
        }
        run.l = sum;
      }
    }
  });

  ws.out_row.resize(static_cast<std::size_t>(D));
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t h = 0; h < nh; ++h) {
      const std::size_t qi = static_cast<std::size_t>(i * nh + h);
      const double* acc = ws.acc.data() + qi * static_cast<std::size_t>(D);
      double denom = ws.run[qi].l;  // sum of exp(logit - m) over the tokens seen
      if (denom > 0.0 && opt.sinks != nullptr)
        denom += std::exp(static_cast<double>(opt.sinks[h]) - ws.run[qi].m);
      for (int64_t d = 0; d < D; ++d)
        ws.out_row[static_cast<std::size_t>(d)] =
            denom > 0.0 ? static_cast<float>(acc[d] / denom) : 0.f;
      detail::store_row(out, i, h, ws.out_row.data());
      if (opt.lse != nullptr) {
        // log(sum over the keys seen of exp(logit) + exp(sink)): the sink counts even for a
        // row that sees no key (its output is zeros, but merged elsewhere it still weighs).
        const double m = ws.run[qi].m, l = ws.run[qi].l;
        const bool sink = opt.sinks != nullptr && std::isfinite(static_cast<double>(opt.sinks[h]));
        double v = -std::numeric_limits<double>::infinity();
        if (l > 0.0) v = m + std::log(l);
        if (sink) {
          const double sv = static_cast<double>(opt.sinks[h]);
          const double hi = std::max(v, sv);
          v = hi + std::log(std::exp(v - hi) + std::exp(sv - hi));
        }
        opt.lse[(q_base + i) * nh + h] = static_cast<float>(v);
      }
    }
}

/// Oracle attention of the queries `q` ([n_q, n_heads, head_dim], the newest n_q positions of
/// `layer`) over `cache`, written to `out` (same shape, any strides); the semantics of
/// kvq::attend (attention/attention.hpp), in double precision.
inline void attend_ref(const KVCache& cache, int layer, KVView<const float> q, KVView<float> out,
                       bool causal, RefAttentionWorkspace& ws,
                       const RopeConfig* key_rope = nullptr) {
  const int64_t T = cache.tokens(layer);
  attend_ref_segments([&](auto&& fn) { cache.for_each_segment(layer, fn); }, T,
                      cache.kv_heads(), cache.head_dim(), q, out, causal, ws, key_rope, layer);
}

/// attend_ref() with the logit and masking options of `opt` (see attend_ref_segments).
inline void attend_ref(const KVCache& cache, int layer, KVView<const float> q, KVView<float> out,
                       bool causal, const AttentionOptions& opt,
                       const RopeConfig* key_rope = nullptr) {
  RefAttentionWorkspace ws;
  const int64_t T = cache.tokens(layer);
  attend_ref_segments([&](auto&& fn) { cache.for_each_segment(layer, fn); }, T,
                      cache.kv_heads(), cache.head_dim(), q, out, causal, ws, key_rope, layer, opt);
}

/// attend_ref() with a workspace of its own.
inline void attend_ref(const KVCache& cache, int layer, KVView<const float> q, KVView<float> out,
                       bool causal = true, const RopeConfig* key_rope = nullptr) {
  RefAttentionWorkspace ws;
  attend_ref(cache, layer, q, out, causal, ws, key_rope);
}

}  // namespace reference
}  // namespace kvq

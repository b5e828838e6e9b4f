#pragma once
/// \file mask.hpp
/// Which tokens a query row sees and what its logits are: causal limit, sliding window,
/// explicit query positions, a custom mask (bits or callback) and the logit soft-cap
/// (AttentionOptions). Every kernel path (per-head tiles and all-heads tiles, scalar and SIMD)
/// calls mask_logits on its scores before the online softmax, and the work split bounds each
/// unit's tokens with first_visible / last_visible, so the rules live here once.
#include "kvq/attention/cpu/problem.hpp"

namespace kvq {
namespace kernels {
namespace attn {

/// Position of query i of the call (0-based): the explicit position, else tokens - n_q + i
/// (causal) or the last token (not causal).
inline int64_t query_pos(const Problem& P, int64_t i) {
  if (P.positions != nullptr) return P.positions[P.q_base + i];
  return P.causal ? P.T - P.nq + i : P.T - 1;
}

/// Last kv position query i may see (causal: its position; else the last token).
inline int64_t last_visible(const Problem& P, int64_t i) {
  return P.causal ? query_pos(P, i) : P.T - 1;
}

/// First kv position query i may see (the start of its sliding window; 0 without one).
inline int64_t first_visible(const Problem& P, int64_t i) {
  return P.window > 0 ? std::max<int64_t>(0, query_pos(P, i) - P.window + 1) : 0;
}

/// True when a custom mask is set.
inline bool has_custom_mask(const Problem& P) {
  return P.mask_bits != nullptr || P.mask_fn != nullptr;
}

/// The custom mask's verdict for query i and kv position t (true without a custom mask).
inline bool custom_visible(const Problem& P, int64_t i, int64_t t) {
  const int64_t gi = P.q_base + i;
  if (P.mask_bits != nullptr)
    return ((P.mask_bits[gi * P.mask_words + t / 64] >> (t % 64)) & 1u) != 0;
  if (P.mask_fn != nullptr) return (*P.mask_fn)(gi, t);
  return true;
}

/// Turns the scores s[0, n) of query i over the tile tokens [t0, t0 + n) into logits ready for
/// the softmax: soft-capped where visible, -inf where not, and s[n, nfill) = -inf. Returns
/// false when the row sees none of the tile; then s[0, nfill) is all 0 (zero weights) and the
/// caller skips the row's softmax update.
inline bool mask_logits(const Problem& P, int64_t i, int64_t t0, int64_t n, int64_t nfill,
                        float* s) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t nv = std::min(n, last_visible(P, i) - t0 + 1);
  const int64_t lo = std::max<int64_t>(0, first_visible(P, i) - t0);
  if (nv <= lo) {
    std::fill(s, s + nfill, 0.f);
    return false;
  }
  if (P.softcap > 0.f) {
    const float cap = P.softcap, inv = 1.f / P.softcap;
    for (int64_t t = lo; t < nv; ++t) s[t] = cap * std::tanh(s[t] * inv);
  }
  if (has_custom_mask(P)) {
    bool any = false;
    for (int64_t t = lo; t < nv; ++t) {
      if (custom_visible(P, i, t0 + t))
        any = true;
      else
        s[t] = ninf;
    }
    if (!any) {
      std::fill(s, s + nfill, 0.f);
      return false;
    }
  }
  std::fill(s + nv, s + nfill, ninf);
  std::fill(s, s + lo, ninf);
  return true;
}

/// Tokens [a, b) unit (chunk, qb) of P reads: its chunk clipped to what the block's queries
/// may see (mask.hpp); a >= b when none.
inline void unit_range(const Problem& P, int64_t chunk, int64_t qb, int64_t& a, int64_t& b) {
  const int64_t i0 = qb * kQueryBlock, i1 = std::min(P.nq, i0 + kQueryBlock);
  a = chunk * P.split;
  b = std::min(P.T, a + P.split);
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = -1;
  for (int64_t i = i0; i < i1; ++i) {
    lo = std::min(lo, first_visible(P, i));
    hi = std::max(hi, last_visible(P, i));
  }
  a = std::max(a, lo);
  b = std::min(b, hi + 1);
}

}  // namespace attn
}  // namespace kernels
}  // namespace kvq

#pragma once
/// \file attention.hpp
/// Attention over a KVCache, for every policy, with GQA/MQA (see reference/attention_ref.hpp
/// for the semantics; this header is the fast entry point).
#include "kvq/reference/attention_ref.hpp"

namespace kvq {

/// Scratch reused across attend() calls.
struct AttentionWorkspace {
  reference::RefAttentionWorkspace ref;
};

inline void attend(const KVCache& cache, int layer, KVView<const float> q, KVView<float> out,
                   bool causal, AttentionWorkspace& ws, const RopeConfig* key_rope = nullptr) {
  reference::attend_ref(cache, layer, q, out, causal, ws.ref, key_rope);
}

inline void attend(const KVCache& cache, int layer, KVView<const float> q, KVView<float> out,
                   bool causal = true, const RopeConfig* key_rope = nullptr) {
  AttentionWorkspace ws;
  attend(cache, layer, q, out, causal, ws, key_rope);
}

inline void attend_one(const KVCache& cache, int layer, const float* q, int n_heads, float* out,
                       AttentionWorkspace& ws, const RopeConfig* key_rope = nullptr) {
  const int D = cache.head_dim();
  attend(cache, layer, KVView<const float>::nhd(q, 1, n_heads, D),
         KVView<float>::nhd(out, 1, n_heads, D), true, ws, key_rope);
}

}  // namespace kvq

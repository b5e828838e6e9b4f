#pragma once
/// \file layout.hpp
/// Page layouts from a policy, for engines that own their pages: the configs of one layer as a
/// streaming cache stores them and the page layout for a page size the engine chooses. An
/// engine that lays out its pages with these functions holds exactly the bytes `KVCache` holds
/// (tests/cache/test_engine_layout.cpp) and hands its page tables to kvq's attention.
///
/// The rule an engine must know: scale groups that span tokens (keys per channel, fp8 scales
/// per head) are quantized when the group is complete, so a page holds whole groups: its size
/// is a multiple of every such group (kivi4, k8v4: 32 tokens); smaller or misaligned pages are
/// refused (kShapeMismatch naming both numbers), never quantized under other groups. Tokens of
/// an incomplete page wait in f32 (the cache's residual/tail rows), so a decode token never
/// goes straight into a kivi4 or k8v4 page. Token-local formats (int/nuq per token, Lloyd-Max,
/// f16/bf16/f32) take any page size that keeps rows on whole bytes.
#include <cstdint>

#include "kvq/core/error.hpp"
#include "kvq/layout/page_layout.hpp"
#include "kvq/policy/spec.hpp"

namespace kvq {

/// `c` as a streaming cache stores it: a group of 0 ("whole extent") on a token-spanning axis
/// becomes kStreamGroupTokens (32) tokens, since a stream has no "all tokens".
inline QuantConfig stream_config(const QuantConfig& c) { return detail::streaming_config(c); }

/// Key config of `layer` (of `n_layers`) under `policy`, as stored in pages.
inline QuantConfig stream_key_config(const Policy& policy, int layer, int n_layers) {
  return stream_config(policy.key_for(layer, n_layers));
}

/// Value config of `layer` (of `n_layers`) under `policy`, as stored in pages.
inline QuantConfig stream_value_config(const Policy& policy, int layer, int n_layers) {
  return stream_config(policy.value_for(layer, n_layers));
}

/// The page size KVCache uses for `layer`: the least common multiple of the key and value token
/// groups, rounded up to a multiple of at least kMinBlockTokens (16). Any multiple of it is a
/// valid engine page size.
inline int64_t cache_page_tokens(const Policy& policy, int layer, int n_layers) {
  return detail::stream_block_tokens(stream_key_config(policy, layer, n_layers),
                                     stream_value_config(policy, layer, n_layers));
}

/// The layout of an engine page of `page_tokens` tokens for `layer` of an `n_layers` model with
/// `kv_heads` x `head_dim` keys and values under `policy`. Throws kShapeMismatch when
/// page_tokens is not a multiple of a token group of the layer's configs (naming both), and
/// what make_page_layout throws otherwise; the policy is validated first.
inline PageLayout make_page_layout(const Policy& policy, int layer, int n_layers,
                                   int64_t page_tokens, int64_t kv_heads, int64_t head_dim) {
  policy.validate();
  const QuantConfig k = stream_key_config(policy, layer, n_layers);
  const QuantConfig v = stream_value_config(policy, layer, n_layers);
  return make_page_layout(k, v, page_tokens, kv_heads, head_dim);
}

}  // namespace kvq

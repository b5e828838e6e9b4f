#pragma once
/// \file simulated_backend.hpp
/// KVBackend for *simulated* quantization: every scale group of keys and of values is quantized
/// and dequantized as soon as its tokens are complete, keys and values independently, and the
/// model attends over the dequantized values with the exact f32 attention code. This is the rule
/// papers use to report a format's accuracy (KIVI's "fake quantization") and the rule behind the
/// stories260K axis table in the reference notes:
///
///   keys grouped over G tokens per channel: a group is quantized once its G tokens are all in,
///   so only the incomplete trailing group is f32; values grouped per token: every token is
///   quantized right away.
///
/// The streaming KVCache (kv_cache.hpp) differs in one way: it packs keys and values in shared
/// blocks of B = lcm(Gt(K), Gt(V)) >= 16 tokens, so per-token values wait in f32 until the key
/// group is complete. Same stored values once a block is packed; slightly different numbers
/// for the newest tokens of every prediction.
///
/// Residual window and sinks follow the cache's rule per tensor: tokens [0, sinks) are never
/// quantized; the group [s, s + G) (s counted from `sinks`) is quantized once the layer holds at
/// least s + G + residual tokens. Skipped layers and per-layer overrides come from the policy.
/// Bytes are counted as the packed groups' real bytes plus 4 bytes per f32 element, so
/// effective_bits() is honest about what a cache under this rule would hold.
///
/// Pre-RoPE keys (KVQuant): with SimulatedOptions::prerope_keys the key groups are formed from
/// the keys *before* RoPE (the `k_prerope` the model appends), dequantized, and rotated by RoPE
/// at their positions afterwards, with kvq::apply_rope_pairs (core/rope.hpp: llama2.c's
/// convention, so an unquantized key comes back as the model computed it).
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvq/cache/kv_cache.hpp"
#include "kvq/core/error.hpp"
#include "kvq/core/rope.hpp"
#include "kvq/eval/kv_backend.hpp"
#include "kvq/policy/spec.hpp"
#include "kvq/quant/quantize.hpp"

namespace kvq {

struct SimulatedOptions {
  bool prerope_keys = false;  ///< quantize keys before RoPE, apply RoPE after dequantization
  double rope_theta = 10000.0;
};

class SimulatedBackend final : public eval::KVBackend {
 public:
  SimulatedBackend(Policy policy, const eval::KVGeometry& g, SimulatedOptions opt = {})
      : policy_(std::move(policy)), g_(g), opt_(opt), fp_(g) {
    KVQ_REQUIRE(!opt.prerope_keys || g.head_dim % 2 == 0, kInvalidArgument,
                "SimulatedBackend: pre-RoPE keys need an even head_dim, got ", g.head_dim);
    policy_.validate();
    const size_t L = static_cast<size_t>(g.n_layers);
    side_.resize(2 * L);
    for (int l = 0; l < g.n_layers; ++l) {
      for (int kv = 0; kv < 2; ++kv) {
        Side& s = side(l, kv);
        s.cfg = detail::streaming_config(kv == 0 ? policy_.key_for(l, g.n_layers)
                                                 : policy_.value_for(l, g.n_layers));
        s.group = static_cast<int>(detail::group_token_extent(s.cfg));
        s.raw.assign(static_cast<size_t>(g.max_tokens) * g.n_kv_heads * g.head_dim, 0.0f);
      }
    }
    reset();
  }

  void reset() override {
    fp_.reset();
    for (Side& s : side_) {
      s.next = policy_.sinks;
      s.packed_bytes = 0;
      s.packed_tokens = 0;
    }
  }

  void append(int layer, int pos, const float* k_prerope, const float* k, const float* v) override {
    fp_.append(layer, pos, k_prerope, k, v);  // checks layer, position and capacity
    const int n = pos + 1;
    const size_t row = static_cast<size_t>(g_.n_kv_heads) * g_.head_dim;
    for (int kv = 0; kv < 2; ++kv) {
      Side& s = side(layer, kv);
      const float* src = kv == 1 ? v : (opt_.prerope_keys ? k_prerope : k);
      std::copy_n(src, row, s.raw.data() + static_cast<size_t>(pos) * row);
      while (n - s.next >= s.group + policy_.residual) {
        const Shape shape{s.group, g_.n_kv_heads, g_.head_dim};
        const KVView<const float> in(s.raw.data() + static_cast<size_t>(s.next) * row, shape);
        quantize(s.cfg, in, s.q);
        s.out.resize(static_cast<size_t>(shape.numel()));
        dequantize(s.q, KVView<float>(s.out.data(), shape));
        if (kv == 0 && opt_.prerope_keys) {
          RopeConfig rc;
          rc.theta = opt_.rope_theta;
          apply_rope_pairs(s.out.data(), s.group, g_.n_kv_heads, g_.head_dim, s.next, rc);
        }
        const KVView<const float> back(s.out.data(), shape);
        if (kv == 0) {
          fp_.overwrite_keys(layer, s.next, back);
        } else {
          fp_.overwrite_values(layer, s.next, back);
        }
        s.packed_bytes += s.q.bytes();
        s.packed_tokens += s.group;
        s.next += s.group;
      }
    }
  }

  void attend(int layer, int pos, const float* q, int n_heads, float* out) override {
    fp_.attend(layer, pos, q, n_heads, out);
  }
  void attend_window(int layer, int pos, const float* q, int n_heads, float* out,
                     int window) override {
    fp_.attend_window(layer, pos, q, n_heads, out, window);
  }

  /// Bytes a cache under this rule would hold now: packed groups plus f32 for the rest.
  std::size_t bytes() const {
    std::size_t b = 0;
    for (int l = 0; l < g_.n_layers; ++l) {
      const std::size_t n = static_cast<std::size_t>(fp_.tokens(l));
      for (int kv = 0; kv < 2; ++kv) {
        const Side& s = side_[static_cast<size_t>(2 * l + kv)];
        b += s.packed_bytes + (n - static_cast<std::size_t>(s.packed_tokens)) * 4u *
                                  static_cast<std::size_t>(g_.n_kv_heads) * g_.head_dim;
      }
    }
    return b;
  }
  /// Key and value elements held now.
  std::size_t elements() const {
    std::size_t n = 0;
    for (int l = 0; l < g_.n_layers; ++l) n += static_cast<std::size_t>(fp_.tokens(l));
    return 2 * n * static_cast<std::size_t>(g_.n_kv_heads) * g_.head_dim;
  }
  const eval::Fp32Backend& storage() const { return fp_; }

 private:
  struct Side {              // keys (0) or values (1) of one layer
    QuantConfig cfg;         // streaming config (group 0 on a token-spanning axis resolved)
    int group = 1;           // tokens per scale group (Gt)
    int next = 0;            // first token not yet quantized
    std::vector<float> raw;  // [max_tokens, kv_heads, head_dim] as appended
    QTensor q;               // reused per group
    std::vector<float> out;  // dequantized group
    std::size_t packed_bytes = 0;
    int packed_tokens = 0;
  };
  Side& side(int layer, int kv) { return side_[static_cast<size_t>(2 * layer + kv)]; }

  Policy policy_;
  eval::KVGeometry g_;
  SimulatedOptions opt_;
  eval::Fp32Backend fp_;
  std::vector<Side> side_;
};

}  // namespace kvq

#pragma once
/// \file state.hpp
/// The cache's own state export and import: the stored state of a KVCache (its layers' pages
/// and f32 windows) read and restored by serializers (io/archive) without io/ being a friend
/// of the cache. KVCache befriends this cache-layer accessor only.
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "kvq/cache/kv_cache.hpp"

namespace kvq {
namespace detail {

/// The friend of KVCache that reads and restores its stored state (see kv_cache.hpp).
struct KVCacheAccess {
  using Layer = KVCache::Layer;
  static const Layer& layer(const KVCache& c, int l) {
    return c.layers_[static_cast<std::size_t>(l)];
  }
  static Layer& layer(KVCache& c, int l) { return c.layers_[static_cast<std::size_t>(l)]; }
  static int64_t row(const KVCache& c) { return c.row_; }
  static bool has_rollback(const KVCache& c, int l) { return layer(c, l).roll; }
  static const std::vector<float>& roll_k(const KVCache& c, int l) { return layer(c, l).roll_k; }
  static const std::vector<float>& roll_v(const KVCache& c, int l) { return layer(c, l).roll_v; }
  static std::size_t layer_struct_bytes() { return sizeof(Layer); }
  /// Page slots [0, n) of a layer (allocated, not yet in use).
  static void reserve_pages(KVCache& c, int l, std::size_t n) { layer(c, l).pages.reserve(n); }
  static std::byte* page_slot(KVCache& c, int l, std::size_t i) { return layer(c, l).pages.page(i); }
  /// Publishes pages [0, n_pages) and the f32 windows of a layer of a cache built for restoring
  /// (no allocation, nothing throws).
  static void commit(KVCache& c, int l, std::size_t n_pages, std::vector<float>&& sk,
                     std::vector<float>&& sv, std::vector<float>&& rk, std::vector<float>&& rv,
                     std::vector<float>&& ok, std::vector<float>&& ov, bool roll) noexcept {
    Layer& L = layer(c, l);
    L.pages.resize(n_pages);
    L.sink_k = std::move(sk);
    L.sink_v = std::move(sv);
    L.res_k = std::move(rk);
    L.res_v = std::move(rv);
    L.roll_k = std::move(ok);
    L.roll_v = std::move(ov);
    L.roll = roll;
    const int64_t row = c.row_;
    L.tokens = static_cast<int64_t>(L.sink_k.size()) / row +
               static_cast<int64_t>(n_pages) * L.block + static_cast<int64_t>(L.res_k.size()) / row;
  }
};

}  // namespace detail
}  // namespace kvq

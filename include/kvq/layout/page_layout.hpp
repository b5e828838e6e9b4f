#pragma once
/// \file page_layout.hpp
/// The paged layout: where every byte of a page of packed tokens lives, on caller-owned memory.
///
/// A page holds `page_tokens` tokens of one layer's keys AND values, [page_tokens, kv_heads,
/// head_dim] each, quantized under (key config, value config). It is one flat byte array made of
/// up to sixteen regions, in this order, each starting at a multiple of kPageAlign (64) bytes:
///
///   K codes | K scales | K zeros | K norms | K qjl signs | K qjl norms | K outlier values |
///   K outlier positions | V codes | ... | V outlier positions | tail padding
///
/// A region a format does not use has 0 bytes (and no padding). The content of every region is
/// exactly the array a QTensor of shape [page_tokens, kv_heads, head_dim] holds (byte order in
/// quant/packed_view.hpp), so key_view()/value_view() of a page are PackedViews that every kvq
/// kernel reads unchanged. The page size is a multiple of 64, so pages placed back to back in
/// an arena keep every region aligned. Sizes per format, byte by byte: docs/layout.md.
///
/// Accounting: PageLayout::breakdown() is the accountant's figure for the page tensors
/// (account(key, [P, H, D]) + account(value, [P, H, D])) plus the alignment padding, reported as
/// ByteBreakdown::padding, so bytes() == breakdown().total() and effective bits stay honest.
///
/// Token granularity: a page can be written and read in token ranges that are multiples of
/// `granule` (the token extent of a scale group of either config, rounded up so that every
/// region of a range starts on a byte): quantize_page() of tokens [t0, t0 + n) writes exactly
/// the bytes quantize() of those n tokens would, at their place in the page, because group
/// boxes are stored token block first. Nothing here allocates once the caller's workspace has
/// grown.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <string>
#include <type_traits>

#include "kvq/core/error.hpp"
#include "kvq/core/tensor.hpp"
#include "kvq/geometry/grouping.hpp"
#include "kvq/quant/packed_view.hpp"
#include "kvq/quant/qtensor.hpp"
#include "kvq/quant/quantize.hpp"

namespace kvq {

/// Alignment of every region and of the page size (one cache line; AVX-512 loads).
inline constexpr std::size_t kPageAlign = 64;

/// Rounds n up to a multiple of kPageAlign.
constexpr std::size_t page_align(std::size_t n) {
  return (n + kPageAlign - 1) / kPageAlign * kPageAlign;
}

/// One region of a page: byte offset from the page start and size.
struct PageRegion {
  std::size_t offset = 0;
  std::size_t bytes = 0;
};

/// The eight regions of one packed tensor (keys or values) inside a page.
struct TensorRegions {
  PageRegion codes, scales, zeros, norms, qjl_signs, qjl_norms;
  PageRegion outlier_values, outlier_pos;  ///< dense-and-sparse (quant/outlier_quant.hpp)
};

/// Where everything lives in one page. Trivially copyable: engines may copy it to the device.
struct PageLayout {
  QuantConfig key;          ///< key config (as stored; the views carry it)
  QuantConfig value;        ///< value config
  int64_t page_tokens = 0;  ///< tokens per page (P)
  int64_t kv_heads = 0;     ///< H
  int64_t head_dim = 0;     ///< D
  int64_t granule = 1;      ///< token ranges are written/read in multiples of this
  TensorRegions k, v;       ///< region offsets and sizes
  std::size_t bytes = 0;    ///< bytes of one page (multiple of kPageAlign)
  std::size_t data = 0;     ///< bytes of the sixteen regions (accountant's figure)

  std::size_t padding() const { return bytes - data; }
  Shape page_shape() const { return Shape{page_tokens, kv_heads, head_dim}; }

  /// The accountant's breakdown of both page tensors plus the padding (total() == bytes).
  ByteBreakdown breakdown() const {
    ByteBreakdown b;
    for (const TensorRegions* r : {&k, &v}) {
      b.codes += r->codes.bytes;
      b.scales += r->scales.bytes;
      b.zeros += r->zeros.bytes;
      b.norms += r->norms.bytes;
      b.residual += r->qjl_signs.bytes + r->qjl_norms.bytes;
      b.outliers += r->outlier_values.bytes + r->outlier_pos.bytes;
    }
    b.padding = padding();
    return b;
  }

  /// The keys of the first `tokens` tokens of `page` (tokens a multiple of granule, or P).
  PackedView key_view(const std::byte* page, int64_t tokens) const {
    return tensor_view(key, k, page, tokens);
  }
  PackedView key_view(const std::byte* page) const { return key_view(page, page_tokens); }
  PackedView value_view(const std::byte* page, int64_t tokens) const {
    return tensor_view(value, v, page, tokens);
  }
  PackedView value_view(const std::byte* page) const { return value_view(page, page_tokens); }

  /// Writable spans of tokens [t0, t0 + n) of `page` (t0 and n multiples of granule).
  PackedSpan key_span(std::byte* page, int64_t t0, int64_t n) const {
    return tensor_span(key, k, page, t0, n);
  }
  PackedSpan value_span(std::byte* page, int64_t t0, int64_t n) const {
    return tensor_span(value, v, page, t0, n);
  }

  /// Throws kInvalidArgument unless [t0, t0 + n) is a range pages can be written in.
  void check_range(int64_t t0, int64_t n, const char* what) const {
    KVQ_REQUIRE(t0 >= 0 && n >= 0 && t0 + n <= page_tokens && t0 % granule == 0 &&
                    (n % granule == 0 || t0 + n == page_tokens),
                kInvalidArgument, what, ": token range [", t0, ", ", t0 + n,
                ") of a page of ", page_tokens, " tokens must lie in the page and start and end on "
                "multiples of the layout's granule ", granule);
  }

 private:
  /// Offsets of token t0 inside each region (t0 a multiple of granule).
  static PackedSpan at(const QuantConfig& c, const TensorRegions& r, std::byte* page, int64_t t0,
                       int64_t n, int64_t H, int64_t D, int64_t P) {
    PackedSpan s;
    s.config = c;
    s.shape = Shape{n, H, D};
    auto ptr = [&](const PageRegion& g, std::size_t off) -> uint8_t* {
      return g.bytes == 0 ? nullptr : reinterpret_cast<uint8_t*>(page + g.offset + off);
    };
    const auto t = static_cast<std::size_t>(t0);
    const auto vec = t * static_cast<std::size_t>(H);  // vectors before token t0
    const auto el = vec * static_cast<std::size_t>(D);  // elements before token t0
    const auto msz = static_cast<std::size_t>(meta_size(c.meta));
    std::size_t code_off = 0, group_off = 0;
    switch (c.format) {
      case Format::kF32: code_off = el * 4; break;
      case Format::kF16:
      case Format::kBF16: code_off = el * 2; break;
      case Format::kE4M3:
      case Format::kE5M2: code_off = el; break;
      case Format::kInt:
      case Format::kNuq:
      case Format::kLloydMax: code_off = el * static_cast<std::size_t>(c.bits) / 8; break;
      case Format::kNvfp4:
      case Format::kMxfp4: code_off = el / 2; break;
    }
    if (!c.is_raw() && c.format != Format::kLloydMax && t0 > 0) {
      const GroupBox box = group_box(c.axis, c.group, Shape{P, H, D});
      group_off = static_cast<std::size_t>(t0 / box.gt * box.nh * box.nc) * scale_slot_bytes(c);
    }
    s.codes = ptr(r.codes, code_off);
    s.scales = ptr(r.scales, group_off);
    s.zeros = ptr(r.zeros, group_off);
    s.norms = ptr(r.norms, vec * msz);
    s.qjl_signs = ptr(r.qjl_signs, el / 8);
    s.qjl_norms = ptr(r.qjl_norms, vec * msz);
    const auto ok = static_cast<std::size_t>(outlier_count(c, D));  // outliers per vector
    s.outlier_values = ptr(r.outlier_values, vec * ok * 2);
    s.outlier_pos = ptr(r.outlier_pos, vec * ok * static_cast<std::size_t>(outlier_pos_bytes(D)));
    return s;
  }
  PackedSpan tensor_span(const QuantConfig& c, const TensorRegions& r, std::byte* page, int64_t t0,
                         int64_t n) const {
    check_range(t0, n, "PageLayout span");
    return at(c, r, page, t0, n, kv_heads, head_dim, page_tokens);
  }
  PackedView tensor_view(const QuantConfig& c, const TensorRegions& r, const std::byte* page,
                         int64_t tokens) const {
    check_range(0, tokens, "PageLayout view");
    // A view of a partial page is the view of its first `tokens` tokens: the regions' prefixes.
    return at(c, r, const_cast<std::byte*>(page), 0, tokens, kv_heads, head_dim, page_tokens)
        .view();
  }
};

static_assert(std::is_trivially_copyable_v<PageLayout>, "PageLayout is copied to devices");

namespace detail {

/// Tokens of one scale group of `c` on a page of P tokens (1 when groups live in one token).
inline int64_t page_group_tokens(const QuantConfig& c, const Shape& page) {
  if (c.is_raw() || c.format == Format::kLloydMax || c.axis == Axis::kToken) return 1;
  return group_box(c.axis, c.group, page).gt;
}

/// Smallest t with t * per_token_bits % 8 == 0.
inline int64_t byte_granule(int64_t per_token_bits) {
  return 8 / static_cast<int64_t>(std::gcd(per_token_bits, int64_t{8}));
}

/// Code bits per token of `c` (and QJL sign bits), to keep every range start on a byte.
inline int64_t token_bits(const QuantConfig& c, int64_t H, int64_t D) {
  int64_t b = 8;
  switch (c.format) {
    case Format::kF32: b = 32; break;
    case Format::kF16:
    case Format::kBF16: b = 16; break;
    case Format::kE4M3:
    case Format::kE5M2: b = 8; break;
    case Format::kInt:
    case Format::kNuq:
    case Format::kLloydMax: b = c.bits; break;
    case Format::kNvfp4:
    case Format::kMxfp4: b = 4; break;
  }
  return b * H * D;
}

inline void place(TensorRegions& r, const PackedSizes& p, std::size_t& off) {
  auto put = [&](PageRegion& g, std::size_t n) {
    g.offset = off;
    g.bytes = n;
    off = page_align(off + n);
  };
  put(r.codes, p.codes);
  put(r.scales, p.scales);
  put(r.zeros, p.zeros);
  put(r.norms, p.norms);
  put(r.qjl_signs, p.qjl_signs);
  put(r.qjl_norms, p.qjl_norms);
  put(r.outlier_values, p.outlier_values);
  put(r.outlier_pos, p.outlier_pos);
}

}  // namespace detail

/// Largest page kvq lays out (1 GiB): a bigger one is a spec mistake (e.g. a group of 2^24
/// tokens), not a page.
inline constexpr std::size_t kMaxPageBytes = std::size_t{1} << 30;

/// The layout of a page of `page_tokens` tokens of `kv_heads` x `head_dim` keys and values.
/// Throws kShapeMismatch when page_tokens is not a multiple of a config's token group (a group
/// is never shrunk to fit a page) or a token-axis group does not divide head_dim, kInvalidArgument for bad bit widths or
/// geometry, kOutOfRange beyond kMaxPageBytes.
inline PageLayout make_page_layout(const QuantConfig& key, const QuantConfig& value,
                                   int64_t page_tokens, int64_t kv_heads, int64_t head_dim) {
  KVQ_REQUIRE(page_tokens > 0 && kv_heads > 0 && head_dim > 0 && page_tokens <= (1 << 24) &&
                  kv_heads <= (1 << 24) && head_dim <= (1 << 24),
              kInvalidArgument, "make_page_layout: page_tokens, kv_heads and head_dim must be in "
              "[1, 2^24], got ", page_tokens, ", ", kv_heads, ", ", head_dim);
  // A config whose scale groups span tokens must fit whole groups in a page: a page shorter
  // than the group (or not a multiple of it) would quantize groups of another size, a different
  // quantizer at a different cost (kivi4 at 16-token pages: 5.5 bits instead of 5.0).
  for (const auto& [c, role] : {std::pair<const QuantConfig*, const char*>{&key, "key"},
                                std::pair<const QuantConfig*, const char*>{&value, "value"}}) {
    const bool spans = !c->is_raw() && c->format != Format::kLloydMax && c->axis != Axis::kToken;
    KVQ_REQUIRE(!spans || c->group == 0 || page_tokens % c->group == 0, kShapeMismatch,
                "make_page_layout: page_tokens ", page_tokens, " is not a multiple of the ", role,
                " config's token group of ", c->group, " (", c->name(),
                "); use pages of a multiple of ", c->group, " tokens");
  }
  PageLayout L;
  L.key = key;
  L.value = value;
  L.page_tokens = page_tokens;
  L.kv_heads = kv_heads;
  L.head_dim = head_dim;
  const Shape s = L.page_shape();
  const PackedSizes ks = packed_sizes(key, s), vs = packed_sizes(value, s);
  KVQ_REQUIRE(ks.total() <= kMaxPageBytes && vs.total() <= kMaxPageBytes &&
                  ks.total() + vs.total() + 16 * kPageAlign <= kMaxPageBytes,
              kOutOfRange, "make_page_layout: a page of ", s.str(), " under ", key.name(), " / ",
              value.name(), " would take ", ks.total() + vs.total(), " bytes, beyond the ",
              kMaxPageBytes, "-byte limit");
  std::size_t off = 0;
  detail::place(L.k, ks, off);
  detail::place(L.v, vs, off);
  L.bytes = page_align(off);
  L.data = ks.total() + vs.total();
  int64_t g = std::lcm(detail::page_group_tokens(key, s), detail::page_group_tokens(value, s));
  for (const QuantConfig* c : {&key, &value}) {
    g = std::lcm(g, detail::byte_granule(detail::token_bits(*c, kv_heads, head_dim)));
    if (c->qjl) g = std::lcm(g, detail::byte_granule(kv_heads * head_dim));
  }
  L.granule = g;
  return L;
}

/// Quantizes k and v ([n, kv_heads, head_dim], any strides, f32/f16/bf16) into tokens
/// [t0, t0 + n) of `page` (t0, n multiples of L.granule, or up to the page end). The bytes equal
/// quantize() of the same n tokens, at their place in the page. On a throw the page's bytes in
/// that range are unspecified (write to a page the caller has not published yet).
namespace detail {

/// ", first at page token T, head H, channel C (value V)" for the first NaN/Inf of x, or "".
template <class T>
std::string first_non_finite(const KVView<const T>& x, int64_t t0) {
  for (int64_t t = 0; t < x.tokens(); ++t)
    for (int64_t h = 0; h < x.heads(); ++h)
      for (int64_t d = 0; d < x.head_dim(); ++d) {
        const float f = static_cast<float>(x.at(t, h, d));
        if (!std::isfinite(f))
          return cat(", first at page token ", t0 + t, ", head ", h, ", channel ", d, " (", f, ")");
      }
  return "";
}

/// The message of a kvq::Error without its "kvq: <kind>: " prefix.
inline std::string error_message(const Error& e) {
  std::string m = e.what();
  const std::string pre = std::string("kvq: ") + to_string(e.kind()) + ": ";
  return m.compare(0, pre.size(), pre) == 0 ? m.substr(pre.size()) : m;
}

}  // namespace detail

template <class T>
void quantize_page(const PageLayout& L, std::byte* page, int64_t t0, const KVView<const T>& k,
                   const KVView<const T>& v, QuantWorkspace& ws) {
  const int64_t n = k.tokens();
  KVQ_REQUIRE(page != nullptr, kInvalidArgument, "quantize_page: the page pointer is null");
  KVQ_REQUIRE(k.shape() == v.shape() && k.heads() == L.kv_heads && k.head_dim() == L.head_dim,
              kShapeMismatch, "quantize_page: keys ", k.shape().str(), " and values ",
              v.shape().str(), " must both be [n, ", L.kv_heads, ", ", L.head_dim, "]");
  L.check_range(t0, n, "quantize_page");
  // Errors of the quantizer say which tensor, which page tokens and (for NaN/Inf) where.
  auto run = [&](const QuantConfig& c, const KVView<const T>& x, const PackedSpan& span,
                 const char* which) {
    try {
      quantize_into(c, x, span, ws);
    } catch (const Error& e) {
      const std::string where =
          e.kind() == ErrorKind::kNonFinite ? detail::first_non_finite(x, t0) : std::string();
      fail(e.kind(), "quantize_page: the ", which, " of page tokens [", t0, ", ", t0 + n, ")",
           where, ": ", detail::error_message(e));
    }
  };
  run(L.key, k, L.key_span(page, t0, n), "keys");
  run(L.value, v, L.value_span(page, t0, n), "values");
}

/// Reconstructs tokens [a, b) of a page holding its first `filled` tokens into k_out and v_out
/// ([b - a, kv_heads, head_dim], any strides, f32/f16/bf16). Any a <= b <= filled.
template <class T>
void dequantize_page(const PageLayout& L, const std::byte* page, int64_t filled, int64_t a,
                     int64_t b, const KVView<T>& k_out, const KVView<T>& v_out,
                     QuantWorkspace& ws) {
  KVQ_REQUIRE(0 <= a && a <= b && b <= filled, kOutOfRange, "dequantize_page: tokens [", a, ", ",
              b, ") of a page holding ", filled);
  dequantize_tokens(L.key_view(page, filled), a, k_out, ws);
  dequantize_tokens(L.value_view(page, filled), a, v_out, ws);
}

/// One region of a layer's tokens, as KVCache::for_each_segment() hands it out and the attention
/// kernels read it (sinks and residual as f32 rows, each page as packed views).
struct CacheSegment {
  enum class Kind : uint8_t { kSinks, kPacked, kResidual };
  Kind kind = Kind::kSinks;
  int64_t begin = 0;  ///< first token position
  int64_t end = 0;    ///< one past the last token position
  /// kPacked: the keys and values of one page, [end - begin, kv_heads, head_dim] each, as
  /// views into the page (what kernels read; pages an engine fills give the same views).
  PackedView key_view;
  PackedView value_view;
  /// kSinks / kResidual: f32 rows, contiguous [end - begin, kv_heads, head_dim].
  KVView<const float> key_rows;
  KVView<const float> value_rows;
  int64_t tokens() const { return end - begin; }
  bool packed() const { return kind == Kind::kPacked; }
};

/// One layer's packed tokens as an engine sees them: a page table. Token i of the packed
/// region (position first_token + i) lives in page i / layout.page_tokens at row
/// i % layout.page_tokens. Every page but the last is full; the last holds
/// tokens - (n_pages - 1) * page_tokens tokens (a multiple of layout.granule).
struct PageTable {
  PageLayout layout;
  const std::byte* const* pages = nullptr;  ///< [n_pages] page pointers
  int64_t n_pages = 0;
  int64_t first_token = 0;  ///< position of the first packed token (after the sinks)
  int64_t tokens = 0;       ///< packed tokens in all pages

  /// Tokens held by page i.
  int64_t page_fill(int64_t i) const {
    return i + 1 < n_pages ? layout.page_tokens : tokens - (n_pages - 1) * layout.page_tokens;
  }
  PackedView key_view(int64_t i) const { return layout.key_view(pages[i], page_fill(i)); }
  PackedView value_view(int64_t i) const { return layout.value_view(pages[i], page_fill(i)); }
};

}  // namespace kvq

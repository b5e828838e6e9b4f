#pragma once
/// \file tensor.hpp
/// Strided views over KV tensors: logical shape [tokens, heads, head_dim] whatever the memory
/// layout. NHD = [tokens, heads, head_dim] contiguous; HND = [heads, tokens, head_dim].
/// Views never own memory. Strides are in elements, must be non-negative, and must not make
/// two logical elements share an address (checked at construction).
#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <type_traits>

#include "kvq/core/error.hpp"
#include "kvq/core/half.hpp"

namespace kvq {

/// Element types kvq reads and writes.
enum class DType : uint8_t { kF32, kF16, kBF16 };

inline const char* to_string(DType d) {
  switch (d) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
  }
  return "?";
}
inline int dtype_size(DType d) { return d == DType::kF32 ? 4 : 2; }

template <class T>
struct dtype_of;
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::kF32;
};
template <>
struct dtype_of<f16> {
  static constexpr DType value = DType::kF16;
};
template <>
struct dtype_of<bf16> {
  static constexpr DType value = DType::kBF16;
};

/// Memory layout of a KV tensor.
enum class Layout : uint8_t { kNHD, kHND };

/// Logical shape of one layer's K or V: [tokens, heads, head_dim].
struct Shape {
  int64_t tokens = 0;
  int64_t heads = 0;
  int64_t head_dim = 0;
  int64_t numel() const { return tokens * heads * head_dim; }
  bool operator==(const Shape& o) const {
    return tokens == o.tokens && heads == o.heads && head_dim == o.head_dim;
  }
  bool operator!=(const Shape& o) const { return !(*this == o); }
  std::string str() const {
    return detail::cat("[tokens=", tokens, ", heads=", heads, ", head_dim=", head_dim, "]");
  }
};

/// Element strides of a view (in elements, not bytes).
struct Strides {
  int64_t token = 0;
  int64_t head = 0;
  int64_t dim = 0;
};

inline Strides contiguous_strides(const Shape& s, Layout layout) {
  if (layout == Layout::kNHD) return {s.heads * s.head_dim, s.head_dim, 1};
  return {s.head_dim, s.tokens * s.head_dim, 1};
}

namespace detail {
/// Throws unless shape is non-negative, strides non-negative, and no two elements alias.
inline void check_view(const Shape& s, const Strides& st) {
  KVQ_REQUIRE(s.tokens >= 0 && s.heads >= 0 && s.head_dim >= 0, kShapeMismatch,
              "negative extent in shape ", s.str());
  KVQ_REQUIRE(st.token >= 0 && st.head >= 0 && st.dim >= 0, kShapeMismatch,
              "negative stride (token=", st.token, ", head=", st.head, ", dim=", st.dim,
              ") for shape ", s.str(), "; negative strides are not supported");
  if (s.numel() == 0) return;  // nothing is addressed
  // Non-overlap: sort the axes with extent > 1 by stride; each stride must exceed the span
  // of all smaller-stride axes.
  std::array<std::pair<int64_t, int64_t>, 3> ax = {
      {{st.token, s.tokens}, {st.head, s.heads}, {st.dim, s.head_dim}}};
  std::sort(ax.begin(), ax.end());
  int64_t span = 0;  // max offset reachable by the axes processed so far
  for (auto& [stride, ext] : ax) {
    if (ext <= 1) continue;
    KVQ_REQUIRE(stride > span, kShapeMismatch, "overlapping strides (token=", st.token,
                ", head=", st.head, ", dim=", st.dim, ") for shape ", s.str());
    span += stride * (ext - 1);
  }
}
}  // namespace detail

/// A strided view of a [tokens, heads, head_dim] tensor of T (float, f16 or bf16; const T for
/// read-only views).
template <class T>
class KVView {
 public:
  using value_type = std::remove_const_t<T>;
  static_assert(std::is_same_v<value_type, float> || std::is_same_v<value_type, f16> ||
                    std::is_same_v<value_type, bf16>,
                "KVView element type must be float, kvq::f16 or kvq::bf16");

  KVView() = default;
  KVView(T* data, Shape shape, Strides strides) : data_(data), shape_(shape), strides_(strides) {
    detail::check_view(shape_, strides_);
    KVQ_REQUIRE(data_ != nullptr || shape_.numel() == 0, kInvalidArgument,
                "null data pointer for non-empty view ", shape_.str());
  }
  /// Contiguous view in the given layout.
  KVView(T* data, Shape shape, Layout layout = Layout::kNHD)
      : KVView(data, shape, contiguous_strides(shape, layout)) {}

  static KVView nhd(T* data, int64_t tokens, int64_t heads, int64_t head_dim) {
    return KVView(data, Shape{tokens, heads, head_dim}, Layout::kNHD);
  }
  static KVView hnd(T* data, int64_t heads, int64_t tokens, int64_t head_dim) {
    return KVView(data, Shape{tokens, heads, head_dim}, Layout::kHND);
  }

  /// Implicit conversion to a read-only view.
  operator KVView<const value_type>() const {
    KVView<const value_type> v;
    v.unsafe_set(data_, shape_, strides_);
    return v;
  }

  T& at(int64_t t, int64_t h, int64_t d) const {
    return data_[t * strides_.token + h * strides_.head + d * strides_.dim];
  }
  /// Pointer to channel 0 of (t, h); the row is contiguous when dim_contiguous().
  T* row(int64_t t, int64_t h) const { return data_ + t * strides_.token + h * strides_.head; }

  T* data() const { return data_; }
  const Shape& shape() const { return shape_; }
  const Strides& strides() const { return strides_; }
  int64_t tokens() const { return shape_.tokens; }
  int64_t heads() const { return shape_.heads; }
  int64_t head_dim() const { return shape_.head_dim; }
  int64_t numel() const { return shape_.numel(); }
  bool empty() const { return numel() == 0; }
  bool dim_contiguous() const { return strides_.dim == 1 || shape_.head_dim <= 1; }
  /// True when the whole view is a dense NHD block (token rows of heads*head_dim).
  bool is_contiguous_nhd() const {
    return dim_contiguous() && (strides_.head == shape_.head_dim || shape_.heads <= 1) &&
           (strides_.token == shape_.heads * shape_.head_dim || shape_.tokens <= 1);
  }
  static constexpr DType dtype() { return dtype_of<value_type>::value; }

  /// Tokens [begin, begin+count) as a view.
  KVView slice_tokens(int64_t begin, int64_t count) const {
    KVQ_REQUIRE(begin >= 0 && count >= 0 && begin + count <= shape_.tokens, kShapeMismatch,
                "token slice [", begin, ", ", begin + count, ") out of range for ",
                shape_.str());
    KVView v;
    v.unsafe_set(data_ + begin * strides_.token, Shape{count, shape_.heads, shape_.head_dim},
                 strides_);
    return v;
  }

  // internal: set without checks (used for conversions of already-checked views)
  void unsafe_set(T* d, Shape s, Strides st) {
    data_ = d;
    shape_ = s;
    strides_ = st;
  }

 private:
  T* data_ = nullptr;
  Shape shape_{};
  Strides strides_{};
};

}  // namespace kvq

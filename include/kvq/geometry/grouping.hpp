#pragma once
/// \file grouping.hpp
/// Grouping axes: which elements of a [tokens, heads, head_dim] tensor share one scale.
///
/// Every axis is a box of gt tokens x gh heads x gc channels:
///   token   : 1 x 1 x G       (G consecutive channels of one token of one head; values)
///   channel : G x 1 x 1       (G consecutive tokens of one channel of one head; keys)
///   head    : G x 1 x head_dim (G tokens, default all, of one whole head)
///   tensor  : G x heads x head_dim (G tokens, default all, of the whole tensor)
/// G = 0 means "the whole extent along the axis". G larger than the extent is clamped to it
/// (a group never spans more than exists). Otherwise G must divide the extent: a partial
/// group is an error here; the streaming cache keeps incomplete token groups in its residual
/// window instead.
#include <cstdint>
#include <string>

#include "kvq/core/error.hpp"
#include "kvq/core/tensor.hpp"

namespace kvq {

/// Tag types for compile-time policies (CUTLASS style).
struct PerToken {};
struct PerChannel {};
struct PerHead {};
struct PerTensor {};

enum class Axis : uint8_t { kToken, kChannel, kHead, kTensor };

inline const char* to_string(Axis a) {
  switch (a) {
    case Axis::kToken: return "token";
    case Axis::kChannel: return "channel";
    case Axis::kHead: return "head";
    case Axis::kTensor: return "tensor";
  }
  return "?";
}

template <class Tag>
struct axis_of;
template <>
struct axis_of<PerToken> {
  static constexpr Axis value = Axis::kToken;
};
template <>
struct axis_of<PerChannel> {
  static constexpr Axis value = Axis::kChannel;
};
template <>
struct axis_of<PerHead> {
  static constexpr Axis value = Axis::kHead;
};
template <>
struct axis_of<PerTensor> {
  static constexpr Axis value = Axis::kTensor;
};

/// The resolved group box for a shape, and the number of boxes along each dimension.
struct GroupBox {
  int64_t gt = 1, gh = 1, gc = 1;  // box extent: tokens, heads, channels
  int64_t nt = 0, nh = 0, nc = 0;  // boxes along tokens, heads, channels
  int64_t count() const { return nt * nh * nc; }
  int64_t size() const { return gt * gh * gc; }
  /// Flat index of the box holding element (t, h, d).
  int64_t index(int64_t t, int64_t h, int64_t d) const {
    return ((t / gt) * nh + h / gh) * nc + d / gc;
  }
};

/// True when the group along tokens is fixed by G (channel, head, tensor axes need G tokens);
/// token-axis groups live inside one token.
inline bool groups_span_tokens(Axis a) { return a != Axis::kToken; }

namespace detail {
inline int64_t resolve_extent(int64_t group, int64_t extent, Axis axis, const Shape& s) {
  KVQ_REQUIRE(group >= 0, kInvalidArgument, "group size must be >= 0 (0 = whole extent), got ",
              group, " for axis ", to_string(axis));
  if (extent == 0) return 1;
  if (group == 0 || group >= extent) return extent;
  KVQ_REQUIRE(extent % group == 0, kShapeMismatch, "group size ", group, " along axis ",
              to_string(axis), " does not divide the extent ", extent, " of shape ", s.str());
  return group;
}
}  // namespace detail

/// Resolves the group box of `axis` with group size `group` for shape `s`; throws a
/// kShapeMismatch naming the shape when the group does not divide its extent.
inline GroupBox group_box(Axis axis, int64_t group, const Shape& s) {
  GroupBox b;
  switch (axis) {
    case Axis::kToken:
      b.gc = detail::resolve_extent(group, s.head_dim, axis, s);
      break;
    case Axis::kChannel:
      b.gt = detail::resolve_extent(group, s.tokens, axis, s);
      break;
    case Axis::kHead:
      b.gt = detail::resolve_extent(group, s.tokens, axis, s);
      b.gc = s.head_dim > 0 ? s.head_dim : 1;
      break;
    case Axis::kTensor:
      b.gt = detail::resolve_extent(group, s.tokens, axis, s);
      b.gh = s.heads > 0 ? s.heads : 1;
      b.gc = s.head_dim > 0 ? s.head_dim : 1;
      break;
  }
  b.nt = s.tokens / b.gt;
  b.nh = s.heads / b.gh;
  b.nc = s.head_dim / b.gc;
  return b;
}

}  // namespace kvq

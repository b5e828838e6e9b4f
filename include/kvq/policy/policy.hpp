#pragma once
/// \file policy.hpp
/// Compile-time KV-cache policies: KVPolicy<KeyQuantizer, ValueQuantizer, Options...>.
///
/// Engines that fix their cache format at build time write the policy as a type, so an
/// impossible combination (5-bit ints, fp8 with per-channel scales, QJL on values, ...) fails
/// to compile with a message that says why, instead of throwing at run time. The type is only a
/// front end: KVPolicy<...>::policy() builds the same runtime Policy the spec parser builds
/// (through the same QuantConfig builders), and the cache consumes that, so the compile-time
/// and runtime forms cannot drift apart. `KVPolicy<...>::spec()` is the canonical spec string;
/// the presets below are checked against their spec-string twins by the tests.
///
/// Quantizer tags (each has `static QuantConfig config()`):
///   Int<Bits, Axis = PerToken, Group = 32>    asymmetric int, Bits in {2, 3, 4, 8}
///   SInt<Bits, Axis = PerToken, Group = 32>   symmetric int
///   Fp8E4M3<Axis = PerHead, Group = 0>        scaled fp8 (Axis PerToken, PerHead or PerTensor)
///   Fp8E5M2<Axis = PerHead, Group = 0>
///   LloydMax<Bits, Qjl = false>               rotate + Lloyd-Max, Bits 1..4 (QJL: keys only)
///   Raw<T>                                    unquantized, T = float, kvq::f16 or kvq::bf16
///   Nuq<Bits, Axis = PerToken, Group = 32>    KVQuant non-uniform, Bits 2..4 (needs calibration)
///   Outliers<Q, N>                            Q (Int, SInt, Fp8*, Nuq) + N exact outliers/vector
///   OutliersPercent<Q, Num, Den = 1>          Q + ceil(Num/Den % x head_dim) outliers/vector
/// Options (layer filters and windows), each at most once except LayerOverride:
///   Residual<R>, Sinks<S>, SkipLayers<First, Last = First>, SkipAs<Quantizer>,
///   LayerOverride<Layer, KeyQuantizer, ValueQuantizer>
#include <string>
#include <type_traits>

#include "kvq/core/half.hpp"
#include "kvq/geometry/grouping.hpp"
#include "kvq/policy/spec.hpp"
#include "kvq/quant/qtensor.hpp"

namespace kvq {

namespace detail {
template <class T>
struct is_axis_tag : std::false_type {};
template <>
struct is_axis_tag<PerToken> : std::true_type {};
template <>
struct is_axis_tag<PerChannel> : std::true_type {};
template <>
struct is_axis_tag<PerHead> : std::true_type {};
template <>
struct is_axis_tag<PerTensor> : std::true_type {};

/// axis_of<Tag> for valid tags; kToken otherwise (the static_assert has already fired then, and
/// this keeps the compiler from piling a second, unreadable error on top of it).
template <class Tag>
constexpr Axis axis_value() {
  if constexpr (is_axis_tag<Tag>::value) {
    return axis_of<Tag>::value;
  } else {
    return Axis::kToken;
  }
}

template <class T, class = void>
struct is_quantizer : std::false_type {};
template <class T>
struct is_quantizer<T, std::void_t<decltype(T::kIsQuantizer)>>
    : std::bool_constant<T::kIsQuantizer> {};

template <class T, class = void>
struct uses_qjl : std::false_type {};
template <class T>
struct uses_qjl<T, std::void_t<decltype(T::kQjl)>> : std::bool_constant<T::kQjl> {};

/// Option kinds, so KVPolicy can reject an option given twice.
enum class OptionKind { kResidual, kSinks, kSkipLayers, kSkipAs, kLayerOverride };

template <class T, class = void>
struct is_policy_option : std::false_type {};
template <class T>
struct is_policy_option<T, std::void_t<decltype(T::kOptionKind)>> : std::true_type {};

/// Kind of option T as an int, -1 for a type that is not an option (so that a wrong option
/// reports only KVPolicy's static_assert, not a cascade of member-lookup errors).
template <class T>
constexpr int option_kind_id() {
  if constexpr (is_policy_option<T>::value) {
    return static_cast<int>(T::kOptionKind);
  } else {
    return -1;
  }
}

template <OptionKind K, class... Options>
constexpr int count_option() {
  return (0 + ... + (option_kind_id<Options>() == static_cast<int>(K) ? 1 : 0));
}

template <class... Options>
constexpr bool options_unique() {
  return count_option<OptionKind::kResidual, Options...>() <= 1 &&
         count_option<OptionKind::kSinks, Options...>() <= 1 &&
         count_option<OptionKind::kSkipLayers, Options...>() <= 1 &&
         count_option<OptionKind::kSkipAs, Options...>() <= 1;
}

template <class Option>
constexpr int override_layer() {
  if constexpr (option_kind_id<Option>() == static_cast<int>(OptionKind::kLayerOverride)) {
    return Option::kLayer;
  } else {
    return -1;
  }
}

template <class Option>
void apply_option(Policy& p) {
  if constexpr (is_policy_option<Option>::value) Option::apply(p);
}

template <class... Options>
constexpr bool override_layers_unique() {
  constexpr int layers[] = {-1, override_layer<Options>()...};
  for (std::size_t i = 0; i < sizeof(layers) / sizeof(layers[0]); ++i)
    for (std::size_t j = i + 1; j < sizeof(layers) / sizeof(layers[0]); ++j)
      if (layers[i] >= 0 && layers[i] == layers[j]) return false;
  return true;
}
}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Quantizer tags

/// Asymmetric (min + scale) integer: `Bits` bits, one scale and zero point per group of
/// `Group` elements along `AxisTag` (channels for PerToken, tokens otherwise).
template <int Bits, class AxisTag = PerToken, int Group = static_cast<int>(kDefaultIntGroup)>
struct Int {
  static_assert(Bits == 2 || Bits == 3 || Bits == 4 || Bits == 8,
                "Int<Bits, ...>: integer formats support 2, 3, 4 or 8 bits");
  static_assert(detail::is_axis_tag<AxisTag>::value,
                "Int<Bits, Axis, ...>: Axis must be PerToken, PerChannel, PerHead or PerTensor");
  static_assert(Group >= 1,
                "Int<Bits, Axis, Group>: Group must be >= 1 (an int policy has no "
                "'whole extent' group; give the extent, e.g. 128)");
  static constexpr bool kIsQuantizer = true;
  static QuantConfig config() {
    return int_config(Bits, detail::axis_value<AxisTag>(), Group, false);
  }
};

/// Symmetric (absmax scale, no zero point) integer, llama.cpp q4_0 / q8_0 style.
template <int Bits, class AxisTag = PerToken, int Group = static_cast<int>(kDefaultIntGroup)>
struct SInt {
  static_assert(Bits == 2 || Bits == 3 || Bits == 4 || Bits == 8,
                "SInt<Bits, ...>: integer formats support 2, 3, 4 or 8 bits");
  static_assert(detail::is_axis_tag<AxisTag>::value,
                "SInt<Bits, Axis, ...>: Axis must be PerToken, PerChannel, PerHead or PerTensor");
  static_assert(Group >= 1,
                "SInt<Bits, Axis, Group>: Group must be >= 1 (an int policy has no "
                "'whole extent' group; give the extent, e.g. 128)");
  static constexpr bool kIsQuantizer = true;
  static QuantConfig config() {
    return int_config(Bits, detail::axis_value<AxisTag>(), Group, true);
  }
};

namespace detail {
template <Format F, class AxisTag, int Group>
struct Fp8Tag {
  static_assert(is_axis_tag<AxisTag>::value,
                "Fp8E4M3/Fp8E5M2<Axis>: Axis must be PerToken, PerHead or PerTensor");
  static_assert(!std::is_same_v<AxisTag, PerChannel>,
                "Fp8E4M3/Fp8E5M2<PerChannel>: fp8 scales are per token, per head or per tensor; "
                "per-channel fp8 scales are not supported");
  static_assert(Group >= 0,
                "Fp8E4M3/Fp8E5M2<Axis, Group>: Group must be >= 0 (0 = all tokens "
                "of a block for PerHead/PerTensor, the whole head for PerToken)");
  static constexpr bool kIsQuantizer = true;
  static QuantConfig config() { return fp8_config(F, axis_value<AxisTag>(), Group); }
};
}  // namespace detail

/// Scaled fp8 e4m3fn, one scale per group box of `AxisTag`.
template <class AxisTag = PerHead, int Group = 0>
struct Fp8E4M3 : detail::Fp8Tag<Format::kE4M3, AxisTag, Group> {};
/// Scaled fp8 e5m2, one scale per group box of `AxisTag`.
template <class AxisTag = PerHead, int Group = 0>
struct Fp8E5M2 : detail::Fp8Tag<Format::kE5M2, AxisTag, Group> {};

/// Rotate, store the vector norm, round every coordinate with a `Bits`-bit Lloyd-Max codebook;
/// `Qjl` adds the 1-bit QJL residual (keys only).
template <int Bits, bool Qjl = false>
struct LloydMax {
  static_assert(Bits >= 1 && Bits <= 4, "LloydMax<Bits>: Lloyd-Max codebooks have 1 to 4 bits");
  static constexpr bool kIsQuantizer = true;
  static constexpr bool kQjl = Qjl;
  static QuantConfig config() { return lm_config(Bits, Qjl); }
};

/// Unquantized storage as float, kvq::f16 or kvq::bf16.
template <class T>
struct Raw {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, f16> || std::is_same_v<T, bf16>,
                "Raw<T>: T must be float, kvq::f16 or kvq::bf16");
  static constexpr bool kIsQuantizer = true;
  static QuantConfig config() {
    return raw_config(std::is_same_v<T, float>
                          ? Format::kF32
                          : (std::is_same_v<T, f16> ? Format::kF16 : Format::kBF16));
  }
};

/// KVQuant's non-uniform datatype: min/max normalization per group of `Group` elements along
/// `AxisTag`, then a learned codebook of 2^Bits levels per layer (kvq::calibrate fills it;
/// quantizing before calibration is an error naming the layer).
template <int Bits, class AxisTag = PerToken, int Group = static_cast<int>(kDefaultIntGroup)>
struct Nuq {
  static_assert(Bits >= 2 && Bits <= 4, "Nuq<Bits, ...>: nuq formats have 2, 3 or 4 bits");
  static_assert(detail::is_axis_tag<AxisTag>::value,
                "Nuq<Bits, Axis, ...>: Axis must be PerToken, PerChannel, PerHead or PerTensor");
  static_assert(Group >= 1, "Nuq<Bits, Axis, Group>: Group must be >= 1");
  static constexpr bool kIsQuantizer = true;
  static QuantConfig config() { return nuq_config(Bits, detail::axis_value<AxisTag>(), Group); }
};

namespace detail {
/// Quantizers whose dense part can take outliers: Int, SInt, Fp8E4M3, Fp8E5M2, Nuq.
template <class Q>
struct accepts_outliers : std::false_type {};
template <int B, class A, int G>
struct accepts_outliers<Int<B, A, G>> : std::true_type {};
template <int B, class A, int G>
struct accepts_outliers<SInt<B, A, G>> : std::true_type {};
template <class A, int G>
struct accepts_outliers<Fp8E4M3<A, G>> : std::true_type {};
template <class A, int G>
struct accepts_outliers<Fp8E5M2<A, G>> : std::true_type {};
template <int B, class A, int G>
struct accepts_outliers<Nuq<B, A, G>> : std::true_type {};
}  // namespace detail

/// Dense-and-sparse: `Q` plus N entries per (token, head) vector kept exactly (spec /out<N>).
template <class Q, int N>
struct Outliers {
  static_assert(detail::accepts_outliers<Q>::value,
                "Outliers<Q, N>: Q must be Int, SInt, Fp8E4M3, Fp8E5M2 or Nuq (outliers "
                "compose with grouped formats, not Raw or LloydMax)");
  static_assert(N >= 1, "Outliers<Q, N>: N must be >= 1");
  static constexpr bool kIsQuantizer = true;
  static QuantConfig config() {
    QuantConfig c = Q::config();
    c.outliers = N;
    return c;
  }
};

/// Dense-and-sparse: `Q` plus ceil(Num / Den % x head_dim) outliers per vector (spec
/// /out<P>%, e.g. OutliersPercent<Int<3, PerChannel>, 1> = int3/channel/g32/out1%).
template <class Q, int Num, int Den = 1>
struct OutliersPercent {
  static_assert(detail::accepts_outliers<Q>::value,
                "OutliersPercent<Q, ...>: Q must be Int, SInt, Fp8E4M3, Fp8E5M2 or Nuq");
  static_assert(Den >= 1 && Num >= 1 && Num <= 100 * Den,
                "OutliersPercent<Q, Num, Den>: the percentage Num/Den must be in (0, 100]");
  static constexpr bool kIsQuantizer = true;
  static QuantConfig config() {
    QuantConfig c = Q::config();
    c.outlier_pct = static_cast<float>(static_cast<double>(Num) / Den);
    return c;
  }
};

// ---------------------------------------------------------------------------------------------
// Options

/// Keep the newest R tokens in f32 (KIVI's residual window).
template <int R>
struct Residual {
  static_assert(R >= 0, "Residual<R>: R must be >= 0");
  static constexpr detail::OptionKind kOptionKind = detail::OptionKind::kResidual;
  static void apply(Policy& p) { p.residual = R; }
};

/// Keep the first S tokens in f32 forever (attention sinks).
template <int S>
struct Sinks {
  static_assert(S >= 0, "Sinks<S>: S must be >= 0");
  static constexpr detail::OptionKind kOptionKind = detail::OptionKind::kSinks;
  static void apply(Policy& p) { p.sinks = S; }
};

/// Store the first `First` and the last `Last` layers under the skip config (f32 unless
/// SkipAs<> says otherwise).
template <int First, int Last = First>
struct SkipLayers {
  static_assert(First >= 0 && Last >= 0, "SkipLayers<First, Last>: counts must be >= 0");
  static constexpr detail::OptionKind kOptionKind = detail::OptionKind::kSkipLayers;
  static void apply(Policy& p) {
    p.skip_first = First;
    p.skip_last = Last;
  }
};

/// What skipped layers store, keys and values alike (default Raw<float>).
template <class Q>
struct SkipAs {
  static_assert(detail::is_quantizer<Q>::value,
                "SkipAs<Q>: Q must be a quantizer tag (Int, SInt, Fp8E4M3, Fp8E5M2, LloydMax, "
                "Raw)");
  static_assert(!detail::uses_qjl<Q>::value,
                "SkipAs<Q>: the skip config stores values too, and QJL is for keys only");
  static constexpr detail::OptionKind kOptionKind = detail::OptionKind::kSkipAs;
  static void apply(Policy& p) { p.skip_config = Q::config(); }
};

/// Layer `Layer` stores keys with KeyQ and values with ValueQ (wins over SkipLayers).
template <int Layer, class KeyQ, class ValueQ>
struct LayerOverride {
  static_assert(Layer >= 0, "LayerOverride<Layer, ...>: Layer must be >= 0");
  static_assert(detail::is_quantizer<KeyQ>::value && detail::is_quantizer<ValueQ>::value,
                "LayerOverride<Layer, KeyQ, ValueQ>: KeyQ and ValueQ must be quantizer tags");
  static_assert(!detail::uses_qjl<ValueQ>::value,
                "LayerOverride<Layer, KeyQ, ValueQ>: QJL is for keys only");
  static constexpr detail::OptionKind kOptionKind = detail::OptionKind::kLayerOverride;
  static constexpr int kLayer = Layer;
  static void apply(Policy& p) { p.overrides[Layer] = {KeyQ::config(), ValueQ::config()}; }
};

// ---------------------------------------------------------------------------------------------

/// Compile-time composition of a key quantizer, a value quantizer and options.
template <class KeyQ, class ValueQ, class... Options>
struct KVPolicy {
  static_assert(detail::is_quantizer<KeyQ>::value,
                "KVPolicy<KeyQ, ...>: KeyQ must be a quantizer tag (Int, SInt, Fp8E4M3, Fp8E5M2, "
                "LloydMax, Raw)");
  static_assert(detail::is_quantizer<ValueQ>::value,
                "KVPolicy<KeyQ, ValueQ, ...>: ValueQ must be a quantizer tag (Int, SInt, "
                "Fp8E4M3, Fp8E5M2, LloydMax, Raw)");
  static_assert(!detail::uses_qjl<ValueQ>::value,
                "KVPolicy<KeyQ, ValueQ>: QJL is an inner-product estimator for keys; values "
                "cannot use it");
  static_assert((detail::is_policy_option<Options>::value && ...),
                "KVPolicy options must be Residual<R>, Sinks<S>, SkipLayers<N, M>, SkipAs<Q> or "
                "LayerOverride<L, K, V>");
  static_assert(detail::options_unique<Options...>(),
                "KVPolicy: Residual, Sinks, SkipLayers and SkipAs may each be given once");
  static_assert(detail::override_layers_unique<Options...>(),
                "KVPolicy: two LayerOverride options name the same layer");

  /// The runtime policy this type describes (what KVCache consumes).
  static Policy policy() {
    Policy p;
    p.key = KeyQ::config();
    p.value = ValueQ::config();
    (detail::apply_option<Options>(p), ...);
    return p;
  }
  /// Canonical spec string (Policy::spec()).
  static std::string spec() { return policy().spec(); }
};

/// The spec presets as types; each equals parse_policy(<its name>) (tested).
namespace presets {
using F32 = KVPolicy<Raw<float>, Raw<float>>;
using F16 = KVPolicy<Raw<f16>, Raw<f16>>;
using Fp8 = KVPolicy<Fp8E4M3<PerHead>, Fp8E4M3<PerHead>>;
using K8V4 = KVPolicy<Fp8E4M3<PerHead>, Int<4, PerToken, 32>>;
using Kivi2 = KVPolicy<Int<2, PerChannel, 32>, Int<2, PerToken, 32>, Residual<32>>;
using Kivi4 = KVPolicy<Int<4, PerChannel, 32>, Int<4, PerToken, 32>, Residual<32>>;
using Kivi2Flip = KVPolicy<Int<2, PerToken, 32>, Int<2, PerChannel, 32>, Residual<32>>;
using Kivi4Flip = KVPolicy<Int<4, PerToken, 32>, Int<4, PerChannel, 32>, Residual<32>>;
using Turbo3 = KVPolicy<LloydMax<3>, LloydMax<3>>;
using Turbo4 = KVPolicy<LloydMax<4>, LloydMax<4>>;
}  // namespace presets

}  // namespace kvq

#pragma once
/// \file outlier_quant.hpp
/// Dense-and-sparse quantization (KVQuant): k entries per (token, head) vector are kept exactly
/// as fp16 value + channel position, the rest is quantized by the dense format (int, fp8 or
/// nuq) with ranges computed without them (geometry/outliers.hpp says which entries and what
/// the dense part holds in their place). k is fixed per vector (config.outliers, or
/// ceil(outlier_pct / 100 * head_dim)), so a block's size depends only on its shape: no count
/// fields, no CSR row pointers.
///
/// Byte layout (quant/packed_view.hpp): the dense format's regions unchanged, then
///   outlier_values  [tokens, heads, k] fp16 (2 bytes each, round to nearest even)
///   outlier_pos     [tokens, heads, k] channel, 1 byte (2 bytes LE when head_dim > 256),
///                   ascending within a vector
/// e.g. head_dim 128, k = 2 (/out1%): 6 bytes per vector = 0.375 bits per value on top of the
/// dense format. Dequantization decodes the dense part, then writes the k exact values.
///
/// An outlier whose magnitude fp16 cannot hold (|x| >= 65520) is rejected (kOutOfRange), as a
/// raw f16 tensor rejects it. reference/outlier_ref.hpp is the scalar oracle.
///
/// Speed. Token-axis groups lie inside one vector, so the token axis runs one fused pass per
/// vector (quantize_outlier_rows): load, statistics, top-k, dense range, encode and pack while
/// the row is in L1 (AVX2: geometry/outliers.hpp's isolate_row_avx2, 8-lane int encode with
/// the codes packed 8 at a time; portable scalar otherwise). Its lean path (int and nuq, group
/// 32, 64 or 128, k <= 4: the common KVQuant settings) isolates four vectors at a time with
/// isolate_rows_lean (head_dim 64, 128, 256: the group count fixed at compile time; float statistics with a proven error bound, no dense row written) and
/// encodes straight from the input, every entry clamped to its group's dense range in code
/// space (lean_codes), which is what encoding the dense row gives, bit for bit; for head_dim
/// 64, 128 and 256 one lean_quad call does every step of four vectors with k, group size and
/// head_dim fixed at compile time (no per-vector dispatch). Token-spanning axes (channel, head,
/// tensor with a token group) are isolated and quantized one slab of whole token blocks at a
/// time (about 128 KiB of input), so the dense quantizer reads the slab from cache. Both give
/// the bytes of the whole-tensor path; on any error they rerun it, so errors (which element,
/// which kind first) are the whole-tensor path's too.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvq/config.hpp"
#include "kvq/core/half.hpp"
#include "kvq/core/rows.hpp"
#include "kvq/core/tensor.hpp"
#include "kvq/geometry/outliers.hpp"
#include "kvq/simd/prefetch.hpp"
#include "kvq/simd/uniform_cpu.hpp"
#include "kvq/quant/grouped_quant.hpp"
#include "kvq/quant/nuq_quant.hpp"
#include "kvq/quant/packed_view.hpp"
#include "kvq/quant/qtensor.hpp"

namespace kvq {

namespace detail {

/// The config of the dense part (no outliers).
inline QuantConfig dense_config(QuantConfig c) {
  c.outliers = 0;
  c.outlier_pct = 0.f;
  return c;
}

/// Stores k outliers of one vector: values as fp16, positions 1 or 2 bytes.
inline void store_outliers(const float* vals, const int32_t* sel, int64_t k, int pos_bytes,
                           uint8_t* vdst, uint8_t* pdst) {
  for (int64_t j = 0; j < k; ++j) {
    const uint16_t hb = float_to_half_bits_fast(vals[j]);
    std::memcpy(vdst + 2 * j, &hb, 2);
    if (pos_bytes == 1) {
      pdst[j] = static_cast<uint8_t>(sel[j]);
    } else {
      pdst[2 * j] = static_cast<uint8_t>(sel[j] & 0xff);
      pdst[2 * j + 1] = static_cast<uint8_t>(sel[j] >> 8);
    }
  }
}

[[noreturn]] inline void throw_outlier_range(float val, int32_t channel, int64_t vector, int64_t H) {
  fail(ErrorKind::kOutOfRange, "quantize: outlier (token=", vector / H, ", head=", vector % H,
       ", channel=", channel, ") is ", val,
       ", which fp16 cannot store (it would become inf); outliers are kept as fp16");
}

/// Throws kOutOfRange naming the first outlier fp16 cannot store.
inline void check_outlier_range(const float* vals, const int32_t* sel, int64_t vectors, int64_t k,
                                int64_t H) {
  for (int64_t i = 0; i < vectors * k; ++i)
    if (!(std::fabs(vals[i]) < 65520.f)) throw_outlier_range(vals[i], sel[i], i / k, H);
}

/// Bits of one code of a dense format (fp8: one byte).
inline int dense_code_bits(const QuantConfig& c) {
  return c.format == Format::kE4M3 || c.format == Format::kE5M2 ? 8 : c.bits;
}

#if KVQ_HAS_AVX2
/// The uniform codes of x[0..8) (32-bit lanes): RNE(clamp(fma(x - z, inv, off), 0, qmax)), the
/// bits of uniform_encode.
__attribute__((always_inline)) inline __m256i int_codes8(const float* x, __m256 z, __m256 inv, __m256 off, __m256 qmax) {
  __m256 v = _mm256_fmadd_ps(_mm256_sub_ps(_mm256_loadu_ps(x), z), inv, off);
  v = _mm256_min_ps(_mm256_max_ps(v, _mm256_setzero_ps()), qmax);
  return _mm256_cvtps_epi32(v);  // round to nearest even (default MXCSR)
}

#if KVQ_HAS_F16C
/// The parameters of n <= 8 groups at once (lane b = group b) of an int or nuq codec, bit for
/// bit its params() (kernels::group_params8): zero, scale and inv into z, s, inv (8 floats
/// each are written; lanes >= n are junk). False when a lane's zero or scale is not finite in
/// the metadata type (the scalar params() then throws, naming the group).
template <class Codec>
__attribute__((always_inline)) inline bool dense_params8(const Codec& c, __m256 L, __m256 Hv, int n,
                                                         __m256& Z, __m256& S, __m256& I) {
  bool symmetric = false;
  float qdiv = 1.f;  // nuq: u = (x - zero) / scale, scale = max - min
  if constexpr (std::is_same_v<Codec, IntCodec>) {
    symmetric = c.symmetric;
    qdiv = static_cast<float>((1 << c.bits) - 1);
  }
  return kernels::group_params8(L, Hv, n, symmetric, c.bits, qdiv, c.meta == MetaDType::kF16, Z, S, I);
}

/// dense_params8 from lo[0..n), hi[0..n) into z, s, inv.
template <class Codec>
inline bool dense_params8(const Codec& c, const float* lo, const float* hi, int n, float* z,
                          float* s, float* inv) {
  const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256 Z, S, I;
  if (!dense_params8(c, _mm256_maskload_ps(lo, lanes), _mm256_maskload_ps(hi, lanes), n, Z, S, I))
    return false;
  _mm256_storeu_ps(z, Z);  // all 8 lanes (the caller's arrays hold 8)
  _mm256_storeu_ps(s, S);
  _mm256_storeu_ps(inv, I);
  return true;
}
#endif
#endif

#if KVQ_HAS_AVX2
/// The lean fused path's codes of one row r[0..D) (quantize_outlier_rows): group size 8 NV, a
/// multiple of 32, so each 32-code chunk lies in one group and its broadcasts are hoisted; B-bit
/// codes packed 32 at a time (write_row_codes' order). The dense row is r clamped to each
/// group's [lo, hi]; the encoding f (int: fma(x - z, inv, off); nuq: (x - z) * inv) rounds
/// monotonically, so f(clamp(x, lo, hi)) = clamp(f(x), min(f(lo), f(hi)), max(f(lo), f(hi)))
/// exactly. Int: the codes' clamp to [0, qmax] and this one merge into one clamp to
/// [ca_g, cb_g] (lean_bounds8); nuq: u is clamped to [ca_g, cb_g] before the thresholds.
template <int NV, int B, class Code8>
__attribute__((always_inline)) inline void lean_row_codes(const float* r, int64_t D, uint8_t* out,
                                                          Code8&& code8) {
  static_assert(NV % 4 == 0, "lean_row_codes: the group is a multiple of 32 channels");
  constexpr int64_t GC = 8 * NV;
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < D / GC; ++b)
    for (int c = 0; c < NV / 4; ++c, out += 4 * B) {
      const float* x = r + b * GC + 32 * c;
      const __m256i p = _mm256_packs_epi32(code8(x, b), code8(x + 8, b));
      const __m256i q = _mm256_packs_epi32(code8(x + 16, b), code8(x + 24, b));
      pack32_store<B>(_mm256_permutevar8x32_epi32(_mm256_packus_epi16(p, q), order), out);
    }
}

/// The code bounds of the lean path for 8 groups (lane b = group b) whose dense ranges are
/// [L, Hv] and parameters Z, I. Int: ca = clamp(min(f(lo), f(hi)), 0, qmax), cb =
/// clamp(max(f(lo), f(hi)), 0, qmax), f(x) = fma(x - z, inv, off), so min(max(f(x), ca), cb) =
/// clamp(f(clamp(x, lo, hi)), 0, qmax), int_codes8 of the dense value. Nuq: [min(u(lo),
/// u(hi)), max(u(lo), u(hi))], u(x) = (x - z) * inv.
template <class Codec>
__attribute__((always_inline)) inline void lean_bounds8(const Codec& c, __m256 L, __m256 Hv, __m256 Z,
                                                        __m256 I, __m256& CA, __m256& CB) {
  if constexpr (std::is_same_v<Codec, IntCodec>) {
    const __m256 off = _mm256_set1_ps(c.lv.off), qmax = _mm256_set1_ps(c.lv.qmax);
    const __m256 zero = _mm256_setzero_ps();
    const __m256 fl = _mm256_fmadd_ps(_mm256_sub_ps(L, Z), I, off);
    const __m256 fh = _mm256_fmadd_ps(_mm256_sub_ps(Hv, Z), I, off);
    CA = _mm256_min_ps(_mm256_max_ps(_mm256_min_ps(fl, fh), zero), qmax);
    CB = _mm256_min_ps(_mm256_max_ps(_mm256_max_ps(fl, fh), zero), qmax);
  } else {
    (void)c;
    const __m256 ul = _mm256_mul_ps(_mm256_sub_ps(L, Z), I);
    const __m256 uh = _mm256_mul_ps(_mm256_sub_ps(Hv, Z), I);
    CA = _mm256_min_ps(ul, uh);
    CB = _mm256_max_ps(ul, uh);
  }
}

/// lean_bounds8 over nc groups (arrays padded to a multiple of 8).
template <class Codec>
inline void lean_bounds(const Codec& c, int64_t nc, const float* lo, const float* hi,
                        const float* z, const float* inv, float* ca, float* cb) {
  for (int64_t b = 0; b < nc; b += 8) {
    __m256 CA, CB;
    lean_bounds8(c, _mm256_loadu_ps(lo + b), _mm256_loadu_ps(hi + b), _mm256_loadu_ps(z + b),
                 _mm256_loadu_ps(inv + b), CA, CB);
    _mm256_storeu_ps(ca + b, CA);
    _mm256_storeu_ps(cb + b, CB);
  }
}

/// The lean path's codes of one row (lean_row_codes) for group size 8 NV and B-bit codes of
/// `codec`, the per-group parameters z, inv and code bounds ca, cb.
template <int NV, int B, class Codec>
__attribute__((always_inline)) inline void lean_codes_nb(const Codec& codec, const float* r, int64_t D,
                                                         const float* z, const float* inv,
                                                         const float* ca, const float* cb,
                                                         uint8_t* out) {
  if constexpr (std::is_same_v<Codec, IntCodec>) {
    const __m256 off = _mm256_set1_ps(codec.lv.off);
    lean_row_codes<NV, B>(r, D, out, [&](const float* x, int64_t b) __attribute__((always_inline)) {
      const __m256 v = _mm256_fmadd_ps(_mm256_sub_ps(_mm256_loadu_ps(x), _mm256_broadcast_ss(z + b)),
                                       _mm256_broadcast_ss(inv + b), off);
      return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, _mm256_broadcast_ss(ca + b)),
                                              _mm256_broadcast_ss(cb + b)));
    });
  } else {
    const NuqSearch8<B> search(codec.thr);
    lean_row_codes<NV, B>(r, D, out, [&](const float* x, int64_t b) __attribute__((always_inline)) {
      const __m256 u = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x), _mm256_broadcast_ss(z + b)),
                                     _mm256_broadcast_ss(inv + b));
      return search(_mm256_min_ps(_mm256_max_ps(u, _mm256_broadcast_ss(ca + b)), _mm256_broadcast_ss(cb + b)));
    });
  }
}

/// Calls f(std::integral_constant<int, B>) for the code width `bits` of Codec (int 2, 3, 4, 8;
/// nuq 2, 3, 4).
template <class Codec, class F>
__attribute__((always_inline)) inline void with_code_bits(int bits, F&& f) {
  switch (bits) {
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    default:
      if constexpr (std::is_same_v<Codec, IntCodec>) return f(std::integral_constant<int, 8>{});
  }
}

/// The lean path's codes of one row for a group size gc in {32, 64, 128} (lean_row_codes).
template <class Codec>
inline void lean_codes(const Codec& codec, int bits, int64_t gc, const float* r, int64_t D,
                       const float* z, const float* inv, const float* ca, const float* cb,
                       uint8_t* out) {
  auto by_bits = [&](auto nv) __attribute__((always_inline)) {
    constexpr int NV = decltype(nv)::value;
    with_code_bits<Codec>(bits, [&](auto bb) __attribute__((always_inline)) {
      lean_codes_nb<NV, decltype(bb)::value>(codec, r, D, z, inv, ca, cb, out);
    });
  };
  switch (gc) {
    case 32: return by_bits(std::integral_constant<int, 4>{});
    case 64: return by_bits(std::integral_constant<int, 8>{});
    default: return by_bits(std::integral_constant<int, 16>{});
  }
}

#if KVQ_HAS_F16C
/// The lean path's codes of four consecutive vectors (row i's codes at out + i D bits / 8),
/// head_dim NC * 8 NV fixed at compile time; per-group arrays of 8 floats per row.
template <class Codec, int NV, int NC>
__attribute__((noinline)) inline void lean_codes4(const Codec& codec, int bits, const float* const* rows,
                                                  const float (*z)[8], const float (*inv)[8],
                                                  const float (*ca)[8], const float (*cb)[8],
                                                  uint8_t* out) {
  constexpr int64_t D = int64_t{NC} * 8 * NV;
  with_code_bits<Codec>(bits, [&](auto bb) __attribute__((always_inline)) {
    constexpr int B = decltype(bb)::value;
    for (int i = 0; i < kLeanRows; ++i)
      lean_codes_nb<NV, B>(codec, rows[i], D, z[i], inv[i], ca[i], cb[i], out + i * (D * B / 8));
  });
}

/// What lean_quad writes to, besides its rows.
struct LeanQuadOut {
  uint8_t* codes;       // vector 0's codes
  uint8_t* scales;      // vector 0's first group
  uint8_t* zeros;       // (null without zero points)
  uint8_t* ovals;       // vector 0's outlier values
  uint8_t* opos;        // vector 0's outlier positions (1 byte each)
};

/// Four consecutive vectors of the lean path in one call, head_dim D = NC * 8 NV in {64, 128,
/// 256} and k = K fixed at compile time: isolate_rows_lean, the outlier range check, group
/// parameters and metadata, the code bounds, lean_codes4 and the outliers (values as fp16,
/// positions one byte: D <= 256), with no per-vector dispatch. The bytes of
/// quantize_outlier_rows' per-vector steps. False when a row is not finite, an outlier is out of
/// fp16 range or a group's parameters are not finite in the metadata type (what was written is
/// then rewritten by the caller's per-vector steps, which throw the error).
template <class Codec, int NV, int K, int NC>
inline bool lean_quad(const Codec& codec, int bits, const float* const* rows, const LeanQuadOut& o,
                      OutlierScratch& sc) {
  constexpr int R = kLeanRows;
  constexpr int64_t D = int64_t{NC} * 8 * NV;
  static_assert(D <= 256 && NC <= 8, "lean_quad: head_dim <= 256 (one-byte positions)");
  alignas(32) float lo[R][8], hi[R][8];
  int32_t sel[R * K];
  float vals[R * K];
  bool ok[R];
  isolate_rows_lean<NV, K, R, NC>(rows, D, sel, vals, &lo[0][0], &hi[0][0], 8, sc, ok);
  if (!(ok[0] && ok[1] && ok[2] && ok[3])) return false;
  // The outliers (R K consecutive values and positions), each |value| < 65520 (fp16's range;
  // false for NaN). One value at a time: isolate_rows_lean stored them one at a time, and a
  // vector load of several would wait for those stores to complete.
  for (int j = 0; j < R * K; ++j)
    if (!(std::fabs(vals[j]) < 65520.f)) return false;
  store_outliers(vals, sel, R * K, 1, o.ovals, o.opos);
  const bool f16 = codec.meta == MetaDType::kF16;
  const int64_t mb = f16 ? 2 : 4;
  alignas(32) float z[R][8], inv[R][8], ca[R][8], cb[R][8];
  for (int i = 0; i < R; ++i) {
    // all 8 lanes (isolate_rows_lean stores them: lanes >= NC are junk, which group_params8
    // ignores and lean_codes4 never reads)
    const __m256 L = _mm256_load_ps(lo[i]), Hv = _mm256_load_ps(hi[i]);
    __m256 Z, S, I, CA, CB;
    if (!dense_params8(codec, L, Hv, NC, Z, S, I)) return false;
    kernels::store_meta8(S, NC, f16, o.scales + i * NC * mb);
    if (codec.has_zero()) kernels::store_meta8(Z, NC, f16, o.zeros + i * NC * mb);
    lean_bounds8(codec, L, Hv, Z, I, CA, CB);
    _mm256_store_ps(z[i], Z);
    _mm256_store_ps(inv[i], I);
    _mm256_store_ps(ca[i], CA);
    _mm256_store_ps(cb[i], CB);
  }
  lean_codes4<Codec, NV, NC>(codec, bits, rows, z, inv, ca, cb, o.codes);
  return true;
}

/// The lean_quad instance for (gc, k, D) (D in {64, 128, 256}), or null.
template <class Codec>
using LeanQuadFn = bool (*)(const Codec&, int, const float* const*, const LeanQuadOut&, OutlierScratch&);
template <class Codec>
inline LeanQuadFn<Codec> lean_quad_for(int64_t D, int64_t gc, int64_t k) {
  LeanQuadFn<Codec> fn = nullptr;
  with_lean_instance(D, gc, k, [&](auto nv, auto kk) {
    constexpr int NV = decltype(nv)::value, K = decltype(kk)::value;
    with_fixed_groups<NV>(D, [&](auto ncc) { fn = &lean_quad<Codec, NV, K, decltype(ncc)::value>; });
  });
  return fn;
}
#endif

#endif

/// The fused token-axis path (see the file comment): every vector of x is isolated
/// (isolate_row), checked, encoded with `codec` (bits-wide codes) and written to q. Four vectors
/// (kLeanRows) are in flight at a time (isolation of all, then their parameters, then their
/// encoding) so their latency chains (sums, sqrt, divisions, the threshold) overlap. Errors are thrown
/// as found (quantize_with_outliers reruns the whole-tensor path to report them in its order).
template <class Codec, class T>
void quantize_outlier_rows(const QuantConfig& cfg, const Codec& codec, int bits, int64_t k,
                           const KVView<const T>& x, const PackedSpan& q, QuantWorkspace& ws) {
  const Shape s = x.shape();
  const int64_t n = s.numel();
  if (n == 0) return;
  const GroupBox box = group_box(Axis::kToken, cfg.group, s);
  const int64_t H = s.heads, D = s.head_dim, gc = box.gc, nc = box.nc, V = s.tokens * H;
  q.codes[packed_bytes(static_cast<std::size_t>(n), bits) - 1] = 0;  // unused trailing bits
  constexpr int R = kLeanRows;  // vectors in flight (4)
  // per-group arrays: 8 lanes at least, a multiple of 8
  const int64_t np = (std::max<int64_t>(nc, 8) + 7) / 8 * 8;
  const auto uD = static_cast<std::size_t>(D), unp = static_cast<std::size_t>(np);
  float* buf = QuantWorkspace::at_least(ws.buf, R * uD);
  float* dense = QuantWorkspace::at_least(ws.dense, R * uD);
  uint8_t* codes = QuantWorkspace::at_least(ws.codes, R * uD);
  float* lo = QuantWorkspace::at_least(ws.lo, R * unp);
  float* hi = QuantWorkspace::at_least(ws.hi, R * unp);
  int32_t* sel = QuantWorkspace::at_least(ws.sel, static_cast<std::size_t>(R * k));
  float* vals = QuantWorkspace::at_least(ws.ovals, static_cast<std::size_t>(R * k));
  // Per group zero / inv (and scale).
  float* pz = QuantWorkspace::at_least(ws.zv, R * unp);
  float* pi = QuantWorkspace::at_least(ws.iv, R * unp);
  float* ps = QuantWorkspace::at_least(ws.u, R * unp);
  const MetaDType meta = cfg.meta;
  // The lean path (int and nuq codecs, group 32, 64 or 128, k <= 4): isolate_rows_lean, no
  // dense row (the codes clamp to the dense ranges, lean_codes), code bounds in ca / cb.
  [[maybe_unused]] bool lean = false;
  [[maybe_unused]] float* ca = nullptr;
  [[maybe_unused]] float* cb = nullptr;
  const float* rows[R] = {};
  const int pb = outlier_pos_bytes(D);
#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
  // head_dim 64, 128, 256: four vectors per lean_quad call (no per-vector dispatch)
  LeanQuadFn<Codec> quad = nullptr;
  if constexpr (std::is_same_v<Codec, IntCodec> || std::is_same_v<Codec, NuqCodec>) {
    lean = (gc == 32 || gc == 64 || gc == 128) && D % gc == 0 && k >= 1 && k <= 4 &&
           D <= 64 * detail::kRowMaskWords && D < (int64_t{1} << 16);
    ca = QuantWorkspace::at_least(ws.ca, R * unp);
    cb = QuantWorkspace::at_least(ws.cb, R * unp);
    if (lean && pb == 1) quad = lean_quad_for<Codec>(D, gc, k);
  }
#endif
  const std::size_t row_bytes = uD * sizeof(T);
  // Codes 8 at a time (gc % 8 == 0, so D % 8 == 0: rows start on a byte); the group of
  // channel e is (e * gmul) >> 32, exact for e, gc < 2^16.
  [[maybe_unused]] const bool chunked = gc % 8 == 0 && D < (int64_t{1} << 16);
  [[maybe_unused]] const uint64_t gmul = (uint64_t{1} << 32) / static_cast<uint64_t>(gc) + 1;
  [[maybe_unused]] auto group_of = [gmul](int64_t e) __attribute__((always_inline)) {
    return static_cast<int64_t>((static_cast<uint64_t>(e) * gmul) >> 32);
  };
  int64_t t_next = 0, h_next = 0;
  for (int64_t v0 = 0; v0 < V; v0 += R) {
    const int nr = static_cast<int>(std::min<int64_t>(R, V - v0));
    int64_t ts[R], hs[R];
    bool ok[R] = {};
    for (int i = 0; i < nr; ++i) {
      const int64_t t = t_next, h = h_next;
      ts[i] = t;
      hs[i] = h;
      if (++h_next == H) h_next = 0, ++t_next;
      if (x.dim_contiguous()) kernels::prefetch_ahead(x.row(t, h), row_bytes);
      rows[i] = load_row(x, t, h, buf + i * uD);
    }
#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
    if (quad != nullptr && nr == R) {
      const auto cbytes = static_cast<std::size_t>(v0 * D) * static_cast<std::size_t>(bits) / 8;
      const auto mb = static_cast<std::size_t>(meta == MetaDType::kF16 ? 2 : 4);
      const auto g0 = static_cast<std::size_t>(v0 * nc);
      const LeanQuadOut o{q.codes + cbytes, q.scales + mb * g0,
                          codec.has_zero() ? q.zeros + mb * g0 : nullptr,
                          q.outlier_values + 2 * v0 * k, q.outlier_pos + v0 * k};
      if (quad(codec, bits, rows, o, ws.outlier)) continue;
    }
#endif
    bool done = false;
#if KVQ_HAS_AVX2
    if (lean)
      done = isolate_rows_lean_rt(nr, rows, D, gc, k, sel, vals, lo, hi, unp, ws.outlier, ok);
#endif
    if (!done)
      for (int i = 0; i < nr; ++i)
        ok[i] = isolate_row(rows[i], D, gc, k, dense + i * uD, sel + i * k, vals + i * k,
                            lo + i * unp, hi + i * unp, ws.outlier);
    for (int i = 0; i < nr; ++i) {
      if (!ok[i]) throw_non_finite_row(x, ts[i], hs[i], "quantize");
      const int32_t* sl = sel + i * k;
      const float* vl = vals + i * k;
      for (int64_t j = 0; j < k; ++j)
        if (!(std::fabs(vl[j]) < 65520.f)) throw_outlier_range(vl[j], sl[j], v0 + i, H);
    }
    for (int i = 0; i < nr; ++i) {  // group parameters, metadata
      const int64_t v = v0 + i;
      const float* l = lo + i * unp;
      const float* u = hi + i * unp;
      float* zg = pz + i * unp;
      float* ig = pi + i * unp;
      [[maybe_unused]] float* sg = ps + i * unp;
      const auto g0 = static_cast<std::size_t>(v * nc);
      bool done = false;
#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
      if constexpr (std::is_same_v<Codec, IntCodec> || std::is_same_v<Codec, NuqCodec>) {
        if (nc <= 8 && dense_params8(codec, l, u, static_cast<int>(nc), zg, sg, ig)) {
          done = true;
          const bool f16 = meta == MetaDType::kF16;
          const auto mb = static_cast<std::size_t>(f16 ? 2 : 4);
          kernels::store_meta8(_mm256_loadu_ps(sg), static_cast<int>(nc), f16, q.scales + mb * g0);
          if (codec.has_zero())
            kernels::store_meta8(_mm256_loadu_ps(zg), static_cast<int>(nc), f16, q.zeros + mb * g0);
        }
      }
#endif
      if (!done)
        for (int64_t b = 0; b < nc; ++b) {
          const auto g = g0 + static_cast<std::size_t>(b);
          const UniformParams p = codec.params(l[b], u[b], static_cast<int64_t>(g));
          store_meta(q.scales, meta, g, p.scale);
          if (codec.has_zero()) store_meta(q.zeros, meta, g, p.zero);
          zg[b] = p.zero;
          ig[b] = p.inv;
        }
#if KVQ_HAS_AVX2
      if (lean) {
        if constexpr (std::is_same_v<Codec, IntCodec> || std::is_same_v<Codec, NuqCodec>)
          lean_bounds(codec, nc, l, u, zg, ig, ca + i * unp, cb + i * unp);
      }
#endif
    }
    for (int i = 0; i < nr; ++i) {  // codes
      const int64_t v = v0 + i;
      const float* dn = dense + i * uD;
      const float* zg = pz + i * unp;
      const float* ig = pi + i * unp;
      uint8_t* cd = codes + i * uD;
#if KVQ_HAS_AVX2
      if (lean) {
        if constexpr (std::is_same_v<Codec, IntCodec> || std::is_same_v<Codec, NuqCodec>)
          lean_codes(codec, bits, gc, rows[i], D, zg, ig, ca + i * unp, cb + i * unp,
                     q.codes + static_cast<std::size_t>(v * D) * static_cast<std::size_t>(bits) / 8);
        continue;
      }
      if (chunked) {
        uint8_t* out = q.codes + static_cast<std::size_t>(v * D) * static_cast<std::size_t>(bits) / 8;
        if constexpr (std::is_same_v<Codec, IntCodec>) {
          const __m256 off = _mm256_set1_ps(codec.lv.off), qmax = _mm256_set1_ps(codec.lv.qmax);
          write_row_codes(bits, D, out, [&](int64_t e) __attribute__((always_inline)) {
            return int_codes8(dn + e, _mm256_broadcast_ss(zg + group_of(e)),
                              _mm256_broadcast_ss(ig + group_of(e)), off, qmax);
          });
        } else if constexpr (std::is_same_v<Codec, NuqCodec>) {
          __m256 thr[kNuqMaxLevels];
          const int nthr = (1 << bits) - 1;
          for (int j = 0; j < nthr; ++j) thr[j] = _mm256_set1_ps(codec.thr[j]);
          write_row_codes(bits, D, out, [&](int64_t e) __attribute__((always_inline)) {
            return nuq_codes8(dn + e, _mm256_broadcast_ss(zg + group_of(e)),
                              _mm256_broadcast_ss(ig + group_of(e)), thr, nthr);
          });
        } else {
          for (int64_t b = 0; b < nc; ++b) codec.encode(dn + b * gc, gc, zg[b], ig[b], cd + b * gc);
          write_row_codes(bits, D, out, [&](int64_t e) __attribute__((always_inline)) {
            return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cd + e)));
          });
        }
        continue;
      }
#endif
      for (int64_t b = 0; b < nc; ++b) codec.encode(dn + b * gc, gc, zg[b], ig[b], cd + b * gc);
      kernels::pack_codes(cd, uD, bits, q.codes, static_cast<std::size_t>(v * D) * static_cast<std::size_t>(bits));
    }
    for (int i = 0; i < nr; ++i) {
      const int64_t v = v0 + i;
      store_outliers(vals + i * k, sel + i * k, k, pb, q.outlier_values + 2 * v * k,
                     q.outlier_pos + pb * v * k);
    }
  }
}

/// The whole-tensor path: every row into ws.dense, isolate_outliers over the tensor, the
/// outlier range check, the dense quantizer over the tensor, the sparse arrays.
template <class T, class Dense>
void quantize_outliers_whole(const QuantConfig& cfg, int64_t k, const KVView<const T>& x,
                             const PackedSpan& q, QuantWorkspace& ws, Dense& dense) {
  const Shape s = x.shape();
  const int64_t T_ = s.tokens, H = s.heads, D = s.head_dim;
  const auto n = static_cast<std::size_t>(s.numel());
  float* buf = QuantWorkspace::at_least(ws.dense, n);
  const std::size_t nk = static_cast<std::size_t>(T_ * H * k);
  float* vals = QuantWorkspace::at_least(ws.ovals, nk);
  int32_t* sel = QuantWorkspace::at_least(ws.sel, nk);
  for (int64_t t = 0; t < T_; ++t)
    for (int64_t h = 0; h < H; ++h) {
      float* dst = buf + (t * H + h) * D;
      const float* r = load_row(x, t, h, dst);
      if (r != dst) std::memcpy(dst, r, static_cast<std::size_t>(D) * sizeof(float));
      float lo = INFINITY, hi = -INFINITY;
      if (!kernels::minmax(dst, D, lo, hi)) throw_non_finite_row(x, t, h, "quantize");
    }
  isolate_outliers(s, cfg.axis, cfg.group, k, buf, sel, vals, ws.outlier);
  check_outlier_range(vals, sel, T_ * H, k, H);
  PackedSpan dq = q;
  dq.config = dense_config(cfg);
  dense(dq.config, KVView<const float>(buf, s), dq);
  const int pb = outlier_pos_bytes(D);
  for (int64_t v = 0; v < T_ * H; ++v)
    store_outliers(vals + v * k, sel + v * k, k, pb, q.outlier_values + 2 * v * k,
                   q.outlier_pos + pb * v * k);
}

/// Token-spanning axes: the whole-tensor path over slabs of whole token blocks (about 128 KiB
/// of f32 each), each written to its part of q (codes, scales, zeros and sparse arrays of a
/// slab are contiguous in box order). False (nothing written) when one slab would be the
/// whole tensor or a slab would not start on a code byte.
template <class T, class Dense>
bool quantize_outliers_slabs(const QuantConfig& cfg, int64_t k, const KVView<const T>& x,
                             const PackedSpan& q, QuantWorkspace& ws, Dense& dense) {
  const Shape s = x.shape();
  const GroupBox box = group_box(cfg.axis, cfg.group, s);
  const int64_t H = s.heads, D = s.head_dim, per_token = H * D;
  if (per_token == 0 || box.gt >= s.tokens) return false;
  const int bits = dense_code_bits(cfg);
  constexpr int64_t kSlabFloats = 32 << 10;
  int64_t blocks = std::max<int64_t>(1, kSlabFloats / (box.gt * per_token));
  while (blocks * box.gt < s.tokens && (blocks * box.gt * per_token * bits) % 8 != 0) ++blocks;
  const int64_t st = blocks * box.gt;  // tokens per slab
  if (st >= s.tokens) return false;
  const int64_t groups_per_block = box.nh * box.nc;
  const auto msz = static_cast<std::size_t>(meta_size(cfg.meta));
  const int pb = outlier_pos_bytes(D);
  for (int64_t t0 = 0; t0 < s.tokens; t0 += st) {
    const int64_t nt = std::min(st, s.tokens - t0);
    PackedSpan sq = q;
    sq.shape = Shape{nt, H, D};
    sq.codes = q.codes + static_cast<std::size_t>(t0 * per_token * bits / 8);
    const auto g0 = static_cast<std::size_t>((t0 / box.gt) * groups_per_block);
    sq.scales = q.scales + g0 * msz;
    if (q.zeros != nullptr) sq.zeros = q.zeros + g0 * msz;
    sq.outlier_values = q.outlier_values + 2 * t0 * H * k;
    sq.outlier_pos = q.outlier_pos + pb * t0 * H * k;
    quantize_outliers_whole(cfg, k, x.slice_tokens(t0, nt), sq, ws, dense);
  }
  return true;
}

}  // namespace detail

/// Quantizes `x` with k > 0 outliers per vector: selection and dense replacement, the dense
/// format's quantizer (`dense(dense_cfg, dense_view, span)`: quantize.hpp passes its own
/// dispatch; the fused token-axis path uses the format's codec directly), then the sparse
/// arrays. Throws like the dense quantizer, plus kOutOfRange for an outlier fp16 cannot hold;
/// the span's contents are then unspecified.
template <class T, class Dense>
void quantize_with_outliers(const QuantConfig& cfg, const KVView<const T>& x, const PackedSpan& q,
                            QuantWorkspace& ws, Dense&& dense) {
  const int64_t k = outlier_count(cfg, x.head_dim());
  try {
    if (cfg.axis == Axis::kToken) {
      switch (cfg.format) {
        case Format::kInt:
          return detail::quantize_outlier_rows(cfg, detail::IntCodec(cfg), cfg.bits, k, x, q, ws);
        case Format::kE4M3:
        case Format::kE5M2:
          return detail::quantize_outlier_rows(cfg, detail::Fp8Codec(cfg), 8, k, x, q, ws);
        case Format::kNuq:
          return detail::quantize_outlier_rows(cfg, detail::NuqCodec(cfg), cfg.bits, k, x, q, ws);
        default: break;
      }
    } else if (detail::quantize_outliers_slabs(cfg, k, x, q, ws, dense)) {
      return;
    }
  } catch (const Error&) {
    // Bad input: the whole-tensor path below reports it (the first non-finite element before
    // any fp16 range error before any metadata overflow), or, should it succeed, its bytes stand.
  }
  detail::quantize_outliers_whole(cfg, k, x, q, ws, dense);
}

/// Writes the exact outliers of tokens [t0, t0 + out.tokens()) of `q` over `out` (which holds
/// the dense reconstruction of those tokens). No-op when q has no outliers.
template <class T>
void apply_outliers(const PackedView& q, int64_t t0, const KVView<T>& out) {
  const int64_t H = q.shape.heads, D = q.shape.head_dim;
  const int64_t k = outlier_count(q.config, D);
  if (k <= 0 || out.numel() == 0) return;
  KVQ_REQUIRE(q.outlier_values != nullptr && q.outlier_pos != nullptr, kInvalidArgument,
              "dequantize: ", q.config.name(), " data lacks its outlier regions");
  const int pb = outlier_pos_bytes(D);
  for (int64_t t = t0; t < t0 + out.tokens(); ++t)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t v = t * H + h;
      for (int64_t j = 0; j < k; ++j) {
        uint16_t hb;
        std::memcpy(&hb, q.outlier_values + 2 * (v * k + j), 2);
        const uint8_t* p = q.outlier_pos + pb * (v * k + j);
        const int64_t d = pb == 1 ? p[0] : (p[0] | (p[1] << 8));
        KVQ_REQUIRE(d < D, kInvalidArgument, "dequantize: outlier position ", d,
                    " outside head_dim ", D, " (corrupt data)");
        out.at(t - t0, h, d) = from_float<std::remove_const_t<T>>(half_bits_to_float(hb));
      }
    }
}

}  // namespace kvq

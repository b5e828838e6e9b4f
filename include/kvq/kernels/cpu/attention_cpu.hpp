#pragma once
/// \file attention_cpu.hpp
/// Fused CPU attention straight from packed KV: decode (one query per head) and chunked
/// prefill (n_q causal queries at the newest positions) over a sequence of segments — f32 rows
/// (sinks, residual window) and packed views (PackedView: a KVCache block, a page of the paged
/// layout, or a page an engine allocated). Only the segments are read, never QTensor or cache
/// internals, so the same kernels run on every storage.
///
/// Design (why it is fast):
///  - Keys are scored from their codes. Per-channel int keys fold the block's scales into the
///    query (q'_d = q_d s_d, once per token block) and add q.zero once per block; per-token
///    scales with one group per row (fp8 per head, int group 0) scale the dot product once per
///    row (plus zero * sum(q)); per-token groups narrower than the row dequantize 16 codes in a
///    register with one FMA shared by all query heads of the GQA group; Lloyd-Max keys are
///    scored against centroids with the query rotated once (q.k = (Rq).(Rk)), QJL adding
///    norm * c * (S Rq).sign; f32/f16/bf16 are read directly. No float key tensor is ever
///    written to memory (pre-RoPE keys are the exception: rows are decoded to floats in
///    blocks of 16 tokens x all heads (per-head path: one row), rotated at their positions
///    with a per-tile RoPE table, then scored).
///  - Values are accumulated from their codes: a row scale multiplies the softmax weight
///    (w = p s) and zero points accumulate as one scalar per row; Lloyd-Max values accumulate
///    in the rotated domain (w = p * norm) and are rotated back once per work unit.
///  - fp32 online softmax per 64-token tile; all query heads of a GQA group (and all queries of
///    a prefill block) are processed in one pass over each tile, so K/V bytes are read once per
///    group.
///  - Long contexts are split into fixed chunks of `split_tokens` processed independently and
///    merged in chunk order (flash-decoding); the split does not depend on the thread count,
///    and every chunk is computed by the same code whichever thread runs it, so the result is
///    bit-identical for any number of threads.
/// Three instruction sets share this code (kernels/cpu/attention_simd.hpp): AVX-512 when
/// head_dim is a multiple of 16, AVX2 when a multiple of 8, else (and under KVQ_NO_SIMD) scalar.
/// When head_dim is a multiple of 16, AVX2 and AVX-512 builds alike run the Simd256
/// instance's own tile loop (Unit::run_tiles): tiles gathered over several
/// pages, all kv heads per tile, keys read token-major, odd-width codes unpacked once per tile,
/// rows prefetched ahead into L2, and the 16-channel register-blocked microkernels of
/// kernels/cpu/attention_avx2.hpp (two 8-lane vectors per 16 channels on AVX2, one 16-lane
/// vector on AVX-512; value group scales folded into the weights; pre-RoPE keys decoded and
/// rotated to f32 rows first). Streams the microkernels do not read (QJL values, value groups
/// that are not a multiple of 16 channels) take the per-head path of the same instance.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvq/core/bitpack.hpp"
#include "kvq/core/error.hpp"
#include "kvq/core/rope.hpp"
#include "kvq/core/rows.hpp"
#include "kvq/core/tensor.hpp"
#include "kvq/geometry/grouping.hpp"
#include "kvq/kernels/cpu/attention_avx2.hpp"
#include "kvq/kernels/cpu/attention_simd.hpp"
#include "kvq/kernels/cpu/uniform_cpu.hpp"
#include "kvq/layout/page_layout.hpp"
#include "kvq/quant/lloyd_max_quant.hpp"
#include "kvq/quant/packed_view.hpp"
#include "kvq/quant/quantize.hpp"

namespace kvq {

/// Runs body(0) .. body(n - 1), possibly in parallel, and returns when all are done (a
/// caller's thread pool). Each index is one worker of the attention call.
using ParallelFor = std::function<void(int64_t n, const std::function<void(int64_t)>& body)>;

/// How an attention call splits its work.
struct AttentionOptions {
  /// Workers (1 = the calling thread only). With no parallel_for, threads - 1 std::threads are
  /// started per call.
  int threads = 1;
  /// Tokens per independently processed chunk (flash-decoding split); 0 = 4096. Results depend
  /// on the split (floating-point order), never on `threads`.
  int64_t split_tokens = 0;
  /// Sliding window (0 = none): the query at position p sees only the tokens at positions
  /// (p - window, p] (with causal; without, the window ends at the last token). Gemma's local
  /// layers; tiles wholly before every query's window are skipped.
  int64_t window = 0;
  /// Caller-supplied parallel-for (optional).
  ParallelFor parallel_for;
};

namespace kernels {
namespace attn {

constexpr int64_t kTile = 64;            ///< tokens per softmax tile
constexpr int64_t kDefaultSplit = 4096;  ///< tokens per chunk when split_tokens == 0
constexpr int64_t kQueryBlock = 16;      ///< queries per work unit (prefill)

enum class Scale : uint8_t {
  kRow,      ///< one (scale, zero) per row: raw formats (1, 0), fp8/int with gc == head_dim, lm
  kGroup,    ///< token axis, groups of gc channels, gc a multiple of the vector width
  kExpand,   ///< token axis, other group widths: per-row scale vectors expanded per channel
  kChannel,  ///< channel axis: per-channel scales shared by a block of gt tokens
};

/// How one segment's keys or values are read.
struct Stream {
  bool packed = false;
  // f32 rows (sinks / residual)
  KVView<const float> rows;
  // packed
  PackedView view;
  GroupBox box;
  Load load = Load::kF32;
  Scale scale = Scale::kRow;
  bool unpack = false;  ///< codes are unpacked into bytes first (odd widths: per tile or per row)
  bool lm = false, qjl = false, zeros = false, raw = false;
  bool nuq = false;  ///< nuq codes: table loads (lut = the layer's levels), int scales and zeros
  int bits = 32;
  int64_t nout = 0;  ///< dense-and-sparse: outliers per (token, head) vector (int / fp8 / nuq dense)
  float off = 0.f, mul = 1.f;
  const detail::LloydMaxContext* ctx = nullptr;
  float lut[16] = {};
};

/// Per-worker scratch (reused; sized on first use).
struct Scratch {
  std::vector<float> s;         // [rows, kTile] scores, then softmax weights
  std::vector<float> w;         // [rows, kTile] value weights
  std::vector<float> m, l;      // [H, rows] running max and sum
  std::vector<float> acc;       // [H, rows, D]
  std::vector<float> acc_rot;   // [H, rows, D] Lloyd-Max values, rotated domain
  std::vector<float> sacc;      // [H, rows, D] QJL value sign sums
  std::vector<float> sconst;    // [H, rows]
  std::vector<float> zacc;      // [rows] value zero terms of one tile
  std::vector<uint8_t> ku, vu;  // [kTile, D] unpacked codes
  std::vector<uint8_t> kub, vub;  // [kTile, H, D] unpacked codes of a whole tile (odd widths)
  std::vector<uint8_t> ksg, vsg;  // [kTile, D] QJL sign bits
  std::vector<const uint8_t*> krp, vrp;  // [kTile] row pointers
  std::vector<float> kms, kmz, vms, vmz;  // tile metadata
  std::vector<float> kq, vq;    // [kTile] QJL factors
  std::vector<float> qf, qz;    // [rows, D], [rows] channel-folded queries
  std::vector<float> krow;      // [kTile, D] decoded (pre-RoPE) key rows
  std::vector<float> rc, rs;    // [kTile, D/2] RoPE cos/sin of positions rope_t0 + t
  int64_t rope_t0 = 0, rope_n = 0;  // the positions rc/rs hold (rope_n = 0: none)
  std::vector<double> rope_c, rope_s;  // [D/2] the recurrence's state (rope_table)
  std::vector<float> tmp;       // [max(D, rows)]
  // AVX2 tiles over several segments (attention_avx2.hpp)
  struct Piece {
    std::size_t si;         ///< segment index
    int64_t loc0, n, o;     ///< segment-local first token, tokens, offset in the tile
  };
  std::vector<Piece> pieces, next;  // this tile's pieces, the next tile's
  std::vector<float> wg;  // [rows, D / 16, kTile] value weights times group scales
  std::vector<float> zg;  // [rows, D / 16] value zero sums per group
  std::vector<int32_t> opos;  // [k, kTile] dense-and-sparse: channel of outlier j of token t
  std::vector<float> odv;     // [k, kTile] its exact value minus its dense value
};

/// Everything an attention call keeps between calls.
struct Workspace {
  std::vector<CacheSegment> segs;
  std::vector<Stream> ks, vs;
  std::vector<float> qs;      // [H, nq*G, D] queries / sqrt(D)
  std::vector<float> qsum;    // [H, nq*G]
  std::vector<float> qrot;    // [H, nq*G, D] rotated queries (Lloyd-Max keys)
  std::vector<float> qs_eo, qrot_eo;  // the same in even/odd channel order (AVX2, 4-bit keys)
  std::vector<float> sq;      // [H, nq*G, D] S R q (QJL keys)
  std::vector<float> sqsum;   // [H, nq*G]
  std::vector<double> inv_freq;  // [D/2] RoPE
  std::vector<double> rope_c1, rope_s1;  // [D/2] cos / sin of inv_freq (one position's step)
  std::vector<float> um, ul, uacc;  // per work unit results
  std::vector<float> out_row;
  std::vector<Scratch> scratch;
  // pages the kernels do not read (needs_decode()): decoded rows, one [n, H, D] pair per such
  // segment, and the dequantization scratch.
  std::vector<std::vector<float>> decoded;
  QuantWorkspace qws;
};

/// True when the fused kernels cannot read `v` straight from its codes: dense-and-sparse
/// outliers over a dense format other than int / fp8 / nuq (decoded to f32 rows first;
/// docs/outliers.md; the spec grammar accepts no other today). nuq codes are read like int
/// codes through a 16-entry table of the layer's levels (x = scale * level[c] + zero); outliers
/// over int, fp8 and nuq are read in the kernels: the dense codes as usual, then each outlier's
/// difference from its dense value (Unit::outlier_scores, Unit::outlier_values).
inline bool needs_decode(const PackedView& v) {
  const Format f = v.config.format;
  return outlier_count(v.config, v.shape.head_dim) > 0 &&
         !(f == Format::kInt || f == Format::kE4M3 || f == Format::kE5M2 || f == Format::kNuq);
}

/// Replaces every packed segment that needs_decode() by f32 row segments holding its
/// dequantized keys and values (the oracle path: the same values reference/attention_ref.hpp
/// scores). Rows live in ws.decoded until the next call.
inline void decode_unsupported(Workspace& ws) {
  std::size_t used = 0;
  for (CacheSegment& s : ws.segs) {
    if (!s.packed() || (!needs_decode(s.key_view) && !needs_decode(s.value_view))) continue;
    if (ws.decoded.size() < used + 2) ws.decoded.resize(used + 2);
    std::vector<float>& kb = ws.decoded[used++];
    std::vector<float>& vb = ws.decoded[used++];
    const Shape sh = s.key_view.shape;
    kb.resize(static_cast<std::size_t>(sh.numel()));
    vb.resize(static_cast<std::size_t>(sh.numel()));
    dequantize_tokens(s.key_view, 0, KVView<float>(kb.data(), sh), ws.qws);
    dequantize_tokens(s.value_view, 0, KVView<float>(vb.data(), sh), ws.qws);
    s.kind = CacheSegment::Kind::kResidual;
    s.key_rows = KVView<const float>(kb.data(), sh);
    s.value_rows = KVView<const float>(vb.data(), sh);
  }
}

/// Problem geometry of one call.
struct Problem {
  int64_t T = 0, H = 0, D = 0, nq = 0, nh = 0, G = 0;
  bool causal = true;
  int64_t window = 0;  // AttentionOptions::window
  const RopeConfig* rope = nullptr;
  int64_t split = kDefaultSplit, nchunks = 0, nqb = 0;
  const detail::LloydMaxContext* k_ctx = nullptr;  // Lloyd-Max keys (query rotation)
  const detail::LloydMaxContext* v_ctx = nullptr;  // Lloyd-Max values (output rotation)
  bool k_qjl = false;
  uint64_t k_seed = 0, v_seed = 0;
};

inline int64_t rows_of_block(const Problem& P, int64_t qb) {
  const int64_t i0 = qb * kQueryBlock;
  return (std::min(P.nq, i0 + kQueryBlock) - i0) * P.G;
}

template <class S, Load L>
inline typename S::V load_chunk(const uint8_t* row, int64_t j, const float* lut) {
  constexpr int W = S::W;
  if constexpr (W == 1 && (L == Load::kF32 || L == Load::kF16 || L == Load::kBF16)) {
    if constexpr (L == Load::kF32) {
      float f;
      std::memcpy(&f, row + 4 * j, 4);
      return f;
    } else {
      uint16_t h;
      std::memcpy(&h, row + 2 * j, 2);
      return L == Load::kF16 ? S::from_f16(&h) : S::from_bf16(&h);
    }
  } else if constexpr (L == Load::kF32) {
    return S::load(reinterpret_cast<const float*>(row) + j * W);
  } else if constexpr (L == Load::kF16) {
    return S::from_f16(reinterpret_cast<const uint16_t*>(row) + j * W);
  } else if constexpr (L == Load::kBF16) {
    return S::from_bf16(reinterpret_cast<const uint16_t*>(row) + j * W);
  } else if constexpr (L == Load::kU8) {
    return S::cvt(S::codes_u8(row + j * W));
  } else if constexpr (L == Load::kE4M3) {
    return S::from_e4m3(row + j * W);
  } else if constexpr (L == Load::kE5M2) {
    return S::from_e5m2(row + j * W);
  } else if constexpr (L == Load::kLut8) {
    return S::lut(S::codes_u8(row + j * W), lut);
  } else if constexpr (W >= 4) {
    if constexpr (L == Load::kU4) return S::cvt(S::codes_u4(row + j * W / 2));
    if constexpr (L == Load::kU2) return S::cvt(S::codes_u2(row + j * W / 4));
    if constexpr (L == Load::kLut4) return S::lut(S::codes_u4(row + j * W / 2), lut);
  }
  return S::zero();  // unreachable: the stream setup never picks these for narrow vectors
}

/// Scores of 4 tokens (t .. t+3) x RB query rows: sc[r * kTile + t + u] = q[r, :] . kl(t + u, :).
/// 4 x RB independent FMA chains hide the FMA latency; one reduce4 per row gives the four
/// tokens' sums in one store.
template <class S, int RB, class KL>
inline void dot_block4(const KL& kl, int64_t t, int64_t nj, const float* q, int64_t D,
                       float* sc) {
  using V = typename S::V;
  V a[4][RB];
  for (int u = 0; u < 4; ++u)
    for (int r = 0; r < RB; ++r) a[u][r] = S::zero();
  for (int64_t j = 0; j < nj; ++j) {
    const V k0 = kl(t, j), k1 = kl(t + 1, j), k2 = kl(t + 2, j), k3 = kl(t + 3, j);
    for (int r = 0; r < RB; ++r) {
      const V qv = S::load(q + r * D + j * S::W);
      a[0][r] = S::fma(qv, k0, a[0][r]);
      a[1][r] = S::fma(qv, k1, a[1][r]);
      a[2][r] = S::fma(qv, k2, a[2][r]);
      a[3][r] = S::fma(qv, k3, a[3][r]);
    }
  }
  for (int r = 0; r < RB; ++r) S::reduce4(a[0][r], a[1][r], a[2][r], a[3][r], sc + r * kTile + t);
}

template <class S, int RB, class KL>
inline void dot_block1(const KL& kl, int64_t t, int64_t nj, const float* q, int64_t D,
                       float* sc) {
  using V = typename S::V;
  V a[RB];
  for (int r = 0; r < RB; ++r) a[r] = S::zero();
  for (int64_t j = 0; j < nj; ++j) {
    const V k = kl(t, j);
    for (int r = 0; r < RB; ++r) a[r] = S::fma(S::load(q + r * D + j * S::W), k, a[r]);
  }
  for (int r = 0; r < RB; ++r) sc[r * kTile + t] = S::reduce(a[r]);
}

template <class S, int RB, class KL>
inline void dot_tokens(const KL& kl, int64_t n, int64_t nj, const float* q, int64_t D,
                       float* sc) {
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) dot_block4<S, RB>(kl, t, nj, q, D, sc);
  for (; t < n; ++t) dot_block1<S, RB>(kl, t, nj, q, D, sc);
}

/// sc[r * kTile + t] = q[r, :] . kl(t, :) for R rows of q (stride D) and n tokens.
template <class S, class KL>
inline void dot_rows(const KL& kl, int64_t n, int64_t nj, const float* q, int64_t D, int64_t R,
                     float* sc) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) dot_tokens<S, 4>(kl, n, nj, q + r * D, D, sc + r * kTile);
  if (r + 2 <= R) {
    dot_tokens<S, 2>(kl, n, nj, q + r * D, D, sc + r * kTile);
    r += 2;
  }
  if (r < R) dot_tokens<S, 1>(kl, n, nj, q + r * D, D, sc + r * kTile);
}

/// acc[r, :] += sum_t w[r, t] * vl(t, :) for RB rows (acc stride D, w stride kTile); tokens
/// alternate between two accumulator sets (2 x RB independent FMA chains).
template <class S, int RB, class VL>
inline void axpy_block(const VL& vl, int64_t nt, int64_t nj, const float* w, float* acc,
                       int64_t D) {
  using V = typename S::V;
  for (int64_t j = 0; j < nj; ++j) {
    V a[RB], b[RB];
    for (int r = 0; r < RB; ++r) {
      a[r] = S::load(acc + r * D + j * S::W);
      b[r] = S::zero();
    }
    int64_t t = 0;
    for (; t + 2 <= nt; t += 2) {
      const V v0 = vl(t, j), v1 = vl(t + 1, j);
      for (int r = 0; r < RB; ++r) {
        a[r] = S::fma(S::set1(w[r * kTile + t]), v0, a[r]);
        b[r] = S::fma(S::set1(w[r * kTile + t + 1]), v1, b[r]);
      }
    }
    if (t < nt) {
      const V v0 = vl(t, j);
      for (int r = 0; r < RB; ++r) a[r] = S::fma(S::set1(w[r * kTile + t]), v0, a[r]);
    }
    for (int r = 0; r < RB; ++r) S::store(acc + r * D + j * S::W, S::add(a[r], b[r]));
  }
}

template <class S, class VL>
inline void axpy_rows(const VL& vl, int64_t nt, int64_t nj, const float* w, float* acc,
                      int64_t D, int64_t n) {
  int64_t r = 0;
  for (; r + 8 <= n; r += 8) axpy_block<S, 8>(vl, nt, nj, w + r * kTile, acc + r * D, D);
  if (r + 4 <= n) {
    axpy_block<S, 4>(vl, nt, nj, w + r * kTile, acc + r * D, D);
    r += 4;
  }
  if (r + 2 <= n) {
    axpy_block<S, 2>(vl, nt, nj, w + r * kTile, acc + r * D, D);
    r += 2;
  }
  if (r < n) axpy_block<S, 1>(vl, nt, nj, w + r * kTile, acc + r * D, D);
}

/// Dispatches a run-time Load to a compile-time one.
template <class F>
inline void with_load(Load l, F&& f) {
  switch (l) {
    case Load::kF32: return f(std::integral_constant<Load, Load::kF32>());
    case Load::kF16: return f(std::integral_constant<Load, Load::kF16>());
    case Load::kBF16: return f(std::integral_constant<Load, Load::kBF16>());
    case Load::kU8: return f(std::integral_constant<Load, Load::kU8>());
    case Load::kU4: return f(std::integral_constant<Load, Load::kU4>());
    case Load::kU2: return f(std::integral_constant<Load, Load::kU2>());
    case Load::kE4M3: return f(std::integral_constant<Load, Load::kE4M3>());
    case Load::kE5M2: return f(std::integral_constant<Load, Load::kE5M2>());
    case Load::kLut8: return f(std::integral_constant<Load, Load::kLut8>());
    case Load::kLut4: return f(std::integral_constant<Load, Load::kLut4>());
  }
}

/// Sets up how a packed view is read with vector width W.
inline void setup_packed(Stream& st, const PackedView& v, int W) {
  st.packed = true;
  st.view = v;
  const QuantConfig& c = v.config;
  const int64_t D = v.shape.head_dim;
  st.box = group_box(c.axis, c.group, v.shape);
  st.scale = Scale::kRow;
  st.mul = 1.f;
  st.off = 0.f;
  st.lm = st.qjl = st.zeros = st.unpack = st.nuq = false;
  st.raw = c.is_raw();
  st.ctx = nullptr;
  st.nout = outlier_count(c, D);
  switch (c.format) {
    case Format::kF32: st.load = Load::kF32; st.bits = 32; return;
    case Format::kF16: st.load = Load::kF16; st.bits = 16; return;
    case Format::kBF16: st.load = Load::kBF16; st.bits = 16; return;
    case Format::kE4M3:
    case Format::kE5M2:
      st.bits = 8;
      st.load = c.format == Format::kE4M3 ? Load::kE4M3 : Load::kE5M2;
      st.mul = c.format == Format::kE4M3 ? 256.f : 1.f;
      break;
    case Format::kInt:
      st.bits = c.bits;
      st.off = uniform_levels(c.bits, c.symmetric).off;
      st.zeros = !c.symmetric;
      break;
    case Format::kNuq:  // x = scale * level[c] + zero: the int path with a table load
      st.bits = c.bits;
      st.nuq = true;
      st.zeros = true;
      for (int k = 0; k < 16; ++k)
        st.lut[k] = k < (1 << c.bits) ? c.nuq_levels[static_cast<std::size_t>(k)] : 0.f;
      break;
    case Format::kLloydMax: {
      st.bits = c.bits;
      st.lm = true;
      st.qjl = c.qjl;
      st.ctx = &detail::lloyd_max_context(static_cast<int>(D), c.bits, c.seed);
      const auto& cent = st.ctx->codebook->centroids;
      for (int k = 0; k < 16; ++k)
        st.lut[k] = k < static_cast<int>(cent.size()) ? cent[static_cast<std::size_t>(k)] : 0.f;
      break;
    }
  }
  if (c.format == Format::kInt || c.format == Format::kLloydMax || st.nuq) {
    const bool lm = c.format == Format::kLloydMax || st.nuq;  // table loads
    const bool aligned = (D * st.bits) % 8 == 0;
    if (st.bits == 8) {
      st.load = lm ? Load::kLut8 : Load::kU8;
    } else if (st.bits == 4 && aligned && W % 2 == 0 && W >= 4) {
      st.load = lm ? Load::kLut4 : Load::kU4;
    } else if (st.bits == 2 && aligned && W % 4 == 0 && !lm) {
      st.load = Load::kU2;
    } else {
      st.unpack = true;
      st.load = lm ? Load::kLut8 : Load::kU8;
    }
  }
  if (st.lm) return;  // per-row norm: kRow
  if (c.axis == Axis::kChannel) {
    st.scale = Scale::kChannel;
  } else if (st.box.gc == D) {
    st.scale = Scale::kRow;
  } else if (st.box.gc % W == 0) {
    st.scale = Scale::kGroup;
  } else {
    st.scale = Scale::kExpand;
  }
}

/// Pointer to the packed row (t, h) of a stream, or the unpacked bytes in `buf`.
inline const uint8_t* packed_row(const Stream& st, int64_t t, int64_t h, uint8_t* buf) {
  const int64_t H = st.view.shape.heads, D = st.view.shape.head_dim;
  const auto e = static_cast<std::size_t>((t * H + h) * D);
  if (st.unpack) {
    unpack_codes(st.view.codes, static_cast<std::size_t>(D), st.bits, buf,
                 e * static_cast<std::size_t>(st.bits));
    return buf;
  }
  return st.view.codes + e * static_cast<std::size_t>(st.bits) / 8;
}

/// Fills the tile's metadata for rows t0..t0+n (segment-local) of head h: kRow -> ms[t], mz[t];
/// kGroup -> ms[t * ng + g]; kExpand -> ms[t * D + d]; kChannel -> ms[d] (the block's).
/// Zero points carry the folded offset: z' = z - off * s (so x = fma(code, s, z')); scales
/// carry the fp8 unscale factor.
inline void tile_meta(const Stream& st, int64_t t0, int64_t n, int64_t h, float* ms, float* mz,
                      float* qn) {
  const PackedView& v = st.view;
  const GroupBox& b = st.box;
  const int64_t D = v.shape.head_dim;
  auto sz = [&](std::size_t g, float* s, float* z) {
    const float sc = v.scale(g);
    *s = sc * st.mul;
    *z = (st.zeros ? v.zero(g) : 0.f) - st.off * sc;
  };
  if (st.raw) {
    for (int64_t t = 0; t < n; ++t) {
      ms[t] = 1.f;
      mz[t] = 0.f;
    }
    return;
  }
  if (st.lm) {
    const int64_t H = v.shape.heads;
    for (int64_t t = 0; t < n; ++t) {
      const auto vi = static_cast<std::size_t>((t0 + t) * H + h);
      ms[t] = v.norm(vi);
      mz[t] = 0.f;
      if (st.qjl)
        qn[t] = v.qjl_norm(vi) * static_cast<float>(std::sqrt(M_PI / 2.0) / static_cast<double>(D));
    }
    return;
  }
  // Group index of (token t0 + t, head h, group g of the row) = b.index(t0 + t, h, g * gc),
  // with the token block counted along the tokens (no integer division per token and group).
  const int64_t hb = h / b.gh;
  int64_t tb = t0 / b.gt, tr = t0 % b.gt;
  auto row_base = [&]() { return static_cast<std::size_t>((tb * b.nh + hb) * b.nc); };
  auto next_token = [&]() {
    if (++tr == b.gt) {
      tr = 0;
      ++tb;
    }
  };
  switch (st.scale) {
    case Scale::kRow:
      for (int64_t t = 0; t < n; ++t, next_token()) sz(row_base(), ms + t, mz + t);
      return;
    case Scale::kGroup: {
      const int64_t ng = D / b.gc;
      for (int64_t t = 0; t < n; ++t, next_token()) {
        const std::size_t g0 = row_base();
        for (int64_t g = 0; g < ng; ++g)
          sz(g0 + static_cast<std::size_t>(g), ms + t * ng + g, mz + t * ng + g);
      }
      return;
    }
    case Scale::kExpand:
      for (int64_t t = 0; t < n; ++t, next_token())
        for (int64_t g = 0; g < D / b.gc; ++g) {
          float s, z;
          sz(row_base() + static_cast<std::size_t>(g), &s, &z);
          for (int64_t d = g * b.gc; d < (g + 1) * b.gc; ++d) {
            ms[t * D + d] = s;
            mz[t * D + d] = z;
          }
        }
      return;
    case Scale::kChannel: {
      const auto g0 = static_cast<std::size_t>(b.index(t0, h, 0));
      for (int64_t d = 0; d < D; ++d) sz(g0 + static_cast<std::size_t>(d), ms + d, mz + d);
      return;
    }
  }
}

/// Decodes the packed row at `row` (tile position t) into floats (real domain for Lloyd-Max:
/// centroids, QJL correction, inverse rotation, norm).
template <class S, Load L>
inline void decode_row(const Stream& st, const uint8_t* row, const uint8_t* sg, int64_t t,
                       const float* ms, const float* mz, const float* qn, float* out,
                       int64_t D) {
  using V = typename S::V;
  const int64_t nj = D / S::W;
  if (!st.packed || st.lm) {
    for (int64_t j = 0; j < nj; ++j) S::store(out + j * S::W, load_chunk<S, L>(row, j, st.lut));
    if (st.lm) {
      const auto& ctx = *st.ctx;
      if (st.qjl) {
        for (int64_t jj = 0; jj < D; ++jj) {
          const float c = sg[jj] ? qn[t] : -qn[t];
          const float* srow = ctx.qjl.data() + jj * D;
          for (int64_t i = 0; i < D; ++i) out[i] += c * srow[i];
        }
      }
      ctx.rotation.apply_inverse(out);
      for (int64_t i = 0; i < D; ++i) out[i] *= ms[t];
    }
    return;
  }
  const int64_t gc = st.box.gc;
  for (int64_t j = 0; j < nj; ++j) {
    const V c = load_chunk<S, L>(row, j, st.lut);
    V s, z;
    switch (st.scale) {
      case Scale::kRow: s = S::set1(ms[t]); z = S::set1(mz[t]); break;
      case Scale::kGroup: {
        const int64_t ng = D / gc, g = j * S::W / gc;
        s = S::set1(ms[t * ng + g]);
        z = S::set1(mz[t * ng + g]);
        break;
      }
      case Scale::kExpand: s = S::load(ms + t * D + j * S::W); z = S::load(mz + t * D + j * S::W); break;
      default: s = S::load(ms + j * S::W); z = S::load(mz + j * S::W); break;
    }
    S::store(out + j * S::W, S::fma(c, s, z));
  }
}

/// Rotates row x (head_dim D) at position pos (core/rope.hpp's formula and rounding).
inline void rope_row(float* x, int64_t D, const float* c, const float* s, RopeStyle style) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t i0 = style == RopeStyle::kAdjacent ? 2 * i : i;
    const int64_t i1 = style == RopeStyle::kAdjacent ? 2 * i + 1 : i + half;
    const float a = x[i0], b = x[i1];
    x[i0] = a * c[i] - b * s[i];
    x[i1] = a * s[i] + b * c[i];
  }
}

/// One work unit: tokens [a, b) x queries [i0, i1), all kv heads.
template <class S>
class Unit {
 public:
  Unit(const Problem& P, Workspace& ws, Scratch& sc) : P_(P), ws_(ws), sc_(sc) {}

  void run(int64_t chunk, int64_t qb) {
    const int64_t D = P_.D, H = P_.H;
    i0_ = qb * kQueryBlock;
    const int64_t i1 = std::min(P_.nq, i0_ + kQueryBlock);
    R_ = (i1 - i0_) * P_.G;
    int64_t a = chunk * P_.split;
    int64_t b = std::min(P_.T, a + P_.split);
    if (P_.causal) b = std::min(b, P_.T - P_.nq + i1);  // last visible token + 1
    if (P_.window > 0) {  // skip what precedes the first query's window (64-token aligned)
      const int64_t last0 = P_.causal ? P_.T - P_.nq + i0_ : P_.T - 1;
      a = std::max(a, (last0 - P_.window + 1) / kTile * kTile);
    }
    const std::size_t nr = static_cast<std::size_t>(H * R_);
    sc_.m.assign(nr, -std::numeric_limits<float>::infinity());
    sc_.l.assign(nr, 0.f);
    sc_.acc.assign(nr * static_cast<std::size_t>(D), 0.f);
    acc_eo_ = false;
    const bool vlm = P_.v_ctx != nullptr;
    if (vlm) {
      sc_.acc_rot.assign(nr * static_cast<std::size_t>(D), 0.f);
      sc_.sacc.assign(nr * static_cast<std::size_t>(D), 0.f);
      sc_.sconst.assign(nr, 0.f);
    }
    const std::size_t tr = static_cast<std::size_t>(R_ * kTile);
    sc_.s.resize(tr);
    sc_.w.resize(tr);
    sc_.zacc.resize(static_cast<std::size_t>(R_));
    const std::size_t td = static_cast<std::size_t>(kTile * D);
    for (auto* v : {&sc_.ku, &sc_.vu, &sc_.ksg, &sc_.vsg}) v->resize(td);
    for (auto* v : {&sc_.kms, &sc_.kmz, &sc_.vms, &sc_.vmz, &sc_.krow}) v->resize(td);
    sc_.krp.resize(kTile);
    sc_.vrp.resize(kTile);
    sc_.kq.resize(kTile);
    sc_.vq.resize(kTile);
    sc_.qf.resize(static_cast<std::size_t>(R_ * D));
    sc_.qz.resize(static_cast<std::size_t>(R_));
    if (P_.rope != nullptr) {
      sc_.rc.resize(static_cast<std::size_t>(kTile * (D / 2)));
      sc_.rs.resize(static_cast<std::size_t>(kTile * (D / 2)));
      sc_.rope_c.resize(static_cast<std::size_t>(D / 2));
      sc_.rope_s.resize(static_cast<std::size_t>(D / 2));
    }
    sc_.rope_n = 0;  // this call's positions and frequencies are computed afresh
    sc_.tmp.resize(static_cast<std::size_t>(std::max(D, R_)));

    if (a < b) {
#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
      if constexpr (std::is_same<S, Simd256>::value) {
        if (D % 16 == 0) {
          // all heads of a tile at once: [H, R, kTile] scores and weights, [H, ...] metadata
          const auto hr = static_cast<std::size_t>(H * R_);
          const auto ngmax = static_cast<std::size_t>(D / 16);
          sc_.s.resize(hr * kTile);
          sc_.w.resize(hr * kTile);
          sc_.wg.resize(hr * ngmax * kTile);
          sc_.zg.resize(hr * ngmax);
          sc_.zacc.resize(hr);
          sc_.qf.resize(hr * static_cast<std::size_t>(D));
          sc_.qz.resize(hr);
          const std::size_t mt = std::max(static_cast<std::size_t>(H) * ngmax * kTile,
                                          static_cast<std::size_t>(std::max(H, kTile) * D));
          for (auto* v : {&sc_.kms, &sc_.kmz, &sc_.vms, &sc_.vmz}) v->resize(mt);
          for (auto* v : {&sc_.kub, &sc_.vub}) v->resize(static_cast<std::size_t>(kTile * H * D));
          if (P_.rope != nullptr)
            sc_.krow.resize(static_cast<std::size_t>(std::max(kRopeBlock * H, kTile) * D));
          sc_.pieces.reserve(static_cast<std::size_t>(kTile));
          sc_.next.reserve(static_cast<std::size_t>(kTile));
          run_tiles(a, b);
          finish(chunk, qb);
          return;
        }
      }
#endif
      for (std::size_t si = 0; si < ws_.segs.size(); ++si) {
        const CacheSegment& seg = ws_.segs[si];
        const int64_t s0 = std::max(a, seg.begin), s1 = std::min(b, seg.end);
        if (s0 >= s1) continue;
        const Stream& ks = ws_.ks[si];
        const Stream& vs = ws_.vs[si];
        int64_t t = s0;
        while (t < s1) {
          int64_t e = std::min(s1, t + kTile);
          for (const Stream* st : {&ks, &vs})
            if (st->packed && st->scale == Scale::kChannel) {
              const int64_t gt = st->box.gt, loc = t - seg.begin;
              e = std::min(e, seg.begin + (loc / gt + 1) * gt);
            }
          for (int64_t h = 0; h < H; ++h) tile(seg, ks, vs, h, t, e);
          t = e;
        }
      }
    }
    finish(chunk, qb);
  }

 private:
  float* row_acc(float* base, int64_t h, int64_t r) const { return base + (h * R_ + r) * P_.D; }

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
  // ---- AVX2 path (attention_avx2.hpp). A tile is up to kTile tokens gathered over consecutive
  // segments of the same kind (a cache's pages hold 16-32 tokens each) and is processed for all
  // kv heads at once, token-major: the keys of a token for every head are one contiguous run
  // of bytes in a page, so scoring reads the keys in address order, and the values of the tile
  // are prefetched while its keys are scored (per-head walks over rows H * D * bytes apart ran
  // at half the bandwidth of a sequential read on the Zen 3 host; see docs/benchmarks.md).
  // Codes of odd bit widths (int3, nuq2/3, lm3, ...) are unpacked to bytes for the whole tile
  // first, then read as 8-bit codes. Streams the microkernels do not read (QJL, group widths
  // that are not a multiple of 16) go through tile() one segment piece and one head at a time.
  using Piece = Scratch::Piece;

  /// Tokens scored ahead of the current one whose key rows are prefetched.
  static constexpr int64_t kKeyAhead = 12;

  /// True when the AVX2 microkernels read this stream.
  static bool fast_stream(const Stream& st) {
    if (!st.packed) return st.rows.dim_contiguous();
    if (st.qjl) return false;
    if (st.lm) return true;
    if (st.scale == Scale::kExpand) return false;
    return st.scale != Scale::kGroup || st.box.gc % 16 == 0;
  }

  /// True when tile_all reads these keys: pre-RoPE keys of any kind (decoded and rotated to
  /// f32 rows first), else the kinds the microkernels read.
  bool keys_in_tile(const Stream& ks) const { return P_.rope != nullptr || fast_stream(ks); }

  /// True when two segments' streams may share a tile (same reading, only the pointers differ).
  static bool same_kind(const Stream& a, const Stream& b) {
    if (a.packed != b.packed || !fast_stream(a) || !fast_stream(b)) return false;
    if (!a.packed) return a.rows.strides().head == b.rows.strides().head;
    return a.load == b.load && a.scale == b.scale && a.bits == b.bits && a.lm == b.lm &&
           a.zeros == b.zeros && a.raw == b.raw && a.off == b.off && a.mul == b.mul &&
           a.box.gt == b.box.gt && a.box.gh == b.box.gh && a.box.gc == b.box.gc &&
           a.ctx == b.ctx && a.view.config.meta == b.view.config.meta && a.nout == b.nout &&
           a.nuq == b.nuq && (!a.nuq || std::memcmp(a.lut, b.lut, sizeof a.lut) == 0);
  }

  /// Collects the next tile of [a, b) from the cursor (si, t) into `out`: pieces of
  /// consecutive segments of one kind, up to kTile tokens (one piece when the microkernels do
  /// not read the streams). Returns its token count (0 at the end).
  int64_t next_tile(int64_t a, int64_t b, std::size_t& si, int64_t& t,
                    std::vector<Piece>& out) const {
    out.clear();
    int64_t tn = 0;
    for (; si < ws_.segs.size(); ++si) {
      const CacheSegment& seg = ws_.segs[si];
      const int64_t s0 = std::max(a, seg.begin), s1 = std::min(b, seg.end);
      if (s0 >= s1) continue;
      if (t < s0) t = s0;
      if (t >= s1) continue;
      const Stream& ks = ws_.ks[si];
      const Stream& vs = ws_.vs[si];
      if (tn > 0 && !(same_kind(ws_.ks[out.front().si], ks) && same_kind(ws_.vs[out.front().si], vs)))
        return tn;
      const bool alone = !(keys_in_tile(ks) && fast_stream(vs));
      while (t < s1) {
        int64_t e = std::min(s1, t + kTile - tn);
        for (const Stream* st : {&ks, &vs})
          if (st->packed && st->scale == Scale::kChannel) {
            const int64_t gt = st->box.gt, loc = t - seg.begin;
            e = std::min(e, seg.begin + (loc / gt + 1) * gt);
          }
        out.push_back(Piece{si, t - seg.begin, e - t, tn});
        tn += e - t;
        t = e;
        if (tn == kTile || alone) return tn;
      }
    }
    return tn;
  }

  /// Puts the value accumulators (and the Lloyd-Max rotated-domain ones) in even/odd channel
  /// order (eo) or back in natural order.
  void acc_order(bool eo) {
    if (eo == acc_eo_) return;
    const int64_t D = P_.D, rows = P_.H * R_;
    auto conv = [&](float* x) {
      for (int64_t i = 0; i < rows; ++i) {
        if (eo) {
          avx2::to_eo(x + i * D, x + i * D, D);
        } else {
          avx2::from_eo(x + i * D, x + i * D, D);
        }
      }
    };
    conv(sc_.acc.data());
    if (P_.v_ctx != nullptr) conv(sc_.acc_rot.data());
    acc_eo_ = eo;
  }

  void run_tiles(int64_t a, int64_t b) {
    std::size_t si = 0;
    int64_t t = a;
    int64_t n = next_tile(a, b, si, t, sc_.pieces);
    for (const Piece& p : sc_.pieces) {
      prefetch_meta(ws_.ks[p.si], p);
      prefetch_meta(ws_.vs[p.si], p);
    }
    while (n > 0) {
      // the next tile, so that its metadata (read first thing when its keys are scored) is
      // prefetched while this tile is processed
      const int64_t nn = next_tile(a, b, si, t, sc_.next);
      const std::size_t si0 = sc_.pieces.front().si;
      if (keys_in_tile(ws_.ks[si0]) && fast_stream(ws_.vs[si0])) {
        for (const Piece& p : sc_.next) {
          prefetch_meta(ws_.ks[p.si], p);
          prefetch_meta(ws_.vs[p.si], p);
        }
        tile_all(n);
      } else {
        acc_order(false);
        for (const Piece& p : sc_.pieces) {
          const CacheSegment& seg = ws_.segs[p.si];
          for (int64_t h = 0; h < P_.H; ++h)
            tile(seg, ws_.ks[p.si], ws_.vs[p.si], h, seg.begin + p.loc0,
                 seg.begin + p.loc0 + p.n);
        }
      }
      std::swap(sc_.pieces, sc_.next);
      n = nn;
    }
  }

  /// Pointers to head 0's row of every tile token (rp[t]); returns the byte distance between
  /// heads and sets `span` to the bytes of a token's rows over all heads. Codes the loaders do
  /// not read in place (st.unpack) are unpacked into ubuf ([kTile, H, D] bytes) first.
  int64_t row_ptrs(const std::vector<Stream>& streams, const std::vector<Piece>& pcs,
                   const uint8_t** rp, int64_t& span, uint8_t* ubuf) const {
    const int64_t H = P_.H, D = P_.D;
    int64_t hs = 0;
    for (const Piece& p : pcs) {
      const Stream& st = streams[p.si];
      if (st.packed && st.unpack) {
        const auto row = static_cast<std::size_t>(H * D);
        unpack_codes(st.view.codes, static_cast<std::size_t>(p.n) * row, st.bits,
                     ubuf + static_cast<std::size_t>(p.o) * row,
                     static_cast<std::size_t>(p.loc0) * row * static_cast<std::size_t>(st.bits));
        for (int64_t t = 0; t < p.n; ++t) rp[p.o + t] = ubuf + (p.o + t) * H * D;
        hs = D;
        span = H * D;
      } else if (st.packed) {
        hs = D * st.bits / 8;
        const uint8_t* base = st.view.codes + p.loc0 * H * hs;
        for (int64_t t = 0; t < p.n; ++t) rp[p.o + t] = base + t * H * hs;
        span = H * hs;
      } else {
        hs = st.rows.strides().head * static_cast<int64_t>(sizeof(float));
        for (int64_t t = 0; t < p.n; ++t)
          rp[p.o + t] = reinterpret_cast<const uint8_t*>(st.rows.row(p.loc0 + t, 0));
        span = (H - 1) * hs + D * static_cast<int64_t>(sizeof(float));
      }
    }
    return hs;
  }

  /// Prefetches the metadata (scales, zeros, norms) piece p reads for all heads: a contiguous
  /// run of groups in the group-box order of packed_view.hpp.
  void prefetch_meta(const Stream& st, const Piece& p) const {
    if (!st.packed || st.raw) return;
    const PackedView& v = st.view;
    const auto msz = static_cast<int64_t>(meta_size(v.config.meta));
    auto run = [](const uint8_t* base, int64_t from, int64_t to) {
      if (base == nullptr) return;
      for (int64_t o = from & ~int64_t{63}; o < to; o += 64) _mm_prefetch(reinterpret_cast<const char*>(base + o), _MM_HINT_T0);
    };
    if (st.lm) {
      run(v.norms, p.loc0 * P_.H * msz, (p.loc0 + p.n) * P_.H * msz);
      return;
    }
    const GroupBox& b = st.box;
    const int64_t g0 = b.index(p.loc0, 0, 0), g1 = b.index(p.loc0 + p.n - 1, P_.H - 1, P_.D - 1) + 1;
    run(v.scales, g0 * msz, g1 * msz);
    if (st.zeros) run(v.zeros, g0 * msz, g1 * msz);
  }

  static void prefetch_rows(const uint8_t* p, int64_t span) {
    for (int64_t o = 0; o < span; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T1);
  }

  /// Per-token metadata of piece p, head h, group-major: ms[g * kTile + p.o + t] (kRow: g = 0;
  /// kGroup: the row's groups of gc channels; Lloyd-Max: the norm); zero points carry the folded
  /// offset as in tile_meta().
  void meta_rows(const Stream& st, const Piece& p, int64_t h, float* ms, float* mz) const {
    const PackedView& v = st.view;
    const GroupBox& b = st.box;
    const MetaDType md = v.config.meta;
    if (st.lm) {
      for (int64_t t = 0; t < p.n; ++t) {
        ms[p.o + t] = detail::load_meta(v.norms, md, static_cast<std::size_t>((p.loc0 + t) * P_.H + h));
        mz[p.o + t] = 0.f;
      }
      return;
    }
    const int64_t ng = st.scale == Scale::kGroup ? P_.D / b.gc : 1;
    int64_t tb = p.loc0 / b.gt, tr = p.loc0 % b.gt;
    const int64_t hb = h / b.gh;
    for (int64_t t = 0; t < p.n; tr = 0, ++tb) {  // runs of tokens sharing one token block
      const int64_t len = std::min(p.n - t, b.gt - tr);
      const auto g0 = static_cast<std::size_t>((tb * b.nh + hb) * b.nc);
      for (int64_t g = 0; g < ng; ++g) {
        const float sc = detail::load_meta(v.scales, md, g0 + static_cast<std::size_t>(g));
        const float z = st.zeros ? detail::load_meta(v.zeros, md, g0 + static_cast<std::size_t>(g)) : 0.f;
        std::fill_n(ms + g * kTile + p.o + t, len, sc * st.mul);
        std::fill_n(mz + g * kTile + p.o + t, len, z - st.off * sc);
      }
      t += len;
    }
  }

  /// 8 metadata values from slot i on, as floats.
  static avx2::V meta8(const uint8_t* base, MetaDType md, std::size_t i) {
    if (md == MetaDType::kF16)
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 2 * i)));
    return _mm256_loadu_ps(reinterpret_cast<const float*>(base + 4 * i));
  }

  /// 8 x 8 transpose (rows v[0..7] become columns).
  static void transpose8(avx2::V* v) {
    using V = avx2::V;
    const V t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
    const V t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
    const V t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
    const V t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
    const V u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const V u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const V u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const V u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    v[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    v[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    v[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    v[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    v[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    v[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    v[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    v[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
  }

  /// Token-axis groups (one scale per token, head and group of gc channels) of piece p for all
  /// heads at once: a token's H * ng values are contiguous, so 8 tokens x 8 values are loaded,
  /// transposed and stored as 8 columns ms[c * kTile + t] (c = h * ng + g). Returns false (and
  /// does nothing) unless the shape allows it.
  bool meta_token_groups(const Stream& st, const Piece& p, int64_t ng, float* ms, float* mz) const {
    using V = avx2::V;
    const GroupBox& b = st.box;
    const int64_t cols = P_.H * ng;
    if (st.lm || b.gt != 1 || b.gh != 1 || b.nc != ng || cols % 8 != 0) return false;
    const PackedView& v = st.view;
    const MetaDType md = v.config.meta;
    const V mul = _mm256_set1_ps(st.mul), off = _mm256_set1_ps(st.off);
    int64_t t = 0;
    for (; t + 8 <= p.n; t += 8)
      for (int64_t c = 0; c < cols; c += 8) {
        V sv[8], zv[8];
        for (int u = 0; u < 8; ++u) {
          const auto i = static_cast<std::size_t>((p.loc0 + t + u) * cols + c);
          sv[u] = meta8(v.scales, md, i);
          zv[u] = st.zeros ? meta8(v.zeros, md, i) : _mm256_setzero_ps();
        }
        transpose8(sv);
        if (st.zeros) transpose8(zv);
        for (int k = 0; k < 8; ++k) {
          _mm256_storeu_ps(ms + (c + k) * kTile + p.o + t, _mm256_mul_ps(sv[k], mul));
          _mm256_storeu_ps(mz + (c + k) * kTile + p.o + t, _mm256_fnmadd_ps(off, sv[k], zv[k]));
        }
      }
    for (; t < p.n; ++t)
      for (int64_t c = 0; c < cols; ++c) {
        const auto i = static_cast<std::size_t>((p.loc0 + t) * cols + c);
        const float sc = detail::load_meta(v.scales, md, i);
        const float z = st.zeros ? detail::load_meta(v.zeros, md, i) : 0.f;
        ms[c * kTile + p.o + t] = sc * st.mul;
        mz[c * kTile + p.o + t] = z - st.off * sc;
      }
    return true;
  }

  /// Per-channel metadata (channel axis) of the block holding segment-local token t0, head h:
  /// ms[d], mz[d] (tile_meta()'s kChannel case, 8 channels at a time).
  void meta_channel(const Stream& st, int64_t t0, int64_t h, float* ms, float* mz) const {
    using V = avx2::V;
    const GroupBox& b = st.box;
    const PackedView& v = st.view;
    const MetaDType md = v.config.meta;
    const int64_t D = P_.D;
    const auto g0 = static_cast<std::size_t>(((t0 / b.gt) * b.nh + h / b.gh) * b.nc);
    if (b.gc != 1 || D % 8 != 0) {
      tile_meta(st, t0, 1, h, ms, mz, nullptr);
      return;
    }
    const V mul = _mm256_set1_ps(st.mul), off = _mm256_set1_ps(st.off);
    for (int64_t d = 0; d < D; d += 8) {
      const V sv = meta8(v.scales, md, g0 + static_cast<std::size_t>(d));
      const V zv = st.zeros ? meta8(v.zeros, md, g0 + static_cast<std::size_t>(d)) : _mm256_setzero_ps();
      _mm256_storeu_ps(ms + d, _mm256_mul_ps(sv, mul));
      _mm256_storeu_ps(mz + d, _mm256_fnmadd_ps(off, sv, zv));
    }
  }

  /// Metadata of every piece and head of the tile: head h at ms + h * ng * kTile; entries
  /// [n, n8) are zero.
  void meta_tile(const std::vector<Stream>& streams, int64_t n, int64_t ng, float* ms,
                 float* mz) const {
    const int64_t n8 = (n + 7) & ~int64_t{7};
    for (const Piece& p : sc_.pieces) {
      if (meta_token_groups(streams[p.si], p, ng, ms, mz)) continue;
      for (int64_t h = 0; h < P_.H; ++h)
        meta_rows(streams[p.si], p, h, ms + h * ng * kTile, mz + h * ng * kTile);
    }
    for (int64_t c = 0; c < P_.H * ng; ++c)
      for (int64_t t = n; t < n8; ++t) ms[c * kTile + t] = mz[c * kTile + t] = 0.f;
  }

  /// Scores of tokens [a, b) for every head: sc[(h * R + r) * kTile + t] = q_h[r] . k_h(t), with
  /// q_h = q + h * qh (R rows of D) and kl = make(h). TB tokens at a time (RB * TB = 8
  /// accumulators); before each step the key rows kKeyAhead tokens on (up to `n`) and the value
  /// rows of the step's tokens are prefetched.
  template <int TB, class MakeKL>
  void dot_heads(int64_t a, int64_t b, int64_t n, const float* q, int64_t qh, const MakeKL& make,
                 int64_t kspan, int64_t vspan) {
    const int64_t D = P_.D, njp = D / 16, R = R_, H = P_.H;
    const uint8_t* const* krp = sc_.krp.data();
    const uint8_t* const* vrp = sc_.vrp.data();
    float* sc = sc_.s.data();
    auto rows = [&](int64_t t, auto tb) {
      constexpr int T = decltype(tb)::value;
      for (int u = 0; u < T; ++u) {
        if (t + u + kKeyAhead < n) prefetch_rows(krp[t + u + kKeyAhead], kspan);
        prefetch_rows(vrp[t + u], vspan);
      }
      for (int64_t h = 0; h < H; ++h) {
        const auto kl = make(h);
        const float* qr = q + h * qh;
        float* s = sc + h * R * kTile;
        int64_t r = 0;
        if constexpr (T == 1 || T == 2 || (avx2::kWide && T == 4))
          for (; r + 4 <= R; r += 4) avx2::dot_blk<4, T>(kl, t, njp, qr + r * D, D, s + r * kTile, kTile);
        if constexpr (T <= 4)
          for (; r + 2 <= R; r += 2) avx2::dot_blk<2, T>(kl, t, njp, qr + r * D, D, s + r * kTile, kTile);
        for (; r < R; ++r) avx2::dot_blk<1, T>(kl, t, njp, qr + r * D, D, s + r * kTile, kTile);
      }
    };
    int64_t t = a;
    for (; t + TB <= b; t += TB) rows(t, std::integral_constant<int, TB>());
    for (; t < b; ++t) rows(t, std::integral_constant<int, 1>());
  }

  template <class MakeKL>
  void dot_all(int64_t a, int64_t b, int64_t n, const float* q, int64_t qh, const MakeKL& make,
               int64_t kspan, int64_t vspan) {
    if (R_ >= 4) {
      dot_heads<avx2::kWide ? 4 : 2>(a, b, n, q, qh, make, kspan, vspan);
    } else if (R_ >= 2) {
      dot_heads<4>(a, b, n, q, qh, make, kspan, vspan);
    } else {
      dot_heads<8>(a, b, n, q, qh, make, kspan, vspan);
    }
  }

  /// acc_h[r] += sum_t w(h, r, g, t) v_h(t) for tokens [a, b), every head, in blocks of
  /// avx2::kTokBlock tokens; the weight of (h, r, group g, t) is w[(h * R + r) * wr + g * wg + t]
  /// (gc = 0: one group), acc = base + (h * R + r) * D, vl = make(h).
  template <class MakeVL>
  void axpy_all(int64_t a, int64_t b, const float* w, int64_t wr, int64_t wg, int64_t gc,
                float* base, const MakeVL& make) {
    const int64_t D = P_.D, njp = D / 16, R = R_, H = P_.H;
    for (int64_t t0 = a; t0 < b; t0 += avx2::kTokBlock) {
      const int64_t t1 = std::min(b, t0 + avx2::kTokBlock);
      for (int64_t h = 0; h < H; ++h) {
        const auto vl = make(h);
        int64_t r = 0;
        // channel pairs per block: 8 (AVX2) or 16 (AVX-512) vector accumulators
        constexpr int kJ = avx2::kWide ? 2 : 1;
        for (; r + 4 <= R; r += 4)
          avx2::axpy_tokens<4, kJ>(vl, t0, t1, njp, w + (h * R + r) * wr, wr, wg, gc,
                                   base + (h * R + r) * D, D);
        for (; r + 2 <= R; r += 2)
          avx2::axpy_tokens<2, 2 * kJ>(vl, t0, t1, njp, w + (h * R + r) * wr, wr, wg, gc,
                                       base + (h * R + r) * D, D);
        for (; r < R; ++r)
          avx2::axpy_tokens<1, 4 * kJ>(vl, t0, t1, njp, w + (h * R + r) * wr, wr, wg, gc,
                                       base + (h * R + r) * D, D);
      }
    }
  }

  /// Tile tokens per block of pre-RoPE key rows (all heads) decoded before they are scored: the
  /// block's f32 rows (16 x H x D floats, 64 KiB at H = 8, D = 128) stay in L2.
  static constexpr int64_t kRopeBlock = 16;

  /// Pre-RoPE keys of tile tokens [a, b) for all heads: every piece's rows decoded and rotated
  /// (rope_key_row) into sc_.krow as [b - a, H, D] floats, krp[t] at token t's rows. The RoPE
  /// table usually holds the tile's positions already (tile_all computes it for the whole
  /// tile). Sets `span` to a token's bytes and returns the byte stride between
  /// heads.
  int64_t rope_keys_all(int64_t a, int64_t b, int64_t& span) {
    const int64_t H = P_.H, D = P_.D;
    float* kr = sc_.krow.data();
    for (const Piece& p : sc_.pieces) {
      const int64_t lo = std::max(a, p.o), hi = std::min(b, p.o + p.n);
      if (lo >= hi) continue;
      const Stream& ks = ws_.ks[p.si];
      const int64_t loc = p.loc0 + (lo - p.o);
      const int64_t tr0 = rope_table(ws_.segs[p.si].begin + loc, hi - lo);
      for (int64_t h = 0; h < H; ++h) {
        if (ks.packed) tile_meta(ks, loc, hi - lo, h, sc_.kms.data(), sc_.kmz.data(), sc_.kq.data());
        for (int64_t t = lo; t < hi; ++t)
          rope_key_row(ks, loc + (t - lo), h, t - lo, tr0 + (t - lo), kr + ((t - a) * H + h) * D);
      }
    }
    for (int64_t t = a; t < b; ++t)
      sc_.krp[static_cast<std::size_t>(t)] = reinterpret_cast<const uint8_t*>(kr + (t - a) * H * D);
    span = H * D * static_cast<int64_t>(sizeof(float));
    return D * static_cast<int64_t>(sizeof(float));
  }

  void tile_all(int64_t n) {
    using V = avx2::V;
    const auto& pcs = sc_.pieces;
    const int64_t R = R_, H = P_.H;
    const Stream& ks0 = ws_.ks[pcs.front().si];
    const Stream& vs0 = ws_.vs[pcs.front().si];
    const int64_t t0 = ws_.segs[pcs.front().si].begin + pcs.front().loc0;
    int64_t kspan = 0, vspan = 0;
    const int64_t vhs = row_ptrs(ws_.vs, pcs, sc_.vrp.data(), vspan, sc_.vub.data());
    if (P_.rope != nullptr) {
      // ---- pre-RoPE keys: the tile's rows of every head decoded and rotated into f32 rows
      // (sc_.krow, [n, H, D]), then scored by the same all-heads kernels as f32 keys
      rope_table(t0, n);
      const float* qs = ws_.qs.data() + i0_ * P_.G * P_.D;
      const uint8_t* const* rp = sc_.krp.data();
      const int64_t khs = P_.D * static_cast<int64_t>(sizeof(float));
      auto plain = [rp, khs](int64_t h) {
        const int64_t off = h * khs;
        return [rp, off](int64_t t, int64_t jp) { return avx2::ld2<Load::kF32>(rp[t] + off, jp, nullptr); };
      };
      for (int64_t a = 0; a < n; a += kRopeBlock) {
        const int64_t b = std::min(n, a + kRopeBlock);
        rope_keys_all(a, b, kspan);
        dot_all(a, b, b, qs, P_.nq * P_.G * P_.D, plain, kspan, vspan);
      }
    } else {
      const int64_t khs = row_ptrs(ws_.ks, pcs, sc_.krp.data(), kspan, sc_.kub.data());
      for (int64_t t = 0; t < std::min(n, kKeyAhead); ++t) prefetch_rows(sc_.krp[static_cast<std::size_t>(t)], kspan);
      // ---- keys: scores [H, R, n]
      with_load(ks0.packed ? ks0.load : Load::kF32,
                [&](auto LC) { score_all<LC.value>(n, khs, kspan, vspan); });
    }
    if (ks0.nout > 0 && P_.rope == nullptr)
      for (const Piece& p : pcs)
        for (int64_t h = 0; h < H; ++h)
          outlier_scores(ws_.ks[p.si], p.loc0, p.n, h,
                         ws_.qs.data() + (h * P_.nq * P_.G + i0_ * P_.G) * P_.D,
                         sc_.s.data() + h * R * kTile + p.o);
    // ---- causal mask, online softmax: weights into sc (entries [n, n8) are 0)
    float* sc = sc_.s.data();
    const int64_t n8 = (n + 7) & ~int64_t{7};
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = 0; r < R; ++r) {
        const int64_t i = i0_ + r / P_.G;
        const int64_t last = P_.causal ? P_.T - P_.nq + i : P_.T - 1;  // last visible position
        const int64_t nv = std::min(n, last - t0 + 1);
        // first visible entry of the tile (sliding window)
        const int64_t lo = P_.window > 0 ? std::max<int64_t>(0, last - P_.window + 1 - t0) : 0;
        float* s = sc + (h * R + r) * kTile;
        if (nv <= lo) {  // this query sees none of the tile
          std::fill(s, s + n8, 0.f);
          continue;
        }
        std::fill(s + nv, s + n8, -std::numeric_limits<float>::infinity());
        std::fill(s, s + lo, -std::numeric_limits<float>::infinity());
        const std::size_t st = static_cast<std::size_t>(h * R + r);
        V mv = _mm256_loadu_ps(s);
        for (int64_t t = 8; t < n8; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float mnew = std::max(sc_.m[st], _mm_cvtss_f32(m4));
        if (mnew != sc_.m[st]) {
          const float alpha = exp_neg(sc_.m[st] - mnew);
          sc_.m[st] = mnew;
          sc_.l[st] *= alpha;
          rescale(row_acc(sc_.acc.data(), h, r), alpha);
          if (P_.v_ctx != nullptr) {
            rescale(row_acc(sc_.acc_rot.data(), h, r), alpha);
            rescale(row_acc(sc_.sacc.data(), h, r), alpha);
            sc_.sconst[st] *= alpha;
          }
        }
        V sum = _mm256_setzero_ps();
        const V mneg = _mm256_set1_ps(-mnew);
        for (int64_t t = 0; t < n8; t += 8) {
          const V e = Simd256::exp(_mm256_add_ps(_mm256_loadu_ps(s + t), mneg));
          _mm256_storeu_ps(s + t, e);
          sum = _mm256_add_ps(sum, e);
        }
        sc_.l[st] += Simd256::reduce(sum);
      }
    // ---- values
    with_load(vs0.packed ? vs0.load : Load::kF32,
              [&](auto LC) { accumulate_all<LC.value>(n, vhs); });
    if (vs0.nout > 0)
      for (const Piece& p : pcs)
        for (int64_t h = 0; h < H; ++h)
          outlier_values(ws_.vs[p.si], p.loc0, p.n, h, sc + h * R * kTile + p.o,
                         row_acc(sc_.acc.data(), h, 0), acc_eo_);
  }

  template <Load L>
  void score_all(int64_t n, int64_t hs, int64_t kspan, int64_t vspan) {
    using V = avx2::V;
    const auto& pcs = sc_.pieces;
    const int64_t D = P_.D, R = R_, H = P_.H, HR = P_.nq * P_.G;
    const Stream& ks0 = ws_.ks[pcs.front().si];
    constexpr bool eo = avx2::eo_order(L);  // 4-bit codes: queries in even/odd order
    const float* qs = (eo ? ws_.qs_eo : ws_.qs).data() + i0_ * P_.G * D;  // head h at + h * HR * D
    float* sc = sc_.s.data();
    float* ms = sc_.kms.data();
    float* mz = sc_.kmz.data();
    const uint8_t* const* rp = sc_.krp.data();
    const float* lut = ks0.lut;
    auto plain = [rp, hs, lut](int64_t h) {
      const int64_t off = h * hs;
      return [rp, off, lut](int64_t t, int64_t jp) { return avx2::ld2<L>(rp[t] + off, jp, lut); };
    };
    if (!ks0.packed || ks0.raw) {
      dot_all(0, n, n, qs, HR * D, plain, kspan, vspan);
      return;
    }
    if (ks0.lm) {
      meta_tile(ws_.ks, n, 1, ms, mz);
      const float* qr = (eo ? ws_.qrot_eo : ws_.qrot).data() + i0_ * P_.G * D;
      dot_all(0, n, n, qr, HR * D, plain, kspan, vspan);
      for (int64_t h = 0; h < H; ++h)
        for (int64_t r = 0; r < R; ++r)
          for (int64_t t = 0; t < n; ++t) sc[(h * R + r) * kTile + t] *= ms[h * kTile + t];
      return;
    }
    switch (ks0.scale) {
      case Scale::kRow: {
        meta_tile(ws_.ks, n, 1, ms, mz);
        dot_all(0, n, n, qs, HR * D, plain, kspan, vspan);
        for (int64_t h = 0; h < H; ++h) {
          const float* qsum = ws_.qsum.data() + h * HR + i0_ * P_.G;
          for (int64_t r = 0; r < R; ++r) {
            float* o = sc + (h * R + r) * kTile;
            const float qr = qsum[r];
            const float* hms = ms + h * kTile;
            const float* hmz = mz + h * kTile;
            for (int64_t t = 0; t < n; ++t) o[t] = std::fma(hms[t], o[t], hmz[t] * qr);
          }
        }
        return;
      }
      case Scale::kGroup: {
        const int64_t gc = ks0.box.gc, ng = D / gc;
        meta_tile(ws_.ks, n, ng, ms, mz);
        auto deq = [rp, hs, lut, gc, ng, ms, mz](int64_t h) {
          const int64_t off = h * hs;
          const float* hms = ms + h * ng * kTile;
          const float* hmz = mz + h * ng * kTile;
          return [rp, off, lut, gc, hms, hmz](int64_t t, int64_t jp) {
            const int64_t g = (16 * jp / gc) * kTile + t;
            return avx2::fma_bcast(avx2::ld2<L>(rp[t] + off, jp, lut), hms + g, hmz + g);
          };
        };
        dot_all(0, n, n, qs, HR * D, deq, kspan, vspan);
        return;
      }
      default: {  // kChannel: per block, the block's scales folded into the queries
        float* qf = sc_.qf.data();  // [H, R, D]
        float* qz = sc_.qz.data();  // [H, R]
        qs = ws_.qs.data() + i0_ * P_.G * D;  // folded in natural order, then permuted
        for (const Piece& p : pcs) {
          for (int64_t h = 0; h < H; ++h) {
            meta_channel(ws_.ks[p.si], p.loc0, h, ms, mz);
            for (int64_t r = 0; r < R; ++r) {
              V z = _mm256_setzero_ps();
              const float* qr = qs + h * HR * D + r * D;
              float* f = qf + (h * R + r) * D;
              for (int64_t j = 0; j < D; j += 8) {
                const V q = _mm256_loadu_ps(qr + j);
                _mm256_storeu_ps(f + j, _mm256_mul_ps(q, _mm256_loadu_ps(ms + j)));
                z = _mm256_fmadd_ps(q, _mm256_loadu_ps(mz + j), z);
              }
              qz[h * R + r] = Simd256::reduce(z);
            }
          }
          if constexpr (eo)
            for (int64_t v = 0; v < H * R; ++v) avx2::to_eo(qf + v * D, qf + v * D, D);
          dot_all(p.o, p.o + p.n, n, qf, R * D, plain, kspan, vspan);
          for (int64_t h = 0; h < H; ++h)
            for (int64_t r = 0; r < R; ++r) {
              float* o = sc + (h * R + r) * kTile + p.o;
              const float z = qz[h * R + r];
              for (int64_t t = 0; t < p.n; ++t) o[t] += z;
            }
        }
        return;
      }
    }
  }

  template <Load L>
  void accumulate_all(int64_t n, int64_t hs) {
    using V = avx2::V;
    const auto& pcs = sc_.pieces;
    const int64_t D = P_.D, R = R_, H = P_.H;
    const Stream& vs0 = ws_.vs[pcs.front().si];
    acc_order(vs0.packed && avx2::eo_order(L));
    const float* p = sc_.s.data();
    float* ms = sc_.vms.data();
    float* mz = sc_.vmz.data();
    const uint8_t* const* rp = sc_.vrp.data();
    const float* lut = vs0.lut;
    const int64_t n8 = (n + 7) & ~int64_t{7};
    auto plain = [rp, hs, lut](int64_t h) {
      const int64_t off = h * hs;
      return [rp, off, lut](int64_t t, int64_t jp) { return avx2::ld2<L>(rp[t] + off, jp, lut); };
    };
    if (!vs0.packed || vs0.raw) {
      axpy_all(0, n, p, kTile, 0, 0, sc_.acc.data(), plain);
      return;
    }
    if (vs0.scale == Scale::kChannel && !vs0.lm) {
      // the block's per-channel vectors, [H, D], dequantized in the loader
      for (const Piece& pc : pcs) {
        for (int64_t h = 0; h < H; ++h)
          meta_channel(ws_.vs[pc.si], pc.loc0, h, ms + h * D, mz + h * D);
        if constexpr (avx2::eo_order(L))
          for (int64_t h = 0; h < H; ++h) {
            avx2::to_eo(ms + h * D, ms + h * D, D);
            avx2::to_eo(mz + h * D, mz + h * D, D);
          }
        auto deq = [rp, hs, lut, ms, mz, D](int64_t h) {
          const int64_t off = h * hs;
          const float* hms = ms + h * D;
          const float* hmz = mz + h * D;
          return [rp, off, lut, hms, hmz](int64_t t, int64_t jp) {
            return avx2::fma_vec(avx2::ld2<L>(rp[t] + off, jp, lut), hms + 16 * jp, hmz + 16 * jp);
          };
        };
        axpy_all(pc.o, pc.o + pc.n, p, kTile, 0, 0, sc_.acc.data(), deq);
      }
      return;
    }
    if (vs0.lm || vs0.scale == Scale::kRow) {
      // w = p * s (row scale or norm); zero points: one scalar per row.
      meta_tile(ws_.vs, n, 1, ms, mz);
      float* w = sc_.w.data();
      for (int64_t h = 0; h < H; ++h)
        for (int64_t r = 0; r < R; ++r) {
          V zs = _mm256_setzero_ps();
          const float* pr = p + (h * R + r) * kTile;
          float* wr = w + (h * R + r) * kTile;
          for (int64_t t = 0; t < n8; t += 8) {
            const V pv = _mm256_loadu_ps(pr + t);
            _mm256_storeu_ps(wr + t, _mm256_mul_ps(pv, _mm256_loadu_ps(ms + h * kTile + t)));
            zs = _mm256_fmadd_ps(pv, _mm256_loadu_ps(mz + h * kTile + t), zs);
          }
          sc_.zacc[static_cast<std::size_t>(h * R + r)] = Simd256::reduce(zs);
        }
      float* acc = vs0.lm ? sc_.acc_rot.data() : sc_.acc.data();
      axpy_all(0, n, w, kTile, 0, 0, acc, plain);
      if (!vs0.lm && (vs0.zeros || vs0.off != 0.f)) {
        for (int64_t hr = 0; hr < H * R; ++hr) {
          float* a = acc + hr * D;
          const V z = _mm256_set1_ps(sc_.zacc[static_cast<std::size_t>(hr)]);
          for (int64_t j = 0; j < D; j += 8) _mm256_storeu_ps(a + j, _mm256_add_ps(_mm256_loadu_ps(a + j), z));
        }
      }
      return;
    }
    // kGroup: w'[h, r, g, t] = p[h, r, t] * s[h, g, t]; zero points: one sum per row and group.
    const int64_t gc = vs0.box.gc, ng = D / gc;
    meta_tile(ws_.vs, n, ng, ms, mz);
    float* wg = sc_.wg.data();
    float* zg = sc_.zg.data();
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t g = 0; g < ng; ++g) {
          V zs = _mm256_setzero_ps();
          const float* pr = p + (h * R + r) * kTile;
          const float* gs = ms + (h * ng + g) * kTile;
          const float* gz = mz + (h * ng + g) * kTile;
          float* wo = wg + ((h * R + r) * ng + g) * kTile;
          for (int64_t t = 0; t < n8; t += 8) {
            const V pv = _mm256_loadu_ps(pr + t);
            _mm256_storeu_ps(wo + t, _mm256_mul_ps(pv, _mm256_loadu_ps(gs + t)));
            zs = _mm256_fmadd_ps(pv, _mm256_loadu_ps(gz + t), zs);
          }
          zg[(h * R + r) * ng + g] = Simd256::reduce(zs);
        }
    float* acc = sc_.acc.data();
    axpy_all(0, n, wg, ng * kTile, kTile, gc, acc, plain);
    for (int64_t hr = 0; hr < H * R; ++hr)
      for (int64_t g = 0; g < ng; ++g) {
        const V z = _mm256_set1_ps(zg[hr * ng + g]);
        float* a = acc + hr * D + g * gc;
        for (int64_t j = 0; j < gc; j += 8) _mm256_storeu_ps(a + j, _mm256_add_ps(_mm256_loadu_ps(a + j), z));
      }
  }
#endif

  void tile(const CacheSegment& seg, const Stream& ks, const Stream& vs, int64_t h, int64_t t0,
            int64_t t1) {
    const int64_t n = t1 - t0, D = P_.D, nj = D / S::W, loc0 = t0 - seg.begin;
    const int64_t R = R_, HR = P_.nq * P_.G;
    const float* qs = ws_.qs.data() + (h * HR + i0_ * P_.G) * D;
    float* sc = sc_.s.data();
    // ---- keys: scores [R, n]
    if (ks.packed) tile_meta(ks, loc0, n, h, sc_.kms.data(), sc_.kmz.data(), sc_.kq.data());
    if (P_.rope != nullptr) {
      score_rope(seg, ks, h, t0, n, qs);
    } else if (!ks.packed) {
      dot_rows<S>(
          [&](int64_t t, int64_t j) { return S::load(ks.rows.row(loc0 + t, h) + j * S::W); }, n,
          nj, qs, D, R, sc);
    } else {
      with_load(ks.load, [&](auto LC) { score_packed<LC.value>(ks, h, loc0, n, qs); });
      if (ks.nout > 0) outlier_scores(ks, loc0, n, h, qs, sc);
    }
    // ---- causal mask, online softmax: weights into sc
    for (int64_t r = 0; r < R; ++r) {
      const int64_t i = i0_ + r / P_.G;
      const int64_t last = P_.causal ? P_.T - P_.nq + i : P_.T - 1;  // last visible position
      const int64_t nv = std::min(n, last - t0 + 1);
      // first visible entry of the tile (sliding window)
      const int64_t lo = P_.window > 0 ? std::max<int64_t>(0, last - P_.window + 1 - t0) : 0;
      float* s = sc + r * kTile;
      const std::size_t st = static_cast<std::size_t>(h * R + r);
      if (nv <= lo) {  // this query sees none of the tile
        std::fill(s, s + kTile, 0.f);
        continue;
      }
      std::fill(s + nv, s + kTile, -std::numeric_limits<float>::infinity());
      std::fill(s, s + lo, -std::numeric_limits<float>::infinity());
      float mx;
      {
        auto mv = S::load(s);
        for (int64_t t = S::W; t < kTile; t += S::W) mv = S::max(mv, S::load(s + t));
        alignas(64) float lanes[S::W];
        S::store(lanes, mv);
        mx = lanes[0];
        for (int k = 1; k < S::W; ++k) mx = std::max(mx, lanes[k]);
      }
      const float mnew = std::max(sc_.m[st], mx);
      if (mnew != sc_.m[st]) {
        const float alpha = exp_neg(sc_.m[st] - mnew);
        sc_.m[st] = mnew;
        sc_.l[st] *= alpha;
        rescale(row_acc(sc_.acc.data(), h, r), alpha);
        if (P_.v_ctx != nullptr) {
          rescale(row_acc(sc_.acc_rot.data(), h, r), alpha);
          rescale(row_acc(sc_.sacc.data(), h, r), alpha);
          sc_.sconst[st] *= alpha;
        }
      }
      using V = typename S::V;
      V sum = S::zero();
      const V mv = S::set1(mnew);
      for (int64_t t = 0; t < kTile; t += S::W) {
        const V p = S::exp(S::fma(mv, S::set1(-1.f), S::load(s + t)));
        S::store(s + t, p);
        sum = S::add(sum, p);
      }
      sc_.l[st] += S::reduce(sum);
    }
    // ---- values
    if (!vs.packed) {
      float* acc = row_acc(sc_.acc.data(), h, 0);
      axpy_rows<S>(
          [&](int64_t t, int64_t j) {
            return S::load(vs.rows.row(loc0 + t, h) + j * S::W);
          },
          n, nj, sc, acc, D, R);
      return;
    }
    tile_meta(vs, loc0, n, h, sc_.vms.data(), sc_.vmz.data(), sc_.vq.data());
    with_load(vs.load, [&](auto LC) { accumulate_packed<LC.value>(vs, h, loc0, n); });
    if (vs.nout > 0) outlier_values(vs, loc0, n, h, sc, row_acc(sc_.acc.data(), h, 0), false);
  }

  // ---- dense-and-sparse streams (quant/outlier_quant.hpp) over int / fp8 / nuq: the kernels read
  // the dense codes as usual (every channel has one; an outlier's holds its clamped value), and
  // these add the sparse part: for each of the k outliers of a (token, head) vector, its fp16
  // value minus the dense value at its channel, times the query (scores) or the softmax weight
  // (values). Dequantization writes the exact values over the dense ones, so dense + this
  // difference is what the oracle reads.

  /// Channel and exact (fp16) value of outlier i of a view (vector-major, k per vector). A
  /// position outside head_dim (a corrupt page: quantizers never write one, the archive reader
  /// and dequantize refuse it) is clamped to the last channel, so the kernels stay inside
  /// their buffers whatever the page holds.
  static std::pair<int64_t, float> outlier_at(const PackedView& v, std::size_t i) {
    uint16_t hb;
    std::memcpy(&hb, v.outlier_values + 2 * i, 2);
    const int64_t D = v.shape.head_dim;
    const int64_t pos = D > 256 ? (v.outlier_pos[2 * i] | (v.outlier_pos[2 * i + 1] << 8))
                                : v.outlier_pos[i];
    return {pos < D ? pos : D - 1, half_bits_to_float_fast(hb)};
  }

  /// f(channel, exact value) for the outliers of vector (loc, h).
  template <class F>
  static void for_outliers(const Stream& st, int64_t loc, int64_t h, F&& f) {
    const auto base = static_cast<std::size_t>((loc * st.view.shape.heads + h) * st.nout);
    for (int64_t j = 0; j < st.nout; ++j) {
      const auto o = outlier_at(st.view, base + static_cast<std::size_t>(j));
      f(o.first, o.second);
    }
  }

  /// f(t, channel, exact value - dense value) for the k outliers of each vector (segment-local
  /// token loc0 + t, head h), t in [0, n). The dense value is code * scale + zero as the kernels
  /// see it (zero with the folded offset, fp8 unscaled value times scale * 2^8 for e4m3, nuq:
  /// the code's level). Everything that does not change per outlier is hoisted: the group box's
  /// token block is counted along the tokens, the channel group is a multiply-shift (no integer
  /// division), and the code kind is a template parameter.
  template <class F>
  static void for_outlier_deltas(const Stream& st, int64_t loc0, int64_t n, int64_t h, F&& f) {
    if (st.load == Load::kE4M3) {
      outlier_deltas<1>(st, loc0, n, h, f);
    } else if (st.load == Load::kE5M2) {
      outlier_deltas<2>(st, loc0, n, h, f);
    } else {
      outlier_deltas<0>(st, loc0, n, h, f);
    }
  }

  /// for_outlier_deltas for one code kind (0: int / nuq codes, st.bits wide, LSB-first
  /// bitstream; 1: e4m3; 2: e5m2).
  template <int Kind, class F>
  static void outlier_deltas(const Stream& st, int64_t loc0, int64_t n, int64_t h, F& f) {
    const PackedView& v = st.view;
    const int64_t H = v.shape.heads, D = v.shape.head_dim, k = st.nout;
    const GroupBox& b = st.box;
    const bool gc1 = b.gc == D;  // one group over the vector's channels
    // pos / gc == (pos * gmul) >> 32 exactly for pos, gc < 2^16
    const bool fast_div = D < (int64_t{1} << 16);
    const uint64_t gmul = (uint64_t{1} << 32) / static_cast<uint64_t>(b.gc) + 1;
    auto group_of = [&](int64_t pos) {
      if (gc1) return int64_t{0};
      return fast_div ? static_cast<int64_t>((static_cast<uint64_t>(pos) * gmul) >> 32) : pos / b.gc;
    };
    const auto bits = static_cast<std::size_t>(st.bits);
    const uint32_t mask = (1u << st.bits) - 1u;
    const float mul = st.mul, off = st.off;
    const bool zeros = st.zeros, nuq = st.nuq;
    const int64_t hb = h / b.gh;
    int64_t tb = loc0 / b.gt, tr = loc0 % b.gt;  // token block of loc0 + t, and t's place in it
    for (int64_t t = 0; t < n; ++t) {
      const int64_t vec = (loc0 + t) * H + h;
      const int64_t gbase = (tb * b.nh + hb) * b.nc;
      const auto ebase = static_cast<std::size_t>(vec * D);
      const auto obase = static_cast<std::size_t>(vec * k);
      for (int64_t j = 0; j < k; ++j) {
        const auto [pos, val] = outlier_at(v, obase + static_cast<std::size_t>(j));
        const std::size_t e = ebase + static_cast<std::size_t>(pos);
        float c;
        if constexpr (Kind == 1) {
          c = SimdScalar::from_e4m3(v.codes + e);
        } else if constexpr (Kind == 2) {
          c = SimdScalar::from_e5m2(v.codes + e);
        } else {
          const std::size_t bit = e * bits;
          uint32_t w = v.codes[bit / 8];
          if (bit % 8 + bits > 8) w |= static_cast<uint32_t>(v.codes[bit / 8 + 1]) << 8;
          const uint32_t code = (w >> (bit % 8)) & mask;
          c = nuq ? st.lut[code] : static_cast<float>(code);
        }
        const auto g = static_cast<std::size_t>(gbase + group_of(pos));
        const float sc = v.scale(g);
        f(t, pos, val - std::fma(c, sc * mul, (zeros ? v.zero(g) : 0.f) - off * sc));
      }
      if (++tr == b.gt) {
        tr = 0;
        ++tb;
      }
    }
  }

  /// The sparse part of tokens [loc0, loc0 + n) (n <= kTile), head h, as a table: channel
  /// sc_.opos[j * kTile + t] and difference sc_.odv[j * kTile + t] of outlier j of token t (the
  /// values for_outlier_deltas gives). With AVX2 the codes are read eight tokens at a time with
  /// gathers (outlier_table8); blocks near the end of the view's regions (a gather reads 4
  /// bytes from each address) and shapes it does not take go through the scalar path.
  void outlier_table(const Stream& st, int64_t loc0, int64_t n, int64_t h) const {
    const int64_t k = st.nout;
    const auto need = static_cast<std::size_t>(k * kTile);
    if (sc_.opos.size() < need) {
      sc_.opos.resize(need);
      sc_.odv.resize(need);
    }
    int32_t* pos = sc_.opos.data();
    float* dv = sc_.odv.data();
    int64_t t0 = 0;
#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
    t0 = outlier_table8(st, loc0, n, h, pos, dv);
#endif
    int64_t i = 0;  // outliers arrive token by token, k per token
    for_outlier_deltas(st, loc0 + t0, n - t0, h, [&](int64_t t, int64_t c, float d) {
      const int64_t j = i++ % k;
      pos[j * kTile + t0 + t] = static_cast<int32_t>(c);
      dv[j * kTile + t0 + t] = d;
    });
  }

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
  /// outlier_table eight tokens at a time: fills tokens [0, m) and returns m (a multiple of 8;
  /// 0 when the view's shape does not suit the vector path). Same arithmetic as
  /// outlier_deltas: dense = fma(c, scale * mul, zero - off * scale), c the int code, the nuq
  /// level, or the fp8 code's value as fp16 (e4m3: exponent rebased, mul = 2^8).
  static int64_t outlier_table8(const Stream& st, int64_t loc0, int64_t n, int64_t h,
                                int32_t* pos, float* dv) {
    const PackedView& v = st.view;
    const int64_t H = v.shape.heads, D = v.shape.head_dim, k = st.nout, T = v.shape.tokens;
    const GroupBox& b = st.box;
    const bool gc1 = b.gc == D;
    const bool gc_pow2 = (b.gc & (b.gc - 1)) == 0;
    const int64_t numel = T * H * D;
    if (n < 8 || (!gc1 && !gc_pow2) || numel * st.bits >= (int64_t{1} << 31) ||
        T * H * k >= (int64_t{1} << 29))
      return 0;
    const int gshift = gc1 ? 31 : __builtin_ctzll(static_cast<unsigned long long>(b.gc));
    const int64_t pb = D > 256 ? 2 : 1;
    const bool f16m = v.config.meta == MetaDType::kF16;
    // Bytes a 4-byte read may touch: the regions' sizes.
    const int64_t code_bytes = (numel * st.bits + 7) / 8;
    const int64_t n_out = T * H * k;
    const int64_t meta_bytes = b.count() * (f16m ? 2 : 4);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i m16 = _mm256_set1_epi32(0xffff);
    const __m256i cmask = _mm256_set1_epi32((1 << st.bits) - 1);
    const __m256i vD = _mm256_set1_epi32(static_cast<int>(D));
    const __m256i vDm1 = _mm256_set1_epi32(static_cast<int>(D - 1));
    const __m256i vbits = _mm256_set1_epi32(st.bits);
    const __m256 vmul = _mm256_set1_ps(st.mul), voff = _mm256_set1_ps(st.off);
    const __m256 lut_lo = _mm256_loadu_ps(st.lut), lut_hi = _mm256_loadu_ps(st.lut + 8);
    const int64_t hb = h / b.gh;
    const bool e4m3 = st.load == Load::kE4M3, e5m2 = st.load == Load::kE5M2;
    auto f16x8 = [&](__m256i w) {  // low 16 bits of each lane -> 8 floats
      const __m256i p = _mm256_packus_epi32(_mm256_and_si256(w, m16), _mm256_setzero_si256());
      return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08)));
    };
    auto meta8 = [&](const uint8_t* base, __m256i g) {
      if (!f16m) return _mm256_i32gather_ps(reinterpret_cast<const float*>(base), g, 4);
      return f16x8(_mm256_i32gather_epi32(reinterpret_cast<const int*>(base),
                                          _mm256_add_epi32(g, g), 1));
    };
    const __m256i vk = _mm256_set1_epi32(static_cast<int>(k));
    int32_t gb[8];
    int64_t tb = loc0 / b.gt, tr = loc0 % b.gt;  // token block of loc0 + m + i, place in it
    int64_t m = 0;
    for (; m + 8 <= n; m += 8) {
      const int64_t tok = loc0 + m;  // first token of the block
      const int64_t vlast = (tok + 7) * H + h;
      const int64_t gmax = (((tok + 7) / b.gt) * b.nh + hb) * b.nc + b.nc - 1;
      // A gather reads 4 bytes at each address: stay inside each region.
      if ((vlast * D + D) * st.bits / 8 + 4 > code_bytes || (vlast * k + k) * 2 + 2 > 2 * n_out ||
          (vlast * k + k) * pb + 3 > pb * n_out ||
          (f16m ? 2 * gmax + 4 : 4 * gmax + 4) > meta_bytes)
        break;
      for (int i = 0; i < 8; ++i) {  // group box base of each token
        gb[i] = static_cast<int32_t>((tb * b.nh + hb) * b.nc);
        if (++tr == b.gt) {
          tr = 0;
          ++tb;
        }
      }
      const __m256i gbase = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb));
      // vector index of each token, and its first outlier's index
      const __m256i vec = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(tok * H + h)),
                                           _mm256_mullo_epi32(lane, _mm256_set1_epi32(static_cast<int>(H))));
      const __m256i o0 = _mm256_mullo_epi32(vec, vk);
      const __m256i e0 = _mm256_mullo_epi32(vec, vD);
      for (int64_t j = 0; j < k; ++j) {
        const __m256i o = _mm256_add_epi32(o0, _mm256_set1_epi32(static_cast<int>(j)));
        __m256i c = _mm256_i32gather_epi32(reinterpret_cast<const int*>(v.outlier_pos),
                                           pb == 2 ? _mm256_add_epi32(o, o) : o, 1);
        c = _mm256_and_si256(c, pb == 2 ? m16 : _mm256_set1_epi32(0xff));
        c = _mm256_min_epi32(c, vDm1);  // as outlier_at: corrupt positions stay in the vector
        const __m256 val = f16x8(_mm256_i32gather_epi32(
            reinterpret_cast<const int*>(v.outlier_values), _mm256_add_epi32(o, o), 1));
        const __m256i bit = _mm256_mullo_epi32(_mm256_add_epi32(e0, c), vbits);
        const __m256i w = _mm256_i32gather_epi32(reinterpret_cast<const int*>(v.codes),
                                                 _mm256_srli_epi32(bit, 3), 1);
        const __m256i code = _mm256_and_si256(
            _mm256_srlv_epi32(w, _mm256_and_si256(bit, _mm256_set1_epi32(7))), cmask);
        __m256 cf;
        if (e4m3) {  // sign to bit 15, exponent and mantissa to bits 7..14 (Simd256::from_e4m3)
          cf = f16x8(_mm256_or_si256(
              _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(0x80)), 8),
              _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(0x7f)), 7)));
        } else if (e5m2) {
          cf = f16x8(_mm256_slli_epi32(code, 8));
        } else if (st.nuq) {  // level[code]: two 8-entry tables, the high one where code >= 8
          cf = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lut_lo, code),
                                _mm256_permutevar8x32_ps(lut_hi, code),
                                _mm256_castsi256_ps(_mm256_slli_epi32(code, 28)));
        } else {
          cf = _mm256_cvtepi32_ps(code);
        }
        const __m256i g =
            gc1 ? gbase : _mm256_add_epi32(gbase, _mm256_srl_epi32(c, _mm_cvtsi32_si128(gshift)));
        const __m256 sc = meta8(v.scales, g);
        const __m256 z = st.zeros ? meta8(v.zeros, g) : _mm256_setzero_ps();
        const __m256 dense = _mm256_fmadd_ps(cf, _mm256_mul_ps(sc, vmul), _mm256_fnmadd_ps(voff, sc, z));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pos + j * kTile + m), c);
        _mm256_storeu_ps(dv + j * kTile + m, _mm256_sub_ps(val, dense));
      }
    }
    return m;
  }
#endif

  /// Scores of tokens [loc0, loc0 + n) (sc[r * kTile + t], R rows of q, stride D) += q . sparse.
  void outlier_scores(const Stream& st, int64_t loc0, int64_t n, int64_t h, const float* q,
                      float* sc) const {
    const int64_t R = R_, D = P_.D, k = st.nout;
    outlier_table(st, loc0, n, h);
    for (int64_t j = 0; j < k; ++j) {
      const int32_t* pos = sc_.opos.data() + j * kTile;
      const float* dv = sc_.odv.data() + j * kTile;
      for (int64_t r = 0; r < R; ++r) {
        const float* qr = q + r * D;
        float* s = sc + r * kTile;
        int64_t t = 0;
#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
        for (; t + 8 <= n; t += 8) {
          const __m256 qv = _mm256_i32gather_ps(
              qr, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pos + t)), 4);
          _mm256_storeu_ps(s + t, _mm256_fmadd_ps(qv, _mm256_loadu_ps(dv + t), _mm256_loadu_ps(s + t)));
        }
#endif
        for (; t < n; ++t) s[t] = std::fma(qr[pos[t]], dv[t], s[t]);
      }
    }
  }

  /// acc[r, channel] (R rows, stride D; even/odd channel order when eo) += p[r * kTile + t] *
  /// sparse difference, tokens [loc0, loc0 + n).
  void outlier_values(const Stream& st, int64_t loc0, int64_t n, int64_t h, const float* p,
                      float* acc, bool eo) const {
    const int64_t R = R_, D = P_.D, k = st.nout;
    outlier_table(st, loc0, n, h);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < k; ++j) {
        const int64_t pos = sc_.opos[static_cast<std::size_t>(j * kTile + t)];
        const float dv = sc_.odv[static_cast<std::size_t>(j * kTile + t)];
        const int64_t i = eo ? (pos & ~int64_t{15}) + (pos & 1) * 8 + ((pos & 15) >> 1) : pos;
        for (int64_t r = 0; r < R; ++r) acc[r * D + i] += p[r * kTile + t] * dv;
      }
  }

  void rescale(float* x, float alpha) {
    const auto a = S::set1(alpha);
    for (int64_t d = 0; d < P_.D; d += S::W) S::store(x + d, S::mul(S::load(x + d), a));
  }

  template <Load L>
  void score_packed(const Stream& ks, int64_t h, int64_t loc0, int64_t n, const float* qs) {
    using V = typename S::V;
    const int64_t D = P_.D, nj = D / S::W, R = R_, HR = P_.nq * P_.G;
    float* sc = sc_.s.data();
    const float* ms = sc_.kms.data();
    const float* mz = sc_.kmz.data();
    const uint8_t** rp = sc_.krp.data();
    for (int64_t t = 0; t < n; ++t) rp[t] = packed_row(ks, loc0 + t, h, sc_.ku.data() + t * D);
    auto plain = [&](int64_t t, int64_t j) { return load_chunk<S, L>(rp[t], j, ks.lut); };
    if (ks.lm) {
      const float* qr = ws_.qrot.data() + (h * HR + i0_ * P_.G) * D;
      dot_rows<S>(plain, n, nj, qr, D, R, sc);
      if (ks.qjl) {
        const float* sq = ws_.sq.data() + (h * HR + i0_ * P_.G) * D;
        const float* sqs = ws_.sqsum.data() + h * HR + i0_ * P_.G;
        uint8_t* sg = sc_.ksg.data();
        for (int64_t t = 0; t < n; ++t) {
          const auto vi = static_cast<std::size_t>((loc0 + t) * ks.view.shape.heads + h);
          unpack_bits(ks.view.qjl_signs, static_cast<std::size_t>(D), 1, sg + t * D,
                      vi * static_cast<std::size_t>(D));
        }
        float* w = sc_.w.data();  // scratch: sign dot products
        dot_rows<S>([&](int64_t t, int64_t j) { return S::cvt(S::codes_u8(sg + t * D + j * S::W)); },
                    n, nj, sq, D, R, w);
        for (int64_t r = 0; r < R; ++r)
          for (int64_t t = 0; t < n; ++t)
            sc[r * kTile + t] += sc_.kq[t] * (2.f * w[r * kTile + t] - sqs[r]);
      }
      for (int64_t r = 0; r < R; ++r)
        for (int64_t t = 0; t < n; ++t) sc[r * kTile + t] *= ms[t];
      return;
    }
    switch (ks.scale) {
      case Scale::kRow: {
        dot_rows<S>(plain, n, nj, qs, D, R, sc);
        const float* qsum = ws_.qsum.data() + h * HR + i0_ * P_.G;
        for (int64_t r = 0; r < R; ++r) {
          float* o = sc + r * kTile;
          const float qr = qsum[r];
          for (int64_t t = 0; t < n; ++t) o[t] = std::fma(ms[t], o[t], mz[t] * qr);
        }
        return;
      }
      case Scale::kGroup: {
        const int64_t gc = ks.box.gc, ng = D / gc;
        dot_rows<S>(
            [&](int64_t t, int64_t j) {
              const int64_t g = t * ng + j * S::W / gc;
              return S::fma(load_chunk<S, L>(rp[t], j, ks.lut), S::set1(ms[g]), S::set1(mz[g]));
            },
            n, nj, qs, D, R, sc);
        return;
      }
      case Scale::kExpand:
        dot_rows<S>(
            [&](int64_t t, int64_t j) {
              return S::fma(load_chunk<S, L>(rp[t], j, ks.lut), S::load(ms + t * D + j * S::W),
                            S::load(mz + t * D + j * S::W));
            },
            n, nj, qs, D, R, sc);
        return;
      case Scale::kChannel: {
        // Fold the block's per-channel scales into the queries, zero points into one constant.
        float* qf = sc_.qf.data();
        float* qz = sc_.qz.data();
        for (int64_t r = 0; r < R; ++r) {
          V z = S::zero();
          for (int64_t j = 0; j < nj; ++j) {
            const V q = S::load(qs + r * D + j * S::W);
            S::store(qf + r * D + j * S::W, S::mul(q, S::load(ms + j * S::W)));
            z = S::fma(q, S::load(mz + j * S::W), z);
          }
          qz[r] = S::reduce(z);
        }
        dot_rows<S>(plain, n, nj, qf, D, R, sc);
        for (int64_t r = 0; r < R; ++r)
          for (int64_t t = 0; t < n; ++t) sc[r * kTile + t] += qz[r];
        return;
      }
    }
  }

  /// cos / sin of positions [t0, t0 + n) (n <= kTile) for every RoPE frequency into sc_.rc /
  /// sc_.rs ([t, D/2]), once per tile piece: every kv head of the piece reuses them (they were
  /// computed per row before, 2 x D/2 libm calls per token and head). Per frequency w: an exact
  /// seed cos(t0 w), sin(t0 w) in double, then angle addition by the precomputed cos(w),
  /// sin(w) in double for the following positions, each rounded to float. After at most
  /// kTile - 1 steps the double recurrence is within ~1e-14 of cos/sin(pos w), far below the
  /// float rounding of the table (so the rows match core/rope.hpp's to about one float ulp).
  /// Returns the table row of position t0 once the table holds positions [t0, t0 + n): the
  /// table in place when it already does, else one computed from t0.
  int64_t rope_table(int64_t t0, int64_t n) {
    if (t0 >= sc_.rope_t0 && t0 + n <= sc_.rope_t0 + sc_.rope_n) return t0 - sc_.rope_t0;
    const int64_t half = P_.D / 2;
    float* rc = sc_.rc.data();
    float* rs = sc_.rs.data();
    double* c = sc_.rope_c.data();
    double* s = sc_.rope_s.data();
    const double* c1 = ws_.rope_c1.data();
    const double* s1 = ws_.rope_s1.data();
    for (int64_t i = 0; i < half; ++i) {
      const double ang = static_cast<double>(t0) * ws_.inv_freq[static_cast<std::size_t>(i)];
      c[i] = std::cos(ang);
      s[i] = std::sin(ang);
    }
    for (int64_t t = 0; t < n; ++t) {  // frequencies inner: independent chains, vectorized
      for (int64_t i = 0; i < half; ++i) {
        rc[t * half + i] = static_cast<float>(c[i]);
        rs[t * half + i] = static_cast<float>(s[i]);
        const double cn = c[i] * c1[i] - s[i] * s1[i];
        s[i] = s[i] * c1[i] + c[i] * s1[i];
        c[i] = cn;
      }
    }
    sc_.rope_t0 = t0;
    sc_.rope_n = n;
    return 0;
  }

  /// Key row (segment-local token loc, head h) decoded to floats in `out` and rotated by the
  /// RoPE table's row tr (pre-RoPE keys); the tile metadata (tile_meta of head h) is read at
  /// row t. Outliers' exact values are written before the rotation.
  void rope_key_row(const Stream& ks, int64_t loc, int64_t h, int64_t t, int64_t tr, float* out) {
    const int64_t D = P_.D;
    if (!ks.packed) {
      std::copy(ks.rows.row(loc, h), ks.rows.row(loc, h) + D, out);
    } else {
      const uint8_t* row = packed_row(ks, loc, h, sc_.ku.data());
      if (ks.qjl) {
        const auto vi = static_cast<std::size_t>(loc * ks.view.shape.heads + h);
        unpack_bits(ks.view.qjl_signs, static_cast<std::size_t>(D), 1, sc_.ksg.data(),
                    vi * static_cast<std::size_t>(D));
      }
      with_load(ks.load, [&](auto LC) {
        decode_row<S, LC.value>(ks, row, sc_.ksg.data(), t, sc_.kms.data(), sc_.kmz.data(),
                                sc_.kq.data(), out, D);
      });
      if (ks.nout > 0)  // the exact outlier values over the dense ones, before the rotation
        for_outliers(ks, loc, h, [&](int64_t pos, float val) { out[pos] = val; });
    }
    rope_row(out, D, sc_.rc.data() + tr * (D / 2), sc_.rs.data() + tr * (D / 2), P_.rope->style);
  }

  /// Pre-RoPE keys: each row decoded (L1), rotated at its position, then scored.
  void score_rope(const CacheSegment& seg, const Stream& ks, int64_t h, int64_t t0, int64_t n,
                  const float* qs) {
    const int64_t D = P_.D, nj = D / S::W, R = R_, loc0 = t0 - seg.begin;
    float* kr = sc_.krow.data();
    const int64_t tr0 = rope_table(t0, n);
    for (int64_t t = 0; t < n; ++t) rope_key_row(ks, loc0 + t, h, t, tr0 + t, kr + t * D);
    dot_rows<S>([&](int64_t t, int64_t j) { return S::load(kr + t * D + j * S::W); }, n, nj, qs,
                D, R, sc_.s.data());
  }

  template <Load L>
  void accumulate_packed(const Stream& vs, int64_t h, int64_t loc0, int64_t n) {
    const int64_t D = P_.D, nj = D / S::W, R = R_;
    const float* p = sc_.s.data();
    float* w = sc_.w.data();
    const uint8_t** rp = sc_.vrp.data();
    for (int64_t t = 0; t < n; ++t) rp[t] = packed_row(vs, loc0 + t, h, sc_.vu.data() + t * D);
    const float* ms = sc_.vms.data();
    const float* mz = sc_.vmz.data();
    if (vs.lm || vs.scale == Scale::kRow) {
      // w = p * s (row scale or norm); zero points: one scalar per row.
      for (int64_t r = 0; r < R; ++r) {
        float zsum = 0.f;
        for (int64_t t = 0; t < n; ++t) {
          w[r * kTile + t] = p[r * kTile + t] * ms[t];
          zsum += p[r * kTile + t] * mz[t];
        }
        sc_.zacc[static_cast<std::size_t>(r)] = zsum;
      }
      float* acc = row_acc(vs.lm ? sc_.acc_rot.data() : sc_.acc.data(), h, 0);
      axpy_rows<S>([&](int64_t t, int64_t j) { return load_chunk<S, L>(rp[t], j, vs.lut); }, n,
                   nj, w, acc, D, R);
      if (vs.lm) {
        if (vs.qjl) {
          // sacc_j += 2 w c s01_j, sconst += w c  (sign = 2 s01 - 1)
          uint8_t* sg = sc_.vsg.data();
          for (int64_t t = 0; t < n; ++t) {
            const auto vi = static_cast<std::size_t>((loc0 + t) * vs.view.shape.heads + h);
            unpack_bits(vs.view.qjl_signs, static_cast<std::size_t>(D), 1, sg + t * D,
                        vi * static_cast<std::size_t>(D));
          }
          for (int64_t r = 0; r < R; ++r) {
            float cs = 0.f;
            for (int64_t t = 0; t < n; ++t) {
              const float wc = w[r * kTile + t] * sc_.vq[t];
              cs += wc;
              w[r * kTile + t] = 2.f * wc;
            }
            sc_.sconst[static_cast<std::size_t>(h * R + r)] += cs;
          }
          axpy_rows<S>([&](int64_t t, int64_t j) { return S::cvt(S::codes_u8(sg + t * D + j * S::W)); },
                       n, nj, w, row_acc(sc_.sacc.data(), h, 0), D, R);
        }
        return;
      }
      if (vs.zeros || vs.off != 0.f) {
        for (int64_t r = 0; r < R; ++r) {
          float* a = row_acc(sc_.acc.data(), h, r);
          const auto z = S::set1(sc_.zacc[static_cast<std::size_t>(r)]);
          for (int64_t j = 0; j < nj; ++j) S::store(a + j * S::W, S::add(S::load(a + j * S::W), z));
        }
      }
      return;
    }
    float* acc = row_acc(sc_.acc.data(), h, 0);
    switch (vs.scale) {
      case Scale::kGroup: {
        const int64_t gc = vs.box.gc, ng = D / gc;
        axpy_rows<S>(
            [&](int64_t t, int64_t j) {
              const int64_t g = t * ng + j * S::W / gc;
              return S::fma(load_chunk<S, L>(rp[t], j, vs.lut), S::set1(ms[g]), S::set1(mz[g]));
            },
            n, nj, p, acc, D, R);
        return;
      }
      case Scale::kExpand:
        axpy_rows<S>(
            [&](int64_t t, int64_t j) {
              return S::fma(load_chunk<S, L>(rp[t], j, vs.lut), S::load(ms + t * D + j * S::W),
                            S::load(mz + t * D + j * S::W));
            },
            n, nj, p, acc, D, R);
        return;
      default:  // kChannel: the block's per-channel vectors
        axpy_rows<S>(
            [&](int64_t t, int64_t j) {
              return S::fma(load_chunk<S, L>(rp[t], j, vs.lut), S::load(ms + j * S::W),
                            S::load(mz + j * S::W));
            },
            n, nj, p, acc, D, R);
        return;
    }
  }

  /// Folds the rotated-domain value sums back and stores the unit's (m, l, acc).
  void finish(int64_t chunk, int64_t qb) {
    const int64_t D = P_.D, H = P_.H, R = R_;
#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
    acc_order(false);
#endif
    const std::size_t unit = static_cast<std::size_t>(chunk * P_.nqb + qb);
    const std::size_t stride = static_cast<std::size_t>(H * kQueryBlock * P_.G);
    float* um = ws_.um.data() + unit * stride;
    float* ul = ws_.ul.data() + unit * stride;
    float* ua = ws_.uacc.data() + unit * stride * static_cast<std::size_t>(D);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = 0; r < R; ++r) {
        const std::size_t st = static_cast<std::size_t>(h * R + r);
        float* acc = row_acc(sc_.acc.data(), h, r);
        if (P_.v_ctx != nullptr && sc_.l[st] > 0.f) {
          float* ar = row_acc(sc_.acc_rot.data(), h, r);
          const float* sa = row_acc(sc_.sacc.data(), h, r);
          const float c0 = sc_.sconst[st];
          const auto& ctx = *P_.v_ctx;
          for (int64_t j = 0; j < D; ++j) {
            const float cj = sa[j] - c0;
            if (cj == 0.f) continue;
            const float* srow = ctx.qjl.data() + j * D;
            for (int64_t i = 0; i < D; ++i) ar[i] += cj * srow[i];
          }
          ctx.rotation.apply_inverse(ar);
          for (int64_t i = 0; i < D; ++i) acc[i] += ar[i];
        }
        um[st] = sc_.m[st];
        ul[st] = sc_.l[st];
        std::copy(acc, acc + D, ua + st * static_cast<std::size_t>(D));
      }
  }

  const Problem& P_;
  Workspace& ws_;
  Scratch& sc_;
  int64_t i0_ = 0, R_ = 0;
  bool acc_eo_ = false;  // AVX2: the value accumulators are in even/odd channel order
};

/// Runs every unit (chunks x query blocks) on `workers` workers, then merges chunk results in
/// chunk order and writes `out`.
template <class S>
void run_units(const Problem& P, Workspace& ws, KVView<float> out, const AttentionOptions& opt) {
  const int64_t units = P.nchunks * P.nqb;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(opt.threads, units));
  if (static_cast<int64_t>(ws.scratch.size()) < workers)
    ws.scratch.resize(static_cast<std::size_t>(workers));
  auto body = [&](int64_t wk) {
    Unit<S> u(P, ws, ws.scratch[static_cast<std::size_t>(wk)]);
    for (int64_t k = wk; k < units; k += workers) u.run(k / P.nqb, k % P.nqb);
  };
  if (workers == 1) {
    body(0);
  } else if (opt.parallel_for) {
    opt.parallel_for(workers, body);
  } else {
    std::vector<std::thread> th;
    th.reserve(static_cast<std::size_t>(workers - 1));
    for (int64_t k = 1; k < workers; ++k) th.emplace_back(body, k);
    body(0);
    for (auto& t : th) t.join();
  }
  // Merge (fixed chunk order).
  const int64_t D = P.D, G = P.G;
  const std::size_t stride = static_cast<std::size_t>(P.H * kQueryBlock * G);
  ws.out_row.resize(static_cast<std::size_t>(D));
  float* o = ws.out_row.data();
  for (int64_t i = 0; i < P.nq; ++i) {
    const int64_t qb = i / kQueryBlock;
    const int64_t R = rows_of_block(P, qb);
    for (int64_t hq = 0; hq < P.nh; ++hq) {
      const int64_t h = hq / G, r = (i - qb * kQueryBlock) * G + hq % G;
      const std::size_t st = static_cast<std::size_t>(h * R + r);
      float M = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < P.nchunks; ++c) {
        const std::size_t u = static_cast<std::size_t>(c * P.nqb + qb);
        if (ws.ul[u * stride + st] > 0.f) M = std::max(M, ws.um[u * stride + st]);
      }
      float L = 0.f;
      std::fill(o, o + D, 0.f);
      for (int64_t c = 0; c < P.nchunks; ++c) {
        const std::size_t u = static_cast<std::size_t>(c * P.nqb + qb);
        const float l = ws.ul[u * stride + st];
        if (!(l > 0.f)) continue;
        const float f = exp_neg(ws.um[u * stride + st] - M);
        L += f * l;
        const float* a = ws.uacc.data() + (u * stride + st) * static_cast<std::size_t>(D);
        for (int64_t d = 0; d < D; ++d) o[d] += f * a[d];
      }
      const float inv = 1.f / L;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      detail::store_row(out, i, hq, o);
    }
  }
}

/// Checks the segments and the queries, prepares the streams and queries, then runs.
template <class S>
void attend_impl(Workspace& ws, Problem& P, KVView<const float> q, KVView<float> out,
                 const AttentionOptions& opt) {
  const int64_t D = P.D, H = P.H, nq = P.nq, G = P.G, HR = nq * G;
  ws.ks.resize(ws.segs.size());
  ws.vs.resize(ws.segs.size());
  P.k_ctx = P.v_ctx = nullptr;
  P.k_qjl = false;
  for (std::size_t i = 0; i < ws.segs.size(); ++i) {
    const CacheSegment& s = ws.segs[i];
    Stream& ks = ws.ks[i];
    Stream& vs = ws.vs[i];
    if (s.packed()) {
      setup_packed(ks, s.key_view, S::W);
      setup_packed(vs, s.value_view, S::W);
      if (ks.lm) {
        KVQ_REQUIRE(P.k_ctx == nullptr || P.k_ctx == ks.ctx || P.k_seed == s.key_view.config.seed,
                    kInvalidArgument, "attend: Lloyd-Max key segments use different seeds");
        P.k_seed = s.key_view.config.seed;
        P.k_ctx = ks.ctx;
        P.k_qjl = P.k_qjl || ks.qjl;
      }
      if (vs.lm) {
        KVQ_REQUIRE(P.v_ctx == nullptr || P.v_ctx == vs.ctx || P.v_seed == s.value_view.config.seed,
                    kInvalidArgument, "attend: Lloyd-Max value segments use different seeds");
        P.v_seed = s.value_view.config.seed;
        P.v_ctx = vs.ctx;
      }
    } else {
      ks = Stream();
      vs = Stream();
      ks.rows = s.key_rows;
      vs.rows = s.value_rows;
    }
  }
  // Queries: [H, nq * G, D], scaled by 1/sqrt(D); sums for zero points; rotations.
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  ws.qs.resize(static_cast<std::size_t>(H * HR * D));
  ws.qsum.resize(static_cast<std::size_t>(H * HR));
  ws.out_row.resize(static_cast<std::size_t>(D));
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t hq = 0; hq < P.nh; ++hq) {
      const int64_t h = hq / G, lr = i * G + hq % G;
      float* dst = ws.qs.data() + (h * HR + lr) * D;
      const float* r = detail::load_row(q, i, hq, ws.out_row.data());
      double sum = 0;
      for (int64_t d = 0; d < D; ++d) {
        dst[d] = r[d] * scale;
        sum += dst[d];
      }
      ws.qsum[static_cast<std::size_t>(h * HR + lr)] = static_cast<float>(sum);
    }
  if (P.k_ctx != nullptr) {
    ws.qrot.assign(ws.qs.begin(), ws.qs.end());
    P.k_ctx->rotation.apply_batch(ws.qrot.data(), H * HR);
    if (P.k_qjl) {
      ws.sq.resize(ws.qs.size());
      ws.sqsum.resize(ws.qsum.size());
      for (int64_t v = 0; v < H * HR; ++v) {
        const float* qr = ws.qrot.data() + v * D;
        float* o = ws.sq.data() + v * D;
        double tot = 0;
        for (int64_t j = 0; j < D; ++j) {
          o[j] = detail::dot_f(P.k_ctx->qjl.data() + j * D, qr, D);
          tot += o[j];
        }
        ws.sqsum[static_cast<std::size_t>(v)] = static_cast<float>(tot);
      }
    }
  }
#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
  if constexpr (std::is_same<S, Simd256>::value) {
    // 4-bit key codes are read in even/odd channel order (attention_avx2.hpp): queries too.
    bool eo = false;
    for (const Stream& ks : ws.ks) eo = eo || (ks.packed && avx2::eo_order(ks.load));
    if (eo && D % 16 == 0) {
      ws.qs_eo.resize(ws.qs.size());
      for (int64_t v = 0; v < H * HR; ++v) avx2::to_eo(ws.qs.data() + v * D, ws.qs_eo.data() + v * D, D);
      if (P.k_ctx != nullptr) {
        ws.qrot_eo.resize(ws.qrot.size());
        for (int64_t v = 0; v < H * HR; ++v)
          avx2::to_eo(ws.qrot.data() + v * D, ws.qrot_eo.data() + v * D, D);
      }
    }
  }
#endif
  if (P.rope != nullptr) {
    ws.inv_freq.resize(static_cast<std::size_t>(D / 2));
    ws.rope_c1.resize(static_cast<std::size_t>(D / 2));
    ws.rope_s1.resize(static_cast<std::size_t>(D / 2));
    for (int64_t i = 0; i < D / 2; ++i) {
      const auto ui = static_cast<std::size_t>(i);
      ws.inv_freq[ui] = std::pow(P.rope->theta, -static_cast<double>(2 * i) / static_cast<double>(D));
      ws.rope_c1[ui] = std::cos(ws.inv_freq[ui]);
      ws.rope_s1[ui] = std::sin(ws.inv_freq[ui]);
    }
  }
  const std::size_t units = static_cast<std::size_t>(P.nchunks * P.nqb);
  const std::size_t stride = static_cast<std::size_t>(H * kQueryBlock * G);
  ws.um.resize(units * stride);
  ws.ul.assign(units * stride, 0.f);
  ws.uacc.resize(units * stride * static_cast<std::size_t>(D));
  run_units<S>(P, ws, out, opt);
}

/// Validates the call and the segments (in order, covering [0, T), matching shapes).
inline void check_call(const std::vector<CacheSegment>& segs, int64_t T, int64_t H, int64_t D,
                       KVView<const float> q, KVView<float> out, bool causal,
                       const RopeConfig* rope, int layer) {
  const int64_t nq = q.tokens(), nh = q.heads();
  KVQ_REQUIRE(q.head_dim() == D, kShapeMismatch, "attend: queries have head_dim ", q.head_dim(),
              " but the cache has ", D);
  KVQ_REQUIRE(nh > 0 && nh % H == 0, kShapeMismatch, "attend: n_heads=", nh,
              " is not a positive multiple of the cache's kv_heads=", H);
  KVQ_REQUIRE(out.shape() == q.shape(), kShapeMismatch, "attend: output ", out.shape().str(),
              " does not match the queries ", q.shape().str());
  if (nq == 0) return;
  KVQ_REQUIRE(T > 0, kInvalidArgument, "attend: layer ", layer, " holds no tokens");
  KVQ_REQUIRE(!causal || nq <= T, kInvalidArgument, "attend: ", nq,
              " causal queries at the newest positions need at least as many tokens, but layer ",
              layer, " holds ", T);
  KVQ_REQUIRE(rope == nullptr || D % 2 == 0, kInvalidArgument,
              "attend: RoPE needs an even head_dim, got ", D);
  int64_t pos = 0;
  for (const CacheSegment& s : segs) {
    KVQ_REQUIRE(s.begin == pos && s.end > s.begin, kInvalidArgument, "attend: segment [",
                s.begin, ", ", s.end, ") does not continue at token ", pos);
    const Shape want{s.end - s.begin, H, D};
    if (s.packed()) {
      KVQ_REQUIRE(s.key_view.shape == want && s.value_view.shape == want &&
                      s.key_view.codes != nullptr && s.value_view.codes != nullptr,
                  kShapeMismatch, "attend: packed segment [", s.begin, ", ", s.end,
                  ") must be ", want.str(), " with codes, got keys ", s.key_view.shape.str(),
                  " and values ", s.value_view.shape.str());
    } else {
      KVQ_REQUIRE(s.key_rows.shape() == want && s.value_rows.shape() == want &&
                      s.key_rows.dim_contiguous() && s.value_rows.dim_contiguous(),
                  kShapeMismatch, "attend: row segment [", s.begin, ", ", s.end, ") must be ",
                  want.str(), " with contiguous rows");
    }
    pos = s.end;
  }
  KVQ_REQUIRE(pos == T, kInvalidArgument, "attend: the segments cover ", pos, " tokens, not ", T);
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t d = 0; d < D; ++d)
        if (!std::isfinite(q.at(i, h, d))) detail::throw_non_finite_row(q, i, h, "attend: query");
}

// Compiled-kernels mode split further (config.hpp): with KVQ_KERNELS_SEPARATE_AVX512 the AVX-512
// instance of attend_impl is compiled in its own translation unit
// (KVQ_KERNELS_IMPLEMENTATION_ATTENTION_AVX512), in parallel with the AVX2 and scalar ones.
#if KVQ_HAS_AVX512 && defined(KVQ_EXTERN_KERNELS)
#if defined(KVQ_KERNELS_IMPLEMENTATION_ATTENTION_AVX512)
template void attend_impl<Simd512>(Workspace&, Problem&, KVView<const float>, KVView<float>,
                                   const AttentionOptions&);
#elif defined(KVQ_KERNELS_IMPLEMENTATION_ATTENTION) && defined(KVQ_KERNELS_SEPARATE_AVX512)
extern template void attend_impl<Simd512>(Workspace&, Problem&, KVView<const float>,
                                          KVView<float>, const AttentionOptions&);
#endif
#endif

/// The entry point: ws.segs holds the segments (already filled by the caller). Under
/// KVQ_EXTERN_KERNELS (config.hpp) only declared here and defined once, in the translation unit
/// that defines KVQ_KERNELS_IMPLEMENTATION(_ATTENTION).
#if defined(KVQ_EXTERN_KERNELS) && !defined(KVQ_KERNELS_IMPLEMENTATION_ATTENTION)
void attend_segments(Workspace& ws, int64_t T, int64_t H, int64_t D, KVView<const float> q,
                     KVView<float> out, bool causal, const RopeConfig* rope,
                     const AttentionOptions& opt, int layer);
#else
#ifndef KVQ_KERNELS_IMPLEMENTATION_ATTENTION
inline
#endif
void attend_segments(Workspace& ws, int64_t T, int64_t H, int64_t D, KVView<const float> q,
                     KVView<float> out, bool causal, const RopeConfig* rope,
                     const AttentionOptions& opt, int layer) {
  check_call(ws.segs, T, H, D, q, out, causal, rope, layer);
  const int64_t nq = q.tokens();
  if (nq == 0) return;
  decode_unsupported(ws);
  KVQ_REQUIRE(opt.threads >= 1, kInvalidArgument, "attend: threads must be >= 1, got ",
              opt.threads);
  KVQ_REQUIRE(opt.split_tokens >= 0, kInvalidArgument,
              "attend: split_tokens must be >= 0 (0 = default), got ", opt.split_tokens);
  KVQ_REQUIRE(opt.window >= 0, kInvalidArgument,
              "attend: window must be >= 0 (0 = none), got ", opt.window);
  Problem P;
  P.T = T;
  P.H = H;
  P.D = D;
  P.nq = nq;
  P.nh = q.heads();
  P.G = P.nh / H;
  P.causal = causal;
  P.window = opt.window;
  P.rope = rope;
  P.split = opt.split_tokens > 0 ? opt.split_tokens : kDefaultSplit;
  P.nchunks = (T + P.split - 1) / P.split;
  P.nqb = (nq + kQueryBlock - 1) / kQueryBlock;
#if KVQ_HAS_AVX512
  if (D % 16 == 0 && !(KVQ_HAS_AVX2 && KVQ_HAS_F16C))
    return attend_impl<Simd512>(ws, P, q, out, opt);
#endif
#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
  if (D % 8 == 0) return attend_impl<Simd256>(ws, P, q, out, opt);
#endif
  attend_impl<SimdScalar>(ws, P, q, out, opt);
}
#endif  // KVQ_EXTERN_KERNELS

}  // namespace attn
}  // namespace kernels
}  // namespace kvq

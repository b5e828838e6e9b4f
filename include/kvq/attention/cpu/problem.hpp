#pragma once
/// \file problem.hpp
/// The fused CPU attention's problem and workspace: AttentionOptions, the per-segment
/// Stream (how keys or values are read), per-worker Scratch, the per-call Workspace and the
/// Problem geometry (attention_cpu.hpp describes the design).
#include <algorithm>
#include <array>
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
#include "kvq/core/softmax.hpp"
#include "kvq/core/tensor.hpp"
#include "kvq/geometry/grouping.hpp"
#include "kvq/layout/page_layout.hpp"
#include "kvq/quant/lloyd_max_quant.hpp"
#include "kvq/quant/packed_view.hpp"
#include "kvq/quant/quantize.hpp"
#include "kvq/quant/rotated_quant.hpp"
#include "kvq/simd/attention_avx2.hpp"
#include "kvq/simd/attention_simd.hpp"
#include "kvq/simd/int8_dot.hpp"
#include "kvq/simd/uniform_cpu.hpp"

namespace kvq {

/// Runs body(0) .. body(n - 1), possibly in parallel, and returns when all are done (a
/// caller's thread pool). Each index is one worker of the attention call.
using ParallelFor = std::function<void(int64_t n, const std::function<void(int64_t)>& body)>;

/// How the fused kernels multiply queries with keys and softmax weights with values.
enum class DotProduct : uint8_t {
  /// fp32 products from the codes (the default): every path matches the double-precision
  /// oracle (reference/attention_ref.hpp) to 2e-5.
  kExact,
  /// Integer dot products where the build and the stream allow (attention/cpu/tiles_int8.hpp):
  /// each query row quantized to int8 (one scale per row and tile, per-channel key scales folded
  /// in first) times 4- or 8-bit int key codes; softmax weights (times the value scales)
  /// quantized to uint8 per (row, channel group, 64-token tile) times 4-bit int value codes;
  /// `vpdpbusd` (AVX-512 VNNI / AVX-VNNI) or `vpmaddubsw` (AVX2). Zero points, f32 rows (sinks,
  /// residual window), and every other format (f16, fp8, FP4, nuq, Lloyd-Max, QJL, per-token
  /// key groups narrower than the row, pre-RoPE keys) keep the exact kernels. Scalar builds and
  /// head_dims that are not a multiple of 64 run exact. Error bounds: docs/attention.md.
  kInt8,
};

/// How an attention call splits its work.
struct AttentionOptions {
  /// Workers (1 = the calling thread only). With no parallel_for, threads - 1 std::threads are
  /// started per call.
  int threads = 1;
  /// Tokens per independently processed chunk (flash-decoding split); 0 = by length: T / 8
  /// rounded up to a multiple of 256, within [256, 4096] (kernels::attn::default_split).
  /// Results depend on the split (floating-point order), never on `threads`.
  int64_t split_tokens = 0;
  /// Sliding window (0 = none): the query at position p sees only the tokens at positions
  /// (p - window, p] (with causal; without, the window ends at the last token). Gemma's local
  /// layers; tiles wholly before every query's window are skipped.
  int64_t window = 0;
  /// Caller-supplied parallel-for (optional).
  ParallelFor parallel_for;
  /// Exact fp32 products (default) or the int8 dot-product path (DotProduct::kInt8).
  DotProduct dot = DotProduct::kExact;

  // ---- logits and masking (attention/cpu/mask.hpp applies them in every kernel path; the
  // oracle reference/attention_ref.hpp implements the same semantics in double).

  /// Softmax scale: logits are scale * q.k (0 = 1/sqrt(head_dim)). Must be finite and >= 0.
  float scale = 0.f;
  /// Logit soft-capping (Gemma 2): logit = softcap * tanh(logit / softcap), after the scale
  /// (0 = off). Must be finite and >= 0.
  float softcap = 0.f;
  /// Explicit query positions ([n_q] kv positions, each in [0, tokens); batch: indexed by the
  /// global query row): query i sits at positions[i] instead of the implicit tokens - n_q + i.
  /// With causal, it sees the tokens at positions <= positions[i]; the window ends there too.
  const int64_t* positions = nullptr;
  /// Custom mask as bits (optional): query i sees kv position t only when bit t % 64 of word
  /// mask_bits[i * mask_words + t / 64] is set (batch: i is the global query row, t the position
  /// within its sequence). Combined with causal and window (all must allow a token). Tree masks
  /// for speculative verification. mask_words must cover every position: >= ceil(tokens / 64).
  const uint64_t* mask_bits = nullptr;
  int64_t mask_words = 0;
  /// Custom mask as a callback (optional; not with mask_bits): mask_fn(query, kv_pos) true when
  /// the query sees the position. Called from the workers concurrently: must be thread-safe.
  std::function<bool(int64_t query, int64_t kv_pos)> mask_fn;
  /// Attention-sink logits (gpt-oss), one f32 per query head ([n_heads]; nullptr = none): each
  /// adds exp(sink - m) to the softmax denominator only (it has no value). Not NaN or +inf.
  const float* sinks = nullptr;
  /// Optional output: the log-sum-exp of each query row and head ([n_q, n_heads] f32,
  /// row-major; attend_batch: indexed by the global query row), log(sum exp(logit)) over the
  /// keys the row sees (after scale, soft-cap and masks; sink logits included), natural log;
  /// -inf for a row that sees nothing (its output is zeros). With it a caller merges this
  /// output exactly with attention it computed elsewhere over other keys (out = sum_i
  /// exp(lse_i - lse) out_i, lse = log sum_i exp(lse_i)). Written only when the call succeeds.
  float* lse = nullptr;
};

namespace kernels {
namespace attn {

constexpr int64_t kTile = 64;            ///< tokens per softmax tile
constexpr int64_t kDefaultSplit = 4096;  ///< the longest chunk when split_tokens == 0
constexpr int64_t kMinDefaultSplit = 256;  ///< the shortest chunk when split_tokens == 0

/// Tokens per chunk when split_tokens == 0, for a sequence of T tokens: T / 8 rounded up to a
/// multiple of 256, within [256, 4096]. A 1000-token sequence is 4 chunks, 8192 tokens 8 chunks
/// of 1024, 32768 tokens 8 of 4096: enough units for a few workers even for one short
/// sequence, each long enough (>= 256 tokens x all kv heads) that its setup and merge stay
/// small. It depends on T only, never on the thread count.
inline int64_t default_split(int64_t T) {
  const int64_t s = ((T + 7) / 8 + kMinDefaultSplit - 1) / kMinDefaultSplit * kMinDefaultSplit;
  return std::min(kDefaultSplit, std::max(kMinDefaultSplit, s));
}
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
  /// Codes in the rotated domain: Lloyd-Max, or int / fp8 / FP4 with QuantConfig::rotate. Keys
  /// are scored against the rotated queries (Workspace::qrot), values accumulated into
  /// Scratch::acc_rot and rotated back once per unit; f32 rows stay in the original basis.
  bool rot = false;
  const Rotation* rotation = nullptr;  ///< the rotation of a rot stream
  bool nuq = false;  ///< nuq codes: table loads (lut = the layer's levels), int scales and zeros
  /// FP4 (nvfp4 / mxfp4) codes: table loads like nuq (lut = the 16 e2m1 values), no zeros, and
  /// the block scale decoded from its e4m3 / e8m0 byte (times the tensor scale for nvfp4).
  bool fp4 = false;
  /// FP4 block scale of byte c: fl(stab[c] * tscale), stab = the 256 decoded e4m3 (nvfp4) or
  /// e8m0 (mxfp4) bytes, tscale = nvfp4's tensor scale (1 for mxfp4): fp4::nv_element_scale /
  /// fp4::decode_e8m0 bit for bit (streams.hpp, fp4_scale).
  const float* stab = nullptr;
  float tscale = 1.f;
  int bits = 32;
  int64_t nout =
      0;  ///< dense-and-sparse: outliers per (token, head) vector (int / fp8 / nuq dense)
  float off = 0.f, mul = 1.f;
  const detail::LloydMaxContext* ctx = nullptr;
  float lut[16] = {};
};

/// Per-worker scratch (reused; sized on first use).
struct Scratch {
  std::vector<float> s;           // [rows, kTile] scores, then softmax weights
  std::vector<float> w;           // [rows, kTile] value weights
  std::vector<SoftmaxState<float>> sm;  // [H, rows] online-softmax state (core/softmax.hpp)
  std::vector<float> acc;         // [H, rows, D]
  std::vector<float> acc_rot;     // [H, rows, D] rotated values (Lloyd-Max, /rot), rotated domain
  std::vector<float> sacc;        // [H, rows, D] QJL value sign sums
  std::vector<float> sconst;      // [H, rows]
  std::vector<float> zacc;        // [rows] value zero terms of one tile
  std::vector<uint8_t> ku, vu;    // [kTile, D] unpacked codes
  std::vector<uint8_t> kub, vub;  // [kTile, H, D] unpacked codes of a whole tile (odd widths)
  std::vector<uint8_t> ksg, vsg;  // [kTile, D] QJL sign bits
  std::vector<const uint8_t*> krp, vrp;   // [kTile] row pointers
  std::vector<float> kms, kmz, vms, vmz;  // tile metadata
  std::vector<float> kq, vq;              // [kTile] QJL factors
  std::vector<float> qf, qz;              // [rows, D], [rows] channel-folded queries
  std::vector<float> krow;                // [kTile, D] decoded (pre-RoPE) key rows
  std::vector<float> rc, rs;              // [kTile, D/2] RoPE cos/sin of positions rope_t0 + t
  int64_t rope_t0 = 0, rope_n = 0;        // the positions rc/rs hold (rope_n = 0: none)
  std::vector<double> rope_c, rope_s;     // [D/2] the recurrence's state (rope_table)
  std::vector<float> tmp;                 // [max(D, rows)]
  // AVX2 tiles over several segments (attention_avx2.hpp)
  struct Piece {
    std::size_t si;      ///< segment index
    int64_t loc0, n, o;  ///< segment-local first token, tokens, offset in the tile
  };
  std::vector<Piece> pieces, next;  // this tile's pieces, the next tile's
  std::vector<float> wg;            // [rows, D / 16, kTile] value weights times group scales
  std::vector<float> zg;            // [rows, D / 16] value zero sums per group
  std::vector<int32_t> opos;        // [k, kTile] dense-and-sparse: channel of outlier j of token t
  std::vector<float> odv;           // [k, kTile] its exact value minus its dense value
  // int8 dot products (tiles_int8.hpp)
  std::vector<int8_t> q8;    // [H, rows, D] quantized queries (chunk layout)
  std::vector<float> q8s;    // [H, rows] their scales
  std::vector<float> q8a;    // [H, rows] their rounding sums (centered codes)
  std::vector<int32_t> idot; // [H, rows, kTile] integer dot products
  std::vector<uint8_t> w8;   // [H, rows, groups, kTile] quantized value weights
  std::vector<float> w8s;    // [H, rows, groups] their scales
  std::vector<uint8_t> xb;   // [kTile / 4, D / 64, 8, 32] token-interleaved value codes of a head
};

/// One work unit of a call (problem p: a sequence of a batch, 0 for a single call; a chunk of
/// tokens; a block of queries) and its cost (tokens it reads x query rows), for the scheduler
/// (merge.hpp).
struct UnitRef {
  int64_t cost;
  int32_t p, chunk, qb;
};

/// Everything an attention call keeps between calls.
struct Workspace {
  std::vector<UnitRef> units;  // the scheduler's unit list
  std::vector<CacheSegment> segs;
  std::vector<Stream> ks, vs;
  std::vector<float> qs;                 // [H, nq*G, D] queries / sqrt(D)
  std::vector<float> qsum;               // [H, nq*G]
  std::vector<float> qrot;               // [H, nq*G, D] rotated queries (rotated keys)
  std::vector<float> qrotsum;            // [H, nq*G] their sums (zero points of rotated int keys)
  std::vector<float> qs_eo, qrot_eo;     // the same in even/odd channel order (AVX2, 4-bit keys)
  std::vector<float> sq;                 // [H, nq*G, D] S R q (QJL keys)
  std::vector<float> sqsum;              // [H, nq*G]
  std::vector<double> inv_freq;          // [D/2] RoPE
  std::vector<double> rope_c1, rope_s1;  // [D/2] cos / sin of inv_freq (one position's step)
  std::vector<SoftmaxState<float>> us;  // per work unit results: softmax states ...
  std::vector<float> uacc;              // ... and accumulators
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

/// The kernels' exp for the online softmax (SoftmaxState::raise / weight): exp_neg.
struct SoftmaxExp {
  float operator()(float x) const { return exp_neg(x); }
};
inline constexpr SoftmaxExp softmax_exp{};

/// Problem geometry of one call.
struct Problem {
  int64_t T = 0, H = 0, D = 0, nq = 0, nh = 0, G = 0;
  bool causal = true;
  int64_t window = 0;  // AttentionOptions::window
  float scale = 1.f;    // resolved AttentionOptions::scale
  float softcap = 0.f;  // AttentionOptions::softcap
  bool int8 = false;    // AttentionOptions::dot == DotProduct::kInt8
  int64_t q_base = 0;   // global row of query 0 (batch): indexes positions and the masks
  const int64_t* positions = nullptr;  // AttentionOptions::positions (global rows)
  const uint64_t* mask_bits = nullptr;
  int64_t mask_words = 0;
  const std::function<bool(int64_t, int64_t)>* mask_fn = nullptr;  // null: none
  const RopeConfig* rope = nullptr;
  int64_t split = kDefaultSplit, nchunks = 0, nqb = 0;
  const detail::LloydMaxContext* k_ctx = nullptr;  // Lloyd-Max keys (query rotation)
  const detail::LloydMaxContext* v_ctx = nullptr;  // Lloyd-Max values (QJL of values)
  const Rotation* k_rot = nullptr;  // rotated keys (Lloyd-Max or /rot): the query rotation
  const Rotation* v_rot = nullptr;  // rotated values: the output rotation
  bool k_qjl = false;  // some key segment carries QJL signs
  bool v_qjl = false;  // some value segment carries QJL signs (the output needs S^T)
  uint64_t k_seed = 0, v_seed = 0;
};

inline int64_t rows_of_block(const Problem& P, int64_t qb) {
  const int64_t i0 = qb * kQueryBlock;
  return (std::min(P.nq, i0 + kQueryBlock) - i0) * P.G;
}

/// Entries per unit in Workspace::us (and rows of D floats in Workspace::uacc): the largest
/// block's rows for every kv head. A decode step (one query) keeps H * G states per unit, not
/// H * kQueryBlock * G: 128 chunks of a 16384-token decode with 8 kv heads, GQA 4 and head_dim
/// 128 need 2 MiB of partial sums, not 32.
inline std::size_t unit_stride(const Problem& P) {
  return static_cast<std::size_t>(P.H * std::min(P.nq, kQueryBlock) * P.G);
}

}  // namespace attn
}  // namespace kernels
}  // namespace kvq

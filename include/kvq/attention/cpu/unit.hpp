#pragma once
/// \file unit.hpp
/// One work unit of the fused CPU attention (a chunk of tokens x a block of queries):
/// class Unit runs the tiles and keeps the online-softmax state. Its members are defined in
/// tiles_all_heads.hpp (AVX2 all-heads tiles), tiles_per_head.hpp, outliers.hpp and rope.hpp.
#include "kvq/attention/cpu/mask.hpp"
#include "kvq/attention/cpu/streams.hpp"

namespace kvq {
namespace kernels {
namespace attn {

template <class S>
class Unit {
 public:
  Unit(const Problem& P, Workspace& ws, Scratch& sc) : P_(P), ws_(ws), sc_(sc) {}

  void run(int64_t chunk, int64_t qb) {
    const int64_t D = P_.D, H = P_.H;
    i0_ = qb * kQueryBlock;
    const int64_t i1 = std::min(P_.nq, i0_ + kQueryBlock);
    R_ = (i1 - i0_) * P_.G;
    int64_t a, b;  // the chunk clipped to what the block's queries see (never read outside)
    unit_range(P_, chunk, qb, a, b);
    const std::size_t nr = static_cast<std::size_t>(H * R_);
    sc_.sm.assign(nr, SoftmaxState<float>::empty());
    sc_.acc.assign(nr * static_cast<std::size_t>(D), 0.f);
    acc_eo_ = false;
    q8_kind_ = 0;
    if (P_.v_rot != nullptr) sc_.acc_rot.assign(nr * static_cast<std::size_t>(D), 0.f);
    if (P_.v_ctx != nullptr) {
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
          if (P_.int8) {
            sc_.q8.resize(hr * static_cast<std::size_t>(D));
            sc_.q8s.resize(hr);
            sc_.q8a.resize(hr);
            sc_.idot.resize(hr * kTile);
            sc_.w8.resize(hr * ngmax * kTile);
            sc_.w8s.resize(hr * ngmax);
            sc_.xb.resize(static_cast<std::size_t>(kTile * D));
          }
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
  static bool fast_stream(const Stream& st);

  /// True when tile_all reads these keys: pre-RoPE keys of any kind (decoded and rotated to
  /// f32 rows first), else the kinds the microkernels read.
  bool keys_in_tile(const Stream& ks) const { return P_.rope != nullptr || fast_stream(ks); }

  /// True when two segments' streams may share a tile (same reading, only the pointers differ).
  static bool same_kind(const Stream& a, const Stream& b);

  /// Collects the next tile of [a, b) from the cursor (si, t) into `out`: pieces of
  /// consecutive segments of one kind, up to kTile tokens (one piece when the microkernels do
  /// not read the streams). Returns its token count (0 at the end).
  int64_t next_tile(int64_t a, int64_t b, std::size_t& si, int64_t& t,
                    std::vector<Piece>& out) const;

  /// Puts the value accumulators (and the Lloyd-Max rotated-domain ones) in even/odd channel
  /// order (eo) or back in natural order.
  void acc_order(bool eo);

  void run_tiles(int64_t a, int64_t b);

  /// Pointers to head 0's row of every tile token (rp[t]); returns the byte distance between
  /// heads and sets `span` to the bytes of a token's rows over all heads. Codes the loaders do
  /// not read in place (st.unpack) are unpacked into ubuf ([kTile, H, D] bytes) first.
  int64_t row_ptrs(const std::vector<Stream>& streams, const std::vector<Piece>& pcs,
                   const uint8_t** rp, int64_t& span, uint8_t* ubuf) const;

  /// Prefetches the metadata (scales, zeros, norms) piece p reads for all heads: a contiguous
  /// run of groups in the group-box order of packed_view.hpp.
  void prefetch_meta(const Stream& st, const Piece& p) const;

  static void prefetch_rows(const uint8_t* p, int64_t span);

  /// Per-token metadata of piece p, head h, group-major: ms[g * kTile + p.o + t] (kRow: g = 0;
  /// kGroup: the row's groups of gc channels; Lloyd-Max: the norm); zero points carry the folded
  /// offset as in tile_meta().
  void meta_rows(const Stream& st, const Piece& p, int64_t h, float* ms, float* mz) const;

  /// 8 metadata values from slot i on, as floats.
  static avx2::V meta8(const uint8_t* base, MetaDType md, std::size_t i);

  /// 8 FP4 block scales from the scale bytes at `codes`: fp4_scale() of each.
  static avx2::V fp4_scale8(const Stream& st, const uint8_t* codes);

  /// 8 x 8 transpose (rows v[0..7] become columns).
  static void transpose8(avx2::V* v);

  /// Token-axis groups (one scale per token, head and group of gc channels) of piece p for all
  /// heads at once: a token's H * ng values are contiguous, so 8 tokens x 8 values are loaded,
  /// transposed and stored as 8 columns ms[c * kTile + t] (c = h * ng + g). Returns false (and
  /// does nothing) unless the shape allows it.
  bool meta_token_groups(const Stream& st, const Piece& p, int64_t ng, float* ms, float* mz) const;

  /// Per-channel metadata (channel axis) of the block holding segment-local token t0, head h:
  /// ms[d], mz[d] (tile_meta()'s kChannel case, 8 channels at a time).
  void meta_channel(const Stream& st, int64_t t0, int64_t h, float* ms, float* mz) const;

  /// Metadata of every piece and head of the tile: head h at ms + h * ng * kTile; entries
  /// [n, n8) are zero.
  void meta_tile(const std::vector<Stream>& streams, int64_t n, int64_t ng, float* ms,
                 float* mz) const;

  /// Scores of tokens [a, b) for every head: sc[(h * R + r) * kTile + t] = q_h[r] . k_h(t), with
  /// q_h = q + h * qh (R rows of D) and kl = make(h). TB tokens at a time (RB * TB = 8
  /// accumulators); before each step the key rows kKeyAhead tokens on (up to `n`) and the value
  /// rows of the step's tokens are prefetched.
  template <int TB, class MakeKL>
  void dot_heads(int64_t a, int64_t b, int64_t n, const float* q, int64_t qh, const MakeKL& make,
                 int64_t kspan, int64_t vspan);

  template <class MakeKL>
  void dot_all(int64_t a, int64_t b, int64_t n, const float* q, int64_t qh, const MakeKL& make,
               int64_t kspan, int64_t vspan);

  /// acc_h[r] += sum_t w(h, r, g, t) v_h(t) for tokens [a, b), every head, in blocks of
  /// avx2::kTokBlock tokens; the weight of (h, r, group g, t) is w[(h * R + r) * wr + g * wg + t]
  /// (gc = 0: one group), acc = base + (h * R + r) * D, vl = make(h).
  template <class MakeVL>
  void axpy_all(int64_t a, int64_t b, const float* w, int64_t wr, int64_t wg, int64_t gc,
                float* base, const MakeVL& make);

  /// Tile tokens per block of pre-RoPE key rows (all heads) decoded before they are scored: the
  /// block's f32 rows (16 x H x D floats, 64 KiB at H = 8, D = 128) stay in L2.
  static constexpr int64_t kRopeBlock = 16;

  /// Pre-RoPE keys of tile tokens [a, b) for all heads: every piece's rows decoded and rotated
  /// (rope_key_row) into sc_.krow as [b - a, H, D] floats, krp[t] at token t's rows. The RoPE
  /// table usually holds the tile's positions already (tile_all computes it for the whole
  /// tile). Sets `span` to a token's bytes and returns the byte stride between
  /// heads.
  int64_t rope_keys_all(int64_t a, int64_t b, int64_t& span);

  void tile_all(int64_t n);

  template <Load L>
  void score_all(int64_t n, int64_t hs, int64_t kspan, int64_t vspan);

  template <Load L>
  void accumulate_all(int64_t n, int64_t hs);

  // ---- int8 dot products (DotProduct::kInt8; tiles_int8.hpp)

  /// True when the int8 path scores these keys: 4- or 8-bit int codes (not nuq, FP4, Lloyd-Max
  /// or QJL) with one scale per row or per-channel scales, head_dim a multiple of 64.
  bool int8_keys(const Stream& st, Load L) const;
  /// True when the int8 path accumulates these values: 4-bit int codes with one scale per row
  /// or groups of 32 or a multiple of 64 channels, head_dim a multiple of 64.
  bool int8_values(const Stream& st, Load L) const;
  /// sc_.idot[(h * R + r) * kTile + t] = sc_.q8 row (h, r) . codes of token t, head h, for tile
  /// tokens [t0, t1) of n (rows hs bytes apart per head); prefetches like dot_heads.
  template <Load L>
  void idot_tokens(int64_t t0, int64_t t1, int64_t n, int64_t hs, int64_t kspan, int64_t vspan);
  template <Load L>
  void score_int8(int64_t n, int64_t hs, int64_t kspan, int64_t vspan);
  /// Returns false (nothing done) when a weight is negative (a page with a negative scale):
  /// the caller runs the exact path then.
  template <Load L>
  bool accumulate_int8(int64_t n, int64_t hs);
#endif

  void tile(const CacheSegment& seg, const Stream& ks, const Stream& vs, int64_t h, int64_t t0,
            int64_t t1);

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
  static std::pair<int64_t, float> outlier_at(const PackedView& v, std::size_t i);

  /// f(channel, exact value) for the outliers of vector (loc, h).
  template <class F>
  static void for_outliers(const Stream& st, int64_t loc, int64_t h, F&& f);

  /// f(t, channel, exact value - dense value) for the k outliers of each vector (segment-local
  /// token loc0 + t, head h), t in [0, n). The dense value is code * scale + zero as the kernels
  /// see it (zero with the folded offset, fp8 unscaled value times scale * 2^8 for e4m3, nuq:
  /// the code's level). Everything that does not change per outlier is hoisted: the group box's
  /// token block is counted along the tokens, the channel group is a multiply-shift (no integer
  /// division), and the code kind is a template parameter.
  template <class F>
  static void for_outlier_deltas(const Stream& st, int64_t loc0, int64_t n, int64_t h, F&& f);

  /// for_outlier_deltas for one code kind (0: int / nuq codes, st.bits wide, LSB-first
  /// bitstream; 1: e4m3; 2: e5m2).
  template <int Kind, class F>
  static void outlier_deltas(const Stream& st, int64_t loc0, int64_t n, int64_t h, F& f);

  /// The sparse part of tokens [loc0, loc0 + n) (n <= kTile), head h, as a table: channel
  /// sc_.opos[j * kTile + t] and difference sc_.odv[j * kTile + t] of outlier j of token t (the
  /// values for_outlier_deltas gives). With AVX2 the codes are read eight tokens at a time with
  /// gathers (outlier_table8); blocks near the end of the view's regions (a gather reads 4
  /// bytes from each address) and shapes it does not take go through the scalar path.
  void outlier_table(const Stream& st, int64_t loc0, int64_t n, int64_t h) const;

#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
  /// outlier_table eight tokens at a time: fills tokens [0, m) and returns m (a multiple of 8;
  /// 0 when the view's shape does not suit the vector path). Same arithmetic as
  /// outlier_deltas: dense = fma(c, scale * mul, zero - off * scale), c the int code, the nuq
  /// level, or the fp8 code's value as fp16 (e4m3: exponent rebased, mul = 2^8).
  static int64_t outlier_table8(const Stream& st, int64_t loc0, int64_t n, int64_t h, int32_t* pos,
                                float* dv);
#endif

  /// Scores of tokens [loc0, loc0 + n) (sc[r * kTile + t], R rows of q, stride D) += q . sparse.
  void outlier_scores(const Stream& st, int64_t loc0, int64_t n, int64_t h, const float* q,
                      float* sc) const;

  /// acc[r, channel] (R rows, stride D; even/odd channel order when eo) += p[r * kTile + t] *
  /// sparse difference, tokens [loc0, loc0 + n).
  void outlier_values(const Stream& st, int64_t loc0, int64_t n, int64_t h, const float* p,
                      float* acc, bool eo) const;

  void rescale(float* x, float alpha);

  template <Load L>
  void score_packed(const Stream& ks, int64_t h, int64_t loc0, int64_t n, const float* qs);

  /// cos / sin of positions [t0, t0 + n) (n <= kTile) for every RoPE frequency into sc_.rc /
  /// sc_.rs ([t, D/2]), once per tile piece: every kv head of the piece reuses them (they were
  /// computed per row before, 2 x D/2 libm calls per token and head). Per frequency w: an exact
  /// seed cos(t0 w), sin(t0 w) in double, then angle addition by the precomputed cos(w),
  /// sin(w) in double for the following positions, each rounded to float. After at most
  /// kTile - 1 steps the double recurrence is within ~1e-14 of cos/sin(pos w), far below the
  /// float rounding of the table (so the rows match core/rope.hpp's to about one float ulp).
  /// Returns the table row of position t0 once the table holds positions [t0, t0 + n): the
  /// table in place when it already does, else one computed from t0.
  int64_t rope_table(int64_t t0, int64_t n);

  /// Key row (segment-local token loc, head h) decoded to floats in `out` and rotated by the
  /// RoPE table's row tr (pre-RoPE keys); the tile metadata (tile_meta of head h) is read at
  /// row t. Outliers' exact values are written before the rotation.
  void rope_key_row(const Stream& ks, int64_t loc, int64_t h, int64_t t, int64_t tr, float* out);

  /// Pre-RoPE keys: each row decoded (L1), rotated at its position, then scored.
  void score_rope(const CacheSegment& seg, const Stream& ks, int64_t h, int64_t t0, int64_t n,
                  const float* qs);

  template <Load L>
  void accumulate_packed(const Stream& vs, int64_t h, int64_t loc0, int64_t n);

  /// Folds the rotated-domain value sums back and stores the unit's (m, l, acc).
  void finish(int64_t chunk, int64_t qb) {
    const int64_t D = P_.D, H = P_.H, R = R_;
#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
    acc_order(false);
#endif
    const std::size_t unit = static_cast<std::size_t>(chunk * P_.nqb + qb);
    const std::size_t stride = unit_stride(P_);
    SoftmaxState<float>* us = ws_.us.data() + unit * stride;
    float* ua = ws_.uacc.data() + unit * stride * static_cast<std::size_t>(D);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = 0; r < R; ++r) {
        const std::size_t st = static_cast<std::size_t>(h * R + r);
        float* acc = row_acc(sc_.acc.data(), h, r);
        if (P_.v_rot != nullptr && sc_.sm[st].l > 0.f) {
          float* ar = row_acc(sc_.acc_rot.data(), h, r);
          if (P_.v_qjl) {  // S is built on first use: never for a non-QJL config
            const float* sa = row_acc(sc_.sacc.data(), h, r);
            const float c0 = sc_.sconst[st];
            const float* qjl_s = P_.v_ctx->qjl_matrix();
            for (int64_t j = 0; j < D; ++j) {
              const float cj = sa[j] - c0;
              if (cj == 0.f) continue;
              const float* srow = qjl_s + j * D;
              for (int64_t i = 0; i < D; ++i) ar[i] += cj * srow[i];
            }
          }
          P_.v_rot->apply_inverse(ar);
          for (int64_t i = 0; i < D; ++i) acc[i] += ar[i];
        }
        us[st] = sc_.sm[st];
        std::copy(acc, acc + D, ua + st * static_cast<std::size_t>(D));
      }
  }

  const Problem& P_;
  Workspace& ws_;
  Scratch& sc_;
  int64_t i0_ = 0, R_ = 0;
  /// What sc_.q8 holds: 0 nothing reusable, else 1 + rotated + 2 * (4-bit layout): the unit's
  /// queries
  /// (int8 keys with one scale per row; tiles_int8.hpp).
  int q8_kind_ = 0;
  bool acc_eo_ = false;  // AVX2: the value accumulators are in even/odd channel order
};

}  // namespace attn
}  // namespace kernels
}  // namespace kvq

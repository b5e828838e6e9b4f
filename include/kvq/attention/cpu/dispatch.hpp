#pragma once
/// \file dispatch.hpp
/// Entry point of the fused CPU attention: validates the call, prepares streams and
/// queries, picks the instruction set and runs (attend_segments; compiled-kernels mode in
/// config.hpp).
#include "kvq/attention/cpu/merge.hpp"
#include "kvq/attention/cpu/outliers.hpp"
#include "kvq/attention/cpu/rope.hpp"
#include "kvq/attention/cpu/tiles_all_heads.hpp"
#include "kvq/attention/cpu/tiles_int8.hpp"
#include "kvq/attention/cpu/tiles_per_head.hpp"

namespace kvq {
namespace kernels {
namespace attn {

/// Prepares the streams of the segments (ws.segs, checked) and the queries of problem P for
/// its units.
template <class S>
void prepare(Workspace& ws, Problem& P, KVView<const float> q) {
  const int64_t D = P.D, H = P.H, nq = P.nq, G = P.G, HR = nq * G;
  ws.ks.resize(ws.segs.size());
  ws.vs.resize(ws.segs.size());
  P.k_ctx = P.v_ctx = nullptr;
  P.k_rot = P.v_rot = nullptr;
  P.k_qjl = P.v_qjl = false;
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
      if (ks.rot) {
        KVQ_REQUIRE(P.k_rot == nullptr || P.k_rot->seed() == ks.rotation->seed(), kInvalidArgument,
                    "attend: rotated key segments use different seeds (", P.k_rot->seed(), " and ",
                    ks.rotation->seed(), ")");
        P.k_rot = ks.rotation;
      }
      if (vs.rot) {
        KVQ_REQUIRE(P.v_rot == nullptr || P.v_rot->seed() == vs.rotation->seed(), kInvalidArgument,
                    "attend: rotated value segments use different seeds (", P.v_rot->seed(),
                    " and ", vs.rotation->seed(), ")");
        P.v_rot = vs.rotation;
      }
      if (vs.lm) {
        KVQ_REQUIRE(P.v_ctx == nullptr || P.v_ctx == vs.ctx || P.v_seed == s.value_view.config.seed,
                    kInvalidArgument, "attend: Lloyd-Max value segments use different seeds");
        P.v_seed = s.value_view.config.seed;
        P.v_ctx = vs.ctx;
        P.v_qjl = P.v_qjl || vs.qjl;
      }
    } else {
      ks = Stream();
      vs = Stream();
      ks.rows = s.key_rows;
      vs.rows = s.value_rows;
    }
  }
  // Queries: [H, nq * G, D], times the softmax scale; sums for zero points; rotations.
  const float scale = P.scale;
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
  if (P.k_rot != nullptr) {
    ws.qrot.assign(ws.qs.begin(), ws.qs.end());
    P.k_rot->apply_batch(ws.qrot.data(), H * HR);
    ws.qrotsum.resize(ws.qsum.size());
    for (int64_t v = 0; v < H * HR; ++v) {
      double sum = 0;
      for (int64_t d = 0; d < D; ++d) sum += ws.qrot[static_cast<std::size_t>(v * D + d)];
      ws.qrotsum[static_cast<std::size_t>(v)] = static_cast<float>(sum);
    }
    if (P.k_qjl) {
      ws.sq.resize(ws.qs.size());
      ws.sqsum.resize(ws.qsum.size());
      for (int64_t v = 0; v < H * HR; ++v) {
        const float* qr = ws.qrot.data() + v * D;
        float* o = ws.sq.data() + v * D;
        double tot = 0;
        const float* qjl_s = P.k_ctx->qjl_matrix();
        for (int64_t j = 0; j < D; ++j) {
          o[j] = detail::dot_f(qjl_s + j * D, qr, D);
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
      for (int64_t v = 0; v < H * HR; ++v)
        avx2::to_eo(ws.qs.data() + v * D, ws.qs_eo.data() + v * D, D);
      if (P.k_rot != nullptr) {
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
      ws.inv_freq[ui] =
          std::pow(P.rope->theta, -static_cast<double>(2 * i) / static_cast<double>(D));
      ws.rope_c1[ui] = std::cos(ws.inv_freq[ui]);
      ws.rope_s1[ui] = std::sin(ws.inv_freq[ui]);
    }
  }
  const std::size_t units = static_cast<std::size_t>(P.nchunks * P.nqb);
  const std::size_t stride = unit_stride(P);
  ws.us.assign(units * stride, SoftmaxState<float>::empty());
  ws.uacc.resize(units * stride * static_cast<std::size_t>(D));
}

/// Prepares problems P[0, np) (workspaces W, queries q[p]; those with no tokens or queries are
/// left alone), runs all their units (merge.hpp) and merges each into out[p] (zeros for a
/// problem with no tokens).
template <class S>
void run_problems(Problem* P, Workspace* W, const KVView<const float>* q, const KVView<float>* out,
                  std::size_t np, std::vector<Scratch>& scratch, std::vector<UnitRef>& units,
                  const AttentionOptions& opt) {
  for (std::size_t p = 0; p < np; ++p)
    if (P[p].nq > 0 && P[p].T > 0) prepare<S>(W[p], P[p], q[p]);
  run_all<S>(P, W, np, scratch, units, opt);
  for (std::size_t p = 0; p < np; ++p) {
    if (P[p].nq == 0) continue;
    if (P[p].T == 0) {
      for (int64_t i = 0; i < out[p].tokens(); ++i)
        for (int64_t h = 0; h < out[p].heads(); ++h) {
          for (int64_t d = 0; d < out[p].head_dim(); ++d) out[p].at(i, h, d) = 0.f;
          if (opt.lse != nullptr)
            opt.lse[(P[p].q_base + i) * out[p].heads() + h] = -std::numeric_limits<float>::infinity();
        }
      continue;
    }
    merge_units(P[p], W[p], out[p], opt.sinks, opt.lse);
  }
}

/// Checks the options that do not depend on the sequence (threads, split, window, scale,
/// softcap, mask, sinks for nh query heads).
inline void check_options(const AttentionOptions& opt, int64_t nh) {
  KVQ_REQUIRE(opt.threads >= 1, kInvalidArgument, "attend: threads must be >= 1, got ",
              opt.threads);
  KVQ_REQUIRE(opt.split_tokens >= 0, kInvalidArgument,
              "attend: split_tokens must be >= 0 (0 = default), got ", opt.split_tokens);
  KVQ_REQUIRE(opt.window >= 0, kInvalidArgument,
              "attend: window must be >= 0 (0 = none), got ", opt.window);
  KVQ_REQUIRE(std::isfinite(opt.scale) && opt.scale >= 0.f, kInvalidArgument,
              "attend: scale must be finite and >= 0 (0 = 1/sqrt(head_dim)), got ", opt.scale);
  KVQ_REQUIRE(std::isfinite(opt.softcap) && opt.softcap >= 0.f, kInvalidArgument,
              "attend: softcap must be finite and >= 0 (0 = off), got ", opt.softcap);
  KVQ_REQUIRE(opt.dot == DotProduct::kExact || opt.dot == DotProduct::kInt8, kInvalidArgument,
              "attend: dot must be DotProduct::kExact or kInt8, got ", static_cast<int>(opt.dot));
  KVQ_REQUIRE(opt.mask_bits == nullptr || !opt.mask_fn, kInvalidArgument,
              "attend: give the custom mask as mask_bits or as mask_fn, not both");
  KVQ_REQUIRE(opt.mask_bits != nullptr || opt.mask_words == 0, kInvalidArgument,
              "attend: mask_words=", opt.mask_words, " is set but mask_bits is null");
  if (opt.sinks != nullptr)
    for (int64_t h = 0; h < nh; ++h)
      KVQ_REQUIRE(!std::isnan(opt.sinks[h]) &&
                      opt.sinks[h] < std::numeric_limits<float>::infinity(),
                  kInvalidArgument, "attend: sink logit of query head ", h,
                  " must not be NaN or +inf, got ", opt.sinks[h]);
}

/// The problem of one sequence: T tokens, kv_heads H, head_dim D, the queries q (rows
/// q_base.. of the call's queries), resolved options.
inline Problem make_problem(int64_t T, int64_t H, int64_t D, KVView<const float> q, bool causal,
                            const RopeConfig* rope, const AttentionOptions& opt, int64_t q_base) {
  Problem P;
  P.T = T;
  P.H = H;
  P.D = D;
  P.nq = q.tokens();
  P.nh = q.heads();
  P.G = P.nh / H;
  P.causal = causal;
  P.window = opt.window;
  P.scale = opt.scale > 0.f ? opt.scale
                            : static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  P.softcap = opt.softcap;
  P.int8 = opt.dot == DotProduct::kInt8;
  P.q_base = q_base;
  P.positions = opt.positions;
  P.mask_bits = opt.mask_bits;
  P.mask_words = opt.mask_words;
  P.mask_fn = opt.mask_fn ? &opt.mask_fn : nullptr;
  P.rope = rope;
  // A split at least as long as the sequence is one chunk; clamping keeps (T + split - 1) from
  // overflowing when a caller writes "never split" as a huge value (INT64_MAX).
  P.split = opt.split_tokens > 0 ? std::min<int64_t>(opt.split_tokens, std::max<int64_t>(T, 1))
                                 : default_split(T);
  P.nchunks = (T + P.split - 1) / P.split;
  P.nqb = (P.nq + kQueryBlock - 1) / kQueryBlock;
  return P;
}

/// Validates the call and the segments (in order, covering [0, T), matching shapes). With a
/// sliding window the segments may skip tokens that no query's window reaches (a layer that
/// released its oldest pages, KVCache::release_before).
inline void check_call(const std::vector<CacheSegment>& segs, int64_t T, int64_t H, int64_t D,
                       KVView<const float> q, KVView<float> out, bool causal,
                       const RopeConfig* rope, int layer, const AttentionOptions& opt = {},
                       int64_t q_base = 0) {
  const int64_t window = opt.window;
  const int64_t nq = q.tokens(), nh = q.heads();
  KVQ_REQUIRE(q.head_dim() == D, kShapeMismatch, "attend: queries have head_dim ", q.head_dim(),
              " but the cache has ", D);
  KVQ_REQUIRE(nh > 0 && nh % H == 0, kShapeMismatch, "attend: n_heads=", nh,
              " is not a positive multiple of the cache's kv_heads=", H);
  KVQ_REQUIRE(out.shape() == q.shape(), kShapeMismatch, "attend: output ", out.shape().str(),
              " does not match the queries ", q.shape().str());
  if (nq == 0) return;
  KVQ_REQUIRE(T > 0, kInvalidArgument, "attend: layer ", layer, " holds no tokens");
  if (opt.positions != nullptr) {
    for (int64_t i = 0; i < nq; ++i)
      KVQ_REQUIRE(opt.positions[q_base + i] >= 0 && opt.positions[q_base + i] < T,
                  kInvalidArgument, "attend: positions[", q_base + i, "]=",
                  opt.positions[q_base + i], " is outside the sequence's ", T, " tokens");
  } else {
    KVQ_REQUIRE(!causal || nq <= T, kInvalidArgument, "attend: ", nq,
                " causal queries at the newest positions need at least as many tokens, but "
                "layer ",
                layer, " holds ", T);
  }
  KVQ_REQUIRE(opt.mask_bits == nullptr || opt.mask_words * 64 >= T, kInvalidArgument,
              "attend: mask_words=", opt.mask_words, " (the mask's stride in 64-bit words) covers ",
              opt.mask_words * 64, " positions, but the sequence has ", T, " tokens (needs >= ",
              (T + 63) / 64, ")");
  KVQ_REQUIRE(rope == nullptr || D % 2 == 0, kInvalidArgument,
              "attend: RoPE needs an even head_dim, got ", D);
  int64_t pos = 0;
  // The first position any query's window reaches (0 without a window): segments may leave
  // out tokens before it.
  int64_t first_seen = 0;
  if (window > 0) {
    int64_t pmin = causal ? T - nq : T - 1;
    if (opt.positions != nullptr)
      for (int64_t i = 0; i < nq; ++i) pmin = std::min(pmin, opt.positions[q_base + i]);
    first_seen = std::max<int64_t>(0, pmin - window + 1);
  }
  for (const CacheSegment& s : segs) {
    KVQ_REQUIRE(s.end > s.begin && (s.begin == pos || (s.begin > pos && s.begin <= first_seen)),
                kInvalidArgument, "attend: segment [", s.begin, ", ", s.end,
                ") does not continue at token ", pos,
                window > 0 ? " (with the window, only tokens before the first query's window may be "
                             "missing)"
                           : "");
    const Shape want{s.end - s.begin, H, D};
    if (s.packed()) {
      KVQ_REQUIRE(s.key_view.shape == want && s.value_view.shape == want &&
                      s.key_view.codes != nullptr && s.value_view.codes != nullptr,
                  kShapeMismatch, "attend: packed segment [", s.begin, ", ", s.end, ") must be ",
                  want.str(), " with codes, got keys ", s.key_view.shape.str(), " and values ",
                  s.value_view.shape.str());
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

/// The entry point: ws.segs holds the segments (already filled by the caller). Under
/// KVQ_EXTERN_KERNELS (config.hpp) only declared here and defined once, in the translation unit
/// that defines KVQ_KERNELS_IMPLEMENTATION (all, or 2: the attention).
#if defined(KVQ_EXTERN_KERNELS) && !defined(KVQ_DETAIL_DEFINE_ATTENTION)
void attend_segments(Workspace& ws, int64_t T, int64_t H, int64_t D, KVView<const float> q,
                     KVView<float> out, bool causal, const RopeConfig* rope,
                     const AttentionOptions& opt, int layer);
#else
#ifndef KVQ_DETAIL_DEFINE_ATTENTION
inline
#endif
    void
    attend_segments(Workspace& ws, int64_t T, int64_t H, int64_t D, KVView<const float> q,
                    KVView<float> out, bool causal, const RopeConfig* rope,
                    const AttentionOptions& opt, int layer) {
  check_options(opt, q.heads());
  check_call(ws.segs, T, H, D, q, out, causal, rope, layer, opt);
  const int64_t nq = q.tokens();
  if (nq == 0) return;
  decode_unsupported(ws);
  Problem P = make_problem(T, H, D, q, causal, rope, opt, 0);
  const KVView<float> o = out;
  // AVX-512 builds take the Simd256 instance as well: its all-heads tile loop runs the 16-lane
  // microkernels (simd/attention_avx2.hpp). A target with AVX-512 but without AVX2/FMA/F16C
  // (no real CPU; only a hand-picked -m flag set) runs the scalar instance.
#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
  if (D % 8 == 0) return run_problems<Simd256>(&P, &ws, &q, &o, 1, ws.scratch, ws.units, opt);
#endif
  run_problems<SimdScalar>(&P, &ws, &q, &o, 1, ws.scratch, ws.units, opt);
}
#endif  // KVQ_EXTERN_KERNELS


/// What a batched call keeps between calls: one Workspace per sequence (its segments, streams,
/// queries and unit results), the per-worker scratch and the unit list shared by all.
struct BatchWorkspace {
  std::vector<Workspace> seq;
  std::vector<Problem> probs;
  std::vector<KVView<const float>> qv;
  std::vector<KVView<float>> ov;
  std::vector<int64_t> T;  // [B] tokens per sequence
  std::vector<Scratch> scratch;
  std::vector<UnitRef> units;
  std::vector<const std::byte*> page_ptrs;  // attend_batch: page pointers of one sequence
};

/// Batched entry point: sequence s (s < B) holds ws.T[s] tokens in the segments ws.seq[s].segs
/// (filled by the caller) and the query rows [q_indptr[s], q_indptr[s + 1]) of q; its output
/// rows are the same rows of out. A sequence with no tokens yields zeros. All units of all
/// sequences are scheduled together (merge.hpp).
#if defined(KVQ_EXTERN_KERNELS) && !defined(KVQ_DETAIL_DEFINE_ATTENTION)
void attend_batch_segments(BatchWorkspace& ws, int64_t B, int64_t H, int64_t D,
                           const int64_t* q_indptr, KVView<const float> q, KVView<float> out,
                           bool causal, const RopeConfig* rope, const AttentionOptions& opt);
#else
#ifndef KVQ_DETAIL_DEFINE_ATTENTION
inline
#endif
    void
    attend_batch_segments(BatchWorkspace& ws, int64_t B, int64_t H, int64_t D,
                          const int64_t* q_indptr, KVView<const float> q, KVView<float> out,
                          bool causal, const RopeConfig* rope, const AttentionOptions& opt) {
  KVQ_REQUIRE(B >= 0, kInvalidArgument, "attend_batch: batch size must be >= 0, got ", B);
  KVQ_REQUIRE(static_cast<int64_t>(ws.seq.size()) >= B && static_cast<int64_t>(ws.T.size()) >= B,
              kInvalidArgument, "attend_batch: the workspace holds ", ws.seq.size(),
              " sequences, not ", B);
  KVQ_REQUIRE(q.head_dim() == D, kShapeMismatch, "attend_batch: queries have head_dim ",
              q.head_dim(), " but the pages have ", D);
  KVQ_REQUIRE(q.heads() > 0 && q.heads() % H == 0, kShapeMismatch, "attend_batch: n_heads=",
              q.heads(), " is not a positive multiple of kv_heads=", H);
  KVQ_REQUIRE(out.shape() == q.shape(), kShapeMismatch, "attend_batch: output ",
              out.shape().str(), " does not match the queries ", q.shape().str());
  KVQ_REQUIRE(q_indptr != nullptr, kInvalidArgument, "attend_batch: query indptr is null");
  KVQ_REQUIRE(q_indptr[0] == 0, kInvalidArgument, "attend_batch: query indptr[0] must be 0, got ",
              q_indptr[0]);
  for (int64_t s = 0; s < B; ++s)
    KVQ_REQUIRE(q_indptr[s + 1] >= q_indptr[s], kInvalidArgument,
                "attend_batch: query indptr is not monotone: indptr[", s + 1, "]=",
                q_indptr[s + 1], " < indptr[", s, "]=", q_indptr[s]);
  KVQ_REQUIRE(q_indptr[B] == q.tokens(), kInvalidArgument, "attend_batch: query indptr[", B,
              "]=", q_indptr[B], " but the queries hold ", q.tokens(), " rows");
  check_options(opt, q.heads());
  ws.probs.resize(static_cast<std::size_t>(B));
  ws.qv.resize(static_cast<std::size_t>(B));
  ws.ov.resize(static_cast<std::size_t>(B));
  for (int64_t s = 0; s < B; ++s) {
    const auto us = static_cast<std::size_t>(s);
    const int64_t q0 = q_indptr[s], n = q_indptr[s + 1] - q0;
    ws.qv[us] = q.slice_tokens(q0, n);
    ws.ov[us] = out.slice_tokens(q0, n);
    if (ws.T[us] > 0) check_call(ws.seq[us].segs, ws.T[us], H, D, ws.qv[us], ws.ov[us], causal, rope,
                                static_cast<int>(s), opt, q0);
  }
  for (int64_t s = 0; s < B; ++s) {
    const auto us = static_cast<std::size_t>(s);
    if (ws.T[us] > 0 && ws.qv[us].tokens() > 0) decode_unsupported(ws.seq[us]);
    ws.probs[us] = make_problem(ws.T[us], H, D, ws.qv[us], causal, rope, opt, q_indptr[s]);
  }
#if KVQ_HAS_AVX2 && KVQ_HAS_F16C
  if (D % 8 == 0)
    return run_problems<Simd256>(ws.probs.data(), ws.seq.data(), ws.qv.data(), ws.ov.data(),
                                 static_cast<std::size_t>(B), ws.scratch, ws.units, opt);
#endif
  run_problems<SimdScalar>(ws.probs.data(), ws.seq.data(), ws.qv.data(), ws.ov.data(),
                           static_cast<std::size_t>(B), ws.scratch, ws.units, opt);
}
#endif  // KVQ_EXTERN_KERNELS

}  // namespace attn
}  // namespace kernels
}  // namespace kvq

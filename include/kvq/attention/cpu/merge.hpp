#pragma once
/// \file merge.hpp
/// The scheduler and the merge: runs the work units of one or several problems (a batch of
/// sequences) on the workers, largest first, then merges each query row's online-softmax
/// states in fixed chunk order (flash-decoding), adds the attention sinks and writes the
/// output rows.
///
/// Split rule (independent of the thread count): a problem of T tokens and n_q queries is cut
/// into ceil(T / split) token chunks x ceil(n_q / kQueryBlock) query blocks, split =
/// AttentionOptions::split_tokens (0: default_split(T), 256-4096 tokens by length); every unit
/// covers all kv heads. Units
/// are ordered by cost (visible tokens x query rows) descending, ties by (problem, chunk,
/// query block), and handed out to the workers one at a time from a shared counter. Each
/// unit's result is computed by the same code whichever worker runs it and merged in chunk
/// order, so the output is bit-identical for any number of threads.
#include <atomic>
#include <cmath>
#include <limits>

#include "kvq/attention/cpu/unit.hpp"

namespace kvq {
namespace kernels {
namespace attn {

/// Runs every unit of the problems P[0, np) (workspaces W[p], prepared) on up to opt.threads
/// workers (opt.parallel_for, else std::threads), `scratch` holding one Scratch per worker.
template <class S>
void run_all(const Problem* P, Workspace* W, std::size_t np, std::vector<Scratch>& scratch,
             std::vector<UnitRef>& units, const AttentionOptions& opt) {
  units.clear();
  for (std::size_t p = 0; p < np; ++p) {
    if (P[p].nq == 0 || P[p].T == 0) continue;
    for (int64_t c = 0; c < P[p].nchunks; ++c)
      for (int64_t qb = 0; qb < P[p].nqb; ++qb) {
        int64_t a, b;
        unit_range(P[p], c, qb, a, b);
        const int64_t cost = std::max<int64_t>(0, b - a) * rows_of_block(P[p], qb);
        units.push_back(UnitRef{cost, static_cast<int32_t>(p), static_cast<int32_t>(c),
                                static_cast<int32_t>(qb)});
      }
  }
  std::sort(units.begin(), units.end(), [](const UnitRef& x, const UnitRef& y) {
    if (x.cost != y.cost) return x.cost > y.cost;
    if (x.p != y.p) return x.p < y.p;
    if (x.chunk != y.chunk) return x.chunk < y.chunk;
    return x.qb < y.qb;
  });
  const auto n = static_cast<int64_t>(units.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(opt.threads, n));
  if (static_cast<int64_t>(scratch.size()) < workers)
    scratch.resize(static_cast<std::size_t>(workers));
  std::atomic<int64_t> next{0};
  auto body = [&](int64_t wk) {
    Scratch& sc = scratch[static_cast<std::size_t>(wk)];
    for (;;) {
      const int64_t k = next.fetch_add(1, std::memory_order_relaxed);
      if (k >= n) break;
      const UnitRef& u = units[static_cast<std::size_t>(k)];
      Unit<S>(P[u.p], W[u.p], sc).run(u.chunk, u.qb);
    }
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
}

/// Merges the chunk results of problem P (fixed chunk order) with the sink logits (`sinks`,
/// [n_heads] or null) and writes `out` (and, when `lse` is given, each row's log-sum-exp at
/// global row P.q_base + i). A row that sees no token (and no sink) is zeros with lse -inf; a
/// row whose only mass is its sink is zeros too (the sink has no value).
inline void merge_units(const Problem& P, Workspace& ws, KVView<float> out, const float* sinks,
                        float* lse) {
  const int64_t D = P.D, G = P.G;
  const std::size_t stride = unit_stride(P);
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
        const SoftmaxState<float>& s = ws.us[u * stride + st];
        if (s.l > 0.f) M = std::max(M, s.m);
      }
      const bool sink = sinks != nullptr && sinks[hq] > -std::numeric_limits<float>::infinity();
      if (sink) M = std::max(M, sinks[hq]);
      float L = 0.f;
      std::fill(o, o + D, 0.f);
      for (int64_t c = 0; c < P.nchunks; ++c) {
        const std::size_t u = static_cast<std::size_t>(c * P.nqb + qb);
        const SoftmaxState<float>& s = ws.us[u * stride + st];
        if (!(s.l > 0.f)) continue;
        const float f = s.weight(M, softmax_exp);
        L += f * s.l;
        const float* a = ws.uacc.data() + (u * stride + st) * static_cast<std::size_t>(D);
        for (int64_t d = 0; d < D; ++d) o[d] += f * a[d];
      }
      if (sink) L += softmax_exp(sinks[hq] - M);
      if (lse != nullptr)
        lse[(P.q_base + i) * P.nh + hq] =
            L > 0.f ? M + std::log(L) : -std::numeric_limits<float>::infinity();
      if (L > 0.f) {
        const float inv = 1.f / L;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      } else {
        std::fill(o, o + D, 0.f);
      }
      detail::store_row(out, i, hq, o);
    }
  }
}

}  // namespace attn
}  // namespace kernels
}  // namespace kvq

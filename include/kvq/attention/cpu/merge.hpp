#pragma once
/// \file merge.hpp
/// Runs the work units on the workers and merges their online-softmax states in fixed
/// chunk order (flash-decoding), writing the output rows.
#include "kvq/attention/cpu/unit.hpp"

namespace kvq {
namespace kernels {
namespace attn {

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
        const SoftmaxState<float>& s = ws.us[u * stride + st];
        if (s.l > 0.f) M = std::max(M, s.m);
      }
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
      const float inv = 1.f / L;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      detail::store_row(out, i, hq, o);
    }
  }
}

}  // namespace attn
}  // namespace kernels
}  // namespace kvq

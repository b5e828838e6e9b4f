// kvq_engine_demo: what an inference engine does with kvq's streaming cache.
//
//   kvq_engine_demo [--policy SPEC[;SPEC...]] [--layers N] [--kv-heads H] [--q-heads Q]
//                   [--head-dim D] [--prefill T] [--decode N] [--seed S]
//
// For every policy: builds a KVCache, appends a synthetic prefill chunk to every layer and runs
// causal attention for its queries, then decodes N tokens one at a time (append one token per
// layer, attend one query). An f32 cache is driven in lockstep, so the demo can report how far
// the quantized cache's attention output drifts from the unquantized one, and an f16 cache too,
// so the demo can print the decode attention speed (fused kernels straight from the packed
// codes, attention/cpu/attention_cpu.hpp) next to the f16 cache's. Prints the memory report:
// bytes by layer and kind, effective bits per value, compression against f16.
//
// Then the batched decode an engine runs per step: --seqs sequences of different lengths (one
// KVCache each), every layer of every step appends one token to each and attends all of them
// in ONE kvq::attend_batch call over their page tables (pages by pointer, sink and residual
// rows as f32), on --threads workers of a kvq::WorkerPool; each sequence's rows are checked
// bit for bit against kvq::attend on its own cache, and the bytes of each sequence are printed.
//
// Then prefix sharing: --seqs sequences (at least 2) forked from one cache holding a shared
// --prefill-token prefix (KVCache::fork shares its pages), each decoding --decode steps of its
// own; the first decodes speculatively (exact rollback on for that fork: 4 draft tokens per
// step, truncated back to the accepted ones). Each fork is checked bit for bit against a cache
// fed its kept tokens alone, and the bytes of each fork (and how many of them sit in shared
// pages) and of all forks together are printed.
//
// The data is synthetic: Gaussian keys with a few large fixed channels (the outlier pattern of
// real keys that makes per-channel key grouping matter), Gaussian values and queries.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kvq/attention/attention.hpp"
#include "kvq/attention/worker_pool.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/core/error.hpp"
#include "kvq/policy/spec.hpp"

namespace {

struct Options {
  std::string policy = "kivi2";
  int layers = 4;
  int kv_heads = 2;
  int q_heads = 8;
  int head_dim = 128;
  int prefill = 256;
  int decode = 64;
  int seqs = 3;
  int threads = 1;
  unsigned seed = 1;
};

const char* const kUsage =
    "usage: kvq_engine_demo [--policy SPEC[;SPEC...]] [--layers N] [--kv-heads H] [--q-heads Q]\n"
    "                       [--head-dim D] [--prefill T] [--decode N] [--seqs B] [--threads N]\n"
    "                       [--seed S]\n"
    "  --policy   policy spec(s), e.g. kivi2, k8v4,skip=2, 'f32;kivi4;turbo3' (default kivi2)\n"
    "  --layers   layers (default 4)          --kv-heads  KV heads (default 2)\n"
    "  --q-heads  query heads, a multiple of --kv-heads (default 8)\n"
    "  --head-dim head dimension (default 128) --prefill  prefill tokens (default 256)\n"
    "  --decode   decode steps (default 64)   --seed      data seed (default 1)\n"
    "  --seqs     sequences of the batched decode and of the prefix sharing (default 3; 0 skips\n"
    "             both; prefix sharing forks at least 2)\n"
    "  --threads  attention workers of the batched decode, a kvq::WorkerPool (default 1)\n";

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "kvq_engine_demo: error: %s\n%s", msg.c_str(), kUsage);
  std::exit(2);
}

/// A decimal integer in [lo, hi]; anything else is a usage error naming the flag.
int parse_int(const std::string& flag, const std::string& text, int lo, int hi) {
  if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos)
    usage_error(flag + " expects a non-negative integer, got '" + text + "'");
  if (text.size() > 9 || std::stol(text) < lo || std::stol(text) > hi)
    usage_error(flag + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                "], got " + text);
  return std::stoi(text);
}

Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (a.rfind("--", 0) != 0) usage_error("unexpected argument '" + a + "'");
    if (i + 1 >= argc) usage_error(a + " needs a value");
    const std::string v = argv[++i];
    if (a == "--policy") {
      o.policy = v;
    } else if (a == "--layers") {
      o.layers = parse_int(a, v, 1, 256);
    } else if (a == "--kv-heads") {
      o.kv_heads = parse_int(a, v, 1, 256);
    } else if (a == "--q-heads") {
      o.q_heads = parse_int(a, v, 1, 1024);
    } else if (a == "--head-dim") {
      o.head_dim = parse_int(a, v, 1, 1024);
    } else if (a == "--prefill") {
      o.prefill = parse_int(a, v, 0, 1 << 20);
    } else if (a == "--decode") {
      o.decode = parse_int(a, v, 0, 1 << 20);
    } else if (a == "--seqs") {
      o.seqs = parse_int(a, v, 0, 256);
    } else if (a == "--threads") {
      o.threads = parse_int(a, v, 1, 256);
    } else if (a == "--seed") {
      o.seed = static_cast<unsigned>(parse_int(a, v, 0, 1 << 30));
    } else {
      usage_error("unknown option '" + a + "'");
    }
  }
  if (o.q_heads % o.kv_heads != 0)
    usage_error("--q-heads " + std::to_string(o.q_heads) + " is not a multiple of --kv-heads " +
                std::to_string(o.kv_heads));
  if (o.prefill + o.decode == 0) usage_error("--prefill and --decode are both 0: nothing to do");
  return o;
}

/// Synthetic rows [tokens, heads, head_dim]; `outliers` scales channels d % 16 == 5.
std::vector<float> synth(std::mt19937& rng, int64_t tokens, int heads, int head_dim,
                         bool outliers) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(static_cast<std::size_t>(tokens * heads * head_dim));
  for (std::size_t i = 0; i < x.size(); ++i) {
    const bool big = outliers && (i % static_cast<std::size_t>(head_dim)) % 16 == 5;
    x[i] = big ? 8.f * nd(rng) + 3.f : nd(rng);
  }
  return x;
}

double rel_rms(const std::vector<float>& ref, const std::vector<float>& x) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    num += (double(x[i]) - ref[i]) * (double(x[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

void run(const Options& o, const kvq::Policy& policy) {
  using Clock = std::chrono::steady_clock;
  const int L = o.layers, H = o.kv_heads, QH = o.q_heads, D = o.head_dim;
  const int max_tokens = o.prefill + o.decode;
  kvq::KVCache cache(policy, L, H, D, max_tokens);  // throws first if the geometry cannot work
  std::printf(
      "policy %s\n  layers %d, kv_heads %d, q_heads %d, head_dim %d, prefill %d, decode %d\n",
      policy.spec().c_str(), L, H, QH, D, o.prefill, o.decode);
  kvq::KVCache ref(kvq::parse_policy("f32"), L, H, D, max_tokens);
  kvq::KVCache half(kvq::parse_policy("f16"), L, H, D, max_tokens);
  std::mt19937 rng(o.seed);
  kvq::AttentionWorkspace ws, ws_ref, ws_half;
  double err_sum = 0, err_max = 0;
  int64_t err_n = 0;
  auto compare = [&](const std::vector<float>& a, const std::vector<float>& b) {
    const double e = rel_rms(b, a);
    err_sum += e;
    err_max = std::max(err_max, e);
    ++err_n;
  };
  using KV = kvq::KVView<const float>;
  using Out = kvq::KVView<float>;

  // Prefill: one chunk per layer, then causal attention for all prefill queries.
  double quant_s = 0, attn_s = 0;
  if (o.prefill > 0) {
    for (int l = 0; l < L; ++l) {
      const auto k = synth(rng, o.prefill, H, D, true);
      const auto v = synth(rng, o.prefill, H, D, false);
      const auto q = synth(rng, o.prefill, QH, D, false);
      const auto t0 = Clock::now();
      cache.append(l, KV::nhd(k.data(), o.prefill, H, D), KV::nhd(v.data(), o.prefill, H, D));
      const auto t1 = Clock::now();
      std::vector<float> out(q.size()), out_ref(q.size());
      kvq::attend(cache, l, KV::nhd(q.data(), o.prefill, QH, D),
                  Out::nhd(out.data(), o.prefill, QH, D), true, ws);
      attn_s += std::chrono::duration<double>(Clock::now() - t1).count();
      quant_s += std::chrono::duration<double>(t1 - t0).count();
      ref.append(l, KV::nhd(k.data(), o.prefill, H, D), KV::nhd(v.data(), o.prefill, H, D));
      half.append(l, KV::nhd(k.data(), o.prefill, H, D), KV::nhd(v.data(), o.prefill, H, D));
      kvq::attend(ref, l, KV::nhd(q.data(), o.prefill, QH, D),
                  Out::nhd(out_ref.data(), o.prefill, QH, D), true, ws_ref);
      compare(out, out_ref);
    }
    std::printf("  prefill: append %.2f ms, causal attention %.2f ms (all layers)\n", quant_s * 1e3,
                attn_s * 1e3);
  }

  // Decode: one token per layer per step, single-query attention.
  double decode_s = 0, attend_s = 0, half_s = 0;
  std::vector<float> out(static_cast<std::size_t>(QH * D)), out_ref(out.size()),
      out_half(out.size());
  for (int step = 0; step < o.decode; ++step) {
    for (int l = 0; l < L; ++l) {
      const auto k = synth(rng, 1, H, D, true);
      const auto v = synth(rng, 1, H, D, false);
      const auto q = synth(rng, 1, QH, D, false);
      const auto t0 = Clock::now();
      cache.append(l, KV::nhd(k.data(), 1, H, D), KV::nhd(v.data(), 1, H, D));
      const auto t1 = Clock::now();
      kvq::attend_one(cache, l, q.data(), QH, out.data(), ws);
      const auto t2 = Clock::now();
      decode_s += std::chrono::duration<double>(t2 - t0).count();
      attend_s += std::chrono::duration<double>(t2 - t1).count();
      half.append(l, KV::nhd(k.data(), 1, H, D), KV::nhd(v.data(), 1, H, D));
      const auto t3 = Clock::now();
      kvq::attend_one(half, l, q.data(), QH, out_half.data(), ws_half);
      half_s += std::chrono::duration<double>(Clock::now() - t3).count();
      ref.append(l, KV::nhd(k.data(), 1, H, D), KV::nhd(v.data(), 1, H, D));
      kvq::attend_one(ref, l, q.data(), QH, out_ref.data(), ws_ref);
      compare(out, out_ref);
    }
  }
  if (o.decode > 0) {
    std::printf("  decode: %d steps in %.2f ms (%.1f tokens/s through %d layers)\n", o.decode,
                decode_s * 1e3, o.decode / std::max(decode_s, 1e-9), L);
    std::printf("  decode attention (fused, %s): %.1f tokens/s; the f16 cache: %.1f tokens/s "
                "(%.2fx)\n",
                kvq::simd_level(), o.decode / std::max(attend_s, 1e-9),
                o.decode / std::max(half_s, 1e-9), half_s / std::max(attend_s, 1e-9));
  }
  std::printf("  attention output vs the f32 cache: relative RMS error mean %.5f, max %.5f\n",
              err_n ? err_sum / static_cast<double>(err_n) : 0.0, err_max);

  const kvq::MemoryReport m = cache.memory_report();
  std::printf("  layer formats: ");
  for (int l = 0; l < L; ++l)
    std::printf("%s%d: k=%s v=%s (B=%lld)%s", l ? ", " : "", l,
                kvq::config_spec(cache.key_config(l)).c_str(),
                kvq::config_spec(cache.value_config(l)).c_str(),
                static_cast<long long>(cache.block_tokens(l)), cache.skipped(l) ? " skipped" : "");
  std::printf("\n  memory (bytes; qjl = QJL signs + norms; sinks and residual are f32 tokens):\n");
  std::fputs(m.str().c_str(), stdout);
  std::printf("\n");
}

/// The batched decode: o.seqs sequences (prefill o.prefill, o.prefill / 2, ... tokens), o.decode
/// steps, one attend_batch per layer per step; rows compared with attend on each cache.
void run_batch(const Options& o, const kvq::Policy& policy) {
  using Clock = std::chrono::steady_clock;
  using KV = kvq::KVView<const float>;
  const int L = o.layers, H = o.kv_heads, QH = o.q_heads, D = o.head_dim, B = o.seqs;
  std::mt19937 rng(o.seed + 1000);
  std::vector<kvq::KVCache> seqs;
  std::vector<int> prefill(static_cast<std::size_t>(B));
  for (int s = 0; s < B; ++s) {
    prefill[static_cast<std::size_t>(s)] = o.prefill >> s;  // 256, 128, 64, ...
    seqs.emplace_back(policy, L, H, D, prefill[static_cast<std::size_t>(s)] + o.decode);
    for (int l = 0; l < L && prefill[static_cast<std::size_t>(s)] > 0; ++l) {
      const int T = prefill[static_cast<std::size_t>(s)];
      const auto k = synth(rng, T, H, D, true), v = synth(rng, T, H, D, false);
      seqs.back().append(l, KV::nhd(k.data(), T, H, D), KV::nhd(v.data(), T, H, D));
    }
  }
  // What an engine keeps per step: the page pointers of all sequences, indptrs, tokens, f32
  // sink / tail rows, gathered per layer from the caches (kvq::CacheBatch: one query each).
  kvq::CacheBatch cbatch;
  std::vector<const kvq::KVCache*> seq_ptrs;
  for (const kvq::KVCache& c : seqs) seq_ptrs.push_back(&c);
  kvq::BatchAttentionWorkspace bws;
  kvq::AttentionWorkspace ws;
  kvq::AttentionOptions opt;
  // The engine's persistent workers (kvq::WorkerPool when it has no pool of its own): started
  // once, woken by every attend_batch call, instead of std::threads started per call.
  kvq::WorkerPool workers(o.threads);
  workers.configure(opt);
  std::vector<float> out(static_cast<std::size_t>(B * QH * D)), one(static_cast<std::size_t>(QH * D));
  double batch_s = 0;
  bool identical = true;
  for (int step = 0; step < o.decode; ++step)
    for (int l = 0; l < L; ++l) {
      const auto q = synth(rng, B, QH, D, false);
      for (kvq::KVCache& c : seqs) {
        const auto k = synth(rng, 1, H, D, true), v = synth(rng, 1, H, D, false);
        c.append(l, KV::nhd(k.data(), 1, H, D), KV::nhd(v.data(), 1, H, D));
      }
      const kvq::PagedKVBatch& b = cbatch.gather(seq_ptrs, l);
      const auto t0 = Clock::now();
      kvq::attend_batch(b, KV::nhd(q.data(), B, QH, D), kvq::KVView<float>::nhd(out.data(), B, QH, D),
                        true, bws, nullptr, opt);
      batch_s += std::chrono::duration<double>(Clock::now() - t0).count();
      for (int s = 0; s < B; ++s) {
        kvq::attend_one(seqs[static_cast<std::size_t>(s)], l, q.data() + s * QH * D, QH, one.data(), ws);
        identical = identical && std::equal(one.begin(), one.end(), out.begin() + s * QH * D);
      }
    }
  std::printf("  batched decode: %d sequences, %d steps x %d layers, one attend_batch call per layer "
              "(%d thread%s): %.1f steps/s; every row equals attend on its own cache: %s\n",
              B, o.decode, L, o.threads, o.threads == 1 ? "" : "s",
              o.decode / std::max(batch_s, 1e-9), identical ? "yes" : "NO");
  for (int s = 0; s < B; ++s) {
    const kvq::MemoryReport m = seqs[static_cast<std::size_t>(s)].memory_report();
    std::printf("    sequence %d: %lld tokens per layer, %zu bytes, %.3f bits/value\n", s,
                static_cast<long long>(seqs[static_cast<std::size_t>(s)].tokens(0)), m.total(),
                m.effective_bits());
  }
  std::printf("\n");
  if (!identical) kvq::fail(kvq::ErrorKind::kInvalidArgument,
                                    "attend_batch rows differ from attend on the same cache");
}

/// Prefix sharing: o.seqs (at least 2) sequences forked from one cache holding a shared
/// o.prefill-token prefix (KVCache::fork(): the pages are shared, not copied), the source then
/// dropped; each fork decodes o.decode steps of its own tokens. Fork 0 decodes speculatively:
/// exact rollback on for that fork only, each step appends kDraft draft tokens to every layer
/// and truncates back to the ones accepted. Each fork is checked bit for bit (page bytes and
/// attend_one) against a cache fed its kept tokens alone; the bytes of each fork and of all
/// together (each shared page once) are printed.
void run_fork(const Options& o, const kvq::Policy& policy) {
  using KV = kvq::KVView<const float>;
  constexpr int kDraft = 4;
  const int L = o.layers, H = o.kv_heads, QH = o.q_heads, D = o.head_dim;
  const int n = std::max(o.seqs, 2), T = o.prefill;
  const auto row = static_cast<std::size_t>(H * D);
  std::mt19937 rng(o.seed + 2000);
  // kept[s][l]: the keys and values sequence s holds in layer l, for the check.
  std::vector<std::vector<std::vector<float>>> kept_k(static_cast<std::size_t>(n)),
      kept_v(kept_k.size());
  std::vector<kvq::KVCache> forks;
  {
    kvq::KVCache root(policy, L, H, D);
    std::vector<std::vector<float>> pk(static_cast<std::size_t>(L)), pv(pk.size());
    for (int l = 0; l < L && T > 0; ++l) {
      pk[static_cast<std::size_t>(l)] = synth(rng, T, H, D, true);
      pv[static_cast<std::size_t>(l)] = synth(rng, T, H, D, false);
      root.append(l, KV::nhd(pk[static_cast<std::size_t>(l)].data(), T, H, D),
                  KV::nhd(pv[static_cast<std::size_t>(l)].data(), T, H, D));
    }
    for (int s = 0; s < n; ++s) {
      forks.push_back(root.fork());
      kept_k[static_cast<std::size_t>(s)] = pk;
      kept_v[static_cast<std::size_t>(s)] = pv;
    }
  }  // the source goes; the forks keep the prefix pages alive
  forks[0].set_exact_rollback(true);
  int64_t drafted = 0, accepted = 0;
  bool exact = true;
  for (int step = 0; step < o.decode; ++step)
    for (int s = 0; s < n; ++s) {
      kvq::KVCache& c = forks[static_cast<std::size_t>(s)];
      const int m = s == 0 ? kDraft : 1;
      const int keep = s == 0 ? (3 * step) % (kDraft + 1) : 1;  // drafts accepted: 0..kDraft
      const int64_t before = c.tokens(0);
      for (int l = 0; l < L; ++l) {
        const auto k = synth(rng, m, H, D, true), v = synth(rng, m, H, D, false);
        c.append(l, KV::nhd(k.data(), m, H, D), KV::nhd(v.data(), m, H, D));
        auto& kk = kept_k[static_cast<std::size_t>(s)][static_cast<std::size_t>(l)];
        auto& kv = kept_v[static_cast<std::size_t>(s)][static_cast<std::size_t>(l)];
        kk.insert(kk.end(), k.begin(), k.begin() + static_cast<std::ptrdiff_t>(keep * row));
        kv.insert(kv.end(), v.begin(), v.begin() + static_cast<std::ptrdiff_t>(keep * row));
      }
      if (keep < m) {
        for (int l = 0; l < L; ++l) exact = exact && c.truncate_is_exact(l, before + keep);
        c.truncate(before + keep);
      }
      if (s == 0) {
        drafted += m;
        accepted += keep;
      }
    }
  // Each fork against a cache fed its kept tokens alone.
  kvq::AttentionWorkspace ws;
  std::vector<float> a(static_cast<std::size_t>(QH * D)), b(a.size());
  for (int s = 0; s < n; ++s) {
    kvq::KVCacheOptions opts;
    opts.exact_rollback = s == 0;
    kvq::KVCache alone(policy, L, H, D, 0, opts);
    const kvq::KVCache& f = forks[static_cast<std::size_t>(s)];
    for (int l = 0; l < L; ++l) {
      const auto& kk = kept_k[static_cast<std::size_t>(s)][static_cast<std::size_t>(l)];
      const auto& kv = kept_v[static_cast<std::size_t>(s)][static_cast<std::size_t>(l)];
      const auto t = static_cast<int64_t>(kk.size() / row);
      if (t > 0) alone.append(l, KV::nhd(kk.data(), t, H, D), KV::nhd(kv.data(), t, H, D));
      const kvq::PageTable pf = f.page_table(l), pa = alone.page_table(l);
      exact = exact && pf.n_pages == pa.n_pages && f.tokens(l) == alone.tokens(l);
      for (int64_t j = 0; exact && j < pf.n_pages; ++j)
        exact = std::equal(pf.pages[j], pf.pages[j] + pf.layout.bytes, pa.pages[j]);
      if (f.tokens(l) == 0) continue;
      const auto q = synth(rng, 1, QH, D, false);
      kvq::attend_one(f, l, q.data(), QH, a.data(), ws);
      kvq::attend_one(alone, l, q.data(), QH, b.data(), ws);
      exact = exact && a == b;
    }
  }
  std::printf(
      "  prefix sharing: %d sequences forked from one %d-token prefix, %d steps; sequence 0 "
      "speculates %d draft tokens per step with exact rollback (%lld of %lld accepted); "
      "every fork equals a cache fed its tokens alone: %s\n",
      n, T, o.decode, kDraft, static_cast<long long>(accepted), static_cast<long long>(drafted),
      exact ? "yes" : "NO");
  std::vector<const kvq::KVCache*> all;
  std::size_t each = 0;
  for (int s = 0; s < n; ++s) {
    const kvq::KVCache& f = forks[static_cast<std::size_t>(s)];
    const kvq::MemoryReport m = f.memory_report();
    std::printf(
        "    fork %d: %lld tokens per layer, %zu bytes (%zu in pages shared with other "
        "forks), %.3f bits/value\n",
        s, static_cast<long long>(f.tokens(0)), m.total(), m.shared(), m.effective_bits());
    all.push_back(&f);
    each += m.total();
  }
  std::printf(
      "    all forks: %zu bytes, each shared page counted once (%zu if every fork held "
      "its own copy)\n\n",
      kvq::unique_total(all), each);
  if (!exact)
    kvq::fail(kvq::ErrorKind::kInvalidArgument,
              "a fork differs from a cache fed the same tokens alone");
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse_args(argc, argv);
  std::vector<kvq::Policy> policies;
  try {
    policies = kvq::parse_policies(o.policy);
  } catch (const kvq::Error& e) {
    usage_error(std::string("--policy: ") + e.what());
  }
  try {
    for (const kvq::Policy& p : policies) {
      run(o, p);
      if (o.seqs > 0 && o.decode > 0) {
        run_batch(o, p);
        run_fork(o, p);
      }
    }
  } catch (const kvq::Error& e) {
    std::fprintf(stderr, "kvq_engine_demo: error: %s\n", e.what());
    return 1;
  }
  return 0;
}

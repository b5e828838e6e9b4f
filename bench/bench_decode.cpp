// Fused attention speed: decode (one query per head) and chunked prefill over a KVCache, for the
// policies an engine would pick, against a plain read-and-sum of the same number of bytes.
//
//   BM_Decode/<policy>/<tokens>   attend_one over <tokens> cached tokens (8 kv heads, head_dim
//                                 128, 32 query heads, one thread). items/s = cached tokens
//                                 attended per second; bytes/s = KV bytes read per second (the
//                                 cache's stored bytes: codes, metadata, f32 sinks/residual);
//                                 counter kv_bytes = those bytes.
//   BM_StreamRead/<bytes>         sum of <bytes> bytes as 64-bit words (the bandwidth ceiling
//                                 for a kernel that reads that many bytes once), one per
//                                 decode size.
//   BM_StreamRead/<bytes>/threads:<n>   the largest of those sizes read by n = 1 or 2
//                                 std::threads at once, each its own buffer (wall-clock time;
//                                 bytes = all threads'): the bandwidth two workers share.
//   BM_Prefill/<policy>/<chunk>   attend of <chunk> causal queries at the newest positions of
//                                 a 2048-token cache; items/s = queries per second.
//   BM_FmaPeak                    the compute ceiling: fp32 FMAs per second (items/s) of one
//                                 thread at the build's widest SIMD (16 lanes with AVX-512, 8
//                                 with AVX2, std::fma scalar otherwise), 12 independent chains.
//                                 BM_Decode's counter fma_per_token (2 x query heads x head_dim:
//                                 a query-key dot product and a weighted value row per query
//                                 head) turns its tokens/s into a fraction of that ceiling.
//   BM_FmaPeak/threads:<n>        the same chains on n = 1 or 2 std::threads at once (wall-clock
//                                 time; items = all threads' FMAs): the compute two workers
//                                 share.
// Besides the presets, BM_Decode/<name>/32768 for KVQuant-style caches (kExtraPolicies): nuq
// codebooks (calibrated once on other synthetic data) and 1% dense-and-sparse outliers, both
// read in the fused kernels; and for the FP4 formats (nvfp4, nvfp4-rot, mxfp4, k8-nvfp4).
//   BM_DecodeBatch/<policy>/<seqs>x<tokens>/threads:<n>   (16x2048, 4x32768, 1x32768)
//                                 attend_batch: one decode query per sequence for <seqs>
//                                 sequences of <tokens> tokens each, their pages copied into one
//                                 pool (distinct bytes per sequence), <n> workers (std::threads).
//                                 items/s = cached tokens attended per second over the batch.
//   BM_DecodeBatch/<policy>/<seqs>x<tokens>/pool:2   the same with 2 workers of a
//                                 kvq::WorkerPool (persistent threads, woken per call).
// kvq_bench_report turns these into fractions of the stream bandwidth and speedups over f16.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "bench_common.hpp"
#include "kvq/attention/attention.hpp"
#include "kvq/attention/worker_pool.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/policy/spec.hpp"
#include "kvq/policy/calibrate.hpp"

namespace {

constexpr int kKvHeads = 8;
constexpr int kDim = 128;
constexpr int kQueryHeads = 32;
constexpr int64_t kMaxTokens = 32768;
const char* const kPolicies[] = {"f32", "f16", "fp8", "k8v4", "kivi4", "kivi2", "turbo4"};
/// Decode-only extras at the largest size: bench name -> policy spec (KIVI's geometry).
const std::pair<const char*, const char*> kExtraPolicies[] = {
    {"kivi4-out1", "k=int4/channel/g32/out1%,v=int4/token/g32/out1%,residual=32"},
    {"nuq4", "k=nuq4/channel/g32,v=nuq4/token/g32,residual=32"},
    {"nuq3-out1", "k=nuq3/channel/g32/out1%,v=nuq3/token/g32/out1%,residual=32"},
    // FP4 (format/fp4.hpp): K and V alike, plain and rotated, and e4m3 keys with NVFP4 values
    {"nvfp4", "k=nvfp4,v=nvfp4"},
    {"nvfp4-rot", "k=nvfp4/rot,v=nvfp4/rot"},
    {"mxfp4", "k=mxfp4,v=mxfp4"},
    {"k8-nvfp4", "k=e4m3/head,v=nvfp4"}};
const int64_t kDecodeTokens[] = {1024, 8192, 32768};
/// BM_DecodePreRope: the same caches read as pre-RoPE keys (KVQuant's geometry: every key row
/// rotated at its position after decoding).
const char* const kPreRopePolicies[] = {"f16", "kivi4", "nuq3-out1"};
const int64_t kPrefillChunks[] = {16, 128};
constexpr int64_t kPrefillContext = 2048;

/// Key and value inputs for the largest context, made once.
const std::vector<float>& input(bool key) {
  static const std::vector<float> k =
      kvq_bench::make_input(static_cast<std::size_t>(kMaxTokens) * kKvHeads * kDim, 11);
  static const std::vector<float> v =
      kvq_bench::make_input(static_cast<std::size_t>(kMaxTokens) * kKvHeads * kDim, 12);
  return key ? k : v;
}

/// The policy of a bench name: a preset, or an extra (nuq codebooks calibrated once on 256
/// tokens of synthetic data made with other seeds than the cached tokens; at registration, so
/// it is kept small: 256 tokens, 262144 values per codebook).
const kvq::Policy& policy_of(const std::string& name) {
  static std::map<std::string, kvq::Policy> policies;
  auto it = policies.find(name);
  if (it != policies.end()) return it->second;
  std::string spec = name;
  for (const auto& e : kExtraPolicies)
    if (name == e.first) spec = e.second;
  kvq::Policy pol = kvq::parse_policy(spec);
  if (spec.find("nuq") != std::string::npos) {
    constexpr int64_t kCalTokens = 256;
    kvq::CalibrationSet cs;
    cs.n_layers = 1;
    cs.kv_heads = kKvHeads;
    cs.head_dim = kDim;
    kvq::CalibrationSet::Sequence seq;
    seq.tokens = kCalTokens;
    kvq::CalibrationSet::Layer L;
    L.k = kvq_bench::make_input(static_cast<std::size_t>(kCalTokens) * kKvHeads * kDim, 21);
    L.v = kvq_bench::make_input(static_cast<std::size_t>(kCalTokens) * kKvHeads * kDim, 22);
    seq.layers.push_back(std::move(L));
    cs.sequences.push_back(std::move(seq));
    pol = kvq::calibrate(pol, cs);
  }
  return policies.emplace(name, std::move(pol)).first->second;
}

/// A one-layer cache of `tokens` tokens under `policy`, built once per (policy, tokens) and kept
/// (repetitions reuse it).
const kvq::KVCache& cache_for(const std::string& policy, int64_t tokens) {
  static std::map<std::pair<std::string, int64_t>, std::unique_ptr<kvq::KVCache>> caches;
  auto& slot = caches[{policy, tokens}];
  if (!slot) {
    slot = std::make_unique<kvq::KVCache>(policy_of(policy), 1, kKvHeads, kDim);
    const float* k = input(true).data();
    const float* v = input(false).data();
    const int64_t row = int64_t{kKvHeads} * kDim;
    for (int64_t t = 0; t < tokens; t += 1024) {
      const int64_t n = std::min<int64_t>(1024, tokens - t);
      slot->append(0, kvq::KVView<const float>::nhd(k + t * row, n, kKvHeads, kDim),
                   kvq::KVView<const float>::nhd(v + t * row, n, kKvHeads, kDim));
    }
  }
  return *slot;
}

int64_t stored_bytes(const std::string& policy, int64_t tokens);

void BM_Decode(benchmark::State& state, std::string policy, int64_t tokens,
               bool pre_rope = false, bool int8 = false) {
  const kvq::KVCache& c = cache_for(policy, tokens);
  const auto kv_bytes = static_cast<int64_t>(c.memory_report().total());
  if (kv_bytes != stored_bytes(policy, tokens)) {
    state.SkipWithError("stored bytes differ from the registration-time figure");
    return;
  }
  const std::vector<float> q =
      kvq_bench::make_input(static_cast<std::size_t>(kQueryHeads) * kDim, 3);
  std::vector<float> out(q.size());
  kvq::AttentionWorkspace ws;
  const kvq::RopeConfig rope;  // pre_rope: the cache's keys are taken as pre-RoPE keys
  const kvq::RopeConfig* key_rope = pre_rope ? &rope : nullptr;
  kvq::AttentionOptions opt;
  if (int8) opt.dot = kvq::DotProduct::kInt8;
  kvq::attend_one(c, 0, q.data(), kQueryHeads, out.data(), ws, key_rope, opt);  // sizes ws
  for (auto _ : state) {
    kvq::attend_one(c, 0, q.data(), kQueryHeads, out.data(), ws, key_rope, opt);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) * tokens);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kv_bytes);
  state.counters["kv_bytes"] = static_cast<double>(kv_bytes);
  state.counters["fma_per_token"] = 2.0 * kQueryHeads * kDim;
}

/// BM_DecodeBatch's inputs: `seqs` copies of the (policy, tokens) cache's pages in one pool
/// (sequence-major), its f32 sink and tail rows shared by every sequence (repetitions reuse it).
struct BatchInput {
  std::vector<std::byte> arena;
  std::vector<int64_t> page_indptr{0}, tokens, query_indptr{0};
  std::vector<int32_t> page_ids;
  std::vector<kvq::KVView<const float>> sk, sv, tk, tv;
  kvq::PagedKVBatch b;
};

const BatchInput& batch_for(const std::string& policy, int64_t seqs, int64_t tokens) {
  static std::map<std::tuple<std::string, int64_t, int64_t>, std::unique_ptr<BatchInput>> inputs;
  auto& slot = inputs[{policy, seqs, tokens}];
  if (slot) return *slot;
  slot = std::make_unique<BatchInput>();
  BatchInput& in = *slot;
  const kvq::KVCache& c = cache_for(policy, tokens);
  const kvq::PageTable pt = c.page_table(0);
  const kvq::KVView<const float> none(nullptr, kvq::Shape{0, kKvHeads, kDim});
  kvq::KVView<const float> sk = none, sv = none, tk = none, tv = none;
  c.for_each_segment(0, [&](const kvq::CacheSegment& g) {
    if (g.kind == kvq::CacheSegment::Kind::kSinks) {
      sk = g.key_rows;
      sv = g.value_rows;
    } else if (g.kind == kvq::CacheSegment::Kind::kResidual) {
      tk = g.key_rows;
      tv = g.value_rows;
    }
  });
  const std::size_t pb = pt.layout.bytes;
  const int64_t pages = seqs * pt.n_pages;
  in.arena.resize(pb * static_cast<std::size_t>(pages) + 64);
  std::byte* pool =
      in.arena.data() + (64 - reinterpret_cast<std::uintptr_t>(in.arena.data()) % 64) % 64;
  for (int64_t s = 0; s < seqs; ++s) {
    for (int64_t i = 0; i < pt.n_pages; ++i) {
      const int64_t id = s * pt.n_pages + i;
      std::memcpy(pool + static_cast<std::size_t>(id) * pb, pt.pages[i], pb);
      in.page_ids.push_back(static_cast<int32_t>(id));
    }
    in.page_indptr.push_back(static_cast<int64_t>(in.page_ids.size()));
    in.tokens.push_back(pt.tokens);
    in.query_indptr.push_back(s + 1);
    in.sk.push_back(sk);
    in.sv.push_back(sv);
    in.tk.push_back(tk);
    in.tv.push_back(tv);
  }
  in.b.layout = pt.layout;
  in.b.pool = pool;
  in.b.pool_pages = pages;
  in.b.batch = seqs;
  in.b.page_indptr = in.page_indptr.data();
  in.b.page_ids = in.page_ids.data();
  in.b.tokens = in.tokens.data();
  in.b.query_indptr = in.query_indptr.data();
  in.b.sink_k = in.sk.data();
  in.b.sink_v = in.sv.data();
  in.b.tail_k = in.tk.data();
  in.b.tail_v = in.tv.data();
  return in;
}

void BM_DecodeBatch(benchmark::State& state, std::string policy, int64_t seqs, int64_t tokens,
                    int threads, bool pool) {
  const BatchInput& in = batch_for(policy, seqs, tokens);
  const std::vector<float> q =
      kvq_bench::make_input(static_cast<std::size_t>(seqs) * kQueryHeads * kDim, 5);
  std::vector<float> out(q.size());
  const auto qv = kvq::KVView<const float>::nhd(q.data(), seqs, kQueryHeads, kDim);
  const auto ov = kvq::KVView<float>::nhd(out.data(), seqs, kQueryHeads, kDim);
  kvq::BatchAttentionWorkspace ws;
  kvq::AttentionOptions opt;
  opt.threads = threads;
  std::unique_ptr<kvq::WorkerPool> workers;
  if (pool) {  // persistent workers instead of std::threads started per call
    workers = std::make_unique<kvq::WorkerPool>(threads);
    workers->configure(opt);
  }
  kvq::attend_batch(in.b, qv, ov, true, ws, nullptr, opt);  // sizes the workspace
  for (auto _ : state) {
    kvq::attend_batch(in.b, qv, ov, true, ws, nullptr, opt);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) * seqs * tokens);
}

// The widest fp32 vector of the build and its FMA (BM_FmaPeak).
#if KVQ_HAS_AVX512
using FmaVec = __m512;
constexpr int kFmaLanes = 16;
FmaVec fma_splat(float x) { return _mm512_set1_ps(x); }
FmaVec fma_step(FmaVec v, FmaVec a, FmaVec b) { return _mm512_fmadd_ps(v, a, b); }
#elif KVQ_HAS_AVX2
using FmaVec = __m256;
constexpr int kFmaLanes = 8;
FmaVec fma_splat(float x) { return _mm256_set1_ps(x); }
FmaVec fma_step(FmaVec v, FmaVec a, FmaVec b) { return _mm256_fmadd_ps(v, a, b); }
#else
using FmaVec = float;
constexpr int kFmaLanes = 1;
FmaVec fma_splat(float x) { return x; }
FmaVec fma_step(FmaVec v, FmaVec a, FmaVec b) { return std::fma(v, a, b); }
#endif

/// kSteps x kChains FMAs on independent accumulators (more than latency x FMA ports on the
/// hosts seen), each x = x * a + b, which stays near 1 (no denormals, no inf).
constexpr int kFmaChains = 12;
void fma_chains(int64_t steps) {
  FmaVec acc[kFmaChains];
  for (auto& v : acc) v = fma_splat(1.f);
  FmaVec a = fma_splat(0.999f), b = fma_splat(0.001f);
  benchmark::DoNotOptimize(a);  // no constant folding
  benchmark::DoNotOptimize(b);
  for (int64_t i = 0; i < steps; ++i)
    for (auto& v : acc) v = fma_step(v, a, b);
  for (auto& v : acc) benchmark::DoNotOptimize(v);
}

/// fp32 FMA throughput of one thread.
void BM_FmaPeak(benchmark::State& state) {
  constexpr int64_t kSteps = 1024;
  for (auto _ : state) fma_chains(kSteps);
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) * kSteps * kFmaChains *
                          kFmaLanes);
}

/// The same FMA chains on `threads` std::threads at once, wall-clock time, items = all threads'
/// FMAs: the compute two workers share (two vCPUs that are one core's SMT siblings share its
/// FMA ports and read about 1x here; two cores read about 2x).
void BM_FmaPeakThreads(benchmark::State& state, int threads) {
  constexpr int64_t kSteps = 1 << 21;  // 5-10 ms per thread: thread start-up is noise
  for (auto _ : state) {
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) workers.emplace_back([] { fma_chains(kSteps); });
    for (auto& w : workers) w.join();
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) * threads * kSteps *
                          kFmaChains * kFmaLanes);
}

void BM_StreamRead(benchmark::State& state, int64_t bytes) {
  std::vector<uint64_t> buf(static_cast<std::size_t>((bytes + 7) / 8));
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = i * 0x9e3779b97f4a7c15ull;
  for (auto _ : state) {
    uint64_t s = 0;
    for (uint64_t w : buf) s += w;
    benchmark::DoNotOptimize(s);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * bytes);
}

/// BM_StreamRead over `threads` buffers of `bytes` each, one std::thread per buffer, all reading
/// at once: the memory bandwidth the batch decode's workers share. Timed in wall-clock time
/// (the workers' CPU time is not the caller's); bytes = all threads' bytes.
void BM_StreamReadThreads(benchmark::State& state, int64_t bytes, int threads) {
  std::vector<std::vector<uint64_t>> bufs(static_cast<std::size_t>(threads));
  for (auto& buf : bufs) {
    buf.resize(static_cast<std::size_t>((bytes + 7) / 8));
    for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = i * 0x9e3779b97f4a7c15ull;
  }
  std::vector<uint64_t> sums(bufs.size() * 8);  // one cache line per thread
  for (auto _ : state) {
    std::vector<std::thread> workers;
    for (std::size_t t = 0; t < bufs.size(); ++t)
      workers.emplace_back([&bufs, &sums, t] {
        uint64_t s = 0;
        for (uint64_t w : bufs[t]) s += w;
        sums[t * 8] = s;
      });
    for (auto& w : workers) w.join();
    benchmark::DoNotOptimize(sums.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * bytes * threads);
}

void BM_Prefill(benchmark::State& state, std::string policy, int64_t chunk) {
  const kvq::KVCache& c = cache_for(policy, kPrefillContext);
  const std::vector<float> q =
      kvq_bench::make_input(static_cast<std::size_t>(chunk) * kQueryHeads * kDim, 4);
  std::vector<float> out(q.size());
  kvq::AttentionWorkspace ws;
  const auto qv = kvq::KVView<const float>::nhd(q.data(), chunk, kQueryHeads, kDim);
  const auto ov = kvq::KVView<float>::nhd(out.data(), chunk, kQueryHeads, kDim);
  kvq::attend(c, 0, qv, ov, true, ws);
  for (auto _ : state) {
    kvq::attend(c, 0, qv, ov, true, ws);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) * chunk);
}

/// Stored bytes of a (policy, tokens) cache without building the large one: the cache is
/// periodic in its block size B once past the f32 window, so bytes(n) = bytes(n') + k * (bytes
/// of one block) with n' = n - k * B a small cache; BM_Decode checks the figure against the
/// real cache.
int64_t stored_bytes(const std::string& policy, int64_t tokens) {
  auto bytes_of = [&](int64_t n) {
    kvq::KVCache c(policy_of(policy), 1, kKvHeads, kDim);
    const int64_t row = int64_t{kKvHeads} * kDim;
    // Stored bytes do not depend on the values: a small all-zero input (no 32k-token input
    // to build at registration time).
    static std::vector<float> zeros;
    if (zeros.size() < static_cast<std::size_t>(std::min<int64_t>(n, 1024) * row))
      zeros.assign(static_cast<std::size_t>(1024 * row), 0.f);
    const float* k = zeros.data();
    const float* v = zeros.data();
    for (int64_t t = 0; t < n; t += 1024) {
      const int64_t m = std::min<int64_t>(1024, n - t);
      c.append(0, kvq::KVView<const float>::nhd(k, m, kKvHeads, kDim),
               kvq::KVView<const float>::nhd(v, m, kKvHeads, kDim));
    }
    return c.memory_report();
  };
  const int64_t B = std::max<int64_t>(1, bytes_of(0).layers[0].block_tokens);
  const int64_t small = tokens % B + 8 * B;
  if (tokens <= small + B) return static_cast<int64_t>(bytes_of(tokens).total());
  const auto a = static_cast<int64_t>(bytes_of(small).total());
  const auto b = static_cast<int64_t>(bytes_of(small + B).total());
  return a + (tokens - small) / B * (b - a);
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      const auto p = line.find(':');
      return p == std::string::npos ? line : line.substr(p + 2);
    }
  return "unknown";
}

std::string cpu_flags() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("flags", 0) == 0) {
      std::string out;
      for (const char* fl : {"avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                             "avx512_bf16", "f16c"})
        if (line.find(std::string(" ") + fl + " ") != std::string::npos ||
            (line.size() >= std::strlen(fl) &&
             line.compare(line.size() - std::strlen(fl), std::string::npos, fl) == 0))
          out += (out.empty() ? "" : " ") + std::string(fl);
      return out;
    }
  return "";
}

int register_all() {
  benchmark::AddCustomContext("cpu_model", cpu_model());
  benchmark::AddCustomContext("cpu_flags", cpu_flags());
  benchmark::AddCustomContext("kvq_simd", kvq::simd_level());
  std::set<int64_t> sizes;
  for (const char* p : kPolicies)
    for (int64_t n : kDecodeTokens) {
      const int64_t bytes = stored_bytes(p, n);
      sizes.insert(bytes);
      benchmark::RegisterBenchmark(
          ("BM_Decode/" + std::string(p) + "/" + std::to_string(n)).c_str(),
          [p = std::string(p), n](benchmark::State& s) { BM_Decode(s, p, n); })
          ->Unit(benchmark::kMillisecond);
    }
  // the int8 dot-product path (DotProduct::kInt8) next to the exact one at the longest length
  for (const char* p : kPolicies)
    benchmark::RegisterBenchmark(
        ("BM_Decode/" + std::string(p) + "/" + std::to_string(kMaxTokens) + "/fast").c_str(),
        [p = std::string(p)](benchmark::State& s) { BM_Decode(s, p, kMaxTokens, false, true); })
        ->Unit(benchmark::kMillisecond);
  for (const auto& e : kExtraPolicies) {
    const int64_t n = kMaxTokens;
    sizes.insert(stored_bytes(e.first, n));
    benchmark::RegisterBenchmark(
        ("BM_Decode/" + std::string(e.first) + "/" + std::to_string(n)).c_str(),
        [p = std::string(e.first), n](benchmark::State& s) { BM_Decode(s, p, n); })
        ->Unit(benchmark::kMillisecond);
  }
  for (const char* p : kPreRopePolicies) {
    const int64_t n = kMaxTokens;
    benchmark::RegisterBenchmark(
        ("BM_DecodePreRope/" + std::string(p) + "/" + std::to_string(n)).c_str(),
        [p = std::string(p), n](benchmark::State& s) { BM_Decode(s, p, n, true); })
        ->Unit(benchmark::kMillisecond);
  }
  for (const char* p : {"f16", "k8v4", "kivi4"})
    for (const auto& st : {std::pair<int64_t, int64_t>{16, 2048}, {4, 32768}, {1, 32768}, {1, 2048}})
      for (int th : {1, 2, -2})  // -2: two workers of a kvq::WorkerPool (".../pool:2")
        benchmark::RegisterBenchmark(
            ("BM_DecodeBatch/" + std::string(p) + "/" + std::to_string(st.first) + "x" +
             std::to_string(st.second) + (th > 0 ? "/threads:" : "/pool:") +
             std::to_string(th > 0 ? th : -th))
                .c_str(),
            [p = std::string(p), st, th](benchmark::State& s) {
              BM_DecodeBatch(s, p, st.first, st.second, th > 0 ? th : -th, th < 0);
            })
            ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_FmaPeak", BM_FmaPeak);
  for (int th : {1, 2})
    benchmark::RegisterBenchmark(("BM_FmaPeak/threads:" + std::to_string(th)).c_str(),
                                 [th](benchmark::State& s) { BM_FmaPeakThreads(s, th); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  for (int64_t b : sizes)
    benchmark::RegisterBenchmark(("BM_StreamRead/" + std::to_string(b)).c_str(),
                                 [b](benchmark::State& s) { BM_StreamRead(s, b); })
        ->Unit(benchmark::kMillisecond);
  // the largest size again on 1 and 2 threads at once (same wall-clock timing for both)
  for (int th : {1, 2})
    benchmark::RegisterBenchmark(
        ("BM_StreamRead/" + std::to_string(*sizes.rbegin()) + "/threads:" + std::to_string(th))
            .c_str(),
        [b = *sizes.rbegin(), th](benchmark::State& s) { BM_StreamReadThreads(s, b, th); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  for (const char* p : kPolicies)
    for (int64_t c : kPrefillChunks)
      benchmark::RegisterBenchmark(
          ("BM_Prefill/" + std::string(p) + "/" + std::to_string(c)).c_str(),
          [p = std::string(p), c](benchmark::State& s) { BM_Prefill(s, p, c); })
          ->Unit(benchmark::kMillisecond);
  return 0;
}

const int registered = register_all();

}  // namespace

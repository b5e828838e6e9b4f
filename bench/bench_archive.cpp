// Offload and restore of one sequence (docs/archive.md, docs/cache.md "Engine pages"): a
// 32768-token cache of 8 kv heads x head_dim 128 (one layer, as an engine offloads layer by
// layer or a whole sequence of such layers) saved to an in-memory archive and restored into a
// cache. Bytes processed = archive bytes per wall-clock second, so GB/s compares with BM_Memcpy.
//   BM_ArchiveSave/<policy>/<tokens>     cache -> checksummed archive bytes
//   BM_ArchiveRestore/<policy>/<tokens>  archive bytes -> a cache (every byte verified)
#include <benchmark/benchmark.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/io/archive.hpp"
#include "kvq/policy/spec.hpp"

namespace {

kvq::KVCache filled_cache(const std::string& spec, int64_t tokens) {
  const int64_t H = kvq_bench::kHeads, D = kvq_bench::kHeadDim;
  kvq::KVCache c(kvq::parse_policy(spec), 1, static_cast<int>(H), static_cast<int>(D));
  const auto k = kvq_bench::make_input(static_cast<std::size_t>(tokens * H * D), 1);
  const auto v = kvq_bench::make_input(static_cast<std::size_t>(tokens * H * D), 2);
  c.append(0, kvq::KVView<const float>::nhd(k.data(), tokens, H, D),
           kvq::KVView<const float>::nhd(v.data(), tokens, H, D));
  return c;
}

void BM_ArchiveSave(benchmark::State& state, std::string spec, int64_t tokens) {
  const kvq::KVCache c = filled_cache(spec, tokens);
  std::size_t bytes = 0;
  for (auto _ : state) {
    auto out = kvq::io::save_archive_bytes(c);
    bytes = out.size();
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  state.counters["archive_MiB"] = static_cast<double>(bytes) / (1 << 20);
}

void BM_ArchiveRestore(benchmark::State& state, std::string spec, int64_t tokens) {
  const kvq::KVCache c = filled_cache(spec, tokens);
  const auto bytes = kvq::io::save_archive_bytes(c);
  kvq::KVCache into(c.policy(), 1, c.kv_heads(), c.head_dim());
  const kvq::io::ArchiveReader reader(bytes.data(), bytes.size());
  for (auto _ : state) {
    reader.load_into(into);
    benchmark::DoNotOptimize(into.page_table(0).pages);
  }
  if (into.tokens(0) != tokens) state.SkipWithError("restored the wrong token count");
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes.size()));
  state.counters["archive_MiB"] = static_cast<double>(bytes.size()) / (1 << 20);
}

const int kRegistered = [] {
  for (const char* spec : {"kivi4", "k8v4", "f16"}) {
    const std::string s = spec;
    benchmark::RegisterBenchmark(("BM_ArchiveSave/" + s + "/32768").c_str(), BM_ArchiveSave, s,
                                 int64_t{32768})
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("BM_ArchiveRestore/" + s + "/32768").c_str(), BM_ArchiveRestore,
                                 s, int64_t{32768})
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
  return 0;
}();

}  // namespace

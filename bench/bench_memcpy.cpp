// Baseline: the machine's single-thread copy bandwidth, so every other benchmark can be quoted
// as a ratio to BM_Memcpy measured in the same run.
#include <benchmark/benchmark.h>

#include <cstring>
#include <vector>

#include "bench_common.hpp"

static void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = kvq_bench::kInputBytes;
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * bytes);
}
BENCHMARK(BM_Memcpy)->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();

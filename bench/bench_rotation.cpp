// Rotation throughput: the fast Walsh-Hadamard transform (TurboQuant's rotate step), the full
// randomized Hadamard rotation (signs + FWHT, and the two-stage scheme for 80/96/192), and the
// dense O(d^2) rotation for comparison. Items = vectors, so items_per_second gives ns/vector.
//
//   kvq_bench --benchmark_filter=Fwht --benchmark_repetitions=5
//             --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "bench_common.hpp"
#include "kvq/geometry/dense_rotation.hpp"
#include "kvq/geometry/rotation.hpp"

namespace {

/// 32 KiB of vectors: fits L1d, so the numbers measure compute, not memory.
constexpr int64_t kBatchFloats = 8192;

std::vector<float> batch_input(int d) {
  std::vector<float> x = kvq_bench::make_input(static_cast<size_t>(kBatchFloats / d) * d);
  return x;
}

void BM_Fwht(benchmark::State& state) {
  const int d = static_cast<int>(state.range(0));
  const int64_t n = kBatchFloats / d;
  std::vector<float> x = batch_input(d);  // [n, d]; orthonormal, so repeated calls stay finite
  for (auto _ : state) {
    kvq::fwht_batch(x.data(), n, d);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * n * d * static_cast<int64_t>(sizeof(float)));
  state.SetLabel(kvq::simd_level());
}
BENCHMARK(BM_Fwht)->Arg(64)->Arg(128)->Arg(256);

void BM_HadamardRotation(benchmark::State& state) {
  const int d = static_cast<int>(state.range(0));
  const int64_t n = kBatchFloats / d;
  const kvq::Rotation r = kvq::Rotation::hadamard(d, 1);
  std::vector<float> x = batch_input(d);
  for (auto _ : state) {
    r.apply_batch(x.data(), n);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * n * d * static_cast<int64_t>(sizeof(float)));
}
BENCHMARK(BM_HadamardRotation)->Arg(64)->Arg(80)->Arg(96)->Arg(128)->Arg(192)->Arg(256);

void BM_DenseRotation(benchmark::State& state) {
  const int d = static_cast<int>(state.range(0));
  const int64_t n = kBatchFloats / d;
  const kvq::Rotation r = kvq::dense_rotation(d, 1);
  std::vector<float> x = batch_input(d);
  for (auto _ : state) {
    r.apply_batch(x.data(), n);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * n * d * static_cast<int64_t>(sizeof(float)));
}
BENCHMARK(BM_DenseRotation)->Arg(128);

}  // namespace

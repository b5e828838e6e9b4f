// BM_Quantize/<fmt>/<axis>/<input> and BM_Dequantize/<fmt>/<axis>/<output>: grouped uniform
// integer formats (asymmetric, group 32, fp16 scale + zero) over 64 MiB of input, head_dim 128.
// Bytes processed = float/half bytes read (quantize) or written (dequantize).
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "bench_common.hpp"
#include "kvq/quant/quantize.hpp"

namespace {

kvq::QuantConfig int_cfg(int bits, kvq::Axis axis) {
  kvq::QuantConfig c;
  c.format = kvq::Format::kInt;
  c.bits = bits;
  c.axis = axis;
  c.group = 32;
  return c;
}

template <class T>
kvq::Shape bench_shape() {
  const int64_t n = static_cast<int64_t>(kvq_bench::kInputBytes / sizeof(T));
  return kvq::Shape{n / (kvq_bench::kHeads * kvq_bench::kHeadDim), kvq_bench::kHeads,
                    kvq_bench::kHeadDim};
}

template <class T>
std::vector<T> bench_input() {
  const kvq::Shape s = bench_shape<T>();
  auto f = kvq_bench::make_input(static_cast<size_t>(s.numel()));
  std::vector<T> v(f.size());
  for (size_t i = 0; i < f.size(); ++i) v[i] = kvq::from_float<T>(f[i]);
  return v;
}

template <class T>
void BM_Quantize(benchmark::State& state, int bits, kvq::Axis axis) {
  const kvq::Shape s = bench_shape<T>();
  const auto x = bench_input<T>();
  const auto cfg = int_cfg(bits, axis);
  kvq::KVView<const T> view(x.data(), s);
  kvq::QTensor q;
  kvq::quantize(cfg, view, q);  // warm: the block's buffers are reused from here on
  for (auto _ : state) {
    kvq::quantize(cfg, view, q);
    benchmark::DoNotOptimize(q.codes.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * s.numel() *
                          static_cast<int64_t>(sizeof(T)));
}

template <class T>
void BM_Dequantize(benchmark::State& state, int bits, kvq::Axis axis) {
  const kvq::Shape s = bench_shape<T>();
  const auto f = kvq_bench::make_input(static_cast<size_t>(s.numel()));
  const auto cfg = int_cfg(bits, axis);
  const auto q = kvq::quantize(cfg, kvq::KVView<const float>(f.data(), s));
  std::vector<T> out(f.size());
  kvq::KVView<T> view(out.data(), s);
  for (auto _ : state) {
    kvq::dequantize(q, view);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * s.numel() *
                          static_cast<int64_t>(sizeof(T)));
}

kvq::QuantConfig lm_cfg(int bits) {
  kvq::QuantConfig c;
  c.format = kvq::Format::kLloydMax;
  c.bits = bits;
  return c;
}

void BM_QuantizeCfg(benchmark::State& state, kvq::QuantConfig cfg) {
  const kvq::Shape s = bench_shape<float>();
  const auto x = bench_input<float>();
  kvq::KVView<const float> view(x.data(), s);
  kvq::QTensor q;
  kvq::quantize(cfg, view, q);
  for (auto _ : state) {
    kvq::quantize(cfg, view, q);
    benchmark::DoNotOptimize(q.codes.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * s.numel() * 4);
}

void BM_DequantizeCfg(benchmark::State& state, kvq::QuantConfig cfg) {
  const kvq::Shape s = bench_shape<float>();
  const auto f = kvq_bench::make_input(static_cast<size_t>(s.numel()));
  const auto q = kvq::quantize(cfg, kvq::KVView<const float>(f.data(), s));
  std::vector<float> out(f.size());
  kvq::KVView<float> view(out.data(), s);
  for (auto _ : state) {
    kvq::dequantize(q, view);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * s.numel() * 4);
}

int register_all() {
  for (int bits : {2, 3, 4}) {
    const std::string tail = "lm" + std::to_string(bits) + "/rot/f32";
    benchmark::RegisterBenchmark(("BM_Quantize/" + tail).c_str(), BM_QuantizeCfg, lm_cfg(bits))
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("BM_Dequantize/" + tail).c_str(), BM_DequantizeCfg,
                                 lm_cfg(bits))
        ->Unit(benchmark::kMillisecond);
  }
  for (int bits : {2, 3, 4, 8}) {
    for (kvq::Axis axis : {kvq::Axis::kToken, kvq::Axis::kChannel}) {
      const std::string tail = "int" + std::to_string(bits) + "/" + kvq::to_string(axis);
      benchmark::RegisterBenchmark(("BM_Quantize/" + tail + "/f32").c_str(), BM_Quantize<float>,
                                   bits, axis)
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark(("BM_Quantize/" + tail + "/f16").c_str(),
                                   BM_Quantize<kvq::f16>, bits, axis)
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark(("BM_Dequantize/" + tail + "/f32").c_str(),
                                   BM_Dequantize<float>, bits, axis)
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark(("BM_Dequantize/" + tail + "/f16").c_str(),
                                   BM_Dequantize<kvq::f16>, bits, axis)
          ->Unit(benchmark::kMillisecond);
    }
  }
  return 0;
}
const int kRegistered = register_all();

}  // namespace

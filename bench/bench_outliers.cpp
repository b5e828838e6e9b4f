// BM_Quantize and BM_DequantizeKVQuant (named apart from issue 2's int dequantize targets)
// for KVQuant's formats (issue 11): nuq3 (a stand-in codebook of 8 fixed non-uniform levels;
// speed does not depend on the level values) and int3 with 1% dense-and-sparse outliers, per
// token (group 32), f32 input, head_dim 128 over the shared 64 MiB input; and, to show the
// other paths are not pathological, int3/out1% per channel (group 32 tokens: the slab path) and
// nuq3/out1% per token. Bytes processed = f32 bytes read (quantize) or written (dequantize).
// BM_QuantizeInCache/...: the per-token quantizers on 64 vectors (in L1), for kernel A/B.
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "bench_common.hpp"
#include "kvq/quant/quantize.hpp"

namespace {

kvq::Shape outlier_bench_shape() {
  const int64_t n = static_cast<int64_t>(kvq_bench::kInputBytes / sizeof(float));
  return kvq::Shape{n / (kvq_bench::kHeads * kvq_bench::kHeadDim), kvq_bench::kHeads,
                    kvq_bench::kHeadDim};
}

kvq::QuantConfig nuq3_cfg() {
  kvq::QuantConfig c;
  c.format = kvq::Format::kNuq;
  c.bits = 3;
  c.axis = kvq::Axis::kToken;
  c.group = 32;
  const float lv[8] = {0.02f, 0.12f, 0.27f, 0.43f, 0.57f, 0.73f, 0.88f, 0.98f};
  for (int i = 0; i < 8; ++i) c.nuq_levels[static_cast<std::size_t>(i)] = lv[i];
  c.nuq_ready = true;
  return c;
}

kvq::QuantConfig int3_out1_cfg() {
  kvq::QuantConfig c;
  c.format = kvq::Format::kInt;
  c.bits = 3;
  c.axis = kvq::Axis::kToken;
  c.group = 32;
  c.outlier_pct = 1.f;
  return c;
}

// quantize(cfg) of kvq_bench's input in shape s, warm (buffers and workspace grown) before the
// timed loop.
void quantize_loop(benchmark::State& state, const kvq::QuantConfig& cfg, const kvq::Shape& s) {
  const auto x = kvq_bench::make_input(static_cast<size_t>(s.numel()));
  kvq::KVView<const float> view(x.data(), s);
  kvq::QTensor q;
  kvq::quantize(cfg, view, q);
  for (auto _ : state) {
    kvq::quantize(cfg, view, q);
    benchmark::DoNotOptimize(q.codes.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * s.numel() * 4);
}

void BM_QuantizeOutlierCfg(benchmark::State& state, kvq::QuantConfig cfg) {
  quantize_loop(state, cfg, outlier_bench_shape());
}

// The same quantizer on 64 vectors (32 KiB of f32, in L1 after the first pass): the per-vector
// compute cost without the memory traffic, for A/B of kernel changes on a host whose memory
// bandwidth moves between runs.
void BM_QuantizeInCacheCfg(benchmark::State& state, kvq::QuantConfig cfg) {
  quantize_loop(state, cfg, kvq::Shape{64 / kvq_bench::kHeads, kvq_bench::kHeads, kvq_bench::kHeadDim});
}

void BM_DequantizeOutlierCfg(benchmark::State& state, kvq::QuantConfig cfg) {
  const kvq::Shape s = outlier_bench_shape();
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

kvq::QuantConfig int3_channel_out1_cfg() {
  kvq::QuantConfig c = int3_out1_cfg();
  c.axis = kvq::Axis::kChannel;
  return c;
}

kvq::QuantConfig nuq3_out1_cfg() {
  kvq::QuantConfig c = nuq3_cfg();
  c.outlier_pct = 1.f;
  return c;
}

int register_outliers() {
  const std::pair<const char*, kvq::QuantConfig> cfgs[] = {
      {"nuq3/token", nuq3_cfg()},
      {"int3/token/out1%", int3_out1_cfg()},
      {"int3/channel/out1%", int3_channel_out1_cfg()},
      {"nuq3/token/out1%", nuq3_out1_cfg()}};
  for (const auto& [name, cfg] : cfgs) {
    benchmark::RegisterBenchmark((std::string("BM_Quantize/") + name + "/f32").c_str(),
                                 BM_QuantizeOutlierCfg, cfg)
        ->Unit(benchmark::kMillisecond);
    if (cfg.axis == kvq::Axis::kToken)  // 64 vectors are 8 tokens: no whole 32-token block
      benchmark::RegisterBenchmark((std::string("BM_QuantizeInCache/") + name + "/f32").c_str(),
                                   BM_QuantizeInCacheCfg, cfg)
          ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark((std::string("BM_DequantizeKVQuant/") + name + "/f32").c_str(),
                                 BM_DequantizeOutlierCfg, cfg)
        ->Unit(benchmark::kMillisecond);
  }
  return 0;
}
const int kOutliersRegistered = register_outliers();

}  // namespace

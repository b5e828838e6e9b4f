// FP8 bulk conversions, single thread, quoted against BM_Memcpy (bench_memcpy.cpp):
//   BM_Fp8Encode/<e4m3|e5m2>/<f32|f16>: 64 MiB of float or half in, scaled by 1/scale from the
//     data's amax, codes out; bytes = input bytes read.
//   BM_Fp8Decode/<e4m3|e5m2>/<f32|f16>: codes in, decode * scale, 64 MiB of float or half out;
//     bytes = output bytes written.
// No UseRealTime(): it would append "/real_time" to these names. The rates are therefore per
// CPU second (the same as wall time for one busy thread on an idle machine; more robust when
// other processes compete for the cores).
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "kvq/core/half.hpp"
#include "kvq/format/fp8.hpp"
#include "kvq/simd/fp8_cpu.hpp"

namespace {

using kvq::fp8::Fp8Kind;

/// The same KV-like data for every FP8 benchmark, built once, kInputBytes of T.
template <class T>
const std::vector<T>& fp8_input() {
  static const std::vector<T> data = [] {
    const std::vector<float> f = kvq_bench::make_input(kvq_bench::kInputBytes / sizeof(T));
    std::vector<T> out(f.size());
    for (size_t i = 0; i < f.size(); ++i) out[i] = kvq::from_float<T>(f[i]);
    return out;
  }();
  return data;
}

template <class T>
float fp8_scale(Fp8Kind kind) {
  float amax = 0.f;
  for (const T& v : fp8_input<T>()) amax = std::max(amax, std::fabs(kvq::to_float(v)));
  return kvq::fp8::compute_scale(kind, amax);
}

template <class T>
void BM_Fp8Encode(benchmark::State& state, Fp8Kind kind) {
  const std::vector<T>& src = fp8_input<T>();
  const float inv_scale = 1.f / fp8_scale<T>(kind);
  std::vector<uint8_t> dst(src.size());
  for (auto _ : state) {
    kvq::fp8::encode(kind, src.data(), dst.data(), src.size(), inv_scale);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(src.size() * sizeof(T)));
}

template <class T>
void BM_Fp8Decode(benchmark::State& state, Fp8Kind kind) {
  const std::vector<T>& x = fp8_input<T>();
  const float scale = fp8_scale<T>(kind);
  std::vector<uint8_t> codes(x.size());
  kvq::fp8::encode(kind, x.data(), codes.data(), x.size(), 1.f / scale);
  std::vector<T> dst(x.size());
  for (auto _ : state) {
    kvq::fp8::decode(kind, codes.data(), dst.data(), codes.size(), scale);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(dst.size() * sizeof(T)));
}

template <class T>
void register_fp8(const char* type_name) {
  for (Fp8Kind kind : {Fp8Kind::kE4M3, Fp8Kind::kE5M2}) {
    const std::string suffix = std::string("/") + kvq::fp8::to_string(kind) + "/" + type_name;
    benchmark::RegisterBenchmark(("BM_Fp8Encode" + suffix).c_str(), [kind](benchmark::State& s) {
      BM_Fp8Encode<T>(s, kind);
    })->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("BM_Fp8Decode" + suffix).c_str(), [kind](benchmark::State& s) {
      BM_Fp8Decode<T>(s, kind);
    })->Unit(benchmark::kMillisecond);
  }
}

const bool kFp8Registered = [] {
  register_fp8<float>("f32");
  register_fp8<kvq::f16>("f16");
  return true;
}();

}  // namespace

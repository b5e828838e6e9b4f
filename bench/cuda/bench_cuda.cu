// kvq_bench_cuda: GPU throughput of the CUDA kernel layer, timed with cudaEvents (median of
// `--iters` runs after warm-up), every figure also given as a ratio to the device-to-device
// memcpy bandwidth measured in the same run:
//   memcpy      cudaMemcpyAsync D2D of 1 GiB: (read + write bytes) / time
//   append      AppendPlan::run of 8192 f16 tokens: (f16 input read + page bytes written) / time
//   decode      DecodePlan::run, one query per head, 32 query heads over 8 kv heads, head_dim 128,
//               over one sequence of 8k / 32k / 128k tokens and 32 sequences of 32k tokens:
//               page bytes read / time, and KV tokens (all sequences) per second
// for the schemes f16, fp8 (e4m3 per token), k8v4 (int8 per-channel g64 keys, int4 per-token g32
// values), kivi4 (int4 per-channel g32 keys, int4 per-token g32 values), and KVQuant's formats:
// kivi4-out1 (kivi4 with 1% dense-and-sparse outliers), nuq3 (per-channel g32 keys, per-token g32
// values, a fixed codebook) and nuq3-out1; the FP4 formats nvfp4 and mxfp4 (K and V).
// Without a visible device it prints why and exits 0 (nothing to measure). Output: one line per
// measurement, "name<TAB>metric=value ..." (bench/cuda/run_device_checks.sh tabulates it).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <kvq/cuda/kvq_cuda.cuh>

namespace {

#define BCK(x)                                                                             \
  do {                                                                                     \
    const cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                        \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

int g_iters = 20;

/// Median milliseconds of fn() over g_iters timed runs after 3 warm-up runs.
template <class F>
double median_ms(F&& fn, cudaStream_t s) {
  for (int i = 0; i < 3; ++i) fn();
  cudaEvent_t a, b;
  BCK(cudaEventCreate(&a));
  BCK(cudaEventCreate(&b));
  std::vector<double> ms;
  for (int i = 0; i < g_iters; ++i) {
    BCK(cudaEventRecord(a, s));
    fn();
    BCK(cudaEventRecord(b, s));
    BCK(cudaEventSynchronize(b));
    float t = 0;
    BCK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

kvq::QuantConfig cfg(kvq::Format f, int bits, kvq::Axis axis, int64_t group) {
  kvq::QuantConfig c;
  c.format = f;
  c.bits = bits;
  c.axis = axis;
  c.group = group;
  return c;
}

/// nuq<bits> with a fixed codebook (timing does not depend on the learned levels).
kvq::QuantConfig nuq(int bits, kvq::Axis axis, int64_t group, int outliers_pct = 0) {
  kvq::QuantConfig c = cfg(kvq::Format::kNuq, bits, axis, group);
  const int n = 1 << bits;
  for (int i = 0; i < n; ++i) c.nuq_levels[static_cast<std::size_t>(i)] = static_cast<float>(i) / (n - 1);
  c.nuq_ready = true;
  c.outlier_pct = static_cast<float>(outliers_pct);
  return c;
}
kvq::QuantConfig with_pct(kvq::QuantConfig c, float pct) {
  c.outlier_pct = pct;
  return c;
}

struct Scheme {
  const char* name;
  kvq::QuantConfig k, v;
};

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    if (std::strncmp(argv[i], "--iters=", 8) == 0) g_iters = std::max(1, std::atoi(argv[i] + 8));
  }
  if (kvq::cuda::visible_devices() == 0) {
    std::printf("kvq_bench_cuda: no CUDA device visible; nothing measured (skipped)\n");
    return 0;
  }
  cudaDeviceProp prop{};
  BCK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device\t%s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount);
  cudaStream_t s;
  BCK(cudaStreamCreate(&s));

  // Device-to-device memcpy bandwidth (read + write).
  const std::size_t mbytes = std::size_t{1} << 30;
  void *src = nullptr, *dst = nullptr;
  BCK(cudaMalloc(&src, mbytes));
  BCK(cudaMalloc(&dst, mbytes));
  BCK(cudaMemset(src, 1, mbytes));
  const double mc_ms = median_ms([&] { cudaMemcpyAsync(dst, src, mbytes, cudaMemcpyDeviceToDevice, s); }, s);
  const double mc_gbs = 2.0 * static_cast<double>(mbytes) / (mc_ms * 1e6);
  std::printf("memcpy_d2d\tms=%.4f\tGB/s=%.1f\tratio=1.000\n", mc_ms, mc_gbs);
  BCK(cudaFree(src));
  BCK(cudaFree(dst));

  const int64_t P = 64, H = 8, Hq = 32, D = 128, chunk = 8192;
  const std::vector<Scheme> schemes = {
      {"f16", cfg(kvq::Format::kF16, 16, kvq::Axis::kToken, 0), cfg(kvq::Format::kF16, 16, kvq::Axis::kToken, 0)},
      {"fp8", cfg(kvq::Format::kE4M3, 8, kvq::Axis::kToken, 0), cfg(kvq::Format::kE4M3, 8, kvq::Axis::kToken, 0)},
      {"k8v4", cfg(kvq::Format::kInt, 8, kvq::Axis::kChannel, 64), cfg(kvq::Format::kInt, 4, kvq::Axis::kToken, 32)},
      {"kivi4", cfg(kvq::Format::kInt, 4, kvq::Axis::kChannel, 32), cfg(kvq::Format::kInt, 4, kvq::Axis::kToken, 32)},
      {"kivi4-out1", with_pct(cfg(kvq::Format::kInt, 4, kvq::Axis::kChannel, 32), 1.f),
       with_pct(cfg(kvq::Format::kInt, 4, kvq::Axis::kToken, 32), 1.f)},
      {"nuq3", nuq(3, kvq::Axis::kChannel, 32), nuq(3, kvq::Axis::kToken, 32)},
      {"nuq3-out1", nuq(3, kvq::Axis::kChannel, 32, 1), nuq(3, kvq::Axis::kToken, 32, 1)},
      {"nvfp4", cfg(kvq::Format::kNvfp4, 4, kvq::Axis::kToken, 16), cfg(kvq::Format::kNvfp4, 4, kvq::Axis::kToken, 16)},
      {"mxfp4", cfg(kvq::Format::kMxfp4, 4, kvq::Axis::kToken, 32), cfg(kvq::Format::kMxfp4, 4, kvq::Axis::kToken, 32)},
  };
  // (batch, tokens per sequence): one long sequence at three lengths, and the engine case of
  // 32 sequences of 32k tokens (issue target: fp8 / int4 decode >= 0.7 of the copy bandwidth).
  struct Shape {
    int64_t batch, tokens;
  };
  std::vector<Shape> shapes = {{1, 8192}, {1, 32768}, {1, 131072}, {32, 32768}};
  if (quick) shapes = {{1, 8192}, {1, 32768}, {8, 32768}};
  int64_t max_pages = 0;
  for (const Shape& sh : shapes) max_pages = std::max(max_pages, sh.batch * sh.tokens / P);

  // Random f16 input chunk, reused for every append.
  std::vector<kvq::f16> h_in(static_cast<std::size_t>(chunk * H * D));
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& x : h_in) x = kvq::f16(nd(rng));
  kvq::f16* d_in = nullptr;
  BCK(cudaMalloc(&d_in, h_in.size() * sizeof(kvq::f16)));
  BCK(cudaMemcpy(d_in, h_in.data(), h_in.size() * sizeof(kvq::f16), cudaMemcpyHostToDevice));

  for (const Scheme& sc : schemes) {
    const kvq::PageLayout L = kvq::make_page_layout(sc.k, sc.v, P, H, D);
    // Every page of every shape is distinct memory: max_pages pages, written by appends of
    // sequences of (at most) 32k tokens; sequence b of a shape owns pages [b T / P, (b + 1) T / P).
    std::byte* arena = nullptr;
    BCK(cudaMalloc(&arena, L.bytes * static_cast<std::size_t>(max_pages)));
    std::vector<const std::byte*> h_table(static_cast<std::size_t>(max_pages));
    for (int64_t i = 0; i < max_pages; ++i) h_table[i] = arena + L.bytes * static_cast<std::size_t>(i);
    std::byte** d_table = nullptr;
    BCK(cudaMalloc(&d_table, sizeof(std::byte*) * h_table.size()));
    BCK(cudaMemcpy(d_table, h_table.data(), sizeof(std::byte*) * h_table.size(), cudaMemcpyHostToDevice));

    // Fill every page (and time one append of `chunk` tokens).
    const kvq::cuda::AppendPlan ap(L, chunk);
    void* aws = nullptr;
    BCK(cudaMalloc(&aws, ap.workspace_bytes()));
    const int64_t fill_pages = 32768 / P;
    for (int64_t p0 = 0; p0 < max_pages; p0 += fill_pages) {
      const int64_t n = std::min(fill_pages, max_pages - p0) * P;
      for (int64_t t = 0; t < n; t += chunk)
        ap.run(aws, d_table + p0, t, d_in, d_in, std::min(chunk, n - t), s);
    }
    ap.check(aws, s);
    const double a_ms = median_ms([&] { ap.run(aws, d_table, 0, d_in, d_in, chunk, s); }, s);
    const double a_bytes = 2.0 * chunk * H * D * 2 + static_cast<double>(L.bytes) * (chunk / P);
    const double a_gbs = a_bytes / (a_ms * 1e6);
    std::printf("append/%s\ttokens=%lld\tms=%.4f\tGB/s=%.1f\tratio=%.3f\n", sc.name,
                static_cast<long long>(chunk), a_ms, a_gbs, a_gbs / mc_gbs);

    for (const Shape& sh : shapes) {
      const int64_t B = sh.batch, T = sh.tokens;
      const kvq::cuda::DecodePlan dp(L, B, Hq, T);
      void* dws = nullptr;
      BCK(cudaMalloc(&dws, dp.workspace_bytes()));
      std::vector<float> h_q(static_cast<std::size_t>(B * Hq * D));
      for (auto& x : h_q) x = nd(rng);
      float *d_q = nullptr, *d_out = nullptr;
      int32_t* d_meta = nullptr;
      BCK(cudaMalloc(&d_q, h_q.size() * 4));
      BCK(cudaMalloc(&d_out, h_q.size() * 4));
      // [page_indptr (B + 1) | seq_tokens (B)]
      std::vector<int32_t> h_meta(static_cast<std::size_t>(2 * B + 1));
      for (int64_t b = 0; b <= B; ++b) h_meta[b] = static_cast<int32_t>(b * (T / P));
      for (int64_t b = 0; b < B; ++b) h_meta[B + 1 + b] = static_cast<int32_t>(T);
      BCK(cudaMalloc(&d_meta, h_meta.size() * sizeof(int32_t)));
      BCK(cudaMemcpy(d_q, h_q.data(), h_q.size() * 4, cudaMemcpyHostToDevice));
      BCK(cudaMemcpy(d_meta, h_meta.data(), h_meta.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
      const double ms = median_ms(
          [&] { dp.run(dws, d_q, d_table, d_meta, d_meta + B + 1, d_out, s); }, s);
      BCK(cudaGetLastError());
      const double bytes = static_cast<double>(L.bytes) * static_cast<double>(B * (T / P));
      const double gbs = bytes / (ms * 1e6);
      std::printf("decode/%s\tbatch=%lld\ttokens=%lld\tsplits=%lld\tms=%.4f\tGB/s=%.1f\t"
                  "ratio=%.3f\tkv_tokens/s=%.3g\n",
                  sc.name, static_cast<long long>(B), static_cast<long long>(T),
                  static_cast<long long>(dp.splits()), ms, gbs, gbs / mc_gbs,
                  static_cast<double>(B * T) / (ms * 1e-3));
      BCK(cudaFree(dws));
      BCK(cudaFree(d_q));
      BCK(cudaFree(d_out));
      BCK(cudaFree(d_meta));
    }
    BCK(cudaFree(aws));
    BCK(cudaFree(d_table));
    BCK(cudaFree(arena));
  }
  BCK(cudaFree(d_in));
  BCK(cudaStreamDestroy(s));
  return 0;
}

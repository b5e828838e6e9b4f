// Exhaustive FP8 encode check: all 2^32 float bit patterns, e4m3 and e5m2, saturating and not,
// through kvq's scalar encoder and its bulk (SIMD where compiled) encoder, each compared bit for
// bit with CUDA's __nv_cvt_float_to_fp8 (cuda_fp8.h host code). Sharded over
// std::thread::hardware_concurrency() threads. Skipped where cuda_fp8.h is not installed.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kvq/core/half.hpp"
#include "kvq/format/fp8.hpp"
#include "kvq/simd/fp8_cpu.hpp"

#if defined(__has_include)
#if __has_include(<cuda_fp8.h>)
#include <cuda_fp8.h>
#define KVQ_TEST_CUDA_FP8 1
#endif
#endif
#ifndef KVQ_TEST_CUDA_FP8
#define KVQ_TEST_CUDA_FP8 0
#endif

namespace {

using kvq::fp8::Fp8Kind;

#if KVQ_TEST_CUDA_FP8
/// Checks every bit pattern in [begin, end) for one format and mode; returns the mismatch
/// count and describes the first few in `first`.
template <Fp8Kind kKind, bool kSat>
uint64_t check_range(uint64_t begin, uint64_t end, std::string* first) {
  constexpr size_t kChunk = 1 << 14;
  constexpr __nv_fp8_interpretation_t kInterp = kKind == Fp8Kind::kE4M3 ? __NV_E4M3 : __NV_E5M2;
  constexpr __nv_saturation_t kMode = kSat ? __NV_SATFINITE : __NV_NOSAT;
  std::vector<float> x(kChunk);
  std::vector<uint8_t> bulk(kChunk);
  uint64_t bad = 0;
  for (uint64_t base = begin; base < end; base += kChunk) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunk, end - base));
    for (size_t i = 0; i < n; ++i) x[i] = kvq::detail::bits_f32(static_cast<uint32_t>(base + i));
    kvq::fp8::encode(kKind, x.data(), bulk.data(), n, 1.f, kSat);
    for (size_t i = 0; i < n; ++i) {
      const uint8_t want = __nv_cvt_float_to_fp8(x[i], kMode, kInterp);
      const uint8_t scalar = kKind == Fp8Kind::kE4M3 ? kvq::fp8::encode_e4m3(x[i], kSat)
                                                     : kvq::fp8::encode_e5m2(x[i], kSat);
      if (scalar != want || bulk[i] != want) {
        if (++bad <= 5) {
          char buf[160];
          std::snprintf(buf, sizeof buf, "  x=0x%08x: scalar 0x%02x bulk 0x%02x CUDA 0x%02x\n",
                        static_cast<unsigned>(base + i), scalar, bulk[i], want);
          *first += buf;
        }
      }
    }
  }
  return bad;
}

template <Fp8Kind kKind, bool kSat>
void run_exhaustive() {
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  // Many more shards than threads so that uneven shards (NaN ranges are cheap) balance out.
  constexpr uint64_t kShards = 1024;
  constexpr uint64_t kTotal = uint64_t{1} << 32;
  std::atomic<uint64_t> next{0}, bad{0};
  std::mutex mu;
  std::string report;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      for (uint64_t s; (s = next.fetch_add(1)) < kShards;) {
        std::string first;
        const uint64_t b =
            check_range<kKind, kSat>(s * (kTotal / kShards), (s + 1) * (kTotal / kShards), &first);
        if (b) {
          bad += b;
          std::lock_guard<std::mutex> lock(mu);
          if (report.size() < 2000) report += first;
        }
      }
    });
  }
  for (auto& th : pool) th.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[ exhaustive ] %s %s: 2^32 inputs in %.1f s on %u threads (simd: %s)\n",
              kvq::fp8::to_string(kKind), kSat ? "satfinite" : "nosat", secs, threads,
              kvq::simd_level());
  EXPECT_EQ(bad.load(), 0u) << "mismatches vs CUDA, first ones:\n" << report;
}
#endif  // KVQ_TEST_CUDA_FP8

#if KVQ_TEST_CUDA_FP8
#define KVQ_EXHAUSTIVE(kind, sat) run_exhaustive<kind, sat>()
#else
#define KVQ_EXHAUSTIVE(kind, sat) \
  GTEST_SKIP() << "cuda_fp8.h not found; exhaustive CUDA comparison skipped"
#endif

TEST(Fp8Exhaustive, E4M3SatFiniteAllFloats) { KVQ_EXHAUSTIVE(Fp8Kind::kE4M3, true); }
TEST(Fp8Exhaustive, E4M3NoSatAllFloats) { KVQ_EXHAUSTIVE(Fp8Kind::kE4M3, false); }
TEST(Fp8Exhaustive, E5M2SatFiniteAllFloats) { KVQ_EXHAUSTIVE(Fp8Kind::kE5M2, true); }
TEST(Fp8Exhaustive, E5M2NoSatAllFloats) { KVQ_EXHAUSTIVE(Fp8Kind::kE5M2, false); }

}  // namespace

// Exhaustive FP4 check: all 2^32 float bit patterns through kvq::fp4::encode_e2m1 against
// CUDA's __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest), and all 2^31 non-negative
// patterns through kvq::fp4::e8m0_floor against __nv_cvt_float_to_e8m0(x, __NV_SATFINITE,
// cudaRoundZero) (cuda_fp4.h / cuda_fp8.h host code). Sharded over
// std::thread::hardware_concurrency() threads. Skipped where the CUDA headers are not installed.
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
#include "kvq/format/fp4.hpp"

#if defined(KVQ_HAVE_CUDA_FP8_H) && defined(__has_include)
#if __has_include(<cuda_fp4.h>)
#include <cuda_fp4.h>
#include <cuda_fp8.h>
#define KVQ_TEST_CUDA_FP4 1
#endif
#endif
#ifndef KVQ_TEST_CUDA_FP4
#define KVQ_TEST_CUDA_FP4 0
#endif

namespace {

#if KVQ_TEST_CUDA_FP4
/// Runs check(begin, end, &first) over [0, total) in shards on every hardware thread.
template <class Check>
void sharded(uint64_t total, const char* what, Check check) {
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  constexpr uint64_t kShards = 1024;
  std::atomic<uint64_t> next{0}, bad{0};
  std::mutex mu;
  std::string report;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      for (uint64_t s; (s = next.fetch_add(1)) < kShards;) {
        std::string first;
        const uint64_t b = check(s * (total / kShards), (s + 1) * (total / kShards), &first);
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
  std::printf("[ exhaustive ] %s: %llu inputs in %.1f s on %u threads\n", what,
              static_cast<unsigned long long>(total), secs, threads);
  EXPECT_EQ(bad.load(), 0u) << "mismatches vs CUDA, first ones:\n" << report;
}

TEST(Fp4Exhaustive, E2M1AllFloats) {
  sharded(uint64_t{1} << 32, "e2m1", [](uint64_t b, uint64_t e, std::string* first) {
    uint64_t bad = 0;
    for (uint64_t u = b; u < e; ++u) {
      const float x = kvq::detail::bits_f32(static_cast<uint32_t>(u));
      const uint8_t want = __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest);
      const uint8_t got = kvq::fp4::encode_e2m1(x);
      if (got != want && ++bad <= 5) {
        char buf[96];
        std::snprintf(buf, sizeof buf, "  x=0x%08x: kvq 0x%x CUDA 0x%x\n",
                      static_cast<unsigned>(u), got, want);
        *first += buf;
      }
    }
    return bad;
  });
}

TEST(Fp4Exhaustive, E8M0AllNonNegativeFloats) {
  sharded(uint64_t{1} << 31, "e8m0 (round toward zero, satfinite)",
          [](uint64_t b, uint64_t e, std::string* first) {
            uint64_t bad = 0;
            for (uint64_t u = b; u < e; ++u) {
              const float x = kvq::detail::bits_f32(static_cast<uint32_t>(u));
              const uint8_t want = __nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundZero);
              const uint8_t got = kvq::fp4::e8m0_floor(x);
              if (got != want && ++bad <= 5) {
                char buf[96];
                std::snprintf(buf, sizeof buf, "  x=0x%08x: kvq 0x%02x CUDA 0x%02x\n",
                              static_cast<unsigned>(u), got, want);
                *first += buf;
              }
            }
            return bad;
          });
}
#else
TEST(Fp4Exhaustive, E2M1AllFloats) { GTEST_SKIP() << "cuda_fp4.h not found"; }
TEST(Fp4Exhaustive, E8M0AllNonNegativeFloats) { GTEST_SKIP() << "cuda_fp8.h not found"; }
#endif

}  // namespace

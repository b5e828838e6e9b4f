// kernels::prefetch_lines must compile to prefetch instructions: a loop of nothing but
// prefetches has no side effect for the compiler, which may delete it (GCC 12 -O3 did, for an
// earlier form of this loop, with no diagnostic). The probe below calls it with a run-time
// length; its machine code, up to its first return, must hold a prefetcht0 (0F 18 /1).
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvq/simd/prefetch.hpp"

namespace {

__attribute__((noinline)) void probe(const void* p, std::size_t bytes) {
  kvq::kernels::prefetch_lines(p, bytes);
}

TEST(Prefetch, LinesCompileToPrefetchInstructions) {
#if (KVQ_HAS_AVX512 || KVQ_HAS_AVX2) && defined(__x86_64__) && defined(__GNUC__)
  const auto* code = reinterpret_cast<const unsigned char*>(&probe);
  bool found = false;
  for (int i = 0; i + 2 < 4096 && code[i] != 0xC3; ++i)  // up to the first ret (C3)
    if (code[i] == 0x0F && code[i + 1] == 0x18 && ((code[i + 2] >> 3) & 7) == 1) found = true;
  EXPECT_TRUE(found) << "prefetch_lines was compiled without prefetch instructions";
#else
  GTEST_SKIP() << "no SIMD prefetch on this build";
#endif
  std::vector<float> buf(1000);
  for (std::size_t n : {0u, 64u, 256u, 300u, 4000u}) probe(buf.data(), n);  // never faults
  probe(buf.data() + buf.size(), 1 << 16);  // past the end: harmless
}

// The default build does not prefetch ahead (docs/benchmarks.md: slower on the hosts measured).
TEST(Prefetch, AheadIsOffByDefault) { EXPECT_EQ(kvq::kernels::kPrefetchAheadBytes, 0u); }

}  // namespace

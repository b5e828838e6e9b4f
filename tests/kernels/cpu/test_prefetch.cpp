// kernels::prefetch_lines must compile to prefetch instructions: a loop of nothing but
// prefetches has no side effect for the compiler, which may delete it (GCC 12 -O3 did, for an
// earlier form of this loop, with no diagnostic). The probe below calls it with a run-time
// length; its machine code must hold a prefetcht0 (0F 18 /1). The probe sits alone in its own
// ELF section, whose bounds the linker provides (__start_/__stop_ symbols), so the scan reads
// exactly the probe's bytes (scanning to the first C3 byte could stop at an operand or run on).
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvq/simd/prefetch.hpp"

#if defined(__x86_64__) && defined(__GNUC__) && defined(__ELF__)
#define KVQ_PROBE_SECTION 1
extern "C" const unsigned char __start_kvq_prefetch_probe[];  // provided by the linker
extern "C" const unsigned char __stop_kvq_prefetch_probe[];
#endif

namespace {

#if defined(KVQ_PROBE_SECTION)
__attribute__((noinline, section("kvq_prefetch_probe"))) void probe(const void* p, std::size_t bytes) {
  kvq::kernels::prefetch_lines(p, bytes);
}
#else
__attribute__((noinline)) void probe(const void* p, std::size_t bytes) {
  kvq::kernels::prefetch_lines(p, bytes);
}
#endif

TEST(Prefetch, LinesCompileToPrefetchInstructions) {
#if (KVQ_HAS_AVX512 || KVQ_HAS_AVX2) && defined(KVQ_PROBE_SECTION)
  const unsigned char* begin = __start_kvq_prefetch_probe;
  const unsigned char* end = __stop_kvq_prefetch_probe;
  ASSERT_LT(begin, end);
  ASSERT_LE(end - begin, 4096) << "the probe's section holds more than the probe";
  bool found = false;
  for (const unsigned char* c = begin; c + 2 < end; ++c)
    if (c[0] == 0x0F && c[1] == 0x18 && ((c[2] >> 3) & 7) == 1) found = true;
  EXPECT_TRUE(found) << "prefetch_lines was compiled without prefetch instructions";
#else
  GTEST_SKIP() << "no SIMD prefetch on this build";
#endif
  std::vector<float> buf(20000);
  for (std::size_t n : {0u, 64u, 256u, 300u, 4000u, 80000u}) probe(buf.data(), n);  // never faults
}

// The default build does not prefetch ahead (docs/benchmarks.md: slower on the hosts measured).
TEST(Prefetch, AheadIsOffByDefault) { EXPECT_EQ(kvq::kernels::kPrefetchAheadBytes, 0u); }

}  // namespace

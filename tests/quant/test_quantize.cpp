// Tests for quant/quantize.hpp (and the views of quant/packed_view.hpp): quantize_into() writes
// exactly the bytes quantize() puts in a QTensor, into caller memory, allocating nothing once
// its workspace has grown; dequantize(PackedView) of any token range equals the QTensor path;
// quantize(cfg, x, out) leaves `out` untouched when it throws; Lloyd-Max context lookups take
// no global mutex; bit widths are validated before any shift. KVQ_TEST_SCALAR_TOO
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <future>
#include <limits>
#include <mutex>
#include <new>
#include <vector>

#include "kvq/accounting/accountant.hpp"
#include "kvq/policy/spec.hpp"
#include "kvq/quant/packed_view.hpp"
#include "kvq/quant/quantize.hpp"
#include "kvq/reference/uniform_ref.hpp"
#include "test_util.hpp"

// Counting global allocator (this test binary only): how many times operator new ran.
namespace {
std::size_t g_allocs = 0;
}
// GCC cannot see that the replaced operator new pairs with free below.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void* operator new(std::size_t n) {
  ++g_allocs;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace {

using kvq::Axis;
using kvq::Format;
using kvq::KVView;
using kvq::MetaDType;
using kvq::QuantConfig;
using kvq::Shape;

/// Every stored format the spec grammar accepts, at both metadata types where it matters.
std::vector<QuantConfig> all_configs() {
  std::vector<QuantConfig> v;
  for (Format f : {Format::kF32, Format::kF16, Format::kBF16}) v.push_back(kvq::raw_config(f));
  for (int bits : {2, 3, 4, 8})
    for (bool sym : {false, true})
      for (Axis a : {Axis::kToken, Axis::kChannel, Axis::kHead, Axis::kTensor})
        for (MetaDType m : {MetaDType::kF16, MetaDType::kF32}) {
          QuantConfig c = kvq::int_config(bits, a, a == Axis::kToken ? 32 : 16, sym);
          c.meta = m;
          v.push_back(c);
        }
  for (Format f : {Format::kE4M3, Format::kE5M2})
    for (Axis a : {Axis::kToken, Axis::kHead, Axis::kTensor}) {
      QuantConfig c = kvq::fp8_config(f, a, a == Axis::kToken ? 0 : 16);
      v.push_back(c);
    }
  for (int b = 1; b <= 4; ++b)
    for (bool qjl : {false, true}) v.push_back(kvq::lm_config(b, qjl));
  return v;
}

/// A span over `mem` with regions laid out at odd (unaligned) offsets, memory pre-filled with
/// garbage, so quantize_into must write every byte it owns itself.
kvq::PackedSpan garbage_span(const QuantConfig& c, const Shape& s, std::vector<uint8_t>& mem) {
  const kvq::PackedSizes p = kvq::packed_sizes(c, s);
  mem.assign(p.total() + 64, 0xA5);
  kvq::PackedSpan sp;
  sp.config = c;
  sp.shape = s;
  std::size_t off = 3;
  auto take = [&](std::size_t n) -> uint8_t* {
    if (n == 0) return nullptr;
    uint8_t* r = mem.data() + off;
    off += n + 1;
    return r;
  };
  sp.codes = take(p.codes);
  sp.scales = take(p.scales);
  sp.zeros = take(p.zeros);
  sp.norms = take(p.norms);
  sp.qjl_signs = take(p.qjl_signs);
  sp.qjl_norms = take(p.qjl_norms);
  return sp;
}

bool same_bytes(const uint8_t* a, const std::vector<uint8_t>& b) {
  return b.empty() || (a != nullptr && std::memcmp(a, b.data(), b.size()) == 0);
}

TEST(QuantizeInto, SameBytesAsQTensorAndNoAllocationAfterTheWorkspaceGrew) {
  const Shape s{32, 3, 64};
  const auto data = kvq_test::kv_data(s, 11, true);
  const KVView<const float> x(data.data(), s);
  int checked = 0;
  for (const QuantConfig& c : all_configs()) {
    const kvq::QTensor q = kvq::quantize(c, x);
    std::vector<uint8_t> mem;
    const kvq::PackedSpan sp = garbage_span(c, s, mem);
    kvq::QuantWorkspace ws;
    kvq::quantize_into(c, x, sp, ws);  // grows ws
    const std::size_t before = g_allocs;
    kvq::quantize_into(c, x, sp, ws);
    EXPECT_EQ(g_allocs, before) << c.name() << ": quantize_into allocated after the first call";
    EXPECT_TRUE(same_bytes(sp.codes, q.codes)) << c.name();
    EXPECT_TRUE(same_bytes(sp.scales, q.scales.raw())) << c.name();
    EXPECT_TRUE(same_bytes(sp.zeros, q.zeros.raw())) << c.name();
    EXPECT_TRUE(same_bytes(sp.norms, q.norms.raw())) << c.name();
    EXPECT_TRUE(same_bytes(sp.qjl_signs, q.qjl_signs)) << c.name();
    EXPECT_TRUE(same_bytes(sp.qjl_norms, q.qjl_norms.raw())) << c.name();
    EXPECT_EQ(kvq::packed_sizes(c, s).total(), q.bytes()) << c.name();

    // dequantize(PackedView) == dequantize(QTensor), whole and by token range, no allocation
    // with a grown workspace.
    std::vector<float> whole(data.size()), part(data.size(), -7.f);
    kvq::dequantize(q, KVView<float>(whole.data(), s));
    const kvq::PackedView v = sp.view();
    kvq::dequantize(v, KVView<float>(part.data(), s), ws);
    EXPECT_EQ(whole, part) << c.name();
    std::fill(part.begin(), part.end(), -7.f);
    const int64_t row = s.heads * s.head_dim;
    for (int64_t t0 : {0, 5, 17, 31}) {
      const int64_t n = std::min<int64_t>(9, s.tokens - t0);
      const std::size_t b2 = g_allocs;
      kvq::dequantize_tokens(v, t0, KVView<float>::nhd(part.data() + t0 * row, n, 3, 64), ws);
      EXPECT_EQ(g_allocs, b2) << c.name();
    }
    for (int64_t t0 : {0, 5, 17, 31})
      for (int64_t t = t0; t < std::min<int64_t>(t0 + 9, s.tokens); ++t)
        for (int64_t i = 0; i < row; ++i)
          ASSERT_EQ(part[static_cast<std::size_t>(t * row + i)],
                    whole[static_cast<std::size_t>(t * row + i)])
              << c.name() << " token " << t;
    ++checked;
  }
  EXPECT_EQ(checked, 3 + 64 + 6 + 8);
}

TEST(QuantizeInto, RejectsMismatchedSpans) {
  const Shape s{16, 2, 32};
  const auto data = kvq_test::kv_data(s, 3, false);
  const KVView<const float> x(data.data(), s);
  const QuantConfig c = kvq::int_config(4, Axis::kToken, 32);
  std::vector<uint8_t> mem;
  kvq::PackedSpan sp = garbage_span(c, s, mem);
  kvq::QuantWorkspace ws;
  kvq::PackedSpan wrong = sp;
  wrong.shape = Shape{8, 2, 32};
  EXPECT_THROW(kvq::quantize_into(c, x, wrong, ws), kvq::Error);
  wrong = sp;
  wrong.zeros = nullptr;
  EXPECT_THROW(kvq::quantize_into(c, x, wrong, ws), kvq::Error);
  EXPECT_NO_THROW(kvq::quantize_into(c, x, sp, ws));
}

// quantize(cfg, x, out) leaves `out` untouched when it throws: a NaN in the last row, a value
// whose metadata overflows fp16 in the last group, a value raw f16 cannot hold. The old code
// resized and half-wrote `out` (grouped formats) or stored NaN/inf without complaint (raw).
TEST(QuantizeStrongGuarantee, OutIsUnchangedWhenQuantizeThrows) {
  const Shape s{32, 2, 64};
  const auto good = kvq_test::kv_data(s, 5, true);
  for (const QuantConfig& c : all_configs()) {
    const Shape s2{16, 2, 64};  // a different shape, so a resize would show
    auto bad = kvq_test::kv_data(s2, 6, true);
    std::vector<float> bad_nan = bad;
    bad_nan.back() = std::numeric_limits<float>::quiet_NaN();
    kvq::QTensor out = kvq::quantize(c, KVView<const float>(good.data(), s));
    const kvq::QTensor copy = out;
    EXPECT_THROW(kvq::quantize(c, KVView<const float>(bad_nan.data(), s2), out), kvq::Error)
        << c.name();
    EXPECT_EQ(out.shape, copy.shape) << c.name();
    EXPECT_EQ(out.codes, copy.codes) << c.name();
    EXPECT_EQ(out.scales, copy.scales) << c.name();
    EXPECT_EQ(out.zeros, copy.zeros) << c.name();
    EXPECT_EQ(out.norms, copy.norms) << c.name();
    EXPECT_EQ(out.qjl_signs, copy.qjl_signs) << c.name();
    // Out of range for fp16 (raw f16 values, fp16 metadata, fp16 norms), in the last row.
    if (c.format == Format::kF16 || (!c.is_raw() && c.meta == MetaDType::kF16 &&
                                     c.format != Format::kE4M3 && c.format != Format::kE5M2)) {
      std::vector<float> big = bad;
      for (int64_t d = 0; d < 64; ++d) big[big.size() - 1 - static_cast<std::size_t>(d)] = -1e7f;
      EXPECT_THROW(kvq::quantize(c, KVView<const float>(big.data(), s2), out), kvq::Error)
          << c.name();
      EXPECT_EQ(out.codes, copy.codes) << c.name();
      EXPECT_EQ(out.scales, copy.scales) << c.name();
      EXPECT_EQ(out.zeros, copy.zeros) << c.name();
      EXPECT_EQ(out.norms, copy.norms) << c.name();
    }
    // And a valid call still replaces it.
    kvq::quantize(c, KVView<const float>(bad.data(), s2), out);
    EXPECT_EQ(out.shape, s2);
  }
}

TEST(QuantizeStrongGuarantee, RawFormatsRejectWhatTheyCannotStore) {
  const Shape s{2, 1, 8};
  std::vector<float> x(16, 1.f);
  x[13] = std::numeric_limits<float>::infinity();
  for (Format f : {Format::kF32, Format::kF16, Format::kBF16}) {
    try {
      kvq::quantize(kvq::raw_config(f), KVView<const float>(x.data(), s));
      ADD_FAILURE() << "no throw for " << kvq::to_string(f);
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.kind(), kvq::ErrorKind::kNonFinite);
      EXPECT_NE(std::string(e.what()).find("channel=5"), std::string::npos) << e.what();
    }
  }
  x[13] = 65520.f;  // rounds to f16 inf
  EXPECT_THROW(kvq::quantize(kvq::raw_config(Format::kF16), KVView<const float>(x.data(), s)),
               kvq::Error);
  x[13] = 65519.f;  // rounds to 65504
  const auto q = kvq::quantize(kvq::raw_config(Format::kF16), KVView<const float>(x.data(), s));
  std::vector<float> y(16);
  kvq::dequantize(q, KVView<float>(y.data(), s));
  EXPECT_EQ(y[13], 65504.f);
  x[13] = 3.4e38f;  // rounds to bf16 inf
  EXPECT_THROW(kvq::quantize(kvq::raw_config(Format::kBF16), KVView<const float>(x.data(), s)),
               kvq::Error);
  EXPECT_NO_THROW(kvq::quantize(kvq::raw_config(Format::kF32), KVView<const float>(x.data(), s)));
}

// quantize(cfg, x, out) on a repeated shape allocates nothing from the third call on (the
// result ping-pongs between `out` and a per-thread scratch tensor).
TEST(QuantizeAllocation, RepeatedShapeAllocatesNothing) {
  const Shape s{32, 2, 64};
  const auto data = kvq_test::kv_data(s, 8, true);
  for (const QuantConfig& c : all_configs()) {
    kvq::QTensor out;
    const KVView<const float> x(data.data(), s);
    kvq::quantize(c, x, out);
    kvq::quantize(c, x, out);
    const std::size_t before = g_allocs;
    kvq::quantize(c, x, out);
    kvq::quantize(c, x, out);
    EXPECT_EQ(g_allocs, before) << c.name();
  }
}

// A context that exists is found without the registry mutex: with the mutex held by this
// thread, another thread still quantizes and dequantizes (the old lookup locked a global
// mutex on every call and would block here forever).
TEST(LloydMaxContext, LookupOfAnExistingContextTakesNoLock) {
  const Shape s{8, 2, 128};
  const auto data = kvq_test::kv_data(s, 2, false);
  const QuantConfig c = kvq::lm_config(3, true);
  const kvq::QTensor warm = kvq::quantize(c, KVView<const float>(data.data(), s));
  std::unique_lock<std::mutex> lock(kvq::detail::lloyd_max_registry().mu);
  auto fut = std::async(std::launch::async, [&] {
    kvq::QTensor q = kvq::quantize(c, KVView<const float>(data.data(), s));
    std::vector<float> y(data.size());
    kvq::dequantize(q, KVView<float>(y.data(), s));
    return q.codes == warm.codes;
  });
  ASSERT_EQ(fut.wait_for(std::chrono::seconds(60)), std::future_status::ready)
      << "Lloyd-Max context lookup blocked on the registry mutex";
  lock.unlock();
  EXPECT_TRUE(fut.get());
  // The same pointer every time (contexts are never rebuilt or freed).
  EXPECT_EQ(&kvq::detail::lloyd_max_context(128, 3, c.seed),
            &kvq::detail::lloyd_max_context(128, 3, c.seed));
}

// Bit widths are validated before anything shifts by them (1 << 32 or 1 << -1 is UB).
TEST(BitWidths, ValidatedBeforeShifting) {
  for (int bits : {-1, 0, 1, 5, 6, 7, 9, 31, 32, 40}) {
    EXPECT_THROW(kvq::uniform_levels(bits, false), kvq::Error) << bits;
    EXPECT_THROW(kvq::uniform_levels(bits, true), kvq::Error) << bits;
    EXPECT_THROW(kvq::uniform_params(-1.f, 1.f, bits, true, MetaDType::kF32, 0), kvq::Error);
    QuantConfig c = kvq_test::int_cfg(4, false, Axis::kToken, 32);
    c.bits = bits;
    EXPECT_THROW(kvq::detail::IntCodec{c}, kvq::Error) << bits;
    EXPECT_THROW(kvq::account(c, Shape{4, 1, 32}), kvq::Error) << bits;
    EXPECT_THROW(kvq::packed_sizes(c, Shape{4, 1, 32}), kvq::Error) << bits;
    EXPECT_THROW(kvq::reference::quantize_uniform(c, KVView<const float>(nullptr, Shape{0, 1, 32})),
                 kvq::Error);
  }
  for (int bits : {-3, 0, 5, 8, 32}) {
    QuantConfig c = kvq::lm_config(4);
    c.bits = bits;
    EXPECT_THROW(kvq::account(c, Shape{4, 1, 32}), kvq::Error) << bits;
  }
  EXPECT_NO_THROW(kvq::uniform_levels(2, true));
  EXPECT_NO_THROW(kvq::uniform_levels(8, false));
}

}  // namespace

// nuq and dense-and-sparse configs through the paged layout, the streaming cache and attention:
// page bytes equal quantize(), the fused attention equals the double-precision oracle (nuq codes
// and outliers over int / fp8 / nuq read in the kernels, no page decoded to rows: dense codes
// through the layer's level table for nuq, then the sparse differences), and a nuq policy
// without calibration is refused clearly.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kvq/attention/attention.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/layout/page_layout.hpp"
#include "kvq/policy/calibrate.hpp"
#include "kvq/quant/quantize.hpp"
#include "kvq/reference/attention_ref.hpp"
#include "test_util.hpp"

namespace {

using kvq::KVView;

/// A calibrated version of `spec` for a 1-layer, H x D cache (learned on other data).
kvq::Policy calibrated(const std::string& spec, int64_t H, int64_t D) {
  kvq::CalibrationSet s;
  s.n_layers = 1;
  s.kv_heads = static_cast<int>(H);
  s.head_dim = static_cast<int>(D);
  kvq::CalibrationSet::Sequence seq;
  seq.tokens = 256;
  kvq::CalibrationSet::Layer L;
  L.k = kvq_test::kv_data({256, H, D}, 1234, true);
  L.v = kvq_test::kv_data({256, H, D}, 4321, false);
  seq.layers.push_back(L);
  s.sequences.push_back(seq);
  return kvq::calibrate(kvq::parse_policy(spec), s);
}

/// `spec` parsed, calibrated first when it names a nuq format.
kvq::Policy policy_for(const std::string& spec, int64_t H, int64_t D) {
  return spec.find("nuq") != std::string::npos ? calibrated(spec, H, D) : kvq::parse_policy(spec);
}

/// A 1-layer cache of `spec` holding T tokens of kv_data (keys seed ks, values vs): the first
/// `prefill` appended at once, the rest one per step (decode), so sinks, pages and the
/// residual window all hold tokens.
kvq::KVCache filled_cache(const std::string& spec, int64_t H, int64_t D, int64_t T, int64_t prefill,
                          uint32_t ks, uint32_t vs) {
  kvq::KVCache c(policy_for(spec, H, D), 1, static_cast<int>(H), static_cast<int>(D));
  const auto kd = kvq_test::kv_data({T, H, D}, ks, true);
  const auto vd = kvq_test::kv_data({T, H, D}, vs, false);
  c.append(0, KVView<const float>::nhd(kd.data(), prefill, H, D),
           KVView<const float>::nhd(vd.data(), prefill, H, D));
  for (int64_t t = prefill; t < T; ++t)
    c.append(0, KVView<const float>::nhd(kd.data() + t * H * D, 1, H, D),
             KVView<const float>::nhd(vd.data() + t * H * D, 1, H, D));
  return c;
}

TEST(OutlierPages, PageBytesEqualQuantize) {
  const int64_t P = 32, H = 2, D = 64;
  const kvq::Policy pol = calibrated("k=nuq3/channel/g16/out1%,v=int3/token/g32/out2", H, D);
  const kvq::QuantConfig kc = pol.key_for(0, 1), vc = pol.value_for(0, 1);
  const kvq::PageLayout L = kvq::make_page_layout(kc, vc, P, H, D);
  EXPECT_EQ(L.breakdown().total(), L.bytes);
  EXPECT_EQ(L.data, kvq::account(kc, {P, H, D}).total() + kvq::account(vc, {P, H, D}).total());
  std::vector<std::byte> page(L.bytes);
  const auto k = kvq_test::kv_data({P, H, D}, 3, true), v = kvq_test::kv_data({P, H, D}, 4, false);
  kvq::QuantWorkspace ws;
  for (int64_t t0 : {int64_t{0}, int64_t{16}})
    kvq::quantize_page(L, page.data(), t0, KVView<const float>::nhd(k.data() + t0 * H * D, 16, H, D),
                       KVView<const float>::nhd(v.data() + t0 * H * D, 16, H, D), ws);
  std::vector<float> kp(k.size()), vp(v.size()), kq(k.size()), vq(v.size());
  kvq::dequantize_page(L, page.data(), P, 0, P, KVView<float>::nhd(kp.data(), P, H, D),
                       KVView<float>::nhd(vp.data(), P, H, D), ws);
  for (int64_t t0 : {int64_t{0}, int64_t{16}}) {
    const kvq::Shape s{16, H, D};
    kvq::dequantize(kvq::quantize(kc, KVView<const float>(k.data() + t0 * H * D, s)),
                    KVView<float>(kq.data() + t0 * H * D, s));
    kvq::dequantize(kvq::quantize(vc, KVView<const float>(v.data() + t0 * H * D, s)),
                    KVView<float>(vq.data() + t0 * H * D, s));
  }
  EXPECT_EQ(kp, kq);
  EXPECT_EQ(vp, vq);
}

TEST(OutlierAttention, FusedEqualsOracle) {
  const int64_t H = 2, D = 64, T = 150, nh = 4;
  for (const char* spec :
       {"k=nuq3/channel/g32,v=nuq3/token/g32,residual=16", "k=int3/channel/g32/out1%,v=int3/token/g32/out1",
        "k=nuq2/channel/g32/out2,v=nuq4/token/g64/out1%,sinks=4", "k=e4m3/head/out1,v=nuq3"}) {
    const kvq::KVCache c = filled_cache(spec, H, D, T, 40, 8, 9);
    for (int64_t nq : {int64_t{1}, int64_t{7}}) {
      const auto q = kvq_test::kv_data({nq, nh, D}, 70, false);
      std::vector<float> out(q.size()), ref(q.size());
      kvq::AttentionWorkspace ws;
      kvq::attend(c, 0, KVView<const float>::nhd(q.data(), nq, nh, D),
                  KVView<float>::nhd(out.data(), nq, nh, D), true, ws);
      kvq::reference::attend_ref(c, 0, KVView<const float>::nhd(q.data(), nq, nh, D),
                                 KVView<float>::nhd(ref.data(), nq, nh, D), true);
      // Error relative to the largest magnitude of each output row (the fused tests' metric).
      double worst = 0;
      for (std::size_t r = 0; r < out.size(); r += static_cast<std::size_t>(D)) {
        double mx = 0, err = 0;
        for (std::size_t d = r; d < r + static_cast<std::size_t>(D); ++d) {
          mx = std::max(mx, std::fabs(double(ref[d])));
          err = std::max(err, std::fabs(double(out[d]) - ref[d]));
        }
        worst = std::max(worst, err / mx);
      }
      EXPECT_LT(worst, 2e-5) << spec << " nq " << nq;
      EXPECT_TRUE(ws.w.decoded.empty()) << spec << ": pages were decoded to rows";
    }
  }
}

/// Largest error of fused vs oracle attention over the rows of the output, relative to each
/// row's largest magnitude.
double fused_error(const kvq::KVCache& c, int64_t nh, int64_t nq, const kvq::RopeConfig* rope,
                   const kvq::AttentionOptions& opt, kvq::AttentionWorkspace& ws) {
  const int64_t D = c.head_dim();
  const auto q = kvq_test::kv_data({nq, nh, D}, 71 + static_cast<uint32_t>(nq), false);
  std::vector<float> out(q.size()), ref(q.size());
  kvq::attend(c, 0, KVView<const float>::nhd(q.data(), nq, nh, D),
              KVView<float>::nhd(out.data(), nq, nh, D), true, ws, rope, opt);
  kvq::reference::attend_ref(c, 0, KVView<const float>::nhd(q.data(), nq, nh, D),
                             KVView<float>::nhd(ref.data(), nq, nh, D), true, rope);
  double worst = 0;
  for (std::size_t r = 0; r < out.size(); r += static_cast<std::size_t>(D)) {
    double mx = 1e-30, err = 0;
    for (std::size_t d = r; d < r + static_cast<std::size_t>(D); ++d) {
      mx = std::max(mx, std::fabs(double(ref[d])));
      err = std::max(err, std::fabs(double(out[d]) - ref[d]));
    }
    worst = std::max(worst, err / mx);
  }
  return worst;
}

// ---- nuq codes and outliers over int, fp8 and nuq dense formats are read in the kernels (no
// page is decoded to rows): every axis, odd and even bit widths (nuq4: the 16-channel table
// loads; nuq2/3: unpacked codes), 1 and several outliers, head_dim 64/128 (the 16-channel
// microkernels) and 40 (the 8-lane path), GQA 1/4, decode and prefill, 1 and 2 threads,
// pre-RoPE keys.
TEST(OutlierAttention, InKernelOutliersEqualTheOracle) {
  const char* specs[] = {
      "k=int4/channel/g32/out2,v=int4/token/g32/out1%,residual=32",
      "k=e4m3/head/out1,v=int4/token/g32/out2",
      "k=int8/token/out1%,v=e4m3/token/out1,sinks=3",
      "k=sint3/channel/g32/out1,v=int3/token/g32/out3,residual=16",
      "k=int2/channel/g32/out2,v=int2/token/g32/out2,residual=32,sinks=4",
      "k=e5m2/tensor/out2,v=int8/head/out1",
      "k=e5m2/token/out1%,v=e5m2/head/out2/f32meta",
      "k=int4/channel/g32/out1/f32meta,v=nuq3/token/g32/out2/f32meta",
      "k=int4/head/out4,v=f16",
      "k=nuq4/channel/g32,v=nuq4/token/g32,residual=16",
      "k=nuq3/channel/g32/out1%,v=nuq3/token/g32/out2,sinks=2",
      "k=nuq2/channel/g32/out2,v=nuq4/head/out1%"};
  for (int64_t D : {64, 128, 40})
    for (const char* spec : specs) {
      const std::string sp(spec);
      // token groups default to 32 channels, which does not divide 40
      if (D == 40 && (sp.find("g32") != std::string::npos || sp.find("/token") != std::string::npos))
        continue;
      const int64_t H = 2, T = 150;
      const kvq::KVCache c = filled_cache(sp, H, D, T, 70, 18, 19);
      for (int G : {1, 4})
        for (int threads : {1, 2}) {
          kvq::AttentionOptions opt;
          opt.threads = threads;
          opt.split_tokens = 64;
          kvq::AttentionWorkspace ws;
          for (int64_t nq : {int64_t{1}, int64_t{9}}) {
            EXPECT_LE(fused_error(c, H * G, nq, nullptr, opt, ws), 2e-5)
                << sp << " D=" << D << " G=" << G << " threads=" << threads << " nq=" << nq;
            EXPECT_TRUE(ws.w.decoded.empty()) << sp << ": pages were decoded to rows";
          }
          kvq::RopeConfig rope;
          EXPECT_LE(fused_error(c, H * G, 3, &rope, opt, ws), 2e-5) << sp << " pre-RoPE D=" << D;
        }
    }
}

// head_dim 320: two-byte outlier positions (channels past 255) in the kernels' sparse step
// (the AVX2 gathers read them four bytes at a time) and the scalar step at the regions' ends.
TEST(OutlierAttention, TwoBytePositionsEqualTheOracle) {
  for (const char* spec : {"k=int4/channel/g32/out2,v=int4/token/g32/out1%,residual=32",
                           "k=nuq3/channel/g32/out1%,v=nuq3/token/g64/out2,sinks=2"}) {
    const kvq::KVCache c = filled_cache(spec, 2, 320, 150, 70, 18, 19);
    kvq::AttentionOptions opt;
    kvq::AttentionWorkspace ws;
    for (int64_t nq : {int64_t{1}, int64_t{9}}) {
      EXPECT_LE(fused_error(c, 8, nq, nullptr, opt, ws), 2e-5) << spec << " nq=" << nq;
      EXPECT_TRUE(ws.w.decoded.empty()) << spec << ": pages were decoded to rows";
    }
  }
}

// A corrupt outlier position (>= head_dim; quantizers never write one and the archive reader
// refuses it) must not take the kernels outside their buffers: it reads as the last channel,
// so the output equals that of the same page holding head_dim - 1 there, bit for bit. Every
// position of the first page is corrupted (the gathered blocks and the scalar tail), keys
// decoded and pre-RoPE.
const kvq::RopeConfig kRope{};

TEST(OutlierAttention, CorruptPositionsStayInsideTheVector) {
  const int64_t H = 2, D = 64, nh = 8;
  for (const char* spec : {"k=int4/token/g32/out2,v=int4/token/g32/out1%",
                           "k=e4m3/token/out1,v=nuq3/token/g32/out2"}) {
    kvq::KVCache bad = filled_cache(spec, H, D, 150, 70, 18, 19);
    kvq::KVCache last = filled_cache(spec, H, D, 150, 70, 18, 19);
    auto poke = [&](kvq::KVCache& c, uint8_t v) {
      const kvq::PageTable pt = c.page_table(0);
      ASSERT_GE(pt.n_pages, 1);
      auto* page = const_cast<std::byte*>(pt.pages[0]);
      for (const kvq::PageRegion* g : {&pt.layout.k.outlier_pos, &pt.layout.v.outlier_pos})
        std::memset(page + g->offset, v, g->bytes);
    };
    poke(bad, 200);
    poke(last, static_cast<uint8_t>(D - 1));
    const auto q = kvq_test::kv_data({3, nh, D}, 77, false);
    for (const kvq::RopeConfig* rope : {static_cast<const kvq::RopeConfig*>(nullptr), &kRope}) {
      std::vector<float> ob(q.size()), ol(q.size());
      kvq::AttentionWorkspace ws;
      kvq::attend(bad, 0, KVView<const float>::nhd(q.data(), 3, nh, D),
                  KVView<float>::nhd(ob.data(), 3, nh, D), true, ws, rope);
      kvq::attend(last, 0, KVView<const float>::nhd(q.data(), 3, nh, D),
                  KVView<float>::nhd(ol.data(), 3, nh, D), true, ws, rope);
      EXPECT_EQ(std::memcmp(ob.data(), ol.data(), ob.size() * sizeof(float)), 0)
          << spec << (rope ? " pre-RoPE" : "");
    }
  }
}

TEST(OutlierAttention, UncalibratedNuqCacheIsRefused) {
  const int64_t H = 1, D = 32;
  auto make_and_fill = [&] {
    kvq::KVCache c(kvq::parse_policy("k=nuq3/channel/g16,v=f16"), 1, static_cast<int>(H),
                   static_cast<int>(D));
    const auto kd = kvq_test::kv_data({64, H, D}, 1, false);
    c.append(0, KVView<const float>::nhd(kd.data(), 64, H, D),
             KVView<const float>::nhd(kd.data(), 64, H, D));
  };
  try {
    make_and_fill();
    FAIL() << "an uncalibrated nuq cache stored data";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("calibrat"), std::string::npos) << e.what();
  }
}

}  // namespace

// Tests of the CUDA kernel layer (include/kvq/cuda/) against the CPU implementation.
//
// Two kinds:
//  - HostEmulated.*: the per-thread bodies of the elementwise kernels (append params / encode /
//    pack, dequantize) are KVQ_HOST_DEVICE functions; here they run on the host, compiled by
//    nvcc, over the whole emulated grid, and must give the bytes quantize_page() and the
//    values dequantize_page() give. Plan checks that need no device run here too, and the
//    decode's per-score rule (ScoreRule: soft-cap, causal, window, mask bits) and option checks
//    (DecodePlan::check). These run in CI on GPU-less machines.
//  - Gpu.*: the real kernels on a device: quantize-append bit-exact against quantize_page (same
//    page bytes, padding included) for int/fp8/raw/Lloyd-Max configs, random and adversarial
//    inputs; dequantize bit-exact against dequantize_page (f32/f16/bf16); batched decode
//    attention within 1e-3 relative of a double-precision reference over the CPU-dequantized
//    pages (nuq and dense-and-sparse outliers included: outlier pages written by the CPU), and
//    with each DecodeOptions option (scale, soft-cap, window, positions, mask bits, sinks, lse,
//    f16/bf16 q and out) against the same reference extended with them (RefOptions);
//    non-finite input reported by AppendPlan::check. Each GTEST_SKIPs with the reason
//    when no CUDA device is visible.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <kvq/cuda/kvq_cuda.cuh>
#include <kvq/layout/page_layout.hpp>

namespace {

using kvq::Axis;
using kvq::Format;
using kvq::PageLayout;
using kvq::QuantConfig;

QuantConfig int_cfg(int bits, Axis axis, int64_t group, bool sym = false,
                    kvq::MetaDType meta = kvq::MetaDType::kF16) {
  QuantConfig c;
  c.format = Format::kInt;
  c.bits = bits;
  c.axis = axis;
  c.group = group;
  c.symmetric = sym;
  c.meta = meta;
  return c;
}
QuantConfig fp8_cfg(bool e5m2, Axis axis, int64_t group = 0, float margin = 1.f) {
  QuantConfig c;
  c.format = e5m2 ? Format::kE5M2 : Format::kE4M3;
  c.bits = 8;
  c.axis = axis;
  c.group = group;
  c.fp8_margin = margin;
  return c;
}
QuantConfig raw_cfg(Format f) {
  QuantConfig c;
  c.format = f;
  c.bits = f == Format::kF32 ? 32 : 16;
  return c;
}
QuantConfig lm_cfg(int bits, kvq::MetaDType meta = kvq::MetaDType::kF16) {
  QuantConfig c;
  c.format = Format::kLloydMax;
  c.bits = bits;
  c.meta = meta;
  return c;
}

/// nvfp4 (tensor scale g) or mxfp4.
QuantConfig fp4_cfg(bool mx, float g = 1.f) {
  QuantConfig c;
  c.format = mx ? Format::kMxfp4 : Format::kNvfp4;
  c.bits = 4;
  c.axis = Axis::kToken;  // blocks of 16 / 32 channels, as the spec parser sets them
  c.group = mx ? 32 : 16;
  c.fp4_tensor_scale = g;
  return c;
}

/// nuq<bits> with a fixed, non-uniform codebook (levels in the normalized space [0, 1]).
QuantConfig nuq_cfg(int bits, Axis axis, int64_t group, kvq::MetaDType meta = kvq::MetaDType::kF16) {
  QuantConfig c = int_cfg(bits, axis, group, false, meta);  // same grouping fields
  c.format = Format::kNuq;
  const int n = 1 << bits;
  for (int i = 0; i < n; ++i) {  // denser near the ends, as learned codebooks of KV data are
    const double u = static_cast<double>(i) / (n - 1);
    c.nuq_levels[static_cast<std::size_t>(i)] =
        static_cast<float>(0.5 - 0.5 * std::cos(3.14159265358979 * u));
  }
  c.nuq_ready = true;
  return c;
}
/// `c` with k dense-and-sparse outliers per vector (or pct % of head_dim when pct > 0).
QuantConfig with_outliers(QuantConfig c, int k, float pct = 0.f) {
  c.outliers = pct > 0.f ? 0 : k;
  c.outlier_pct = pct;
  return c;
}

struct Pair {
  std::string name;
  QuantConfig k, v;
};

/// Key/value config pairs of the elementwise formats (no Lloyd-Max).
std::vector<Pair> elementwise_pairs() {
  using kvq::MetaDType;
  return {
      {"int4 token g32 / int4 token g32", int_cfg(4, Axis::kToken, 32), int_cfg(4, Axis::kToken, 32)},
      {"int2 token g16 / int3 token g32", int_cfg(2, Axis::kToken, 16), int_cfg(3, Axis::kToken, 32)},
      {"int8 channel g16 / int4 token (kivi-like k8v4)", int_cfg(8, Axis::kChannel, 16),
       int_cfg(4, Axis::kToken, 0)},
      {"int4 channel g32 / int2 token g32", int_cfg(4, Axis::kChannel, 32), int_cfg(2, Axis::kToken, 32)},
      {"int3 channel g16 sym / int3 token g0 sym", int_cfg(3, Axis::kChannel, 16, true),
       int_cfg(3, Axis::kToken, 0, true)},
      {"int4 head g16 f32meta / int8 tensor g16", int_cfg(4, Axis::kHead, 16, false, MetaDType::kF32),
       int_cfg(8, Axis::kTensor, 16)},
      {"e4m3 token / e5m2 head g16", fp8_cfg(false, Axis::kToken), fp8_cfg(true, Axis::kHead, 16)},
      {"e4m3 channel g16 margin 1.25 / e4m3 token g32", fp8_cfg(false, Axis::kChannel, 16, 1.25f),
       fp8_cfg(false, Axis::kToken, 32)},
      {"f16 / bf16", raw_cfg(Format::kF16), raw_cfg(Format::kBF16)},
      {"f32 / int4 token g32", raw_cfg(Format::kF32), int_cfg(4, Axis::kToken, 32)},
      {"nuq3 channel g32 / nuq3 token g32", nuq_cfg(3, Axis::kChannel, 32),
       nuq_cfg(3, Axis::kToken, 32)},
      {"nuq4 channel g16 f32meta / nuq2 token g0", nuq_cfg(4, Axis::kChannel, 16, kvq::MetaDType::kF32),
       nuq_cfg(2, Axis::kToken, 0)},
      {"nuq2 head g16 / int4 token g32", nuq_cfg(2, Axis::kHead, 16), int_cfg(4, Axis::kToken, 32)},
      {"nvfp4 / nvfp4", fp4_cfg(false), fp4_cfg(false)},
      {"mxfp4 / nvfp4 tensor scale 0.01", fp4_cfg(true), fp4_cfg(false, 0.01f)},
      {"nvfp4 tensor scale 3 / mxfp4", fp4_cfg(false, 3.f), fp4_cfg(true)},
  };
}
/// Pairs with dense-and-sparse outliers (per token and per channel, k 1 to 4, 32, over int,
/// fp8 and nuq).
std::vector<Pair> outlier_pairs() {
  return {
      {"int3 channel g32 out1% / int3 token g32 out1%",
       with_outliers(int_cfg(3, Axis::kChannel, 32), 0, 1.f),
       with_outliers(int_cfg(3, Axis::kToken, 32), 0, 1.f)},
      {"nuq3 channel g32 out2 / nuq3 token g32 out3", with_outliers(nuq_cfg(3, Axis::kChannel, 32), 2),
       with_outliers(nuq_cfg(3, Axis::kToken, 32), 3)},
      {"e4m3 token out4 / int4 token g16 out1", with_outliers(fp8_cfg(false, Axis::kToken), 4),
       with_outliers(int_cfg(4, Axis::kToken, 16), 1)},
      {"int2 channel g16 sym out32 / e5m2 channel g16 out2",
       with_outliers(int_cfg(2, Axis::kChannel, 16, true), 32),
       with_outliers(fp8_cfg(true, Axis::kChannel, 16), 2)},
      {"int4 token g8 out8 / nuq4 token g64 out1", with_outliers(int_cfg(4, Axis::kToken, 8), 8),
       with_outliers(nuq_cfg(4, Axis::kToken, 64), 1)},
  };
}
std::vector<Pair> lm_pairs() {
  return {{"lm4 / lm4", lm_cfg(4), lm_cfg(4)},
          {"lm1 / lm2 f32meta", lm_cfg(1), lm_cfg(2, kvq::MetaDType::kF32)},
          {"lm3 / int4 token g32", lm_cfg(3), int_cfg(4, Axis::kToken, 32)}};
}

enum class Input { kGaussian, kOutlierChannels, kConstantGroups, kTinyAndZero, kLarge };
const char* to_string(Input i) {
  switch (i) {
    case Input::kGaussian: return "gaussian";
    case Input::kOutlierChannels: return "outlier channels";
    case Input::kConstantGroups: return "constant groups";
    case Input::kTinyAndZero: return "tiny, subnormal and signed zeros";
    case Input::kLarge: return "large (fp16-range) values";
  }
  return "?";
}
const Input kInputs[] = {Input::kGaussian, Input::kOutlierChannels, Input::kConstantGroups,
                         Input::kTinyAndZero, Input::kLarge};

std::vector<float> make_input(Input kind, int64_t n, int64_t H, int64_t D, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(static_cast<std::size_t>(n * H * D));
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) {
        float v = nd(rng);
        switch (kind) {
          case Input::kGaussian: break;
          case Input::kOutlierChannels: v *= (d % 17 == 3) ? 40.f : 1.f; break;
          case Input::kConstantGroups: v = (t % 3 == 0) ? 0.75f : ((h + d / 16) % 2 ? -2.f : v); break;
          case Input::kTinyAndZero: {
            const int r = static_cast<int>(rng() % 4);
            v = r == 0 ? 0.f : (r == 1 ? -0.f : v * 1e-6f * (r == 2 ? 1e-3f : 1.f));
            break;
          }
          case Input::kLarge: v *= 3000.f; break;
        }
        x[static_cast<std::size_t>((t * H + h) * D + d)] = v;
      }
  return x;
}

using Pages = std::vector<std::vector<std::byte>>;

Pages zero_pages(const PageLayout& L, int64_t n_pages) {
  return Pages(static_cast<std::size_t>(n_pages), std::vector<std::byte>(L.bytes, std::byte{0}));
}

/// CPU: quantize tokens [pos, pos + n) of x (f32 [n, H, D]) into the sequence's pages.
void cpu_append(const PageLayout& L, Pages& pages, int64_t pos, const std::vector<float>& k,
                const std::vector<float>& v, int64_t n) {
  kvq::QuantWorkspace ws;
  const int64_t H = L.kv_heads, D = L.head_dim;
  for (int64_t t = pos; t < pos + n;) {
    const int64_t p = t / L.page_tokens, tp = t % L.page_tokens;
    const int64_t m = std::min(L.page_tokens - tp, pos + n - t);
    const float* kp = k.data() + (t - pos) * H * D;
    const float* vp = v.data() + (t - pos) * H * D;
    kvq::quantize_page(L, pages[static_cast<std::size_t>(p)].data(), tp,
                       kvq::KVView<const float>::nhd(kp, m, H, D),
                       kvq::KVView<const float>::nhd(vp, m, H, D), ws);
    t += m;
  }
}

/// CPU: dequantize the first `tokens` tokens into f32 [tokens, H, D] (keys and values).
template <class T>
void cpu_dequantize(const PageLayout& L, const Pages& pages, int64_t tokens, std::vector<T>& k,
                    std::vector<T>& v) {
  kvq::QuantWorkspace ws;
  const int64_t H = L.kv_heads, D = L.head_dim;
  k.assign(static_cast<std::size_t>(tokens * H * D), T{});
  v.assign(k.size(), T{});
  for (int64_t p = 0; p * L.page_tokens < tokens; ++p) {
    const int64_t filled = std::min(L.page_tokens, tokens - p * L.page_tokens);
    kvq::dequantize_page(L, pages[static_cast<std::size_t>(p)].data(), filled, 0, filled,
                         kvq::KVView<T>::nhd(k.data() + p * L.page_tokens * H * D, filled, H, D),
                         kvq::KVView<T>::nhd(v.data() + p * L.page_tokens * H * D, filled, H, D),
                         ws);
  }
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

/// First differing byte of two page sets, as a message ("" when equal).
std::string first_difference(const PageLayout& L, const Pages& a, const Pages& b) {
  for (std::size_t p = 0; p < a.size(); ++p)
    for (std::size_t i = 0; i < L.bytes; ++i)
      if (a[p][i] != b[p][i]) {
        const char* region = "padding";
        const kvq::TensorRegions* rs[2] = {&L.k, &L.v};
        const char* names[6] = {"codes", "scales", "zeros", "norms", "qjl_signs", "qjl_norms"};
        for (int t = 0; t < 2; ++t) {
          const kvq::PageRegion* r[6] = {&rs[t]->codes, &rs[t]->scales, &rs[t]->zeros,
                                         &rs[t]->norms, &rs[t]->qjl_signs, &rs[t]->qjl_norms};
          for (int j = 0; j < 6; ++j)
            if (i >= r[j]->offset && i < r[j]->offset + r[j]->bytes) region = names[j];
        }
        return "page " + std::to_string(p) + " byte " + std::to_string(i) + " (" + region +
               "): expected " + std::to_string(static_cast<int>(a[p][i])) + ", got " +
               std::to_string(static_cast<int>(b[p][i]));
      }
  return "";
}

std::vector<std::byte*> page_ptrs(Pages& pages) {
  std::vector<std::byte*> p;
  for (auto& v : pages) p.push_back(v.data());
  return p;
}

/// Host emulation of AppendPlan::run for the elementwise formats: every thread of every pass.
void emulated_append(const PageLayout& layout, Pages& pages, int64_t pos,
                     const std::vector<float>& k, const std::vector<float>& v, int64_t n,
                     kvq::cuda::AppendStatus& st) {
  const kvq::cuda::PagedDesc L = kvq::cuda::make_paged_desc(layout);
  std::vector<std::byte*> ptrs = page_ptrs(pages);
  std::vector<uint8_t> scratch(static_cast<std::size_t>(n * L.H * L.D));
  std::vector<uint8_t> chosen(scratch.size(), 0xee);  // stale flags: pass O must clear them
  std::vector<kvq::cuda::detail::OutlierBox> obox;
  const kvq::cuda::TensorDesc* X[2] = {&L.k, &L.v};
  const std::vector<float>* in[2] = {&k, &v};
  for (int t = 0; t < 2; ++t) {
    const kvq::cuda::detail::AppendPasses passes = kvq::cuda::detail::append_passes(*X[t]);
    const bool grouped = passes.grouped;
    const int64_t boxes = grouped ? n / X[t]->gt * X[t]->nh * X[t]->nc : 0;
    const bool out = X[t]->outliers > 0;
    if (out) {  // passes S and O
      obox.assign(static_cast<std::size_t>(boxes), kvq::cuda::detail::OutlierBox{});
      for (int64_t i = 0; i < boxes; ++i)
        kvq::cuda::detail::outlier_stats(*X[t], L, in[t]->data(), i, obox.data(), &st, t);
      if (st.code != 0) return;
      for (int64_t i = 0; i < n * L.H; ++i)
        kvq::cuda::detail::outlier_select(*X[t], L, ptrs.data(), pos, in[t]->data(), i,
                                          obox.data(), chosen.data(), &st, t);
      if (st.code != 0) return;
    }
    for (int64_t i = 0; i < boxes; ++i)
      kvq::cuda::detail::append_params(*X[t], L, ptrs.data(), pos, in[t]->data(), i, &st, t,
                                       out ? chosen.data() : nullptr, out ? obox.data() : nullptr);
    if (st.code != 0) return;
    for (int64_t i = 0; i < n * L.H * L.D; ++i)
      kvq::cuda::detail::append_encode(*X[t], L, ptrs.data(), pos, in[t]->data(), i,
                                       scratch.data(), out ? chosen.data() : nullptr,
                                       out ? obox.data() : nullptr);
    if (passes.packed) {  // (Lloyd-Max layouts are skipped by the callers)
      for (int64_t i = 0; i < n * L.H * L.D * X[t]->bits / 8; ++i)
        kvq::cuda::detail::append_pack(*X[t], L, ptrs.data(), pos, i, scratch.data());
    }
  }
}

constexpr int64_t kP = 64, kH = 2, kD = 64;

/// The kvq::ErrorKind f() throws, as an int; -1 when it returns.
template <class F>
int error_kind(F&& f) {
  try {
    f();
  } catch (const kvq::Error& e) {
    return static_cast<int>(e.kind());
  }
  return -1;
}
const int kOutOfRange = static_cast<int>(kvq::ErrorKind::kOutOfRange);

TEST(HostEmulated, AppendWritesTheBytesOfQuantizePage) {
  std::vector<Pair> all = elementwise_pairs();
  for (const Pair& p : outlier_pairs()) all.push_back(p);
  for (const Pair& pr : all) {
    const PageLayout L = kvq::make_page_layout(pr.k, pr.v, kP, kH, kD);
    for (Input in : kInputs) {
      SCOPED_TRACE(pr.name + ", " + to_string(in));
      // Two appends: a full page, then 1.5 pages starting mid-page (crosses a boundary).
      const int64_t n1 = kP, n2 = kP + kP / 2;
      auto k1 = make_input(in, n1, kH, kD, 1), v1 = make_input(in, n1, kH, kD, 2);
      auto k2 = make_input(in, n2, kH, kD, 3), v2 = make_input(in, n2, kH, kD, 4);
      Pages cpu = zero_pages(L, 3), emu = zero_pages(L, 3);
      if (pr.k.format == Format::kLloydMax) continue;
      if (n2 % L.granule != 0) continue;
      cpu_append(L, cpu, 0, k1, v1, n1);
      cpu_append(L, cpu, n1, k2, v2, n2);
      kvq::cuda::AppendStatus st;
      emulated_append(L, emu, 0, k1, v1, n1, st);
      emulated_append(L, emu, n1, k2, v2, n2, st);
      ASSERT_EQ(st.code, 0);
      EXPECT_EQ(first_difference(L, cpu, emu), "");
    }
  }
}

// head_dim 320: outlier positions take two bytes (little-endian) and channels past 255 must
// round-trip; head_dim 128: k = ceil(1% of 128) = 2. Append and dequantize, bytes and bits.
TEST(HostEmulated, OutliersAtWideHeads) {
  for (int64_t D : {int64_t{128}, int64_t{320}}) {
    const Pair pr{"int4 token g64 out1% / nuq3 channel g32 out3",
                  with_outliers(int_cfg(4, Axis::kToken, 64), 0, 1.f),
                  with_outliers(nuq_cfg(3, Axis::kChannel, 32), 3)};
    SCOPED_TRACE("head_dim " + std::to_string(D));
    const PageLayout L = kvq::make_page_layout(pr.k, pr.v, kP, kH, D);
    const kvq::cuda::PagedDesc desc = kvq::cuda::make_paged_desc(L);
    EXPECT_EQ(desc.k.pos_bytes, D > 256 ? 2 : 1);
    EXPECT_EQ(desc.k.outliers, (D + 99) / 100);
    for (Input in : {Input::kGaussian, Input::kOutlierChannels}) {
      SCOPED_TRACE(to_string(in));
      auto k = make_input(in, kP, kH, D, 70), v = make_input(in, kP, kH, D, 71);
      for (int64_t t = 0; t < kP; ++t) k[static_cast<std::size_t>((t * kH) * D + D - 3)] += 50.f;
      Pages cpu = zero_pages(L, 1), emu = zero_pages(L, 1);
      cpu_append(L, cpu, 0, k, v, kP);
      kvq::cuda::AppendStatus st;
      emulated_append(L, emu, 0, k, v, kP, st);
      ASSERT_EQ(st.code, 0);
      EXPECT_EQ(first_difference(L, cpu, emu), "");
      std::vector<float> ck, cv;
      cpu_dequantize(L, cpu, kP, ck, cv);
      std::vector<float> gk(ck.size()), gv(cv.size());
      std::vector<const std::byte*> ptrs = {cpu[0].data()};
      for (int64_t i = 0; i < static_cast<int64_t>(ck.size()); ++i) {
        kvq::cuda::detail::dequantize_element(desc.k, ptrs.data(), kP, kH, D, i, gk.data());
        kvq::cuda::detail::dequantize_element(desc.v, ptrs.data(), kP, kH, D, i, gv.data());
      }
      EXPECT_TRUE(same_bits(ck, gk)) << "keys";
      EXPECT_TRUE(same_bits(cv, gv)) << "values";
      // Gaussian input: channel D - 3 of every token's head 0 is its vector's largest outlier,
      // read back exact (to fp16), through a position above 255 when D = 320.
      for (int64_t t = 0; in == Input::kGaussian && t < kP; ++t) {
        const auto i = static_cast<std::size_t>((t * kH) * D + D - 3);
        EXPECT_EQ(gk[i], kvq::to_float(kvq::f16(k[i]))) << "token " << t;
      }
    }
  }
}

TEST(HostEmulated, AppendReportsNonFiniteAndOverflowLikeTheCpu) {
  const QuantConfig c = int_cfg(4, Axis::kToken, 32);
  const PageLayout L = kvq::make_page_layout(c, c, kP, kH, kD);
  auto k = make_input(Input::kGaussian, kP, kH, kD, 5), v = k;
  Pages pages = zero_pages(L, 1);
  k[77] = NAN;
  kvq::cuda::AppendStatus st;
  emulated_append(L, pages, 0, k, v, kP, st);
  EXPECT_EQ(st.code, static_cast<int32_t>(kvq::elem::ElementStatus::kNonFinite));
  EXPECT_EQ(st.where, 77);
  EXPECT_THROW(kvq::cuda::AppendPlan::throw_status(st), kvq::Error);
  try {
    kvq::cuda::AppendPlan::throw_status(st);
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.kind(), kvq::ErrorKind::kNonFinite);
  }
  // fp16 metadata overflow: the CPU throws kOutOfRange, the emulated kernel reports it.
  k[77] = 1e6f;
  kvq::cuda::AppendStatus st2;
  emulated_append(L, pages, 0, k, v, kP, st2);
  EXPECT_EQ(st2.code, static_cast<int32_t>(kvq::elem::ElementStatus::kScaleOverflow));
  Pages cpu = zero_pages(L, 1);
  EXPECT_EQ(error_kind([&] { cpu_append(L, cpu, 0, k, v, kP); }), kOutOfRange)
      << "the CPU must refuse a group beyond fp16 metadata";
  // Outliers: an isolated value beyond fp16 (f32 metadata, so the dense part is fine) is
  // kOutOfRange on the CPU and kOutlierRange in the status word; NaN still comes first.
  const QuantConfig o = with_outliers(int_cfg(4, Axis::kToken, 32, false, kvq::MetaDType::kF32), 2);
  const PageLayout Lo = kvq::make_page_layout(o, o, kP, kH, kD);
  auto ko = make_input(Input::kGaussian, kP, kH, kD, 6), vo = ko;
  vo[300] = 70000.f;
  Pages po = zero_pages(Lo, 1);
  kvq::cuda::AppendStatus st3;
  emulated_append(Lo, po, 0, ko, vo, kP, st3);
  EXPECT_EQ(st3.code, static_cast<int32_t>(kvq::elem::ElementStatus::kOutlierRange));
  EXPECT_EQ(st3.tensor, 1);
  EXPECT_EQ(st3.where, 300);
  EXPECT_EQ(error_kind([&] { kvq::cuda::AppendPlan::throw_status(st3); }), kOutOfRange);
  Pages co = zero_pages(Lo, 1);
  EXPECT_EQ(error_kind([&] { cpu_append(Lo, co, 0, ko, vo, kP); }), kOutOfRange)
      << "the CPU must refuse an outlier beyond fp16";
  // FP4: NaN refused by the block pass (kNonFinite naming the element), like the CPU.
  for (const QuantConfig& f : {fp4_cfg(false), fp4_cfg(true)}) {
    const PageLayout Lf = kvq::make_page_layout(f, f, kP, kH, kD);
    auto kf = make_input(Input::kGaussian, kP, kH, kD, 9), vf = kf;
    vf[1234] = -INFINITY;
    Pages pf = zero_pages(Lf, 1);
    kvq::cuda::AppendStatus st5;
    emulated_append(Lf, pf, 0, kf, vf, kP, st5);
    EXPECT_EQ(st5.code, static_cast<int32_t>(kvq::elem::ElementStatus::kNonFinite)) << f.name();
    EXPECT_EQ(st5.tensor, 1);
    EXPECT_EQ(st5.where, 1234);
    Pages cf = zero_pages(Lf, 1);
    EXPECT_EQ(error_kind([&] { cpu_append(Lf, cf, 0, kf, vf, kP); }),
              static_cast<int>(kvq::ErrorKind::kNonFinite));
  }
  vo[5] = NAN;
  kvq::cuda::AppendStatus st4;
  emulated_append(Lo, po, 0, ko, vo, kP, st4);
  EXPECT_EQ(st4.code, static_cast<int32_t>(kvq::elem::ElementStatus::kNonFinite));
}

TEST(HostEmulated, DequantizeGivesTheBitsOfDequantizePage) {
  std::vector<Pair> all = elementwise_pairs();
  for (const Pair& p : outlier_pairs()) all.push_back(p);
  for (const Pair& pr : all) {
    SCOPED_TRACE(pr.name);
    const PageLayout L = kvq::make_page_layout(pr.k, pr.v, kP, kH, kD);
    const kvq::cuda::PagedDesc desc = kvq::cuda::make_paged_desc(L);
    const int64_t tokens = 2 * kP + (kP / 2 / L.granule) * L.granule;
    Pages pages = zero_pages(L, 3);
    cpu_append(L, pages, 0, make_input(Input::kOutlierChannels, tokens, kH, kD, 7),
               make_input(Input::kGaussian, tokens, kH, kD, 8), tokens);
    std::vector<std::byte*> ptrs = page_ptrs(pages);
    std::vector<const std::byte*> cptrs(ptrs.begin(), ptrs.end());
    auto check = [&](auto tag) {
      using T = decltype(tag);
      std::vector<T> ck, cv;
      cpu_dequantize(L, pages, tokens, ck, cv);
      std::vector<T> gk(ck.size()), gv(cv.size());
      for (int64_t i = 0; i < static_cast<int64_t>(ck.size()); ++i) {
        kvq::cuda::detail::dequantize_element(desc.k, cptrs.data(), kP, kH, kD, i, gk.data());
        kvq::cuda::detail::dequantize_element(desc.v, cptrs.data(), kP, kH, kD, i, gv.data());
      }
      EXPECT_TRUE(same_bits(ck, gk)) << "keys";
      EXPECT_TRUE(same_bits(cv, gv)) << "values";
    };
    check(float{});
    check(kvq::f16{});
    check(kvq::bf16{});
  }
}

TEST(HostEmulated, PlansRejectWhatTheKernelsDoNotImplement) {
  auto kind_of = [](auto&& f) { return error_kind(f); };
  const int unsupported = static_cast<int>(kvq::ErrorKind::kUnsupported);
  const int invalid = static_cast<int>(kvq::ErrorKind::kInvalidArgument);
  QuantConfig qjl = lm_cfg(3);
  qjl.qjl = true;
  EXPECT_EQ(kind_of([&] { kvq::cuda::make_paged_desc(kvq::make_page_layout(qjl, qjl, kP, kH, kD)); }),
            unsupported);
  EXPECT_EQ(kind_of([&] {  // two-stage Hadamard (head_dim 96) is CPU only
              kvq::cuda::make_paged_desc(kvq::make_page_layout(lm_cfg(4), lm_cfg(4), kP, kH, 96));
            }),
            unsupported);
  // Rotated int / fp8 (/rot) is CPU only: refused naming the config.
  QuantConfig rot = int_cfg(4, Axis::kToken, 32);
  rot.rotate = true;
  EXPECT_EQ(kind_of([&] { kvq::cuda::make_paged_desc(kvq::make_page_layout(rot, rot, kP, kH, kD)); }),
            unsupported);
  // Outliers: up to kMaxGpuOutliers per vector on the GPU append; any k read.
  const QuantConfig out = with_outliers(int_cfg(4, Axis::kToken, 32), 2);
  const PageLayout Lo = kvq::make_page_layout(int_cfg(4, Axis::kChannel, 32), out, kP, kH, kD);
  EXPECT_EQ(kvq::cuda::make_paged_desc(Lo).v.outliers, 2);
  EXPECT_EQ(kind_of([&] { kvq::cuda::AppendPlan(Lo, 64); }), -1);
  EXPECT_EQ(kind_of([&] { kvq::cuda::DecodePlan(Lo, 1, 2, 100, 0, 132); }), -1);
  const QuantConfig many = with_outliers(int_cfg(4, Axis::kToken, 32), 33);
  const PageLayout Lm = kvq::make_page_layout(many, many, kP, kH, kD);
  EXPECT_EQ(kvq::cuda::make_paged_desc(Lm).k.outliers, 33);
  EXPECT_EQ(kind_of([&] { kvq::cuda::AppendPlan(Lm, 64); }), unsupported);
  // nuq needs its calibrated codebook, as on the CPU.
  QuantConfig raw_nuq = nuq_cfg(3, Axis::kToken, 32);
  raw_nuq.nuq_ready = false;
  EXPECT_EQ(kind_of([&] {
              kvq::cuda::make_paged_desc(kvq::make_page_layout(raw_nuq, raw_nuq, kP, kH, kD));
            }),
            invalid);
  const QuantConfig c = int_cfg(4, Axis::kChannel, 16);
  const PageLayout L = kvq::make_page_layout(c, c, kP, kH, kD);
  EXPECT_EQ(kind_of([&] { kvq::cuda::DecodePlan(L, 1, 3, 100); }), invalid);  // 3 % 2 != 0
  EXPECT_EQ(kind_of([&] { kvq::cuda::DecodePlan(L, 0, 4, 100); }), invalid);
  EXPECT_EQ(kind_of([&] {
              kvq::cuda::DecodePlan(kvq::make_page_layout(c, c, kP, kH, 512), 1, 2, 100);
            }),
            unsupported);
  kvq::cuda::AppendPlan ap(L, 64);
  // Range checks come before any CUDA call, so they run without a device too.
  EXPECT_EQ(kind_of([&] {
              ap.run<float>(reinterpret_cast<void*>(16), reinterpret_cast<std::byte* const*>(16), 8,
                            reinterpret_cast<const float*>(16), reinterpret_cast<const float*>(16),
                            16);
            }),
            invalid);  // pos 8 is not a multiple of the granule 16
  EXPECT_EQ(kind_of([&] {
              ap.run<float>(reinterpret_cast<void*>(16), reinterpret_cast<std::byte* const*>(16), 0,
                            reinterpret_cast<const float*>(16), reinterpret_cast<const float*>(16),
                            128);
            }),
            invalid);  // beyond max_new_tokens
  const kvq::cuda::DecodePlan dp(L, 4, 8, 40000, 0, 132);
  EXPECT_GE(dp.splits(), 1);
  EXPECT_GE(dp.split_tokens() * dp.splits(), 40000);
  EXPECT_EQ(dp.split_tokens() % 64, 0);
}

// ----------------------------------------------------------------------------------------------
// On a device.

#define KVQ_REQUIRE_GPU()                                                                     \
  do {                                                                                        \
    if (kvq::cuda::visible_devices() == 0)                                                    \
      GTEST_SKIP() << "no CUDA device visible: the kernels are compiled but not run here "    \
                      "(run bench/cuda/run_device_checks.sh on a machine with a GPU)";        \
  } while (0)

#define CK(x) ASSERT_EQ((x), cudaSuccess) << #x << ": " << cudaGetErrorString(x)

/// Device copies of a sequence's pages and of its page pointer array.
struct DevPages {
  std::vector<std::byte*> ptrs;
  std::byte** table = nullptr;
  std::size_t bytes = 0;
  DevPages(const PageLayout& L, int64_t n) : bytes(L.bytes) {
    for (int64_t i = 0; i < n; ++i) {
      std::byte* p = nullptr;
      cudaMalloc(&p, bytes);
      cudaMemset(p, 0, bytes);
      ptrs.push_back(p);
    }
    cudaMalloc(&table, sizeof(std::byte*) * ptrs.size());
    cudaMemcpy(table, ptrs.data(), sizeof(std::byte*) * ptrs.size(), cudaMemcpyHostToDevice);
  }
  ~DevPages() {
    for (auto* p : ptrs) cudaFree(p);
    cudaFree(table);
  }
  void upload(const Pages& h) {
    for (std::size_t i = 0; i < ptrs.size(); ++i)
      cudaMemcpy(ptrs[i], h[i].data(), bytes, cudaMemcpyHostToDevice);
  }
  Pages download() const {
    Pages h(ptrs.size(), std::vector<std::byte>(bytes));
    for (std::size_t i = 0; i < ptrs.size(); ++i)
      cudaMemcpy(h[i].data(), ptrs[i], bytes, cudaMemcpyDeviceToHost);
    return h;
  }
};

template <class T>
T* to_device(const std::vector<T>& h) {
  T* d = nullptr;
  cudaMalloc(&d, sizeof(T) * std::max<std::size_t>(h.size(), 1));
  cudaMemcpy(d, h.data(), sizeof(T) * h.size(), cudaMemcpyHostToDevice);
  return d;
}
template <class T>
std::vector<T> to_host(const T* d, std::size_t n) {
  std::vector<T> h(n);
  cudaMemcpy(h.data(), d, sizeof(T) * n, cudaMemcpyDeviceToHost);
  return h;
}

template <class T>
std::vector<T> convert_input(const std::vector<float>& x) {
  std::vector<T> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = kvq::from_float<T>(x[i]);
  return y;
}
template <class T>
std::vector<float> round_trip(const std::vector<float>& x) {  // the values T input carries
  std::vector<float> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = kvq::to_float(kvq::from_float<T>(x[i]));
  return y;
}

template <class T>
void gpu_append_case(const Pair& pr, Input in) {
  SCOPED_TRACE(pr.name + ", " + to_string(in));
  const PageLayout L = kvq::make_page_layout(pr.k, pr.v, kP, kH, kD);
  const int64_t n1 = kP, n2 = kP + kP / 2;
  if (n2 % L.granule != 0) return;
  std::vector<float> k1 = round_trip<T>(make_input(in, n1, kH, kD, 11)),
                     v1 = round_trip<T>(make_input(in, n1, kH, kD, 12)),
                     k2 = round_trip<T>(make_input(in, n2, kH, kD, 13)),
                     v2 = round_trip<T>(make_input(in, n2, kH, kD, 14));
  Pages cpu = zero_pages(L, 3);
  cpu_append(L, cpu, 0, k1, v1, n1);
  cpu_append(L, cpu, n1, k2, v2, n2);
  DevPages dev(L, 3);
  const kvq::cuda::AppendPlan plan(L, n2);
  void* ws = nullptr;
  CK(cudaMalloc(&ws, plan.workspace_bytes()));
  T* dk1 = to_device(convert_input<T>(k1));
  T* dv1 = to_device(convert_input<T>(v1));
  T* dk2 = to_device(convert_input<T>(k2));
  T* dv2 = to_device(convert_input<T>(v2));
  plan.run(ws, dev.table, 0, dk1, dv1, n1);
  EXPECT_NO_THROW(plan.check(ws));
  plan.run(ws, dev.table, n1, dk2, dv2, n2);
  EXPECT_NO_THROW(plan.check(ws));
  EXPECT_EQ(first_difference(L, cpu, dev.download()), "");
  for (void* p : {static_cast<void*>(dk1), static_cast<void*>(dv1), static_cast<void*>(dk2),
                  static_cast<void*>(dv2), ws})
    cudaFree(p);
}

TEST(Gpu, AppendWritesTheBytesOfQuantizePage) {
  KVQ_REQUIRE_GPU();
  std::vector<Pair> all = elementwise_pairs();
  for (const Pair& p : lm_pairs()) all.push_back(p);
  for (const Pair& p : outlier_pairs()) all.push_back(p);
  for (const Pair& pr : all)
    for (Input in : kInputs) {
      gpu_append_case<float>(pr, in);
      if (in == Input::kGaussian) {
        gpu_append_case<kvq::f16>(pr, in);
        gpu_append_case<kvq::bf16>(pr, in);
      }
    }
}

TEST(Gpu, AppendReportsNonFiniteInput) {
  KVQ_REQUIRE_GPU();
  for (const Pair& pr : {elementwise_pairs()[0], lm_pairs()[0]}) {
    const PageLayout L = kvq::make_page_layout(pr.k, pr.v, kP, kH, kD);
    auto k = make_input(Input::kGaussian, kP, kH, kD, 21), v = k;
    v[1000] = INFINITY;
    DevPages dev(L, 1);
    const kvq::cuda::AppendPlan plan(L, kP);
    void* ws = nullptr;
    CK(cudaMalloc(&ws, plan.workspace_bytes()));
    float* dk = to_device(k);
    float* dv = to_device(v);
    plan.run(ws, dev.table, 0, dk, dv, kP);
    try {
      plan.check(ws);
      ADD_FAILURE() << pr.name << ": Inf in the values was not reported";
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.kind(), kvq::ErrorKind::kNonFinite) << e.what();
    }
    cudaFree(dk);
    cudaFree(dv);
    cudaFree(ws);
  }
}

TEST(Gpu, DequantizeGivesTheBitsOfDequantizePage) {
  KVQ_REQUIRE_GPU();
  std::vector<Pair> all = elementwise_pairs();
  for (const Pair& p : lm_pairs()) all.push_back(p);
  for (const Pair& p : outlier_pairs()) all.push_back(p);
  for (const Pair& pr : all) {
    SCOPED_TRACE(pr.name);
    const PageLayout L = kvq::make_page_layout(pr.k, pr.v, kP, kH, kD);
    const kvq::cuda::PagedDesc desc = kvq::cuda::make_paged_desc(L);
    const int64_t tokens = 2 * kP + (kP / 2 / L.granule) * L.granule;
    Pages pages = zero_pages(L, 3);
    cpu_append(L, pages, 0, make_input(Input::kOutlierChannels, tokens, kH, kD, 31),
               make_input(Input::kGaussian, tokens, kH, kD, 32), tokens);
    DevPages dev(L, 3);
    dev.upload(pages);
    auto check = [&](auto tag) {
      using T = decltype(tag);
      std::vector<T> ck, cv;
      cpu_dequantize(L, pages, tokens, ck, cv);
      T* dk = nullptr;
      T* dv = nullptr;
      cudaMalloc(&dk, sizeof(T) * ck.size());
      cudaMalloc(&dv, sizeof(T) * cv.size());
      kvq::cuda::dequantize_pages(desc, dev.table, tokens, dk, dv);
      EXPECT_TRUE(same_bits(ck, to_host(dk, ck.size()))) << "keys";
      EXPECT_TRUE(same_bits(cv, to_host(dv, cv.size()))) << "values";
      cudaFree(dk);
      cudaFree(dv);
    };
    check(float{});
    check(kvq::f16{});
    check(kvq::bf16{});
  }
}

/// The logit and masking options of reference_decode, written out plainly (the semantics of
/// AttentionOptions and reference/attention_ref.hpp for one decode query).
struct RefOptions {
  double scale = 0;                 ///< 0: 1/sqrt(D)
  double softcap = 0;               ///< 0: off
  int64_t window = 0;               ///< 0: none
  const int64_t* pos = nullptr;     ///< the query's position (null: the last token)
  const uint64_t* mask = nullptr;   ///< the sequence's mask words (null: none)
  const float* sinks = nullptr;     ///< [Hq] sink logits (null: none; -inf: none for that head)
};

/// Double-precision decode attention over f32 keys/values [T, H, D] for queries [Hq, D]; the
/// rows' log-sum-exp of the logits into `lse` ([Hq]) when given (-inf when nothing weighs).
/// Query position p: token t is seen when t <= p, t >= p - window + 1 (window > 0) and its mask
/// bit is set; logit = scale * q.k, then softcap * tanh(logit / softcap); a sink adds
/// exp(sink - max) to the denominator and exp(sink) to the lse sum. A row that sees no token is
/// zeros (its lse is the sink's, or -inf).
std::vector<float> reference_decode(const std::vector<float>& k, const std::vector<float>& v,
                                    int64_t T, int64_t H, int64_t D, const float* q, int64_t Hq,
                                    std::vector<double>* lse = nullptr, const RefOptions& o = {}) {
  std::vector<float> out(static_cast<std::size_t>(Hq * D), 0.f);
  if (lse) lse->assign(static_cast<std::size_t>(Hq), -INFINITY);
  const double scale = o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(D));
  const int64_t p = o.pos != nullptr ? *o.pos : T - 1;
  for (int64_t hq = 0; hq < Hq; ++hq) {
    const int64_t h = hq / (Hq / H);
    std::vector<double> s(static_cast<std::size_t>(T));
    std::vector<bool> seen(static_cast<std::size_t>(T), false);
    double m = -INFINITY;
    for (int64_t t = 0; t < T; ++t) {
      if (t > p) continue;
      if (o.window > 0 && t < p - o.window + 1) continue;
      if (o.mask != nullptr && ((o.mask[t / 64] >> (t % 64)) & 1u) == 0) continue;
      seen[t] = true;
      double dot = 0;
      for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(q[hq * D + d]) * k[(t * H + h) * D + d];
      s[t] = dot * scale;
      if (o.softcap > 0) s[t] = o.softcap * std::tanh(s[t] / o.softcap);
      m = std::max(m, s[t]);
    }
    double l = 0;
    std::vector<double> acc(static_cast<std::size_t>(D), 0.0);
    for (int64_t t = 0; t < T; ++t) {
      if (!seen[t]) continue;
      const double w = std::exp(s[t] - m);
      l += w;
      for (int64_t d = 0; d < D; ++d) acc[d] += w * v[(t * H + h) * D + d];
    }
    const bool sink = o.sinks != nullptr && std::isfinite(o.sinks[hq]);
    const double sv = sink ? o.sinks[hq] : 0.0;
    if (l > 0) {
      const double denom = l + (sink ? std::exp(sv - m) : 0.0);
      for (int64_t d = 0; d < D; ++d) out[hq * D + d] = static_cast<float>(acc[d] / denom);
    }
    if (lse) {
      double x = l > 0 ? m + std::log(l) : -INFINITY;
      if (sink) {
        const double hi = std::max(x, sv);
        x = hi + std::log(std::exp(x - hi) + std::exp(sv - hi));
      }
      (*lse)[static_cast<std::size_t>(hq)] = x;
    }
  }
  return out;
}

struct DecodeCase {
  Pair pr;
  int64_t group;
  float q_gain;
  int64_t split_tokens;
  int64_t head_dim;
};

/// Every decode-attention case the GPU runs (Gpu.DecodeAttention*; HostEmulated.DecodeCases
/// builds the same pages and plans on the host, so a case the layout refuses fails in CI).
std::vector<DecodeCase> decode_cases() {
  std::vector<DecodeCase> cases;
  std::vector<Pair> pairs = {
      {"f16 / f16", raw_cfg(Format::kF16), raw_cfg(Format::kF16)},
      {"e4m3 head / e4m3 head (fp8)", fp8_cfg(false, Axis::kHead, 64), fp8_cfg(false, Axis::kHead, 64)},
      {"k8v4: int8 channel g64 / int4 token g32", int_cfg(8, Axis::kChannel, 64),
       int_cfg(4, Axis::kToken, 32)},
      {"kivi4: int4 channel g32 / int4 token g32", int_cfg(4, Axis::kChannel, 32),
       int_cfg(4, Axis::kToken, 32)},
      {"int2 token g16 / int3 token g32", int_cfg(2, Axis::kToken, 16), int_cfg(3, Axis::kToken, 32)},
      {"lm4 / lm3", lm_cfg(4), lm_cfg(3)},
      {"e5m2 token / lm2", fp8_cfg(true, Axis::kToken), lm_cfg(2)},
      {"nuq4 channel g32 / nuq3 token g32", nuq_cfg(4, Axis::kChannel, 32), nuq_cfg(3, Axis::kToken, 32)},
  };
  for (const Pair& p : outlier_pairs()) pairs.push_back(p);
  for (const Pair& p : elementwise_pairs()) pairs.push_back(p);
  for (const Pair& pr : pairs) {
    cases.push_back({pr, 4, 1.f, 0, kD});
    cases.push_back({pr, 1, 1.f, 64, kD});   // many splits, MHA
    cases.push_back({pr, 12, 8.f, 0, kD});   // two CTAs per GQA group, peaky softmax
  }
  // The tiled kernel's shapes: lanes per token 4 (32), 16 (128; 96 with idle lanes), 32 (256);
  // GQA groups 2 and 8 (the 8-head instance); vector and element-by-element formats together.
  for (const int64_t D : {32, 96, 128, 256}) {
    std::vector<Pair> more = elementwise_pairs();
    for (const Pair& p : outlier_pairs()) more.push_back(p);
    if (D != 96) {
      for (const Pair& p : lm_pairs()) more.push_back(p);
    }
    for (const Pair& pr : more) {
      // (a group that does not divide head_dim is the layout's refusal, not the kernel's)
      if (error_kind([&] { kvq::make_page_layout(pr.k, pr.v, kP, kH, D); }) ==
          static_cast<int>(kvq::ErrorKind::kShapeMismatch))
        continue;
      cases.push_back({pr, 4, 1.f, 0, D});
      cases.push_back({pr, D == 128 ? 8 : 2, 4.f, 128, D});
    }
  }
  // head_dim 20 (not a multiple of 8: every format element by element).
  const std::vector<Pair> odd = {
      {"f16 / bf16", raw_cfg(Format::kF16), raw_cfg(Format::kBF16)},
      {"int4 channel g32 / int8 token g4", int_cfg(4, Axis::kChannel, 32), int_cfg(8, Axis::kToken, 4)},
      {"e4m3 token / f32", fp8_cfg(false, Axis::kToken), raw_cfg(Format::kF32)},
  };
  for (const Pair& pr : odd) {
    cases.push_back({pr, 4, 1.f, 0, 20});
    cases.push_back({pr, 8, 2.f, 64, 20});
  }
  return cases;
}

/// One decode case: sequences of 1 granule, ~5 pages, 0 and ~1000 tokens written by the CPU,
/// decoded on the GPU (device) and compared with reference_decode over the CPU-dequantized
/// pages; without device, only the host half (pages, plan) runs.
void decode_case(const DecodeCase& dc, bool device) {
  const Pair& pr = dc.pr;
  const int64_t group = dc.group, split_tokens = dc.split_tokens, kD = dc.head_dim;
  const float q_gain = dc.q_gain;
  SCOPED_TRACE(pr.name + ", group " + std::to_string(group) + ", query gain " +
               std::to_string(q_gain) + ", split " + std::to_string(split_tokens) +
               ", head_dim " + std::to_string(kD));
  const PageLayout L = kvq::make_page_layout(pr.k, pr.v, kP, kH, kD);
  const int64_t g = L.granule;
  const std::vector<int64_t> lens = {g, (5 * kP / g) * g + g, 0, (1000 / g) * g};
  const int64_t B = static_cast<int64_t>(lens.size()), Hq = kH * group;
  std::vector<Pages> seqs;
  std::vector<int32_t> indptr = {0}, tokens;
  std::vector<std::vector<float>> ks, vs;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t T = lens[b], np = (T + kP - 1) / kP;
    Pages p = zero_pages(L, np);
    auto k = make_input(Input::kOutlierChannels, T, kH, kD, 40 + b);
    auto v = make_input(Input::kGaussian, T, kH, kD, 50 + b);
    if (T > 0) cpu_append(L, p, 0, k, v, T);
    std::vector<float> dk, dv;
    cpu_dequantize(L, p, T, dk, dv);
    ks.push_back(dk);
    vs.push_back(dv);
    seqs.push_back(std::move(p));
    indptr.push_back(indptr.back() + static_cast<int32_t>(np));
    tokens.push_back(static_cast<int32_t>(T));
  }
  std::vector<float> q = make_input(Input::kGaussian, B, Hq, kD, 60);
  for (float& x : q) x *= q_gain;
  const int64_t max_len = *std::max_element(lens.begin(), lens.end());
  const kvq::cuda::DecodePlan plan(L, B, Hq, max_len, split_tokens);
  if (!device) return;
  std::vector<std::unique_ptr<DevPages>> dev;
  std::vector<const std::byte*> table;
  for (auto& s : seqs) {
    dev.push_back(std::make_unique<DevPages>(L, static_cast<int64_t>(s.size())));
    dev.back()->upload(s);
    for (auto* p : dev.back()->ptrs) table.push_back(p);
  }
  void* ws = nullptr;
  CK(cudaMalloc(&ws, plan.workspace_bytes()));
  const std::byte** dtable = to_device(table);
  int32_t* dindptr = to_device(indptr);
  int32_t* dtokens = to_device(tokens);
  float* dq = to_device(q);
  float* dout = nullptr;
  float* dlse = nullptr;
  CK(cudaMalloc(&dout, sizeof(float) * q.size()));
  CK(cudaMalloc(&dlse, sizeof(float) * static_cast<std::size_t>(B * Hq)));
  plan.run(ws, dq, dtable, dindptr, dtokens, dout);  // twice: no state kept between runs
  plan.run(ws, dq, dtable, dindptr, dtokens, dout, nullptr, 0.f, dlse);
  CK(cudaDeviceSynchronize());
  const std::vector<float> got = to_host(dout, q.size());
  const std::vector<float> got_lse = to_host(dlse, static_cast<std::size_t>(B * Hq));
  for (int64_t b = 0; b < B; ++b) {
    std::vector<double> want_lse;
    const auto want =
        reference_decode(ks[b], vs[b], lens[b], kH, kD, q.data() + b * Hq * kD, Hq, &want_lse);
    for (int64_t h = 0; h < Hq; ++h) {
      const double a = got_lse[static_cast<std::size_t>(b * Hq + h)], w = want_lse[static_cast<std::size_t>(h)];
      if (lens[b] == 0) {
        EXPECT_TRUE(std::isinf(a) && a < 0) << "empty sequence " << b << ": lse " << a;
      } else {
        EXPECT_NEAR(a, w, 1e-3 * (1.0 + std::fabs(w))) << "sequence " << b << " head " << h;
      }
    }
    double err = 0, mag = 0;
    for (int64_t i = 0; i < Hq * kD; ++i) {
      err = std::max(err, static_cast<double>(std::fabs(got[b * Hq * kD + i] - want[i])));
      mag = std::max(mag, static_cast<double>(std::fabs(want[i])));
    }
    if (lens[b] == 0) {
      EXPECT_EQ(err, 0.0) << "empty sequence " << b << " must give zeros";
    } else {
      EXPECT_LE(err, 1e-3 * mag) << "sequence " << b << " (" << lens[b] << " tokens)";
    }
  }
  cudaFree(ws);
  cudaFree(dtable);
  cudaFree(dindptr);
  cudaFree(dtokens);
  cudaFree(dq);
  cudaFree(dout);
  cudaFree(dlse);
}

/// Which tensors the tiled decode kernel reads with vector loads (the rest go element by
/// element through load_element): expected kinds from the page formats' definitions.
TEST(HostEmulated, DecodeVectorPathsCoverTheProductionFormats) {
  namespace d = kvq::cuda::detail;
  auto info = [](const QuantConfig& c, int64_t D) {
    return d::vec_info(kvq::cuda::make_paged_desc(kvq::make_page_layout(c, c, kP, kH, D)).k, D);
  };
  struct Want {
    const char* name;
    QuantConfig c;
    int64_t D;
    int kind, consecutive, words;
  };
  const std::vector<Want> wants = {
      {"f16", raw_cfg(Format::kF16), 128, d::kVecF16, 0, 4},
      {"bf16", raw_cfg(Format::kBF16), 64, d::kVecBF16, 0, 4},
      {"e4m3 token (one scale per vector)", fp8_cfg(false, Axis::kToken), 128, d::kVecFp8, 0, 2},
      {"e5m2 channel g16", fp8_cfg(true, Axis::kChannel, 16), 128, d::kVecFp8, 1, 2},
      {"int4 token g32", int_cfg(4, Axis::kToken, 32), 128, d::kVecInt4, 0, 1},
      {"int8 channel g64", int_cfg(8, Axis::kChannel, 64), 128, d::kVecInt8, 1, 2},
      {"int2 token g16 sym", int_cfg(2, Axis::kToken, 16, true), 64, d::kVecInt2, 0, 1},
      {"int4 token g4 (groups of 4 channels)", int_cfg(4, Axis::kToken, 4), 64, d::kVecGeneric, 0, 0},
      {"int3 token g32", int_cfg(3, Axis::kToken, 32), 128, d::kVecGeneric, 0, 0},
      {"f32", raw_cfg(Format::kF32), 128, d::kVecGeneric, 0, 0},
      {"nuq4 channel g32", nuq_cfg(4, Axis::kChannel, 32), 128, d::kVecGeneric, 0, 0},
      {"lm4", lm_cfg(4), 128, d::kVecGeneric, 0, 0},
      {"int4 token g32 + 1 outlier", with_outliers(int_cfg(4, Axis::kToken, 32), 1), 128,
       d::kVecGeneric, 0, 0},
      {"f16 at head_dim 20", raw_cfg(Format::kF16), 20, d::kVecGeneric, 0, 0},
      {"nvfp4 (element by element)", fp4_cfg(false), 128, d::kVecGeneric, 0, 0},
      {"mxfp4 (element by element)", fp4_cfg(true), 64, d::kVecGeneric, 0, 0},
  };
  for (const Want& w : wants) {
    const d::VecInfo v = info(w.c, w.D);
    EXPECT_EQ(v.kind, w.kind) << w.name;
    EXPECT_EQ(v.consecutive_meta, w.consecutive) << w.name;
    EXPECT_EQ(v.words, w.words) << w.name;
  }
}

TEST(HostEmulated, DecodeCases) {
  const std::vector<DecodeCase> cases = decode_cases();
  EXPECT_GE(cases.size(), 240u);
  for (const DecodeCase& dc : cases) decode_case(dc, false);
}

TEST(Gpu, DecodeAttentionMatchesTheReference) {
  KVQ_REQUIRE_GPU();
  for (const DecodeCase& dc : decode_cases()) decode_case(dc, true);
}

// ----------------------------------------------------------------------------------------------
// Decode options (DecodeOptions): the per-score rule on the host, the option checks, and the
// kernels with each option against reference_decode's RefOptions.

/// The kvq::Error message f() throws ("" when it returns).
template <class F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const kvq::Error& e) {
    return e.what();
  }
  return "";
}

TEST(HostEmulated, DecodeScoreRuleSoftcap) {
  kvq::cuda::detail::ScoreRule r;
  const float xs[] = {-1e4f, -100.f, -3.5f, -0.1f, 0.f, 1e-6f, 0.2f, 7.f, 50.f, 3e4f};
  for (float x : xs) EXPECT_EQ(r.logit(x), x) << "no cap: the scaled score itself";
  for (float cap : {0.5f, 5.f, 30.f, 50.f}) {
    r.softcap = cap;
    for (float x : xs) {
      const double want = static_cast<double>(cap) * std::tanh(static_cast<double>(x) / cap);
      // tanhf is within a few ulp; a float division and product add one rounding each.
      EXPECT_NEAR(r.logit(x), want, 4e-7 * cap + 1e-12) << "cap " << cap << ", x " << x;
      EXPECT_LE(std::fabs(r.logit(x)), cap) << "cap " << cap << ", x " << x;
    }
  }
  EXPECT_FLOAT_EQ(r.logit(50.f), 50.f * std::tanh(1.f));  // cap 50: tanh(1)
}

TEST(HostEmulated, DecodeScoreRuleVisibility) {
  using Rule = kvq::cuda::detail::ScoreRule;
  // Visible positions among [0, n) for a rule, as a list.
  auto seen = [](const Rule& r, int64_t n) {
    std::vector<int64_t> v;
    for (int64_t t = 0; t < n; ++t)
      if (r.sees(t)) v.push_back(t);
    return v;
  };
  using V = std::vector<int64_t>;
  Rule r;
  r.pos = 9;  // causal: 0 .. 9
  EXPECT_EQ(seen(r, 12), (V{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  r.window = 3;  // (6, 9]
  EXPECT_EQ(seen(r, 12), (V{7, 8, 9}));
  r.window = 1;  // the query's own position only
  EXPECT_EQ(seen(r, 12), (V{9}));
  r.window = 10;  // exactly reaches position 0
  EXPECT_EQ(seen(r, 12), (V{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  r.window = 1000;
  EXPECT_EQ(seen(r, 12), (V{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  r.pos = 0;
  r.window = 0;
  EXPECT_EQ(seen(r, 5), (V{0}));
  r.pos = -1;  // before every token: nothing
  EXPECT_EQ(seen(r, 5), V{});
  // Mask bits: word 0 has bits 0, 5 and 63, word 1 bits 0 (position 64) and 6 (70).
  const uint64_t words[2] = {(1ull << 0) | (1ull << 5) | (1ull << 63), (1ull << 0) | (1ull << 6)};
  r.mask_row = words;
  r.mask_words = 2;
  r.pos = 100;
  EXPECT_EQ(seen(r, 101), (V{0, 5, 63, 64, 70}));
  r.pos = 64;  // causal cuts position 70
  EXPECT_EQ(seen(r, 101), (V{0, 5, 63, 64}));
  r.pos = 70;
  r.window = 10;  // (60, 70] and the mask
  EXPECT_EQ(seen(r, 101), (V{63, 64, 70}));
  r.window = 6;  // (64, 70]
  EXPECT_EQ(seen(r, 101), (V{70}));
  r.window = 5;  // (65, 70]
  EXPECT_EQ(seen(r, 101), (V{70}));
  r.pos = 69;  // (64, 69]: the mask excludes all
  EXPECT_EQ(seen(r, 101), V{});
  const uint64_t all[2] = {~0ull, ~0ull};
  r.mask_row = all;
  r.window = 0;
  r.pos = 300;  // positions past the mask's 128 are not seen
  EXPECT_EQ(seen(r, 301).size(), 128u);
  EXPECT_EQ(seen(r, 301).back(), 127);
  // clip(): a split [a, e) cut to what causal and window allow (the kernel's page skipping).
  auto clip = [](int64_t pos, int64_t window, int64_t a, int64_t e) {
    Rule c;
    c.pos = pos;
    c.window = window;
    c.clip(a, e);
    return a < e ? V{a, e} : V{};
  };
  EXPECT_EQ(clip(9, 0, 0, 64), (V{0, 10}));
  EXPECT_EQ(clip(1000, 0, 0, 64), (V{0, 64}));
  EXPECT_EQ(clip(-1, 0, 0, 64), V{});
  EXPECT_EQ(clip(9, 3, 0, 64), (V{7, 10}));
  EXPECT_EQ(clip(9, 3, 8, 64), (V{8, 10}));
  EXPECT_EQ(clip(9, 3, 0, 5), V{});     // wholly before the window
  EXPECT_EQ(clip(9, 3, 10, 64), V{});   // wholly after the query
  EXPECT_EQ(clip(200, 100, 64, 128), (V{101, 128}));
  EXPECT_EQ(clip(200, 100, 0, 64), V{});
  EXPECT_EQ(clip(int64_t{1} << 40, 5, 0, 64), V{});  // unchecked positions: no overflow
  // score(): the logit where seen, -inf elsewhere.
  r.softcap = 2.f;
  r.pos = 3;
  r.mask_row = words;
  EXPECT_NEAR(r.score(0, 10.f), 2.0 * std::tanh(5.0), 1e-6);
  EXPECT_EQ(r.score(1, 10.f), -INFINITY);  // mask bit clear
  EXPECT_EQ(r.score(5, 10.f), -INFINITY);  // after the query
}

TEST(HostEmulated, DecodeOptionsAreCheckedBeforeAnyDeviceCall) {
  const QuantConfig c = int_cfg(4, Axis::kToken, 32);
  const PageLayout L = kvq::make_page_layout(c, c, kP, kH, kD);
  const kvq::cuda::DecodePlan plan(L, 2, 4, 100, 0, 132);
  const int invalid = static_cast<int>(kvq::ErrorKind::kInvalidArgument);
  const uint64_t bits[4] = {};
  using O = kvq::cuda::DecodeOptions;
  struct Bad {
    O opt;
    const char* field;
  };
  std::vector<Bad> bad;
  auto add = [&](const char* field, auto set) {
    O o;
    set(o);
    bad.push_back({o, field});
  };
  add("sm_scale", [](O& o) { o.sm_scale = -0.5f; });
  add("sm_scale", [](O& o) { o.sm_scale = INFINITY; });
  add("sm_scale", [](O& o) { o.sm_scale = NAN; });
  add("softcap", [](O& o) { o.softcap = -1.f; });
  add("softcap", [](O& o) { o.softcap = INFINITY; });
  add("softcap", [](O& o) { o.softcap = NAN; });
  add("window", [](O& o) { o.window = -1; });
  add("mask_words", [&](O& o) { o.mask_bits = bits; });  // mask_words 0
  add("mask_words", [&](O& o) {                          // 64 positions < max_seq_tokens 100
    o.mask_bits = bits;
    o.mask_words = 1;
  });
  add("mask_words", [](O& o) { o.mask_words = 2; });  // without mask_bits
  add("q_type", [](O& o) { o.q_type = static_cast<kvq::cuda::IoType>(7); });
  add("out_type", [](O& o) { o.out_type = static_cast<kvq::cuda::IoType>(-1); });
  for (const Bad& b : bad) {
    EXPECT_EQ(error_kind([&] { plan.check(b.opt); }), invalid) << b.field;
    EXPECT_NE(error_message([&] { plan.check(b.opt); }).find(b.field), std::string::npos)
        << b.field << ": " << error_message([&] { plan.check(b.opt); });
    // run() checks before any CUDA call, so it refuses without a device too.
    void* fake = reinterpret_cast<void*>(256);
    EXPECT_EQ(error_kind([&] {
                plan.run(fake, fake, reinterpret_cast<const std::byte* const*>(fake),
                         reinterpret_cast<const int32_t*>(fake),
                         reinterpret_cast<const int32_t*>(fake), fake, b.opt);
              }),
              invalid)
        << b.field;
  }
  // What run() accepts.
  O ok;
  EXPECT_EQ(error_kind([&] { plan.check(ok); }), -1);
  ok.sm_scale = 0.125f;
  ok.softcap = 30.f;
  ok.window = 4096;
  ok.mask_bits = bits;
  ok.mask_words = 2;  // 128 positions >= 100
  ok.q_type = kvq::cuda::IoType::kBF16;
  ok.out_type = kvq::cuda::IoType::kF16;
  EXPECT_EQ(error_kind([&] { plan.check(ok); }), -1);
  ok.mask_words = 4;  // a longer row stride is fine
  EXPECT_EQ(error_kind([&] { plan.check(ok); }), -1);
}

/// One decode-options case: which options are on (each resolved per sequence by
/// options_case). `blind`: sequence 0's mask words are all clear (it sees nothing) and sequence
/// 3's bits are set only before its window (nothing either, when a window is on).
struct OptCase {
  std::string name;
  float scale = 0.f, softcap = 0.f, q_gain = 1.f;
  int32_t window = 0;
  bool positions = false, mask = false, blind = false, sinks = false;
  kvq::cuda::IoType io = kvq::cuda::IoType::kF32;
  int64_t split = 0, group = 4, head_dim = kD;
};

std::vector<OptCase> option_cases() {
  using kvq::cuda::IoType;
  std::vector<OptCase> v;
  auto add = [&](const char* name, auto set) {
    OptCase c;
    c.name = name;
    set(c);
    v.push_back(c);
  };
  add("sm_scale 0.3", [](OptCase& c) { c.scale = 0.3f; });
  add("softcap 3, peaky (q gain 8)", [](OptCase& c) {
    c.softcap = 3.f;
    c.q_gain = 8.f;
  });
  add("window 100, split 64 (splits and pages outside skipped)", [](OptCase& c) {
    c.window = 100;
    c.split = 64;
  });
  add("window 1", [](OptCase& c) { c.window = 1; });
  add("positions", [](OptCase& c) { c.positions = true; });
  add("positions, window 150, split 64", [](OptCase& c) {
    c.positions = true;
    c.window = 150;
    c.split = 64;
  });
  add("mask bits", [](OptCase& c) { c.mask = true; });
  add("mask bits, a sequence sees nothing, sinks", [](OptCase& c) {
    c.mask = true;
    c.blind = true;
    c.sinks = true;
  });
  add("window 200 + mask bits excluding sequences 0 and 3", [](OptCase& c) {
    c.window = 200;
    c.mask = true;
    c.blind = true;
  });
  add("sinks", [](OptCase& c) { c.sinks = true; });
  add("f16 q and out", [](OptCase& c) { c.io = IoType::kF16; });
  add("bf16 q and out", [](OptCase& c) { c.io = IoType::kBF16; });
  add("f16 q and out, softcap 20, window 300", [](OptCase& c) {
    c.io = IoType::kF16;
    c.softcap = 20.f;
    c.window = 300;
  });
  add("everything, bf16, group 12", [](OptCase& c) {
    c.scale = 0.2f;
    c.softcap = 10.f;
    c.q_gain = 2.f;
    c.window = 250;
    c.positions = true;
    c.mask = true;
    c.blind = true;
    c.sinks = true;
    c.io = IoType::kBF16;
    c.split = 64;
    c.group = 12;
  });
  add("everything, f32, head_dim 128, group 8", [](OptCase& c) {
    c.softcap = 15.f;
    c.window = 333;
    c.positions = true;
    c.mask = true;
    c.sinks = true;
    c.group = 8;
    c.head_dim = 128;
  });
  return v;
}

std::vector<Pair> option_pairs() {
  return {
      {"f16 / f16", raw_cfg(Format::kF16), raw_cfg(Format::kF16)},
      {"e4m3 head / e4m3 head (fp8)", fp8_cfg(false, Axis::kHead, 64), fp8_cfg(false, Axis::kHead, 64)},
      {"kivi4: int4 channel g32 / int4 token g32", int_cfg(4, Axis::kChannel, 32),
       int_cfg(4, Axis::kToken, 32)},
      {"lm4 / int3 token g32 (element by element)", lm_cfg(4), int_cfg(3, Axis::kToken, 32)},
  };
}

/// One decode-options case on one format pair: sequences of 1 granule, ~5 pages, 0 and ~1000
/// tokens written by the CPU, decoded on the GPU with the options and compared with
/// reference_decode over the CPU-dequantized pages. The page-table entries of pages wholly
/// outside a sequence's [pos - window + 1, pos] are null, so a kernel that read them would
/// fault. Without device, only the host half (pages, plan, check) runs.
void options_case(const Pair& pr, const OptCase& oc, bool device) {
  using kvq::cuda::IoType;
  const int64_t D = oc.head_dim, group = oc.group;
  SCOPED_TRACE(pr.name + ", " + oc.name + ", head_dim " + std::to_string(D));
  const PageLayout L = kvq::make_page_layout(pr.k, pr.v, kP, kH, D);
  const int64_t g = L.granule;
  const std::vector<int64_t> lens = {g, (5 * kP / g) * g + g, 0, (1000 / g) * g};
  const int64_t B = static_cast<int64_t>(lens.size()), Hq = kH * group;
  const int64_t max_len = *std::max_element(lens.begin(), lens.end());
  // Options, per sequence.
  std::vector<int64_t> pos(static_cast<std::size_t>(B));
  for (int64_t b = 0; b < B; ++b)
    pos[b] = oc.positions ? (lens[b] * 7) / 10 : lens[b] - 1;  // (the empty sequence: 0)
  const int64_t words = oc.mask ? (max_len + 63) / 64 + 1 : 0;  // one spare word: row stride
  std::vector<uint64_t> mask(static_cast<std::size_t>(B * std::max<int64_t>(words, 1)), 0);
  if (oc.mask) {
    std::mt19937_64 rng(77);
    for (auto& w : mask) w = rng() | rng();  // ~3/4 of the positions seen
    if (oc.blind) {
      for (int64_t i = 0; i < words; ++i) mask[i] = 0;  // sequence 0 sees nothing
      if (oc.window > 0) {  // sequence 3: bits only before its window
        uint64_t* row = mask.data() + 3 * words;
        for (int64_t t = 0; t < words * 64; ++t)
          if (t >= pos[3] - oc.window + 1) row[t / 64] &= ~(1ull << (t % 64));
      }
    }
  }
  std::vector<float> sinks(static_cast<std::size_t>(Hq));
  {
    std::mt19937 rng(78);
    std::uniform_real_distribution<float> u(-1.f, 4.f);
    for (auto& x : sinks) x = u(rng);
    sinks[1] = -INFINITY;  // no sink for query head 1
  }
  kvq::cuda::DecodeOptions opt;
  opt.sm_scale = oc.scale;
  opt.softcap = oc.softcap;
  opt.window = oc.window;
  opt.mask_words = static_cast<int32_t>(words);
  opt.q_type = opt.out_type = oc.io;

  std::vector<Pages> seqs;
  std::vector<int32_t> indptr = {0}, tokens;
  std::vector<std::vector<float>> ks, vs;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t T = lens[b], np = (T + kP - 1) / kP;
    Pages p = zero_pages(L, np);
    auto k = make_input(Input::kOutlierChannels, T, kH, D, 40 + b);
    auto v = make_input(Input::kGaussian, T, kH, D, 50 + b);
    if (T > 0) cpu_append(L, p, 0, k, v, T);
    std::vector<float> dk, dv;
    cpu_dequantize(L, p, T, dk, dv);
    ks.push_back(dk);
    vs.push_back(dv);
    seqs.push_back(std::move(p));
    indptr.push_back(indptr.back() + static_cast<int32_t>(np));
    tokens.push_back(static_cast<int32_t>(T));
  }
  std::vector<float> q = make_input(Input::kGaussian, B, Hq, D, 60);
  for (float& x : q) x *= oc.q_gain;
  if (oc.io == IoType::kF16) q = round_trip<kvq::f16>(q);  // the values the query carries
  if (oc.io == IoType::kBF16) q = round_trip<kvq::bf16>(q);
  const kvq::cuda::DecodePlan plan(L, B, Hq, max_len, oc.split);
  {
    kvq::cuda::DecodeOptions host = opt;  // check() reads no pointee
    if (oc.mask) host.mask_bits = mask.data();
    EXPECT_EQ(error_kind([&] { plan.check(host); }), -1);
  }
  if (!device) return;

  std::vector<std::unique_ptr<DevPages>> dev;
  std::vector<const std::byte*> table;
  int64_t nulled = 0;
  for (int64_t b = 0; b < B; ++b) {
    auto& s = seqs[static_cast<std::size_t>(b)];
    dev.push_back(std::make_unique<DevPages>(L, static_cast<int64_t>(s.size())));
    dev.back()->upload(s);
    const int64_t lo = oc.window > 0 ? pos[b] - oc.window + 1 : 0, hi = pos[b];
    for (std::size_t i = 0; i < s.size(); ++i) {
      const int64_t first = static_cast<int64_t>(i) * kP, last = first + kP - 1;
      const bool outside = last < lo || first > hi;
      nulled += outside ? 1 : 0;
      table.push_back(outside ? nullptr : dev.back()->ptrs[i]);
    }
  }
  if (oc.window > 0 && oc.split == 64) EXPECT_GT(nulled, 0) << "the case must skip pages";
  std::vector<int32_t> pos32(pos.begin(), pos.end());
  void* ws = nullptr;
  CK(cudaMalloc(&ws, plan.workspace_bytes()));
  const std::byte** dtable = to_device(table);
  int32_t* dindptr = to_device(indptr);
  int32_t* dtokens = to_device(tokens);
  int32_t* dpos = to_device(pos32);
  uint64_t* dmask = to_device(mask);
  float* dsinks = to_device(sinks);
  void* dq = nullptr;
  if (oc.io == IoType::kF16) {
    dq = to_device(convert_input<kvq::f16>(q));
  } else if (oc.io == IoType::kBF16) {
    dq = to_device(convert_input<kvq::bf16>(q));
  } else {
    dq = to_device(q);
  }
  const std::size_t esize = oc.io == IoType::kF32 ? 4 : 2;
  void* dout = nullptr;
  float* dlse = nullptr;
  CK(cudaMalloc(&dout, esize * q.size()));
  CK(cudaMalloc(&dlse, sizeof(float) * static_cast<std::size_t>(B * Hq)));
  opt.positions = oc.positions ? dpos : nullptr;
  opt.mask_bits = oc.mask ? dmask : nullptr;
  opt.sinks = oc.sinks ? dsinks : nullptr;
  opt.lse = dlse;
  EXPECT_NO_THROW(plan.run(ws, dq, dtable, dindptr, dtokens, dout, opt));
  CK(cudaDeviceSynchronize());
  std::vector<float> got(q.size());
  if (oc.io == IoType::kF16) {
    const auto h = to_host(static_cast<const kvq::f16*>(dout), q.size());
    for (std::size_t i = 0; i < got.size(); ++i) got[i] = kvq::to_float(h[i]);
  } else if (oc.io == IoType::kBF16) {
    const auto h = to_host(static_cast<const kvq::bf16*>(dout), q.size());
    for (std::size_t i = 0; i < got.size(); ++i) got[i] = kvq::to_float(h[i]);
  } else {
    got = to_host(static_cast<const float*>(dout), q.size());
  }
  const std::vector<float> got_lse = to_host(dlse, static_cast<std::size_t>(B * Hq));
  // The kernel's f32 result is within 1e-3 of the largest magnitude (the f32 decode test's
  // bound); an f16 / bf16 output adds its own rounding, at most the unit roundoff u (2^-11,
  // 2^-8) relative to the stored value.
  const double u = oc.io == IoType::kF16 ? std::ldexp(1.0, -11)
                                         : (oc.io == IoType::kBF16 ? std::ldexp(1.0, -8) : 0.0);
  for (int64_t b = 0; b < B; ++b) {
    RefOptions ro;
    ro.scale = oc.scale;
    ro.softcap = oc.softcap;
    ro.window = oc.window;
    ro.pos = &pos[b];
    ro.mask = oc.mask ? mask.data() + b * words : nullptr;
    ro.sinks = oc.sinks ? sinks.data() : nullptr;
    std::vector<double> want_lse;
    const auto want =
        reference_decode(ks[b], vs[b], lens[b], kH, D, q.data() + b * Hq * D, Hq, &want_lse, ro);
    const bool blind = lens[b] == 0 || (oc.blind && (b == 0 || (b == 3 && oc.window > 0)));
    for (int64_t h = 0; h < Hq; ++h) {
      const double a = got_lse[static_cast<std::size_t>(b * Hq + h)];
      const double w = want_lse[static_cast<std::size_t>(h)];
      if (std::isinf(w)) {
        EXPECT_TRUE(std::isinf(a) && a < 0) << "sequence " << b << " head " << h << ": lse " << a;
      } else {
        EXPECT_NEAR(a, w, 1e-3 * (1.0 + std::fabs(w))) << "sequence " << b << " head " << h;
      }
      if (blind) {  // sees nothing: lse is the sink's alone (or -inf)
        const bool sink = oc.sinks && h != 1;
        EXPECT_EQ(w, sink ? static_cast<double>(sinks[h]) : -INFINITY) << "reference, head " << h;
      }
    }
    double mag = 0;
    for (int64_t i = 0; i < Hq * D; ++i) mag = std::max(mag, static_cast<double>(std::fabs(want[i])));
    if (blind) {
      EXPECT_EQ(mag, 0.0) << "reference: sequence " << b << " sees nothing";
      for (int64_t i = 0; i < Hq * D; ++i)
        ASSERT_EQ(got[b * Hq * D + i], 0.f) << "sequence " << b << " sees nothing: zeros";
      continue;
    }
    int64_t bad = 0;
    double worst = 0;
    for (int64_t i = 0; i < Hq * D; ++i) {
      const double w = want[i], e = std::fabs(got[b * Hq * D + i] - w);
      const double bound = 1e-3 * mag + u * (std::fabs(w) + 1e-3 * mag);
      if (!(e <= bound)) ++bad;
      worst = std::max(worst, e / bound);
    }
    EXPECT_EQ(bad, 0) << "sequence " << b << " (" << lens[b] << " tokens): worst error "
                      << worst << " x the bound";
  }
  for (void* p : {ws, static_cast<void*>(dtable), static_cast<void*>(dindptr),
                  static_cast<void*>(dtokens), static_cast<void*>(dpos), static_cast<void*>(dmask),
                  static_cast<void*>(dsinks), dq, dout, static_cast<void*>(dlse)})
    cudaFree(p);
}

TEST(HostEmulated, DecodeOptionCases) {
  for (const Pair& pr : option_pairs())
    for (const OptCase& oc : option_cases()) options_case(pr, oc, false);
}

TEST(Gpu, DecodeOptionsMatchTheReference) {
  KVQ_REQUIRE_GPU();
  for (const Pair& pr : option_pairs())
    for (const OptCase& oc : option_cases()) options_case(pr, oc, true);
}

TEST(Gpu, DecodeF32FormMatchesTheOptionsForm) {
  // The old run() signature forwards to the options form: same bits.
  KVQ_REQUIRE_GPU();
  const Pair pr = option_pairs()[2];
  const PageLayout L = kvq::make_page_layout(pr.k, pr.v, kP, kH, kD);
  const int64_t T = 300, Hq = 8;
  Pages p = zero_pages(L, (T + kP - 1) / kP);
  cpu_append(L, p, 0, make_input(Input::kGaussian, T, kH, kD, 1),
             make_input(Input::kGaussian, T, kH, kD, 2), T);
  DevPages dev(L, static_cast<int64_t>(p.size()));
  dev.upload(p);
  const kvq::cuda::DecodePlan plan(L, 1, Hq, T);
  void* ws = nullptr;
  CK(cudaMalloc(&ws, plan.workspace_bytes()));
  const std::vector<float> q = make_input(Input::kGaussian, 1, Hq, kD, 3);
  float* dq = to_device(q);
  int32_t* dmeta = to_device(std::vector<int32_t>{0, static_cast<int32_t>(p.size()), static_cast<int32_t>(T)});
  float *o1 = nullptr, *o2 = nullptr, *l1 = nullptr, *l2 = nullptr;
  CK(cudaMalloc(&o1, sizeof(float) * q.size()));
  CK(cudaMalloc(&o2, sizeof(float) * q.size()));
  CK(cudaMalloc(&l1, sizeof(float) * Hq));
  CK(cudaMalloc(&l2, sizeof(float) * Hq));
  plan.run(ws, dq, dev.table, dmeta, dmeta + 2, o1, nullptr, 0.07f, l1);
  kvq::cuda::DecodeOptions opt;
  opt.sm_scale = 0.07f;
  opt.lse = l2;
  plan.run(ws, dq, dev.table, dmeta, dmeta + 2, o2, opt);
  CK(cudaDeviceSynchronize());
  EXPECT_TRUE(same_bits(to_host(o1, q.size()), to_host(o2, q.size())));
  EXPECT_TRUE(same_bits(to_host(l1, Hq), to_host(l2, Hq)));
  for (void* x : {ws, static_cast<void*>(dq), static_cast<void*>(dmeta), static_cast<void*>(o1),
                  static_cast<void*>(o2), static_cast<void*>(l1), static_cast<void*>(l2)})
    cudaFree(x);
}

}  // namespace

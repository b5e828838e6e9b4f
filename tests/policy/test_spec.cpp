// Tests for policy/spec.hpp and policy/policy.hpp: the spec grammar (a contract with checks
// outside kvq), presets, layer filters, errors, and the compile-time policies.
//
// Compile-time rejections cannot run as tests; each of these fails to compile with the quoted
// static_assert message (checked by hand when the tags were written):
//   Int<5>                                  "integer formats support 2, 3, 4 or 8 bits"
//   SInt<4, PerToken, 0>                    "Group must be >= 1 ..."
//   Int<4, int>                             "Axis must be PerToken, PerChannel, PerHead or
//   PerTensor" Fp8E4M3<PerChannel>                     "per-channel fp8 scales are not supported"
//   LloydMax<0>, LloydMax<5>                "Lloyd-Max codebooks have 1 to 4 bits"
//   Raw<double>                             "T must be float, kvq::f16 or kvq::bf16"
//   KVPolicy<int, Raw<float>>               "KeyQ must be a quantizer tag ..."
//   KVPolicy<LloydMax<4>, LloydMax<4, true>>  "QJL is an inner-product estimator for keys ..."
//   KVPolicy<..., Residual<8>, Residual<16>>  "... may each be given once"
//   KVPolicy<..., LayerOverride<1, ...>, LayerOverride<1, ...>>  "two LayerOverride ... same layer"
//   KVPolicy<..., double>                   "KVPolicy options must be Residual<R>, ..."
//   SkipAs<LloydMax<3, true>>               "QJL is for keys only"
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "kvq/policy/policy.hpp"
#include "kvq/policy/spec.hpp"

namespace {

using kvq::Axis;
using kvq::ErrorKind;
using kvq::Format;
using kvq::parse_policy;
using kvq::Policy;

// The canonical expansion of every preset: part of the contract (docs/policy.md).
const std::vector<std::pair<std::string, std::string>> kCanonical = {
    {"f32", "k=f32,v=f32,residual=0,sinks=0,skip=0:0"},
    {"f16", "k=f16,v=f16,residual=0,sinks=0,skip=0:0"},
    {"fp8", "k=e4m3/head,v=e4m3/head,residual=0,sinks=0,skip=0:0"},
    {"k8v4", "k=e4m3/head,v=int4/token/g32,residual=0,sinks=0,skip=0:0"},
    {"kivi2", "k=int2/channel/g32,v=int2/token/g32,residual=32,sinks=0,skip=0:0"},
    {"kivi4", "k=int4/channel/g32,v=int4/token/g32,residual=32,sinks=0,skip=0:0"},
    {"kivi2-flip", "k=int2/token/g32,v=int2/channel/g32,residual=32,sinks=0,skip=0:0"},
    {"kivi4-flip", "k=int4/token/g32,v=int4/channel/g32,residual=32,sinks=0,skip=0:0"},
    {"turbo3", "k=lm3/rot,v=lm3/rot,residual=0,sinks=0,skip=0:0"},
    {"turbo4", "k=lm4/rot,v=lm4/rot,residual=0,sinks=0,skip=0:0"},
};

TEST(Spec, EveryPresetHasItsCanonicalExpansionAndRoundTrips) {
  ASSERT_EQ(kvq::policy_presets().size(), kCanonical.size());
  for (const auto& [name, canonical] : kCanonical) {
    SCOPED_TRACE(name);
    const Policy p = parse_policy(name);
    EXPECT_EQ(p.spec(), canonical);
    const Policy again = parse_policy(p.spec());
    EXPECT_EQ(again, p);
    EXPECT_EQ(again.spec(), canonical);
    // The preset table's own spec string expands to the same policy.
    bool found = false;
    for (const kvq::Preset& pr : kvq::policy_presets()) {
      if (name == pr.name) {
        found = true;
        EXPECT_EQ(parse_policy(pr.spec), p);
      }
    }
    EXPECT_TRUE(found);
  }
}

TEST(Spec, PresetConfigsHaveTheDocumentedFields) {
  const Policy k = parse_policy("kivi2");
  EXPECT_EQ(k.key.format, Format::kInt);
  EXPECT_EQ(k.key.bits, 2);
  EXPECT_FALSE(k.key.symmetric);
  EXPECT_EQ(k.key.axis, Axis::kChannel);
  EXPECT_EQ(k.key.group, 32);
  EXPECT_EQ(k.value.axis, Axis::kToken);
  EXPECT_EQ(k.residual, 32);
  EXPECT_EQ(k.sinks, 0);
  const Policy f = parse_policy("fp8");
  EXPECT_EQ(f.key.format, Format::kE4M3);
  EXPECT_EQ(f.key.axis, Axis::kHead);
  EXPECT_EQ(f.key.group, 0);
  const Policy t = parse_policy("turbo4");
  EXPECT_EQ(t.key.format, Format::kLloydMax);
  EXPECT_EQ(t.key.bits, 4);
  EXPECT_FALSE(t.key.qjl);
  EXPECT_TRUE(parse_policy("f32").key.is_raw());
}

TEST(Spec, DefaultsOfOmittedParts) {
  const Policy p = parse_policy("k=int4,v=sint8/channel");
  EXPECT_EQ(p.key.axis, Axis::kToken);
  EXPECT_EQ(p.key.group, kvq::kDefaultIntGroup);
  EXPECT_TRUE(p.value.symmetric);
  EXPECT_EQ(p.value.bits, 8);
  EXPECT_EQ(p.value.axis, Axis::kChannel);
  EXPECT_EQ(p.value.group, 32);
  EXPECT_EQ(p.residual, 0);
  EXPECT_EQ(p.sinks, 0);
  EXPECT_EQ(p.skip_first, 0);
  EXPECT_EQ(p.skip_last, 0);
  EXPECT_EQ(p.spec(), "k=int4/token/g32,v=sint8/channel/g32,residual=0,sinks=0,skip=0:0");
  const Policy f = parse_policy("k=e5m2,v=e4m3/token/g16");
  EXPECT_EQ(f.key.format, Format::kE5M2);
  EXPECT_EQ(f.key.axis, Axis::kHead);
  EXPECT_EQ(f.key.group, 0);
  EXPECT_EQ(f.value.axis, Axis::kToken);
  EXPECT_EQ(f.value.group, 16);
  EXPECT_EQ(f.spec(), "k=e5m2/head,v=e4m3/token/g16,residual=0,sinks=0,skip=0:0");
  // Lloyd-Max: /rot is implied and accepted; /qjl only on keys; f32meta everywhere quantized.
  const Policy l = parse_policy("k=lm2/qjl/rot,v=lm1/f32meta");
  EXPECT_TRUE(l.key.qjl);
  EXPECT_EQ(l.value.meta, kvq::MetaDType::kF32);
  EXPECT_EQ(l.spec(), "k=lm2/rot/qjl,v=lm1/rot/f32meta,residual=0,sinks=0,skip=0:0");
  EXPECT_EQ(parse_policy("k=lm3,v=lm3"), parse_policy("k=lm3/rot,v=lm3/rot"));
  // Whitespace around items and '=' is ignored.
  EXPECT_EQ(parse_policy("  kivi2 , residual = 64 "), parse_policy("kivi2,residual=64"));
}

TEST(Spec, PresetsAndFieldsCombineLaterFieldsWin) {
  const Policy a = parse_policy("k8v4,skip=2");
  EXPECT_EQ(a.skip_first, 2);
  EXPECT_EQ(a.skip_last, 2);
  EXPECT_EQ(a.spec(), "k=e4m3/head,v=int4/token/g32,residual=0,sinks=0,skip=2:2");
  const Policy b = parse_policy("kivi2,residual=128");
  EXPECT_EQ(b.residual, 128);
  EXPECT_EQ(b.key.bits, 2);
  const Policy c = parse_policy("kivi4,v=int8/token/g64,sinks=4,skip=1:3,skipas=fp8");
  EXPECT_EQ(c.value.bits, 8);
  EXPECT_EQ(c.value.group, 64);
  EXPECT_EQ(c.sinks, 4);
  EXPECT_EQ(c.skip_first, 1);
  EXPECT_EQ(c.skip_last, 3);
  EXPECT_EQ(c.skip_config.format, Format::kE4M3);
  EXPECT_EQ(c.spec(),
            "k=int4/channel/g32,v=int8/token/g64,residual=32,sinks=4,skip=1:3,"
            "skipas=e4m3/head");
  EXPECT_EQ(parse_policy(c.spec()), c);
  EXPECT_EQ(parse_policy("kivi2,skipas=f16").skip_config.format, Format::kF16);
  EXPECT_EQ(parse_policy("kivi2,skipas=int8/token/g32").skip_config.bits, 8);
}

TEST(Spec, SkipSelectsExactlyTheBoundaryLayers) {
  // On a 5-layer model skip=1:2 leaves layers 0, 3 and 4 unquantized.
  const Policy p = parse_policy("kivi2,skip=1:2");
  std::vector<int> skipped;
  for (int l = 0; l < 5; ++l) {
    if (p.skips(l, 5)) skipped.push_back(l);
    const kvq::QuantConfig k = p.key_for(l, 5), v = p.value_for(l, 5);
    if (p.skips(l, 5)) {
      EXPECT_EQ(k.format, Format::kF32);
      EXPECT_EQ(v.format, Format::kF32);
    } else {
      EXPECT_TRUE(kvq::same_config(k, p.key));
      EXPECT_TRUE(kvq::same_config(v, p.value));
    }
  }
  EXPECT_EQ(skipped, (std::vector<int>{0, 3, 4}));
  // skip=N alone is N first and N last.
  const Policy q = parse_policy("kivi2,skip=2");
  for (int l = 0; l < 6; ++l) EXPECT_EQ(q.skips(l, 6), l < 2 || l >= 4) << l;
  // Overlapping ranges skip everything; out-of-range layers are an error.
  const Policy r = parse_policy("kivi2,skip=3:3");
  for (int l = 0; l < 4; ++l) EXPECT_TRUE(r.skips(l, 4));
  EXPECT_THROW(r.skips(4, 4), kvq::Error);
  EXPECT_THROW(r.key_for(-1, 4), kvq::Error);
  // skip=0:M and skip=N:0.
  const Policy s = parse_policy("kivi2,skip=0:1");
  EXPECT_FALSE(s.skips(0, 3));
  EXPECT_TRUE(s.skips(2, 3));
}

TEST(Spec, OverridesWinOverSkipAndFollowTheFinalBase) {
  const Policy p = parse_policy("kivi2,skip=1,k@0=int8/token/g32,v@2=f16,residual=64");
  // Layer 0 is skipped but overridden: key int8, value = the base value config (int2 token).
  EXPECT_EQ(p.key_for(0, 4).bits, 8);
  EXPECT_TRUE(kvq::same_config(p.value_for(0, 4), p.value));
  // Layer 2: key = base key, value f16.
  EXPECT_TRUE(kvq::same_config(p.key_for(2, 4), p.key));
  EXPECT_EQ(p.value_for(2, 4).format, Format::kF16);
  EXPECT_EQ(p.key_for(3, 4).format, Format::kF32);  // skipped, not overridden
  EXPECT_EQ(p.spec(),
            "k=int2/channel/g32,v=int2/token/g32,residual=64,sinks=0,skip=1:1,"
            "k@0=int8/token/g32,v@0=int2/token/g32,k@2=int2/channel/g32,v@2=f16");
  EXPECT_EQ(parse_policy(p.spec()), p);
  // An override half follows the base given after it.
  const Policy q = parse_policy("k=int4,v@1=f16,v=int8");
  EXPECT_EQ(q.value_for(0, 2).bits, 8);
  EXPECT_EQ(q.key_for(1, 2).bits, 4);
}

TEST(Spec, ParsePoliciesSplitsOnSemicolons) {
  const std::vector<Policy> ps = kvq::parse_policies("f32;kivi2,residual=8; turbo3");
  ASSERT_EQ(ps.size(), 3u);
  EXPECT_EQ(ps[0], parse_policy("f32"));
  EXPECT_EQ(ps[1].residual, 8);
  EXPECT_EQ(ps[2], parse_policy("turbo3"));
  EXPECT_EQ(kvq::parse_policies("kivi4").size(), 1u);
  for (const char* bad : {"", ";", "f32;", ";f32", "f32;;kivi2", "f32; ;kivi2"}) {
    try {
      kvq::parse_policies(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kParse) << bad;
    }
  }
}

TEST(Spec, ErrorMessagesNameTheTokenAndWhatWasExpected) {
  try {
    parse_policy("k=int5/channel,v=int4");
    FAIL();
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kParse);
    EXPECT_EQ(std::string(e.what()),
              "kvq: parse error: unknown format 'int5' in 'k=int5/channel' (expected one of "
              "f32, f16, bf16, e4m3, e5m2, int2, int3, int4, int8, sint2, sint3, sint4, sint8, "
              "lm1, lm2, lm3, lm4, nuq2, nuq3, nuq4, nvfp4, mxfp4)");
  }
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "empty policy spec"},
      {"   ", "empty policy spec"},
      {"kivi5", "unknown preset 'kivi5'"},
      {"kivi5",
       "expected one of f32, f16, fp8, k8v4, kivi2, kivi4, kivi2-flip, kivi4-flip, "
       "turbo3, turbo4"},
      {"residual=4,kivi2", "preset 'kivi2' must be the first item"},
      {"kivi2,kivi4", "preset 'kivi4' must be the first item"},
      {"kivi2,,skip=1", "empty item 2"},
      {"kivi2,", "empty item 2"},
      {",kivi2", "empty item 1"},
      {"k=int4,k=int8,v=f16", "field 'k' given twice"},
      {"kivi2,residual=8,residual=16", "field 'residual' given twice"},
      {"kivi2,resid=8", "unknown field 'resid' in 'resid=8' (expected k, v, residual"},
      {"k=int4", "sets no value format"},
      {"v=int4", "sets no key format"},
      {"k=,v=f16", "empty format in 'k='"},
      {"k=int4/g0,v=f16", "group size must be >= 1 in 'g0'"},
      {"k=int4/g,v=f16", "missing number for the group size"},
      {"k=int4/g32x,v=f16",
       "expected a non-negative integer for the group size g<N> in "
       "'k=int4/g32x', got '32x'"},
      {"k=int4/g-4,v=f16", "got '-4'"},
      {"k=int4/g99999999999999999999,v=f16", "too large"},
      {"kivi2,residual=-1", "expected a non-negative integer for residual in 'residual=-1'"},
      {"kivi2,residual=12abc", "got '12abc'"},
      {"kivi2,residual=", "missing number for residual"},
      {"kivi2,residual=+5", "got '+5'"},
      {"kivi2,sinks=1.5", "got '1.5'"},
      {"kivi2,skip=2:", "missing number for the last-layer count of skip"},
      {"kivi2,skip=:2", "missing number for the first-layer count of skip"},
      {"kivi2,skip=1:2:3", "got '2:3'"},
      {"k=int4/token/channel,v=f16", "axis given twice ('token' and 'channel')"},
      {"k=int4/g8/g16,v=f16", "group size given twice ('g8' and 'g16')"},
      {"k=f16/rot,v=f16", "format 'f16' cannot rotate"},
      {"k=nuq3/rot,v=f16", "format 'nuq3' cannot rotate"},
      {"k=int4/out2/rot,v=f16", "rotation with dense-and-sparse outliers is not supported"},
      {"k=lm3/rot/rot,v=f16", "'rot' given twice"},
      {"k=lm3,v=lm3/qjl", "only k= (or k@<layer>=) terms may use it"},
      {"k=int4/qjl,v=f16", "has no QJL residual"},
      {"k=f16/channel,v=f16", "format 'f16' takes no axis"},
      {"k=f16/g32,v=f16", "format 'f16' takes no group size"},
      {"k=f32/f32meta,v=f16", "has no metadata"},
      {"k=lm4/channel,v=f16", "Lloyd-Max stores one norm per vector"},
      {"k=lm4/g8,v=f16", "takes no group size"},
      {"k=e4m3/channel,v=f16", "format 'e4m3' cannot use axis 'channel'"},
      {"k=int4/chanel,v=f16", "unknown option 'chanel' in 'k=int4/chanel' (expected an axis"},
      {"k=int4//g32,v=f16", "empty option after '/'"},
      {"k=INT4,v=f16", "unknown format 'INT4'"},
      {"k=int4 /token,v=f16", "unknown format 'int4 '"},
      {"kivi2,skipas=k8v4", "skipas preset 'k8v4' in 'skipas=k8v4' stores keys and values"},
      {"kivi2,skipas=lm3/qjl", "QJL is an inner-product estimator for keys"},
      {"kivi2,skipas=", "empty format in 'skipas='"},
      {"kivi2,k@x=int8", "expected a non-negative integer for the layer index"},
      {"kivi2,k@=int8", "unknown field 'k@'"},
      {"kivi2,k@1=int8,k@1=int4", "field 'k@1' given twice"},
      {"kivi2,v@0=lm2/qjl", "only k= (or k@<layer>=) terms may use it"},
      {"kivi2=3", "unknown field 'kivi2'"},
  };
  for (const auto& [spec, needle] : cases) {
    SCOPED_TRACE(spec);
    try {
      parse_policy(spec);
      ADD_FAILURE() << "accepted '" << spec << "'";
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kParse);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
          << "message: " << e.what() << "\nexpected to contain: " << needle;
    }
  }
}

TEST(Spec, HandBuiltPoliciesAreValidatedAndComparedByRelevantFields) {
  Policy p;  // f32 keys and values by default
  EXPECT_EQ(p, parse_policy("f32"));
  p.key = kvq::int_config(4, Axis::kChannel, 0);  // int group 0 is outside the grammar
  EXPECT_THROW(p.validate(), kvq::Error);
  EXPECT_THROW(p.spec(), kvq::Error);
  p.key = kvq::int_config(5);
  EXPECT_THROW(p.validate(), kvq::Error);
  p.key = kvq::fp8_config(Format::kE4M3, Axis::kChannel);
  EXPECT_THROW(p.validate(), kvq::Error);
  p.key = kvq::lm_config(3, true);
  p.validate();
  p.value = kvq::lm_config(3, true);  // QJL on values
  EXPECT_THROW(p.validate(), kvq::Error);
  p.value = kvq::raw_config(Format::kBF16);
  p.residual = -1;
  EXPECT_THROW(p.validate(), kvq::Error);
  // Irrelevant fields do not matter: a hand-built f16 config with bits=4 equals the parsed one.
  kvq::QuantConfig c;
  c.format = Format::kF16;
  EXPECT_TRUE(kvq::same_config(c, kvq::parse_quant_config("f16")));
  kvq::QuantConfig lm = kvq::lm_config(2);
  lm.seed = 7;
  EXPECT_FALSE(kvq::same_config(lm, kvq::parse_quant_config("lm2")));
  EXPECT_EQ(kvq::config_spec(kvq::parse_quant_config("sint4/head/g8/f32meta")),
            "sint4/head/g8/f32meta");
}

// Outlier percentages: the canonical term is the shortest plain decimal that parses back to
// the same float ("%g" wrote 1.2345678 as 1.23457, another float, and 0.00001 as 1e-05, which
// the grammar refuses). Expected texts written by hand.
TEST(Spec, OutlierPercentRoundTrips) {
  const std::pair<const char*, const char*> cases[] = {
      {"int4/channel/g32/out1.2345678%", "int4/channel/g32/out1.2345678%"},
      {"int4/channel/g32/out0.00001%", "int4/channel/g32/out0.00001%"},
      {"int4/channel/g32/out0.5%", "int4/channel/g32/out0.5%"},
      {"int4/channel/g32/out100%", "int4/channel/g32/out100%"},
      {"int4/channel/g32/out2.50%", "int4/channel/g32/out2.5%"},
      {"int4/channel/g32/out0.0000000001%", "int4/channel/g32/out0.0000000001%"},
  };
  for (const auto& tc : cases) {
    const kvq::QuantConfig c = kvq::parse_quant_config(tc.first);
    const std::string spec = kvq::config_spec(c);
    EXPECT_EQ(spec, tc.second) << tc.first;
    EXPECT_TRUE(kvq::same_config(kvq::parse_quant_config(spec), c)) << tc.first;
  }
}

// FP4 terms: nvfp4 / mxfp4 parse to the block formats of quant/fp4_quant.hpp and are written
// bare (the block is part of the format); options they cannot take are parse errors naming the
// option. Expected configs written by hand from the format definitions (16 / 32 channels).
TEST(Spec, Fp4TermsParseAndRoundTrip) {
  const kvq::QuantConfig nv = kvq::parse_quant_config("nvfp4");
  EXPECT_EQ(nv.format, Format::kNvfp4);
  EXPECT_EQ(nv.bits, 4);
  EXPECT_EQ(nv.axis, Axis::kToken);
  EXPECT_EQ(nv.group, 16);
  EXPECT_EQ(nv.fp4_tensor_scale, 1.0f);
  const kvq::QuantConfig mx = kvq::parse_quant_config("mxfp4");
  EXPECT_EQ(mx.format, Format::kMxfp4);
  EXPECT_EQ(mx.group, 32);
  EXPECT_EQ(kvq::config_spec(nv), "nvfp4");
  EXPECT_EQ(kvq::config_spec(mx), "mxfp4");
  EXPECT_TRUE(kvq::same_config(nv, kvq::fp4_config(Format::kNvfp4)));
  EXPECT_FALSE(kvq::same_config(nv, kvq::fp4_config(Format::kNvfp4, 0.5f)));
  EXPECT_FALSE(kvq::same_config(nv, mx));
  for (const char* spec : {"k=nvfp4,v=mxfp4", "k=e4m3/head,v=nvfp4,residual=32",
                           "k=mxfp4,v=mxfp4,sinks=4,skip=1:1", "kivi4,v@0=nvfp4"}) {
    const Policy p = parse_policy(spec);
    EXPECT_EQ(parse_policy(p.spec()), p) << spec << " -> " << p.spec();
  }
  EXPECT_EQ(parse_policy("k=e4m3/head,v=nvfp4").spec(),
            "k=e4m3/head,v=nvfp4,residual=0,sinks=0,skip=0:0");
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"k=nvfp4/token,v=f16", "format 'nvfp4' takes no axis ('token' in 'k=nvfp4/token')"},
      {"k=mxfp4/channel,v=f16", "blocks of 32 channels along head_dim"},
      {"k=nvfp4/g32,v=f16", "format 'nvfp4' takes no group size ('g32'"},
      {"k=nvfp4/f32meta,v=f16", "stores its block scales as one e4m3 byte each"},
      {"k=mxfp4/f32meta,v=f16", "one e8m0 byte each"},
      {"k=nvfp4/out2,v=f16", "outliers apply to the int, fp8 and nuq formats, not 'nvfp4'"},
      {"k=e4m3/rot/out1%,v=f16", "'rot' and 'out1%'"},
      {"k=nvfp4/qjl,v=f16", "format 'nvfp4' has no QJL residual"},
      {"k=fp4,v=f16", "unknown format 'fp4'"},
  };
  for (const auto& [spec, needle] : bad) {
    try {
      parse_policy(spec);
      ADD_FAILURE() << spec << " parsed";
    } catch (const kvq::Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kParse) << spec;
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
  // Hand-built configs the grammar cannot express are refused by validation.
  kvq::QuantConfig c = kvq::fp4_config(Format::kMxfp4);
  c.group = 16;
  EXPECT_THROW(kvq::validate_config(c, "key", false), kvq::Error);
  c = kvq::fp4_config(Format::kNvfp4, 0.f);
  EXPECT_THROW(kvq::validate_config(c, "key", false), kvq::Error);
  EXPECT_NO_THROW(kvq::validate_config(kvq::fp4_config(Format::kNvfp4, 0.25f), "key", false));
  // The metadata type does not apply to FP4 (byte scales): a hand-built f32meta config is
  // written and compared as the bare term.
  c = kvq::fp4_config(Format::kMxfp4);
  c.meta = kvq::MetaDType::kF32;
  EXPECT_EQ(kvq::config_spec(c), "mxfp4");
  EXPECT_EQ(c.name(), "mxfp4");
  EXPECT_TRUE(kvq::same_config(kvq::parse_quant_config(kvq::config_spec(c)), c));
}

// Random mutations of valid specs: parsing must succeed (and then round-trip through spec())
// or throw kvq::Error(kParse) -- never crash, hang, or throw anything else.
TEST(Spec, FuzzedSpecsParseOrThrowKvqError) {
  std::vector<std::string> seeds;
  for (const auto& c : kCanonical) {
    seeds.push_back(c.first);
    seeds.push_back(c.second);
  }
  seeds.push_back("kivi4,v=int8/token/g64,sinks=4,skip=1:3,skipas=fp8,k@2=lm2/qjl,v@2=f16");
  seeds.push_back("k=sint4/head/g8/f32meta,v=e5m2/tensor/g16,residual=100");
  const std::string alphabet = "kvgrestiomlnhac0123456789=,/:;@-_+ .x\t";
  const std::vector<std::string> words = {
      "int",     "sint", "lm",        "e4m3",   "e5m2",    "f16",     "bf16",  "token",
      "channel", "head", "tensor",    "rot",    "qjl",     "g0",      "g",     "skip=",
      "k@",      "v@",   "residual=", "sinks=", "skipas=", "f32meta", "kivi2", "99999999999"};
  std::mt19937 rng(1234);
  int accepted = 0, rejected = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    std::string s = seeds[rng() % seeds.size()];
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const std::size_t pos = s.empty() ? 0 : rng() % (s.size() + 1);
      switch (rng() % 5) {
        case 0:
          s.insert(pos, 1, alphabet[rng() % alphabet.size()]);
          break;
        case 1:
          if (!s.empty() && pos < s.size()) s.erase(pos, 1 + rng() % 3);
          break;
        case 2:
          if (!s.empty() && pos < s.size()) s[pos] = alphabet[rng() % alphabet.size()];
          break;
        case 3:
          s.insert(pos, words[rng() % words.size()]);
          break;
        case 4:
          s.insert(pos, 1, static_cast<char>(rng() % 256));
          break;
      }
    }
    try {
      const Policy p = parse_policy(s);
      const Policy again = parse_policy(p.spec());
      ASSERT_EQ(again, p) << "spec '" << s << "' -> '" << p.spec() << "'";
      ++accepted;
    } catch (const kvq::Error& e) {
      ASSERT_EQ(e.kind(), ErrorKind::kParse) << "spec '" << s << "': " << e.what();
      ++rejected;
    }
  }
  EXPECT_GT(accepted, 100);
  EXPECT_GT(rejected, 100);
}

TEST(CompileTimePolicy, PresetTypesEqualTheirSpecs) {
  EXPECT_EQ(kvq::presets::F32::policy(), parse_policy("f32"));
  EXPECT_EQ(kvq::presets::F16::policy(), parse_policy("f16"));
  EXPECT_EQ(kvq::presets::Fp8::policy(), parse_policy("fp8"));
  EXPECT_EQ(kvq::presets::K8V4::policy(), parse_policy("k8v4"));
  EXPECT_EQ(kvq::presets::Kivi2::policy(), parse_policy("kivi2"));
  EXPECT_EQ(kvq::presets::Kivi4::policy(), parse_policy("kivi4"));
  EXPECT_EQ(kvq::presets::Kivi2Flip::policy(), parse_policy("kivi2-flip"));
  EXPECT_EQ(kvq::presets::Kivi4Flip::policy(), parse_policy("kivi4-flip"));
  EXPECT_EQ(kvq::presets::Turbo3::policy(), parse_policy("turbo3"));
  EXPECT_EQ(kvq::presets::Turbo4::policy(), parse_policy("turbo4"));
  EXPECT_EQ(kvq::presets::Kivi2::spec(), parse_policy("kivi2").spec());
  EXPECT_EQ(kvq::presets::K8V4::spec(), "k=e4m3/head,v=int4/token/g32,residual=0,sinks=0,skip=0:0");
}

TEST(CompileTimePolicy, OptionsAndLayerFiltersMatchTheSpecForm) {
  using P = kvq::KVPolicy<kvq::Int<4, kvq::PerChannel, 64>, kvq::SInt<8>, kvq::Residual<128>,
                          kvq::Sinks<4>, kvq::SkipLayers<1, 2>, kvq::SkipAs<kvq::Fp8E4M3<>>,
                          kvq::LayerOverride<3, kvq::LloydMax<2, true>, kvq::Raw<kvq::bf16>>>;
  const Policy p = P::policy();
  EXPECT_EQ(P::spec(),
            "k=int4/channel/g64,v=sint8/token/g32,residual=128,sinks=4,skip=1:2,"
            "skipas=e4m3/head,k@3=lm2/rot/qjl,v@3=bf16");
  EXPECT_EQ(parse_policy(P::spec()), p);
  using Q = kvq::KVPolicy<kvq::Fp8E5M2<kvq::PerToken, 16>, kvq::Raw<float>, kvq::SkipLayers<2>>;
  EXPECT_EQ(Q::spec(), "k=e5m2/token/g16,v=f32,residual=0,sinks=0,skip=2:2");
  using R = kvq::KVPolicy<kvq::Fp8E4M3<kvq::PerTensor>, kvq::Int<3, kvq::PerHead, 16>>;
  EXPECT_EQ(R::spec(), "k=e4m3/tensor,v=int3/head/g16,residual=0,sinks=0,skip=0:0");
}

}  // namespace

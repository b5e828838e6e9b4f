// Policy terms for kinds of layers (k@local / v@local / k@global / v@global, spec.hpp): parsing,
// the canonical spec and its round trip, binding to a model's layer kinds (precedence: k@L over
// kind terms over skip over the base configs), and the refusal to use an unbound policy.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kvq/cache/kv_cache.hpp"
#include "kvq/io/calibration_file.hpp"
#include "kvq/policy/spec.hpp"

namespace {

using kvq::parse_policy;
using kvq::parse_quant_config;
using kvq::same_config;

TEST(LayerKinds, ParseAndCanonicalSpec) {
  const auto p = parse_policy("kivi2,k@local=int4/channel/g32,v@global=f16");
  EXPECT_TRUE(p.has_kind_terms());
  EXPECT_TRUE(p.local.has_key);
  EXPECT_FALSE(p.local.has_value);
  EXPECT_FALSE(p.global.has_key);
  EXPECT_TRUE(p.global.has_value);
  EXPECT_EQ(p.spec(),
            "k=int2/channel/g32,v=int2/token/g32,residual=32,sinks=0,skip=0:0,"
            "k@local=int4/channel/g32,v@global=f16");
  EXPECT_EQ(parse_policy(p.spec()), p);
  EXPECT_NE(parse_policy("kivi2,k@local=int4/channel/g32"), parse_policy("kivi2,k@global=int4/channel/g32"));
  EXPECT_FALSE(parse_policy("kivi2").has_kind_terms());
}

TEST(LayerKinds, Errors) {
  EXPECT_THROW(parse_policy("kivi2,k@local=f16,k@local=f32"), kvq::Error);  // given twice
  EXPECT_THROW(parse_policy("kivi2,v@global=lm3/qjl"), kvq::Error);         // QJL on values
  EXPECT_THROW(parse_policy("kivi2,k@loc=f16"), kvq::Error);
  const auto p = parse_policy("kivi2,k@global=f16");
  try {
    (void)p.key_for(0, 4);
    FAIL() << "an unbound policy was used";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("bind_layer_kinds"), std::string::npos) << e.what();
  }
  EXPECT_THROW(kvq::KVCache(p, 4, 1, 64), kvq::Error);
  EXPECT_THROW(p.bind_layer_kinds({1, 0}, 4), kvq::Error);  // kinds for 2 of 4 layers
  // A calibration file holds a bound policy: kind terms there are a parse error.
  try {
    kvq::parse_calibration(
        R"({"format": "kvq-calibration", "version": 1, "spec": "kivi2,k@local=nuq3/channel/g32",)"
        R"( "n_layers": 2, "codebooks": []})",
        "kinds.json");
    FAIL() << "kind terms in a calibration file were accepted";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.kind(), kvq::ErrorKind::kParse);
    EXPECT_NE(std::string(e.what()).find("k@local"), std::string::npos) << e.what();
  }
}

TEST(LayerKinds, BindingPrecedence) {
  // layers: 0 local, 1 local (explicit k@1), 2 global, 3 local (skipped, last layer)
  const auto p = parse_policy("kivi2,skip=0:1,k@local=int4/channel/g32,v@global=f16,k@1=int8");
  const auto b = p.bind_layer_kinds({1, 1, 0, 1}, 4);
  EXPECT_FALSE(b.has_kind_terms());
  const auto i2c = parse_quant_config("int2/channel/g32"), i2t = parse_quant_config("int2/token/g32");
  const auto i4c = parse_quant_config("int4/channel/g32"), f16 = parse_quant_config("f16");
  const auto f32 = parse_quant_config("f32"), i8 = parse_quant_config("int8");
  EXPECT_TRUE(same_config(b.key_for(0, 4), i4c));
  EXPECT_TRUE(same_config(b.value_for(0, 4), i2t));
  EXPECT_TRUE(same_config(b.key_for(1, 4), i8));  // k@L wins over the kind term
  EXPECT_TRUE(same_config(b.value_for(1, 4), i2t));
  EXPECT_TRUE(same_config(b.key_for(2, 4), i2c));
  EXPECT_TRUE(same_config(b.value_for(2, 4), f16));
  EXPECT_TRUE(same_config(b.key_for(3, 4), i4c));  // the kind term wins over skip ...
  EXPECT_TRUE(same_config(b.value_for(3, 4), f32));  // ... the half it does not set stays skipped
  // No sliding layers (SmolLM2, llama2.c): every layer is global.
  const auto g = parse_policy("kivi4,v@global=int8/token/g32,k@local=f16").bind_layer_kinds({}, 3);
  for (int l = 0; l < 3; ++l) {
    EXPECT_TRUE(same_config(g.key_for(l, 3), parse_quant_config("int4/channel/g32")));
    EXPECT_TRUE(same_config(g.value_for(l, 3), parse_quant_config("int8/token/g32")));
  }
  // A bound policy is an ordinary one: a cache takes it, and its spec lists the layers.
  kvq::KVCache cache(b, 4, 1, 64);
  EXPECT_TRUE(same_config(cache.policy().key_for(0, 4), i4c));
  EXPECT_NE(b.spec().find("k@0=int4/channel/g32,v@0=int2/token/g32"), std::string::npos) << b.spec();
  EXPECT_EQ(parse_policy("kivi2").bind_layer_kinds({1, 0}, 2), parse_policy("kivi2"));
}

}  // namespace

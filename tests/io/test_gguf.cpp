// GGUF reader: every metadata kind, tensor infos and alignment; each dequantizer against blocks
// built and decoded by hand; hostile files (truncations at every offset, bit flips, bad fields)
// refused with a kvq::Error naming the problem.
#include "kvq/io/gguf.hpp"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "io/gguf_test_util.hpp"

namespace {

using kvq::Error;
using kvq::ErrorKind;
using kvq::io::GgufFile;
using kvq_test::GgufBuilder;

GgufFile parse(const std::vector<uint8_t>& b) { return GgufFile::parse(b.data(), b.size(), "test"); }

/// The error message of parsing b (fails the test when it parses).
std::string parse_error(const std::vector<uint8_t>& b) {
  try {
    parse(b);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kIo) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "parsed without error";
  return "";
}

void put_f16(std::vector<uint8_t>* b, size_t at, uint16_t bits) {
  (*b)[at] = static_cast<uint8_t>(bits & 0xFF);
  (*b)[at + 1] = static_cast<uint8_t>(bits >> 8);
}

std::vector<float> deq(uint32_t type, const std::vector<uint8_t>& block, int64_t n) {
  std::vector<float> y(static_cast<size_t>(n));
  kvq::io::dequantize(type, block.data(), y.data(), n);
  return y;
}

GgufBuilder small_model_file() {
  GgufBuilder g;
  g.str("general.architecture", "llama");
  g.u32("llama.block_count", 2);
  g.strings("tokenizer.ggml.tokens", {"a", "b", "ab"});
  g.tensor_f32("x", {4, 2}, {1, 2, 3, 4, 5, 6, 7, 8});
  g.tensor_f32("y", {3}, {-1, 0, 1});
  return g;
}

// ---------------------------------------------------------------------------------------------
// Structure
// ---------------------------------------------------------------------------------------------

TEST(Gguf, EveryMetadataKindRoundTrips) {
  GgufBuilder g;
  g.u8("u8", 200);
  g.i8("i8", -100);
  g.u16("u16", 60000);
  g.i16("i16", -30000);
  g.u32("u32", 4000000000u);
  g.i32("i32", -2000000000);
  g.f32("f32", 1.5f);
  g.boolean("bool", true);
  g.str("str", "hello");
  g.u64("u64", 1ull << 40);
  g.i64("i64", -(1ll << 40));
  g.f64("f64", -0.25);
  g.strings("strs", {"x", "", "yz"});
  g.i32s("ints", {3, -1, 7});
  g.f32s("floats", {0.5f, -2.0f});
  g.nested_u16("nested", {{1, 2}, {}, {3}});
  const GgufFile f = parse(g.build());
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.metadata_keys().size(), 16u);
  EXPECT_EQ(f.metadata_keys()[0], "u8");
  EXPECT_EQ(f.get_int("u8"), 200);
  EXPECT_EQ(f.get_int("i8"), -100);
  EXPECT_EQ(f.get_int("u16"), 60000);
  EXPECT_EQ(f.get_int("i16"), -30000);
  EXPECT_EQ(f.get_int("u32"), 4000000000ll);
  EXPECT_EQ(f.get_int("i32"), -2000000000);
  EXPECT_EQ(f.get_float("f32"), 1.5);
  EXPECT_TRUE(f.get_bool_or("bool", false));
  EXPECT_EQ(f.get_string("str"), "hello");
  EXPECT_EQ(f.get_int("u64"), 1ll << 40);
  EXPECT_EQ(f.get_int("i64"), -(1ll << 40));
  EXPECT_EQ(f.get_float("f64"), -0.25);
  EXPECT_EQ(f.get_strings("strs"), (std::vector<std::string>{"x", "", "yz"}));
  EXPECT_EQ(f.get_ints("ints"), (std::vector<int64_t>{3, -1, 7}));
  EXPECT_EQ(f.find("floats")->floats(), (std::vector<double>{0.5, -2.0}));
  const auto& nested = f.find("nested")->items;
  ASSERT_EQ(nested.size(), 3u);
  EXPECT_EQ(nested[0].ints(), (std::vector<int64_t>{1, 2}));
  EXPECT_TRUE(nested[1].ints().empty());
  EXPECT_EQ(nested[2].ints(), (std::vector<int64_t>{3}));
  // Typed getters name the key and the actual type.
  EXPECT_THROW(f.get_string("u8"), Error);
  EXPECT_THROW(f.get_int("str"), Error);
  EXPECT_THROW(f.get_int("u8", 0, 100), Error);
  EXPECT_THROW(f.get_strings("ints"), Error);
  try {
    f.get_int("missing.key");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'missing.key' is missing"), std::string::npos);
  }
  EXPECT_EQ(f.get_int_or("missing.key", 7, 0, 10), 7);
}

TEST(Gguf, TensorInfosAndData) {
  const GgufFile f = parse(small_model_file().build());
  ASSERT_EQ(f.tensors().size(), 2u);
  const auto& x = f.tensor("x");
  EXPECT_EQ(x.ne, (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(x.n_elements, 8);
  EXPECT_EQ(x.n_bytes, 32u);
  EXPECT_EQ(x.rows(), 2);
  EXPECT_STREQ(x.type_name(), "F32");
  EXPECT_EQ(f.data_offset() % 32, 0u);
  EXPECT_EQ(f.tensor("y").offset, 32u);  // next aligned offset after x's 32 bytes
  EXPECT_EQ(f.dequantize_tensor("x"), (std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(f.dequantize_tensor("y", {3}), (std::vector<float>{-1, 0, 1}));
  EXPECT_THROW(f.dequantize_tensor("y", {4}), Error);  // shape check names the tensor
  EXPECT_THROW(f.tensor("z"), Error);
  EXPECT_EQ(f.find_tensor("z"), nullptr);
}

TEST(Gguf, CustomAlignmentAndVersion2) {
  GgufBuilder g(2, 64);
  g.u32("general.alignment", 64);
  g.tensor_f32("a", {2}, {1, 2});
  g.tensor_f32("b", {2}, {3, 4});
  const GgufFile f = parse(g.build());
  EXPECT_EQ(f.version(), 2u);
  EXPECT_EQ(f.alignment(), 64u);
  EXPECT_EQ(f.data_offset() % 64, 0u);
  EXPECT_EQ(f.tensor("b").offset, 64u);
  EXPECT_EQ(f.dequantize_tensor("b"), (std::vector<float>{3, 4}));
}

TEST(Gguf, OpenMapsAFileAndDetectsMagic) {
  const auto path = std::filesystem::temp_directory_path() / "kvq_test_gguf_open.gguf";
  const auto bytes = small_model_file().build();
  {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }
  EXPECT_TRUE(GgufFile::is_gguf_file(path.string()));
  const GgufFile f = GgufFile::open(path.string());
  EXPECT_TRUE(f.mapped());
  EXPECT_EQ(f.dequantize_tensor("x")[7], 8.0f);
  std::filesystem::remove(path);
  EXPECT_FALSE(GgufFile::is_gguf_file(path.string()));
  EXPECT_THROW(GgufFile::open(path.string()), Error);
}

// ---------------------------------------------------------------------------------------------
// Dequantization against hand-built blocks (expected values worked out by hand)
// ---------------------------------------------------------------------------------------------

TEST(GgufDequant, F16AndBF16) {
  std::vector<uint8_t> h(6);
  put_f16(&h, 0, 0x3C00);  // 1
  put_f16(&h, 2, 0xC000);  // -2
  put_f16(&h, 4, 0x3800);  // 0.5
  EXPECT_EQ(deq(1, h, 3), (std::vector<float>{1.0f, -2.0f, 0.5f}));
  std::vector<uint8_t> b(4);
  put_f16(&b, 0, 0x3F80);  // bf16 1.0
  put_f16(&b, 2, 0xC040);  // bf16 -3.0
  EXPECT_EQ(deq(30, b, 2), (std::vector<float>{1.0f, -3.0f}));
}

TEST(GgufDequant, Q4_0) {
  std::vector<uint8_t> b(18);
  put_f16(&b, 0, 0x3800);  // d = 0.5
  for (int j = 0; j < 16; ++j) b[2 + j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  const auto y = deq(2, b, 32);
  EXPECT_EQ(y[0], -4.0f);   // (0 - 8) * 0.5
  EXPECT_EQ(y[3], -2.5f);   // (3 - 8) * 0.5
  EXPECT_EQ(y[15], 3.5f);   // (15 - 8) * 0.5
  EXPECT_EQ(y[16], 3.5f);   // high nibble of byte 0: 15
  EXPECT_EQ(y[31], -4.0f);  // high nibble of byte 15: 0
}

TEST(GgufDequant, Q4_1) {
  std::vector<uint8_t> b(20);
  put_f16(&b, 0, 0x3400);  // d = 0.25
  put_f16(&b, 2, 0xBC00);  // m = -1
  for (int j = 0; j < 16; ++j) b[4 + j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  const auto y = deq(3, b, 32);
  EXPECT_EQ(y[0], -1.0f);
  EXPECT_EQ(y[5], 0.25f);
  EXPECT_EQ(y[15], 2.75f);
  EXPECT_EQ(y[16], 2.75f);
  EXPECT_EQ(y[31], -1.0f);
}

TEST(GgufDequant, Q5_0) {
  std::vector<uint8_t> b(22, 0);
  put_f16(&b, 0, 0x3C00);  // d = 1
  const uint32_t qh = (1u << 0) | (1u << 17);  // fifth bits of values 0 and 17
  std::memcpy(&b[2], &qh, 4);
  for (int j = 0; j < 16; ++j) b[6 + j] = 0x88;
  b[6] = 0x21;
  b[7] = 0x43;
  const auto y = deq(6, b, 32);
  EXPECT_EQ(y[0], 1.0f);     // (1 | 16) - 16
  EXPECT_EQ(y[16], -14.0f);  // 2 - 16
  EXPECT_EQ(y[1], -13.0f);   // 3 - 16
  EXPECT_EQ(y[17], 4.0f);    // (4 | 16) - 16
  EXPECT_EQ(y[2], -8.0f);
  EXPECT_EQ(y[18], -8.0f);
}

TEST(GgufDequant, Q5_1) {
  std::vector<uint8_t> b(24, 0);
  put_f16(&b, 0, 0x3800);  // d = 0.5
  put_f16(&b, 2, 0x4000);  // m = 2
  const uint32_t qh = 0x80000001u;  // values 0 and 31
  std::memcpy(&b[4], &qh, 4);
  b[8] = 0x21;
  b[8 + 15] = 0xF0;
  const auto y = deq(7, b, 32);
  EXPECT_EQ(y[0], 10.5f);   // 17 * 0.5 + 2
  EXPECT_EQ(y[16], 3.0f);   // 2 * 0.5 + 2
  EXPECT_EQ(y[15], 2.0f);   // 0 * 0.5 + 2
  EXPECT_EQ(y[31], 17.5f);  // (15 | 16) * 0.5 + 2
  EXPECT_EQ(y[7], 2.0f);
}

TEST(GgufDequant, Q8_0) {
  std::vector<uint8_t> b(34, 0);
  put_f16(&b, 0, 0x3000);  // d = 0.125
  const int8_t q[5] = {-128, -1, 0, 1, 127};
  for (int j = 0; j < 5; ++j) b[2 + j] = static_cast<uint8_t>(q[j]);
  const auto y = deq(8, b, 32);
  EXPECT_EQ(y[0], -16.0f);
  EXPECT_EQ(y[1], -0.125f);
  EXPECT_EQ(y[2], 0.0f);
  EXPECT_EQ(y[3], 0.125f);
  EXPECT_EQ(y[4], 15.875f);
}

/// Q4_K/Q5_K scales: sub-block scales {1, 2, 3, 4, 17, 0, 3, 0}, mins {5, 6, 7, 8, 34, 0, 3, 15}.
void k_scales(std::vector<uint8_t>* b, size_t at) {
  const uint8_t s[12] = {0x41, 2, 3, 4, 0x85, 6, 7, 8, 0x21, 0x00, 0x33, 0xF0};
  for (int i = 0; i < 12; ++i) (*b)[at + i] = s[i];
}

TEST(GgufDequant, Q4_K) {
  std::vector<uint8_t> b(144, 0);
  put_f16(&b, 0, 0x3C00);  // d = 1
  put_f16(&b, 2, 0x3800);  // dmin = 0.5
  k_scales(&b, 4);
  for (int i = 0; i < 128; ++i) b[16 + i] = static_cast<uint8_t>((i % 16) | ((i / 16) << 4));
  const auto y = deq(12, b, 256);
  EXPECT_EQ(y[0], -2.5f);            // scale 1 * 0 - 0.5 * 5
  EXPECT_EQ(y[5], 2.5f);             // 1 * 5 - 2.5
  EXPECT_EQ(y[32 + 17], -1.0f);      // sub-block 1: high nibble of byte 17 = 1; 2 * 1 - 0.5 * 6
  EXPECT_EQ(y[128 + 3], 34.0f);      // sub-block 4: low nibble of byte 67 = 3; 17 * 3 - 0.5 * 34
  EXPECT_EQ(y[160 + 31], 0.0f);      // sub-block 5: scale 0, min 0
  EXPECT_EQ(y[192 + 10], 28.5f);     // sub-block 6: low nibble of byte 106 = 10; 3 * 10 - 1.5
  EXPECT_EQ(y[224 + 20], -7.5f);     // sub-block 7: scale 0, min 15
}

TEST(GgufDequant, Q5_K) {
  std::vector<uint8_t> b(176, 0);
  put_f16(&b, 0, 0x3C00);  // d = 1
  put_f16(&b, 2, 0x3800);  // dmin = 0.5
  k_scales(&b, 4);
  b[16 + 0] = 0x01;   // fifth bit of value 0 of sub-block 0
  b[16 + 17] = 0x02;  // value 17 of sub-block 1
  b[16 + 3] = 0x10;   // value 3 of sub-block 4
  b[16 + 31] = 0x40;  // value 31 of sub-block 6
  for (int i = 0; i < 128; ++i) b[48 + i] = static_cast<uint8_t>((i % 16) | ((i / 16) << 4));
  const auto y = deq(13, b, 256);
  EXPECT_EQ(y[0], 13.5f);         // 1 * (0 + 16) - 2.5
  EXPECT_EQ(y[5], 2.5f);          // no fifth bit
  EXPECT_EQ(y[32 + 17], 31.0f);   // 2 * (1 + 16) - 3
  EXPECT_EQ(y[128 + 3], 306.0f);  // 17 * (3 + 16) - 17
  EXPECT_EQ(y[192 + 31], 91.5f);  // 3 * (15 + 16) - 1.5
  EXPECT_EQ(y[192 + 10], 28.5f);  // 3 * 10 - 1.5
}

TEST(GgufDequant, Q6_K) {
  std::vector<uint8_t> b(210, 0);
  for (int i = 0; i < 128; ++i) b[i] = static_cast<uint8_t>(i);           // ql
  for (int i = 0; i < 64; ++i) b[128 + i] = static_cast<uint8_t>(i);      // qh
  for (int i = 0; i < 16; ++i) b[192 + i] = static_cast<uint8_t>(static_cast<int8_t>(i - 8));
  put_f16(&b, 208, 0x3800);  // d = 0.5
  const auto y = deq(14, b, 256);
  EXPECT_EQ(y[0], 128.0f);     // q = 0 - 32, scale -8: 0.5 * -8 * -32
  EXPECT_EQ(y[37], 33.0f);     // low nibble of ql[37] = 5, bits 2-3 of qh[5] = 1: 21 - 32; scale -6
  EXPECT_EQ(y[84], 22.5f);     // high nibble of ql[20] = 1, bits 4-5 of qh[20] = 1: -15; scale -3
  EXPECT_EQ(y[127], 14.5f);    // high nibble of ql[63] = 3, bits 6-7 of qh[31] = 0: -29; scale -1
  EXPECT_EQ(y[208], 52.5f);    // 2nd half: high nibble of ql[80] = 5, qh[48] bits 4-5 = 3: 21; scale 5
  EXPECT_EQ(y[255], -87.5f);   // high nibble of ql[127] = 7, qh[63] bits 6-7 = 0: -25; scale 7
}

TEST(GgufDequant, QuantizedTensorThroughTheFile) {
  std::vector<uint8_t> blocks(2 * 34, 0);
  put_f16(&blocks, 0, 0x3C00);   // block 0: d = 1
  put_f16(&blocks, 34, 0x4000);  // block 1: d = 2
  blocks[2] = 5;
  blocks[34 + 2 + 31] = static_cast<uint8_t>(-3);
  GgufBuilder g;
  g.tensor("q", {32, 2}, 8, blocks);
  const auto y = parse(g.build()).dequantize_tensor("q", {32, 2});
  EXPECT_EQ(y[0], 5.0f);
  EXPECT_EQ(y[63], -6.0f);
}

TEST(GgufDequant, UnsupportedTypeIsRefusedByName) {
  std::vector<uint8_t> b(84, 0);
  try {
    deq(10, b, 256);  // Q2_K
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("Q2_K"), std::string::npos) << e.what();
  }
  EXPECT_THROW(deq(2, b, 31), Error);  // not a whole block
}

// ---------------------------------------------------------------------------------------------
// Hostile files
// ---------------------------------------------------------------------------------------------

TEST(GgufHostile, BadMagicAndVersion) {
  auto b = small_model_file().build();
  auto m = b;
  m[0] = 'X';
  EXPECT_NE(parse_error(m).find("not a GGUF file"), std::string::npos);
  for (uint32_t v : {1u, 4u, 0xFFFFFFFFu}) {
    auto w = b;
    std::memcpy(&w[4], &v, 4);
    EXPECT_NE(parse_error(w).find("version"), std::string::npos);
  }
  EXPECT_NE(parse_error({'G', 'G'}).find("truncated"), std::string::npos);
}

TEST(GgufHostile, ImpossibleCounts) {
  auto b = small_model_file().build();
  auto t = b;
  const uint64_t huge = 1ull << 60;
  std::memcpy(&t[8], &huge, 8);
  EXPECT_NE(parse_error(t).find("tensor count"), std::string::npos);
  auto m = b;
  std::memcpy(&m[16], &huge, 8);
  EXPECT_NE(parse_error(m).find("metadata count"), std::string::npos);
}

TEST(GgufHostile, HugeStringAndArrayCounts) {
  GgufBuilder g;
  std::vector<uint8_t> e;
  GgufBuilder::string(&e, "k");
  GgufBuilder::pod(&e, uint32_t{8});
  GgufBuilder::pod(&e, uint64_t{1} << 62);  // string length
  g.raw_meta(e);
  EXPECT_NE(parse_error(g.build()).find("length"), std::string::npos);

  GgufBuilder a;
  std::vector<uint8_t> arr;
  GgufBuilder::string(&arr, "arr");
  GgufBuilder::pod(&arr, uint32_t{9});
  GgufBuilder::pod(&arr, uint32_t{8});           // of strings
  GgufBuilder::pod(&arr, uint64_t{1} << 58);     // count
  a.raw_meta(arr);
  const std::string msg = parse_error(a.build());
  EXPECT_NE(msg.find("array count"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'arr'"), std::string::npos) << msg;
}

TEST(GgufHostile, BadValueTypesAndBools) {
  GgufBuilder g;
  std::vector<uint8_t> e;
  GgufBuilder::string(&e, "weird");
  GgufBuilder::pod(&e, uint32_t{13});
  g.raw_meta(e);
  EXPECT_NE(parse_error(g.build()).find("unknown value type 13"), std::string::npos);

  GgufBuilder b;
  std::vector<uint8_t> f;
  GgufBuilder::string(&f, "flag");
  GgufBuilder::pod(&f, uint32_t{7});
  GgufBuilder::pod(&f, uint8_t{2});
  b.raw_meta(f);
  EXPECT_NE(parse_error(b.build()).find("bool"), std::string::npos);

  GgufBuilder d;
  d.u32("dup", 1);
  d.u32("dup", 2);
  EXPECT_NE(parse_error(d.build()).find("duplicate metadata key 'dup'"), std::string::npos);

  GgufBuilder al;
  al.u32("general.alignment", 48);
  EXPECT_NE(parse_error(al.build()).find("power of two"), std::string::npos);
  GgufBuilder al2;
  al2.u64("general.alignment", 32);
  EXPECT_NE(parse_error(al2.build()).find("general.alignment"), std::string::npos);
}

TEST(GgufHostile, DeeplyNestedArrays) {
  GgufBuilder g;
  std::vector<uint8_t> e;
  GgufBuilder::string(&e, "deep");
  GgufBuilder::pod(&e, uint32_t{9});
  for (int i = 0; i < 20; ++i) {  // array of array of array ... (gguf-py layout: no item tags)
    GgufBuilder::pod(&e, uint32_t{9});
    GgufBuilder::pod(&e, uint64_t{1});
  }
  e.resize(e.size() + 64, 0);
  g.raw_meta(e);
  EXPECT_NE(parse_error(g.build()).find("nested deeper"), std::string::npos);
}

TEST(GgufHostile, BadTensorInfos) {
  {  // n_dims 5
    GgufBuilder g;
    g.tensor("t", {1, 1, 1, 1, 1}, 0, std::vector<uint8_t>(4));
    EXPECT_NE(parse_error(g.build()).find("n_dims = 5"), std::string::npos);
  }
  {  // unknown ggml type
    GgufBuilder g;
    g.tensor("t", {32}, 99, std::vector<uint8_t>(64));
    EXPECT_NE(parse_error(g.build()).find("unknown ggml type code 99"), std::string::npos);
  }
  {  // row not a whole number of blocks
    GgufBuilder g;
    g.tensor("t", {33}, 8, std::vector<uint8_t>(68));
    EXPECT_NE(parse_error(g.build()).find("not a multiple of the Q8_0 block"), std::string::npos);
  }
  {  // data past the end of the file
    GgufBuilder g;
    g.tensor("t", {64}, 0, std::vector<uint8_t>(100));
    const std::string m = parse_error(g.build());
    EXPECT_NE(m.find("'t'"), std::string::npos) << m;
    EXPECT_NE(m.find("truncated"), std::string::npos) << m;
  }
  {  // element count overflow
    GgufBuilder g;
    g.tensor("t", {1ull << 40, 1ull << 40}, 0, std::vector<uint8_t>(4));
    EXPECT_NE(parse_error(g.build()).find("overflows"), std::string::npos);
  }
  {  // duplicate tensor name
    GgufBuilder g;
    g.tensor_f32("t", {1}, {1});
    g.tensor_f32("t", {1}, {2});
    EXPECT_NE(parse_error(g.build()).find("duplicate tensor name"), std::string::npos);
  }
}

TEST(GgufHostile, MisalignedAndOverlappingOffsets) {
  GgufBuilder g;
  g.tensor_f32("a", {8}, {0, 1, 2, 3, 4, 5, 6, 7});
  g.tensor_f32("b", {8}, {0, 1, 2, 3, 4, 5, 6, 7});
  const auto good = g.build();
  const GgufFile f = parse(good);
  // Locate b's offset field: the last 8 bytes of the tensor infos, just before the padding.
  // Find it by value: b sits at data offset 32.
  size_t at = 0;
  for (size_t i = 24; i + 8 <= f.data_offset(); ++i) {
    uint64_t v;
    std::memcpy(&v, &good[i], 8);
    if (v == 32) at = i;
  }
  ASSERT_NE(at, 0u);
  auto mis = good;
  const uint64_t four = 4;
  std::memcpy(&mis[at], &four, 8);
  EXPECT_NE(parse_error(mis).find("not a multiple of the alignment"), std::string::npos);
  auto ov = good;
  const uint64_t zero = 0;
  std::memcpy(&ov[at], &zero, 8);
  EXPECT_NE(parse_error(ov).find("overlap"), std::string::npos);
}

/// Every truncation of a valid file is refused cleanly (kvq::Error, no crash, no huge
/// allocation); the sanitizer build checks there is no out-of-bounds read on the way.
TEST(GgufHostile, TruncationAtEveryOffset) {
  const auto b = small_model_file().build();
  for (size_t n = 0; n < b.size(); ++n) {
    std::vector<uint8_t> t(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_THROW(GgufFile::parse(t.data(), t.size()), Error) << "truncated to " << n << " bytes";
  }
  EXPECT_NO_THROW(parse(b));
}

/// Single-bit flips anywhere: the file either still parses (and its tensors stay inside the
/// buffer) or is refused with a kvq::Error.
TEST(GgufHostile, BitFlipsParseOrFailCleanly) {
  const auto b = small_model_file().build();
  int refused = 0, parsed = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      auto m = b;
      m[i] = static_cast<uint8_t>(m[i] ^ (1u << bit));
      try {
        const GgufFile f = GgufFile::parse(m.data(), m.size());
        for (const auto& t : f.tensors()) {
          ASSERT_LE(f.data_offset() + t.offset + t.n_bytes, m.size());
          if (kvq::io::ggml_type_traits(t.type).dequantizable) {
            (void)f.dequantize_tensor(t.name);
          }
        }
        ++parsed;
      } catch (const Error&) {
        ++refused;
      }
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_GT(parsed, 0);  // flips in tensor data or padding leave a valid file
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// A file written by the reference writer (gguf-py 0.19.0, llama.cpp's `gguf` package), not by
// kvq: tests/io/data/make_gguf_py_fixture.py made tests/io/data/gguf_py_arrays.gguf; the
// expected values are the ones that script wrote.

TEST(GgufReference, GgufPyArraysOfArraysAndSmallInts) {
  const GgufFile f = GgufFile::open(std::string(KVQ_SOURCE_DIR) + "/tests/io/data/gguf_py_arrays.gguf");
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_int("x.u32"), 7);
  // [[1, 2], [3, 4, 5], [-6]]: arrays of INT32 arrays (Python ints are INT32 in gguf-py).
  const auto& nested = f.find("x.nested")->items;
  ASSERT_EQ(nested.size(), 3u);
  EXPECT_EQ(nested[0].elem_type, kvq::io::GgufValueType::kI32);
  EXPECT_EQ(nested[0].ints(), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(nested[1].ints(), (std::vector<int64_t>{3, 4, 5}));
  EXPECT_EQ(nested[2].ints(), (std::vector<int64_t>{-6}));
  // [["a"], ["bc", "def"]]
  const auto& ns = f.find("x.nested_str")->items;
  ASSERT_EQ(ns.size(), 2u);
  EXPECT_EQ(ns[0].strings, (std::vector<std::string>{"a"}));
  EXPECT_EQ(ns[1].strings, (std::vector<std::string>{"bc", "def"}));
  // [[[1.5], [2.5, 3.5]], [[4.5]]]: three levels.
  const auto& deep = f.find("x.deep")->items;
  ASSERT_EQ(deep.size(), 2u);
  ASSERT_EQ(deep[0].items.size(), 2u);
  EXPECT_EQ(deep[0].items[0].floats(), (std::vector<double>{1.5}));
  EXPECT_EQ(deep[0].items[1].floats(), (std::vector<double>{2.5, 3.5}));
  ASSERT_EQ(deep[1].items.size(), 1u);
  EXPECT_EQ(deep[1].items[0].floats(), (std::vector<double>{4.5}));
  // A UINT8 array: one byte per element in memory.
  const kvq::io::GgufValue* u8s = f.find("x.u8s");
  ASSERT_NE(u8s, nullptr);
  EXPECT_EQ(u8s->elem_type, kvq::io::GgufValueType::kU8);
  EXPECT_EQ(f.get_ints("x.u8s"), (std::vector<int64_t>{250, 251, 252, 253, 254, 255, 0, 1}));
  EXPECT_EQ(u8s->raw.size(), 8u);
  EXPECT_EQ(f.get_ints("x.bools"), (std::vector<int64_t>{1, 0, 1}));
  EXPECT_EQ(f.get_strings("x.strs"), (std::vector<std::string>{"one", "two"}));
  const auto& t = f.tensor("t");
  EXPECT_EQ(t.ne, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(f.dequantize_tensor("t"), (std::vector<float>{0, 1, 2, 3, 4, 5}));
}

TEST(GgufHostile, LargeU8ArrayCostsItsSize) {
  // 16 MiB of u8 elements: held as 16 MiB (the reader once widened each to int64, 8x, and each
  // nested element cost a ~176-byte value).
  const uint64_t n = uint64_t{16} << 20;
  GgufBuilder g;
  std::vector<uint8_t> e;
  GgufBuilder::string(&e, "big");
  GgufBuilder::pod(&e, uint32_t{9});
  GgufBuilder::pod(&e, uint32_t{0});
  GgufBuilder::pod(&e, n);
  for (uint64_t k = 0; k < n; ++k) e.push_back(static_cast<uint8_t>(k * 7));
  g.raw_meta(e);
  const GgufFile f = parse(g.build());
  const kvq::io::GgufValue* v = f.find("big");
  ASSERT_NE(v, nullptr);
  EXPECT_EQ(v->count, n);
  EXPECT_EQ(v->raw.size(), n);
  EXPECT_LE(v->raw.capacity(), n + 64);
  EXPECT_EQ(v->int_at(12345), static_cast<uint8_t>(12345 * 7));
  EXPECT_EQ(v->int_at(n - 1), static_cast<uint8_t>((n - 1) * 7));
  EXPECT_LT(sizeof(kvq::io::GgufValue), 256u);
}

TEST(GgufHostile, TooManyInnerArraysAreRefused) {
  // 2^16 + 1 empty inner arrays (12 file bytes each) exceed kGgufMaxNestedArrays.
  GgufBuilder g;
  std::vector<uint8_t> e;
  GgufBuilder::string(&e, "many");
  GgufBuilder::pod(&e, uint32_t{9});
  GgufBuilder::pod(&e, uint32_t{9});
  const uint64_t n = kvq::io::kGgufMaxNestedArrays + 1;
  GgufBuilder::pod(&e, n);
  for (uint64_t k = 0; k < n; ++k) {
    GgufBuilder::pod(&e, uint32_t{0});
    GgufBuilder::pod(&e, uint64_t{0});
  }
  g.raw_meta(e);
  EXPECT_NE(parse_error(g.build()).find("inner arrays"), std::string::npos);
}

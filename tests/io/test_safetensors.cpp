// Tests for kvq/io/json.hpp and kvq/io/safetensors.hpp: the strict JSON parser, round trips for
// every dtype with metadata, reading by name, one test per hostile input, and a seeded mutation
// fuzz loop (run under ASan+UBSan in the sanitizer build).
#include <gtest/gtest.h>

#include <algorithm>

#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "io/io_test_util.hpp"
#include "kvq/io/json.hpp"
#include "kvq/io/safetensors.hpp"

namespace {

using kvq::DType;
using kvq::ErrorKind;
using kvq::io::Array;
using kvq::io::Json;
using kvq::io::parse_json;
using kvq::io::read_safetensors_bytes;
using kvq_test::TempDir;

/// A .safetensors image built by hand: length prefix (the header's size unless given), header
/// text, then `data` bytes.
std::vector<uint8_t> st_file(const std::string& header, const std::vector<uint8_t>& data,
                             uint64_t length_field = UINT64_MAX) {
  std::vector<uint8_t> out(8 + header.size() + data.size());
  kvq::io::detail::store_u64le(out.data(),
                               length_field == UINT64_MAX ? header.size() : length_field);
  std::copy(header.begin(), header.end(), out.begin() + 8);
  std::copy(data.begin(), data.end(),
            out.begin() + static_cast<std::ptrdiff_t>(8 + header.size()));
  return out;
}

std::vector<uint8_t> zeros(size_t n) { return std::vector<uint8_t>(n, 0); }

kvq::io::SafetensorsFile parse(const std::vector<uint8_t>& b) {
  return read_safetensors_bytes(b.data(), b.size(), "test.safetensors");
}

std::vector<float> iota(size_t n, float start = 0.f) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = start + static_cast<float>(i) * 0.5f;
  return v;
}

Json pj(const std::string& s) { return parse_json(s, "t.json"); }

#define EXPECT_PARSE_ERROR(stmt, ...) \
  EXPECT_TRUE(::kvq_test::throws_error([&] { stmt; }, ErrorKind::kParse, {__VA_ARGS__}))

// ---------------------------------------------------------------------------------------------
// JSON parser

TEST(Json, ParsesAllValueKinds) {
  const Json j = pj(R"( {"a": [1, -2.5e3, 0, true, false, null], "b": {"c": "d"}, "": {}} )");
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j.keys(), (std::vector<std::string>{"a", "b", ""}));
  const Json& a = *j.find("a");
  ASSERT_EQ(a.size(), 6u);
  EXPECT_EQ(a.items()[0].as_int64(), 1);
  EXPECT_EQ(a.items()[1].number_text(), "-2.5e3");
  EXPECT_FALSE(a.items()[1].as_int64().has_value());
  EXPECT_EQ(a.items()[2].as_int64(), 0);
  EXPECT_TRUE(a.items()[3].as_bool());
  EXPECT_FALSE(a.items()[4].as_bool());
  EXPECT_TRUE(a.items()[5].is_null());
  EXPECT_EQ(j.find("b")->find("c")->as_string(), "d");
  EXPECT_TRUE(j.find("")->is_object());
  EXPECT_EQ(j.find("zz"), nullptr);
  EXPECT_TRUE(kvq_test::throws_error([&] { (void)a.as_string(); }, ErrorKind::kInvalidArgument,
                                     {"an array", "not a string"}));
}

TEST(Json, StringEscapesIncludingSurrogatePairs) {
  const Json j = pj(R"("q\"b\\s\/\b\f\n\r\t \u0041\u00e9\u20ac\ud83d\ude00 \u0000")");
  const std::string expect =
      std::string("q\"b\\s/\b\f\n\r\t A\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80 ") +
      std::string(1, '\0');
  EXPECT_EQ(j.as_string(), expect);
  EXPECT_EQ(pj("\"caf\xc3\xa9 \xf0\x9f\x98\x80\"").as_string(), "caf\xc3\xa9 \xf0\x9f\x98\x80");
}

TEST(Json, Int64Conversions) {
  EXPECT_EQ(pj("9223372036854775807").as_int64(), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(pj("-9223372036854775808").as_int64(), std::numeric_limits<int64_t>::min());
  EXPECT_FALSE(pj("9223372036854775808").as_int64().has_value());
  EXPECT_FALSE(pj("18446744073709551616").as_int64().has_value());
  EXPECT_FALSE(pj("1.0").as_int64().has_value());
  EXPECT_FALSE(pj("1e3").as_int64().has_value());
  EXPECT_EQ(pj("-0").as_int64(), 0);
  EXPECT_FALSE(pj("\"3\"").as_int64().has_value());
}

TEST(Json, QuoteRoundTrips) {
  const std::string s = std::string("a\"b\\c\n\x01\x1f\t/\xc3\xa9", 13) + std::string(1, '\0');
  EXPECT_EQ(pj(kvq::io::json_quote(s)).as_string(), s);
  EXPECT_TRUE(kvq_test::throws_error([] { kvq::io::json_quote("\xff"); },
                                     ErrorKind::kInvalidArgument, {"not valid UTF-8"}));
}

TEST(Json, RejectsMalformedDocuments) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "end of input"},
      {"[1, 2,]", "expected a value"},
      {"{\"a\": 1,}", "expected a string"},
      {"{'a': 1}", "expected a string"},
      {"[01]", "leading zero"},
      {"[1.]", "after a decimal point"},
      {"[.5]", "expected a value"},
      {"[1e]", "in an exponent"},
      {"[-]", "in a number"},
      {"[NaN]", "expected a value"},
      {"[Infinity]", "expected a value"},
      {"[tru]", "expected a value"},
      {"[1] // c", "after the document"},
      {"[1] [2]", "after the document"},
      {"\"abc", "unterminated string"},
      {"\"a\tb\"", "control character"},
      {"\"\\x41\"", "invalid escape"},
      {"\"\\u12zz\"", "bad hex digit"},
      {"\"\\u12", "truncated \\u escape"},
      {"\"\\ud800\"", "unpaired high surrogate"},
      {"\"\\ud800\\u0041\"", "not followed by a low"},
      {"\"\\udc00\"", "unpaired low surrogate"},
      {"\"\xff\"", "invalid UTF-8"},
      {"\"\xc0\xaf\"", "invalid UTF-8"},          // overlong '/'
      {"\"\xed\xa0\x80\"", "invalid UTF-8"},      // encoded surrogate
      {"\"\xf4\x90\x80\x80\"", "invalid UTF-8"},  // above U+10FFFF
      {"\"\xe2\x82\"", "invalid UTF-8"},          // truncated sequence
      {"{\"a\": 1, \"a\": 2}", "duplicate object key 'a'"},
      {"{\"a\" 1}", "expected ':'"},
      {"[1 2]", "expected ']'"},
  };
  for (const auto& [text, why] : cases) {
    EXPECT_PARSE_ERROR(pj(text), "t.json", "invalid JSON at byte", why);
  }
}

TEST(Json, DepthAndValueLimits) {
  const std::string ok = std::string(64, '[') + std::string(64, ']');
  {  // accepted, with all 64 levels there: 63 single-element arrays around an empty one
    const Json j = pj(ok);
    const Json* cur = &j;
    int depth = 0;
    while (cur->is_array() && cur->items().size() == 1) {
      cur = &cur->items()[0];
      ++depth;
    }
    EXPECT_EQ(depth, 63);
    EXPECT_TRUE(cur->is_array() && cur->items().empty());
  }
  const std::string deep = std::string(65, '[') + std::string(65, ']');
  EXPECT_PARSE_ERROR(pj(deep), "deeper than 64");
  const std::string very_deep(100000, '[');  // must not overflow the stack
  EXPECT_PARSE_ERROR(pj(very_deep), "deeper than 64");
  kvq::io::JsonLimits lim;
  lim.max_values = 10;
  {  // 10 values (the array and its 9 numbers): accepted whole
    const Json j = parse_json("[1,2,3,4,5,6,7,8,9]", "t.json", ErrorKind::kParse, lim);
    ASSERT_TRUE(j.is_array());
    ASSERT_EQ(j.items().size(), 9u);
    EXPECT_EQ(j.items()[8].as_int64(), 9);
  }
  EXPECT_PARSE_ERROR(parse_json("[1,2,3,4,5,6,7,8,9,10]", "t.json", ErrorKind::kParse, lim),
                     "more than 10 values");
}

// ---------------------------------------------------------------------------------------------
// Round trips

TEST(Safetensors, RoundTripAllDTypesWithMetadata) {
  TempDir dir;
  std::map<std::string, Array> t;
  t["a.f32"] = Array::from_float(iota(24, -3.f), {2, 3, 4}, DType::kF32);
  t["b.f16"] = Array::from_float(iota(6), {6}, DType::kF16);
  t["c.bf16"] = Array::from_float(iota(10, 1.f), {5, 2}, DType::kBF16);
  t["d.scalar"] = Array::from_float(iota(1, 7.f), {}, DType::kF32);
  t["e.empty"] = Array::from_float(nullptr, {0, 4}, DType::kF16);
  t["f \"quoted\" \xc3\xa9"] = Array::from_float(iota(3), {3}, DType::kBF16);
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "a\nb \"c\""}};

  const auto path = dir / "x.safetensors";
  kvq::io::write_safetensors(path, t, meta);
  const auto f = kvq::io::read_safetensors(path);
  EXPECT_EQ(f.tensors, t);
  EXPECT_EQ(f.metadata, meta);

  const std::vector<uint8_t> enc = kvq::io::encode_safetensors(t, meta);
  EXPECT_EQ(kvq::io::detail::load_u64le(enc.data()) % 8, 0u) << "header padded to 8 bytes";
  const auto g = parse(enc);
  EXPECT_EQ(g.tensors, t);
  EXPECT_EQ(g.metadata, meta);

  EXPECT_EQ(kvq::io::read_safetensors_tensor(path, "c.bf16"), t["c.bf16"]);
  EXPECT_EQ(kvq::io::read_safetensors_tensor(path, "c.bf16").to_float(), iota(10, 1.f));
  const auto h = kvq::io::read_safetensors_header(path);
  ASSERT_EQ(h.tensors.size(), t.size());
  ASSERT_NE(h.find("a.f32"), nullptr);
  EXPECT_EQ(h.find("a.f32")->dtype, "F32");
  EXPECT_EQ(h.find("a.f32")->shape, (std::vector<int64_t>{2, 3, 4}));
  EXPECT_IO_ERROR(kvq::io::read_safetensors_tensor(path, "missing"), "no tensor named 'missing'");
}

TEST(Safetensors, ReadsHandWrittenFileWithPaddingAndAnyKeyOrder) {
  const std::string header =
      R"({ "w": {"data_offsets": [8, 16], "shape": [2], "dtype": "F32"},
           "__metadata__": {"k": "v"},
           "u": {"shape": [2, 2], "dtype": "BF16", "data_offsets": [0, 8]} }       )";
  std::vector<uint8_t> data = {0x80, 0x3f, 0x00, 0x40, 0x40, 0x40, 0x80, 0x40};  // 1 2 3 4 bf16
  const float w[2] = {-1.f, 0.25f};
  data.resize(16);
  std::memcpy(data.data() + 8, w, 8);
  const auto f = parse(st_file(header, data));
  EXPECT_EQ(f.metadata.at("k"), "v");
  EXPECT_EQ(f.tensors.at("u").to_float(), (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(f.tensors.at("w").to_float(), (std::vector<float>{-1.f, 0.25f}));
}

TEST(Safetensors, EmptyFileAndZeroSizeTensors) {
  EXPECT_TRUE(parse(st_file("{}", {})).tensors.empty());
  // Zero-size tensors may share an offset with each other and with the next tensor.
  const auto f = parse(st_file(R"({"a":{"dtype":"F16","shape":[0],"data_offsets":[0,0]},)"
                               R"("b":{"dtype":"F16","shape":[3,0],"data_offsets":[0,0]},)"
                               R"("c":{"dtype":"F16","shape":[1],"data_offsets":[0,2]},)"
                               R"("d":{"dtype":"F32","shape":[0,2],"data_offsets":[2,2]}})",
                               zeros(2)));
  EXPECT_EQ(f.tensors.size(), 4u);
}

TEST(Safetensors, OtherDTypesAreValidatedButOnlyReadableAsError) {
  TempDir dir;
  const std::string header = R"({"ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]},)"
                             R"("x":{"dtype":"F32","shape":[1],"data_offsets":[16,20]}})";
  const auto file = st_file(header, zeros(20));
  EXPECT_IO_ERROR(parse(file), "test.safetensors", "tensor 'ids'", "dtype 'I64'",
                  "only F32, F16 and BF16");
  kvq_test::write_bytes(dir / "m.safetensors", file);
  EXPECT_EQ(kvq::io::read_safetensors_tensor(dir / "m.safetensors", "x").to_float(),
            std::vector<float>{0.f});
  EXPECT_IO_ERROR(kvq::io::read_safetensors_tensor(dir / "m.safetensors", "ids"), "'ids'", "I64");
}

TEST(Safetensors, WriterRejectsBadInput) {
  std::map<std::string, Array> t;
  t["__metadata__"] = Array::from_float(iota(1), {1}, DType::kF32);
  EXPECT_TRUE(kvq_test::throws_error([&] { kvq::io::encode_safetensors(t); },
                                     ErrorKind::kInvalidArgument, {"reserved"}));
  t.clear();
  t["\xff"] = Array::from_float(iota(1), {1}, DType::kF32);
  EXPECT_TRUE(kvq_test::throws_error([&] { kvq::io::encode_safetensors(t); },
                                     ErrorKind::kInvalidArgument, {"UTF-8"}));
  t.clear();
  Array bad = Array::from_float(iota(4), {4}, DType::kF32);
  bad.bytes.pop_back();
  t["bad"] = bad;
  EXPECT_TRUE(kvq_test::throws_error([&] { kvq::io::encode_safetensors(t); },
                                     ErrorKind::kInvalidArgument, {"'bad'", "payload has 15"}));
}

TEST(Safetensors, MissingFile) {
  TempDir dir;
  EXPECT_IO_ERROR(kvq::io::read_safetensors(dir / "none.safetensors"), "none.safetensors",
                  "no such file");
}

// ---------------------------------------------------------------------------------------------
// Hostile input: one test per case.

const std::string kOne = R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";

std::string entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  const std::string& offsets) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape +
         ",\"data_offsets\":" + offsets + "}";
}

TEST(SafetensorsHostile, FileShorterThanLengthPrefix) {
  const auto f = st_file(kOne, zeros(8));
  for (size_t n = 0; n < 8; ++n) {
    EXPECT_IO_ERROR(read_safetensors_bytes(f.data(), n, "s.st"), "s.st", "too short");
  }
}

TEST(SafetensorsHostile, HeaderLengthPastEndOfFile) {
  EXPECT_IO_ERROR(parse(st_file(kOne, zeros(8), kOne.size() + 9)), "header length", "past the end");
}

TEST(SafetensorsHostile, HeaderLengthAbsurd) {
  EXPECT_IO_ERROR(parse(st_file(kOne, zeros(8), 100'000'001)), "header length 100000001",
                  "limit of 100000000");
  EXPECT_IO_ERROR(parse(st_file(kOne, zeros(8), UINT64_MAX - 1)), "exceeds the limit");
}

TEST(SafetensorsHostile, HeaderLengthZero) {
  EXPECT_IO_ERROR(parse(st_file("", {})), "header length is 0");
}

TEST(SafetensorsHostile, HeaderNotAnObject) {
  EXPECT_IO_ERROR(parse(st_file("[1, 2]", {})), "does not start with '{'", "0x5b");
  EXPECT_IO_ERROR(parse(st_file(" {}", {})), "does not start with '{'");
}

TEST(SafetensorsHostile, InvalidJson) {
  EXPECT_IO_ERROR(parse(st_file(R"({"t":{"dtype":"F32",}})", {})), "test.safetensors: header",
                  "invalid JSON at byte 20");
  EXPECT_IO_ERROR(parse(st_file(R"({} x)", {})), "after the header object");
  EXPECT_IO_ERROR(
      parse(st_file(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", zeros(8))),
      "expected '}'");
  EXPECT_IO_ERROR(parse(st_file("{\"t\xff\":1}", {})), "invalid UTF-8");
}

TEST(SafetensorsHostile, EntryNotAnObject) {
  EXPECT_IO_ERROR(parse(st_file(R"({"t":[1,2]})", {})), "tensor 't'", "entry is an array");
}

TEST(SafetensorsHostile, DataOffsetsOutOfBounds) {
  EXPECT_IO_ERROR(parse(st_file("{" + entry("t", "F32", "[2]", "[0,8]") + "}", zeros(4))),
                  "tensor 't'", "data_offsets [0, 8]", "exceed the data buffer of 4 bytes");
}

TEST(SafetensorsHostile, DataOffsetsEndBeforeBegin) {
  EXPECT_IO_ERROR(parse(st_file("{" + entry("t", "F32", "[0]", "[8,0]") + "}", zeros(8))),
                  "tensor 't'", "data_offsets [8, 0]", "end < begin");
}

TEST(SafetensorsHostile, DataOffsetsOverlap) {
  EXPECT_IO_ERROR(parse(st_file("{" + entry("a", "F32", "[2]", "[0,8]") + "," +
                                    entry("b", "F32", "[2]", "[4,12]") + "}",
                                zeros(12))),
                  "tensor 'b'", "[4, 12]", "overlap tensor 'a' at [0, 8]");
  // Two tensors on the very same bytes.
  EXPECT_IO_ERROR(parse(st_file("{" + entry("a", "F32", "[2]", "[0,8]") + "," +
                                    entry("b", "F32", "[2]", "[0,8]") + "}",
                                zeros(8))),
                  "overlap");
}

TEST(SafetensorsHostile, DataOffsetsLeaveGap) {
  EXPECT_IO_ERROR(parse(st_file("{" + entry("a", "F32", "[1]", "[0,4]") + "," +
                                    entry("b", "F32", "[1]", "[8,12]") + "}",
                                zeros(12))),
                  "tensor 'b'", "gap of 4 unused bytes at buffer offset 4");
  EXPECT_IO_ERROR(parse(st_file("{" + entry("a", "F32", "[1]", "[4,8]") + "}", zeros(8))),
                  "tensor 'a'", "gap of 4");
}

TEST(SafetensorsHostile, TrailingBytesInBuffer) {
  EXPECT_IO_ERROR(parse(st_file(kOne, zeros(12))), "data buffer has 12 bytes", "cover only 8");
}

TEST(SafetensorsHostile, TruncatedData) {
  const auto f = st_file(kOne, zeros(8));
  EXPECT_IO_ERROR(read_safetensors_bytes(f.data(), f.size() - 1, "cut.st"), "cut.st", "tensor 't'",
                  "exceed the data buffer of 7 bytes");
}

TEST(SafetensorsHostile, TruncatedFileOnDisk) {
  TempDir dir;
  auto f = st_file(kOne, zeros(8));
  f.resize(f.size() - 2);
  kvq_test::write_bytes(dir / "cut.safetensors", f);
  EXPECT_IO_ERROR(kvq::io::read_safetensors(dir / "cut.safetensors"), "cut.safetensors",
                  "exceed the data buffer");
}

TEST(SafetensorsHostile, OffsetsDoNotMatchShape) {
  EXPECT_IO_ERROR(parse(st_file("{" + entry("t", "F32", "[3]", "[0,8]") + "}", zeros(8))),
                  "tensor 't'", "data_offsets [0, 8] span 8 bytes", "shape [3] of F32 needs 12");
  EXPECT_IO_ERROR(parse(st_file("{" + entry("t", "BF16", "[2,2]", "[0,16]") + "}", zeros(16))),
                  "shape [2, 2] of BF16 needs 8");
}

TEST(SafetensorsHostile, NegativeShapeEntry) {
  EXPECT_IO_ERROR(parse(st_file("{" + entry("t", "F32", "[2,-1]", "[0,0]") + "}", {})),
                  "tensor 't'", "field 'shape' entry 1 is -1", ">= 0");
}

TEST(SafetensorsHostile, NonIntegerShapeEntry) {
  EXPECT_IO_ERROR(parse(st_file("{" + entry("t", "F32", "[2.5]", "[0,0]") + "}", {})), "tensor 't'",
                  "field 'shape' entry 0 is 2.5", "not an integer");
  EXPECT_IO_ERROR(parse(st_file("{" + entry("t", "F32", "[1e1]", "[0,40]") + "}", zeros(40))),
                  "entry 0 is 1e1");
  EXPECT_IO_ERROR(parse(st_file("{" + entry("t", "F32", "[\"2\"]", "[0,8]") + "}", zeros(8))),
                  "entry 0 is a string");
  EXPECT_IO_ERROR(parse(st_file("{" + entry("t", "F32", "[null]", "[0,8]") + "}", zeros(8))),
                  "entry 0 is null");
  EXPECT_IO_ERROR(
      parse(st_file("{" + entry("t", "F32", "[18446744073709551616]", "[0,8]") + "}", zeros(8))),
      "entry 0 is 18446744073709551616", "fits in int64");
  EXPECT_IO_ERROR(parse(st_file("{" + entry("t", "F32", "2", "[0,8]") + "}", zeros(8))),
                  "field 'shape' is a number, not an array");
}

TEST(SafetensorsHostile, ShapeProductOverflow) {
  EXPECT_IO_ERROR(
      parse(st_file("{" + entry("t", "F32", "[4294967296,4294967296]", "[0,8]") + "}", zeros(8))),
      "tensor 't'", "overflows int64");
  // 2^62 elements fit, 2^62 * 4 bytes do not.
  EXPECT_IO_ERROR(
      parse(st_file("{" + entry("t", "F32", "[4611686018427387904]", "[0,8]") + "}", zeros(8))),
      "tensor 't'", "overflow int64");
  EXPECT_IO_ERROR(
      parse(st_file("{" + entry("t", "F32", "[0,4294967296,4294967296]", "[0,0]") + "}", {})),
      "overflows int64");
}

TEST(SafetensorsHostile, NegativeOrNonIntegerOffsets) {
  EXPECT_IO_ERROR(parse(st_file("{" + entry("t", "F32", "[2]", "[-8,0]") + "}", zeros(8))),
                  "field 'data_offsets' entry 0 is -8");
  EXPECT_IO_ERROR(parse(st_file("{" + entry("t", "F32", "[2]", "[0,8.0]") + "}", zeros(8))),
                  "field 'data_offsets' entry 1 is 8.0");
  EXPECT_IO_ERROR(parse(st_file("{" + entry("t", "F32", "[2]", "[0]") + "}", zeros(8))),
                  "must be an array [begin, end], got an array of 1");
  EXPECT_IO_ERROR(parse(st_file("{" + entry("t", "F32", "[2]", "[0,4,8]") + "}", zeros(8))),
                  "an array of 3");
  EXPECT_IO_ERROR(parse(st_file("{" + entry("t", "F32", "[2]", "{}") + "}", zeros(8))),
                  "got an object");
}

TEST(SafetensorsHostile, DuplicateTensorName) {
  EXPECT_IO_ERROR(parse(st_file("{" + entry("t", "F32", "[1]", "[0,4]") + "," +
                                    entry("t", "F32", "[1]", "[4,8]") + "}",
                                zeros(8))),
                  "duplicate tensor name 't'");
}

TEST(SafetensorsHostile, UnsupportedDType) {
  EXPECT_IO_ERROR(parse(st_file("{" + entry("ids", "I32", "[2]", "[0,8]") + "}", zeros(8))),
                  "tensor 'ids'", "dtype 'I32'");
}

TEST(SafetensorsHostile, UnknownDType) {
  EXPECT_IO_ERROR(parse(st_file("{" + entry("t", "Q4_0", "[2]", "[0,8]") + "}", zeros(8))),
                  "tensor 't'", "unknown dtype 'Q4_0'");
  EXPECT_IO_ERROR(
      parse(st_file(R"({"t":{"dtype":32,"shape":[2],"data_offsets":[0,8]}})", zeros(8))),
      "field 'dtype' is a number");
}

TEST(SafetensorsHostile, MissingField) {
  EXPECT_IO_ERROR(parse(st_file(R"({"t":{"dtype":"F32","data_offsets":[0,8]}})", zeros(8))),
                  "tensor 't'", "missing field 'shape'");
  EXPECT_IO_ERROR(parse(st_file(R"({"t":{"dtype":"F32","shape":[2]}})", zeros(8))),
                  "missing field 'data_offsets'");
  EXPECT_IO_ERROR(parse(st_file(R"({"t":{"shape":[2],"data_offsets":[0,8]}})", zeros(8))),
                  "missing field 'dtype'");
}

TEST(SafetensorsHostile, UnknownField) {
  EXPECT_IO_ERROR(
      parse(st_file(R"({"t":{"dtype":"F32","shape":[2],"data_offset":[0,8],"data_offsets":[0,8]}})",
                    zeros(8))),
      "tensor 't'", "unknown field 'data_offset'");
}

TEST(SafetensorsHostile, DuplicateFieldInEntry) {
  EXPECT_IO_ERROR(
      parse(st_file(R"({"t":{"dtype":"F32","shape":[2],"shape":[2],"data_offsets":[0,8]}})",
                    zeros(8))),
      "duplicate object key 'shape'");
}

TEST(SafetensorsHostile, BadMetadata) {
  EXPECT_IO_ERROR(parse(st_file(R"({"__metadata__":{"a":1}})", {})),
                  "'__metadata__' value of 'a' is a number");
  EXPECT_IO_ERROR(parse(st_file(R"({"__metadata__":["a"]})", {})), "'__metadata__' is an array");
  EXPECT_IO_ERROR(parse(st_file(R"({"__metadata__":{},"__metadata__":{}})", {})),
                  "duplicate '__metadata__'");
}

TEST(SafetensorsHostile, RankAboveLimit) {
  std::string shape = "[";
  for (int i = 0; i < 65; ++i) shape += i ? ",1" : "1";
  shape += "]";
  EXPECT_IO_ERROR(parse(st_file("{" + entry("t", "F32", shape, "[0,4]") + "}", zeros(4))),
                  "field 'shape' has 65 entries");
}

TEST(SafetensorsHostile, DeepNestingAndHugeEntries) {
  EXPECT_IO_ERROR(parse(st_file("{\"t\":" + std::string(10000, '[') + "}", {})), "deeper than 64");
  std::string big = "{\"t\":[";
  for (int i = 0; i < 70000; ++i) big += i ? ",0" : "0";
  big += "]}";
  EXPECT_IO_ERROR(parse(st_file(big, {})), "more than 65536 values");
}

TEST(SafetensorsHostile, HostileNamesArePrintedSafely) {
  // A control character and a quote in the name come out escaped in the message.
  EXPECT_IO_ERROR(parse(st_file("{" + entry("a\\u0001'", "F32", "[3]", "[0,8]") + "}", zeros(8))),
                  "tensor 'a\\x01\\''");
}

// ---------------------------------------------------------------------------------------------
// Fuzz

TEST(SafetensorsFuzz, MutatedFilesParseOrThrowKvqError) {
  std::map<std::string, Array> t;
  t["layers.0.k"] = Array::from_float(iota(8), {2, 1, 4}, DType::kF16);
  t["w"] = Array::from_float(iota(3), {3}, DType::kF32);
  t["z"] = Array::from_float(iota(2), {1, 2}, DType::kBF16);
  std::vector<std::vector<uint8_t>> seeds;
  seeds.push_back(kvq::io::encode_safetensors(t, {{"format", "pt"}}));
  seeds.push_back(
      st_file(R"({ "a": {"shape": [2], "dtype": "BF16", "data_offsets": [0, 4]}, "b\u00e9": )"
              R"({"dtype": "F32", "shape": [], "data_offsets": [4, 8]} })",
              zeros(8)));
  const int ok = kvq_test::fuzz(seeds, 3000, 777, [](const std::vector<uint8_t>& b) {
    const auto f = read_safetensors_bytes(b.data(), b.size(), "fuzz.safetensors");
    for (const auto& kv : f.tensors) {
      try {
        kv.second.validate();
      } catch (const kvq::Error& e) {
        ADD_FAILURE() << "parsed tensor is inconsistent: " << e.what();
      }
    }
  });
  EXPECT_GT(ok, 0);
}

TEST(SafetensorsFuzz, EveryTruncationOfAValidFileThrows) {
  std::map<std::string, Array> t;
  t["a"] = Array::from_float(iota(6), {2, 3}, DType::kF16);
  const auto f = kvq::io::encode_safetensors(t);
  for (size_t n = 0; n < f.size(); ++n) {
    EXPECT_IO_ERROR(read_safetensors_bytes(f.data(), n, "cut.st"), "cut.st");
  }
  const auto whole = read_safetensors_bytes(f.data(), f.size(), "cut.st");
  ASSERT_EQ(whole.tensors.size(), 1u);
  const Array& a = whole.tensors.at("a");
  EXPECT_EQ(a.dtype, DType::kF16);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a.to_float(), iota(6));
}

}  // namespace

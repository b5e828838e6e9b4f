// Tests for kvq/io/npy.hpp: round trips for every dtype and format version, the header
// parser's tolerance, Fortran order, the bf16 conventions, one test per hostile input, and a
// seeded mutation fuzz loop (run under ASan+UBSan in the sanitizer build).
#include <gtest/gtest.h>

#include <algorithm>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "io/io_test_util.hpp"
#include "kvq/core/half.hpp"
#include "kvq/io/npy.hpp"

namespace {

using kvq::DType;
using kvq::ErrorKind;
using kvq::io::Array;
using kvq::io::NpyReadOptions;
using kvq::io::read_npy;
using kvq::io::read_npy_bytes;
using kvq_test::TempDir;

/// A .npy file built by hand: magic, version, length field, `dict` padded with spaces to a
/// 64-byte boundary and terminated by '\n' (unless pad is false), then `data`.
std::vector<uint8_t> npy_file(int major, const std::string& dict, const std::vector<uint8_t>& data,
                              bool pad = true, int minor = 0) {
  const size_t len_bytes = major == 1 ? 2 : 4;
  std::string header = dict;
  if (pad) {
    const size_t pre = 8 + len_bytes;
    while ((pre + header.size() + 1) % 64 != 0) header += ' ';
    header += '\n';
  }
  std::vector<uint8_t> out(8 + len_bytes + header.size() + data.size());
  const uint8_t magic[8] = {0x93, 'N', 'U', 'M', 'P', 'Y', static_cast<uint8_t>(major),
                            static_cast<uint8_t>(minor)};
  std::copy(magic, magic + 8, out.begin());
  for (size_t i = 0; i < len_bytes; ++i) {
    out[8 + i] = static_cast<uint8_t>(header.size() >> (8 * i));
  }
  std::copy(header.begin(), header.end(), out.begin() + static_cast<std::ptrdiff_t>(8 + len_bytes));
  std::copy(data.begin(), data.end(),
            out.begin() + static_cast<std::ptrdiff_t>(8 + len_bytes + header.size()));
  return out;
}

std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 4);
  if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

std::vector<float> iota(size_t n, float start = 0.f) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = start + static_cast<float>(i);
  return v;
}

Array parse(const std::vector<uint8_t>& b, const NpyReadOptions& opt = {}) {
  return read_npy_bytes(b.data(), b.size(), opt, "test.npy");
}

std::vector<float> kv_like(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 3.f);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// ---------------------------------------------------------------------------------------------
// Round trips

class NpyRoundTrip : public ::testing::TestWithParam<DType> {};

TEST_P(NpyRoundTrip, FileRoundTripMatchesRounding) {
  TempDir dir;
  const DType dt = GetParam();
  const std::vector<int64_t> shape = {7, 3, 16};
  const std::vector<float> x = kv_like(7 * 3 * 16, 1);
  const auto path = dir / "a.npy";
  kvq::io::write_npy(path, x.data(), shape, dt);
  const Array a = read_npy(path);
  EXPECT_EQ(a.dtype, dt);
  EXPECT_EQ(a.shape, shape);
  const std::vector<float> y = a.to_float();
  ASSERT_EQ(y.size(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    float expect = x[i];
    if (dt == DType::kF16) expect = kvq::half_bits_to_float(kvq::float_to_half_bits(x[i]));
    if (dt == DType::kBF16) expect = kvq::bf16_bits_to_float(kvq::float_to_bf16_bits(x[i]));
    ASSERT_EQ(y[i], expect) << "element " << i;
  }
}

TEST_P(NpyRoundTrip, EveryVersionIsBitExact) {
  const DType dt = GetParam();
  // Specials survive as bits: NaN payload, infinities, signed zero, subnormals.
  Array a;
  a.dtype = dt;
  a.shape = {2, 5};
  std::mt19937 rng(7);
  a.bytes.resize(10 * static_cast<size_t>(kvq::dtype_size(dt)));
  for (auto& b : a.bytes) b = static_cast<uint8_t>(rng());
  if (dt != DType::kF32) {  // a quiet NaN and -inf in the first two elements
    const uint16_t nan = dt == DType::kF16 ? 0x7e01 : 0x7fc1;
    const uint16_t ninf = dt == DType::kF16 ? 0xfc00 : 0xff80;
    kvq::io::detail::store_u16le(a.bytes.data(), nan);
    kvq::io::detail::store_u16le(a.bytes.data() + 2, ninf);
  }
  for (int version : {0, 1, 2, 3}) {
    const std::vector<uint8_t> enc = kvq::io::encode_npy(a, version);
    EXPECT_EQ(enc[6], version == 0 ? 1 : version);
    const size_t len_bytes = enc[6] == 1 ? 2 : 4;
    const size_t hlen = enc[6] == 1 ? kvq::io::detail::load_u16le(enc.data() + 8)
                                    : kvq::io::detail::load_u32le(enc.data() + 8);
    EXPECT_EQ((8 + len_bytes + hlen) % 64, 0u) << "data must start 64-byte aligned";
    EXPECT_EQ(enc[8 + len_bytes + hlen - 1], '\n');
    EXPECT_EQ(parse(enc), a) << "version " << version;
  }
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, NpyRoundTrip,
                         ::testing::Values(DType::kF32, DType::kF16, DType::kBF16),
                         [](const auto& info) { return std::string(kvq::to_string(info.param)); });

TEST(Npy, WriterUsesNumpyHeaderAndBf16AsV2) {
  const Array a = Array::from_float(iota(6), {2, 3}, DType::kBF16);
  const std::vector<uint8_t> enc = kvq::io::encode_npy(a);
  const std::string text(enc.begin() + 10, enc.begin() + 10 + 59);
  EXPECT_EQ(text, "{'descr': '<V2', 'fortran_order': False, 'shape': (2, 3), }");
  const Array one = Array::from_float(iota(4), {4}, DType::kF32);
  const std::vector<uint8_t> e1 = kvq::io::encode_npy(one);
  EXPECT_NE(std::string(e1.begin(), e1.end()).find("'shape': (4,), }"), std::string::npos);
  const Array scalar = Array::from_float(iota(1), {}, DType::kF16);
  const std::vector<uint8_t> e0 = kvq::io::encode_npy(scalar);
  EXPECT_NE(std::string(e0.begin(), e0.end()).find("'<f2', 'fortran_order': False, 'shape': (), }"),
            std::string::npos);
  EXPECT_EQ(parse(e0), scalar);
}

TEST(Npy, HandWrittenVersions1To3) {
  const std::vector<float> x = iota(12, -3.f);
  const std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }";
  for (int major : {1, 2, 3}) {
    const Array a = parse(npy_file(major, dict, f32_bytes(x)));
    EXPECT_EQ(a.dtype, DType::kF32);
    EXPECT_EQ(a.shape, (std::vector<int64_t>{3, 4}));
    EXPECT_EQ(a.to_float(), x) << "version " << major;
  }
  // Version 3 allows UTF-8 in the header; an unpadded header without '\n' is tolerated too.
  const Array b = parse(npy_file(3, dict + " ", f32_bytes(x), /*pad=*/false));
  EXPECT_EQ(b.to_float(), x);
}

TEST(Npy, HeaderParserIsTolerantOfSpacingOrderAndSpelling) {
  const std::vector<float> x = iota(6);
  const std::vector<std::string> dicts = {
      "{'shape': (2, 3), 'fortran_order': False, 'descr': '<f4'}",
      "{\"descr\":\"<f4\",\"fortran_order\":False,\"shape\":(2,3)}",
      "{ 'descr' : '<f4' ,\n\t'fortran_order' : False , 'shape' : ( 2 , 3 , ) , }",
      "{'descr': '<f4', 'fortran_order': False, 'shape': (2L, 3L), }",  // Python 2 longs
      "{'descr': '<f4', 'fortran_order': False, 'shape': (+2, 3)}",
  };
  for (const auto& d : dicts) {
    const Array a = parse(npy_file(1, d, f32_bytes(x)));
    EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3})) << d;
    EXPECT_EQ(a.to_float(), x) << d;
  }
}

TEST(Npy, ScalarEmptyAndOneDimensionalShapes) {
  EXPECT_EQ(
      parse(npy_file(1, "{'descr': '<f4', 'fortran_order': False, 'shape': ()}", f32_bytes({2.5f})))
          .to_float(),
      std::vector<float>{2.5f});
  const Array e =
      parse(npy_file(1, "{'descr': '<f2', 'fortran_order': False, 'shape': (0, 5)}", {}));
  EXPECT_EQ(e.shape, (std::vector<int64_t>{0, 5}));
  EXPECT_TRUE(e.bytes.empty());
  const Array v = parse(
      npy_file(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,)}", f32_bytes(iota(3))));
  EXPECT_EQ(v.shape, (std::vector<int64_t>{3}));
}

TEST(Npy, FortranOrderIsTransposedToCOrder) {
  // 2x3: C order [[0,1,2],[3,4,5]] is stored column-major as 0,3,1,4,2,5.
  const Array a = parse(npy_file(1, "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3)}",
                                 f32_bytes({0, 3, 1, 4, 2, 5})));
  EXPECT_EQ(a.to_float(), iota(6));
  // Rank 3: element (i,j,k) at Fortran offset i + 2j + 6k holds the C index 12i + 4j + k.
  std::vector<float> fdata(24);
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 3; ++j) {
      for (int k = 0; k < 4; ++k) fdata[i + 2 * j + 6 * k] = static_cast<float>(12 * i + 4 * j + k);
    }
  }
  const Array b = parse(
      npy_file(2, "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3, 4)}", f32_bytes(fdata)));
  EXPECT_EQ(b.shape, (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(b.to_float(), iota(24));
  // f16, rank 1 (order is irrelevant) and an empty array.
  const Array c = parse(npy_file(1, "{'descr': '<f2', 'fortran_order': True, 'shape': (2,)}",
                                 {0x00, 0x3c, 0x00, 0x40}));
  EXPECT_EQ(c.to_float(), (std::vector<float>{1.f, 2.f}));
  EXPECT_TRUE(parse(npy_file(1, "{'descr': '<f2', 'fortran_order': True, 'shape': (3, 0)}", {}))
                  .bytes.empty());
}

TEST(Npy, FortranOrderFromFile) {
  TempDir dir;
  kvq_test::write_bytes(dir / "f.npy",
                        npy_file(3, "{'descr': '<f4', 'fortran_order': True, 'shape': (3, 2)}",
                                 f32_bytes({0, 2, 4, 1, 3, 5})));
  const Array a = read_npy(dir / "f.npy");
  EXPECT_EQ(a.shape, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(a.to_float(), iota(6));
}

TEST(Npy, Bf16Conventions) {
  // bf16 bits of 1.0 and -2.0.
  const std::vector<uint8_t> data = {0x80, 0x3f, 0x00, 0xc0};
  for (const char* descr : {"<V2", "|V2", "bfloat16"}) {
    const Array a = parse(npy_file(
        1, std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (2,)}", data));
    EXPECT_EQ(a.dtype, DType::kBF16) << descr;
    EXPECT_EQ(a.to_float(), (std::vector<float>{1.f, -2.f})) << descr;
  }
  NpyReadOptions raw;
  raw.raw_u16_as_bf16 = true;
  for (const char* descr : {"<u2", "<i2"}) {
    const auto file = npy_file(
        1, std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (2,)}", data);
    EXPECT_IO_ERROR(parse(file), "test.npy", descr, "raw_u16_as_bf16");
    const Array a = parse(file, raw);
    EXPECT_EQ(a.dtype, DType::kBF16);
    EXPECT_EQ(a.to_float(), (std::vector<float>{1.f, -2.f}));
  }
}

TEST(Npy, MissingFileAndDirectory) {
  TempDir dir;
  EXPECT_IO_ERROR(read_npy(dir / "nope.npy"), "nope.npy", "no such file");
  EXPECT_IO_ERROR(read_npy(dir.path()), "directory");
}

TEST(Npy, WriterRejectsInconsistentArrays) {
  Array a;
  a.dtype = DType::kF32;
  a.shape = {2, 2};
  a.bytes.resize(12);
  EXPECT_TRUE(kvq_test::throws_error([&] { kvq::io::encode_npy(a); }, ErrorKind::kInvalidArgument,
                                     {"[2, 2]", "12"}));
  Array deep;
  deep.shape.assign(65, 1);
  deep.bytes.resize(4);
  EXPECT_TRUE(kvq_test::throws_error([&] { kvq::io::encode_npy(deep); },
                                     ErrorKind::kInvalidArgument, {"rank 65"}));
  EXPECT_TRUE(kvq_test::throws_error(
      [&] { kvq::io::encode_npy(Array::from_float(iota(1), {1}, DType::kF32), 4); },
      ErrorKind::kInvalidArgument, {"version 4"}));
}

// ---------------------------------------------------------------------------------------------
// Hostile input: one test per case.

const std::string kGoodDict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), }";

TEST(NpyHostile, WrongMagic) {
  auto f = npy_file(1, kGoodDict, f32_bytes(iota(4)));
  f[1] = 'X';
  EXPECT_IO_ERROR(parse(f), "test.npy", "magic", "93 58 55 4d 50 59");
}

TEST(NpyHostile, FileShorterThanPreamble) {
  const auto f = npy_file(1, kGoodDict, f32_bytes(iota(4)));
  for (size_t n = 0; n < 10; ++n) {
    EXPECT_IO_ERROR(read_npy_bytes(f.data(), n, {}, "short.npy"), "short.npy");
  }
}

TEST(NpyHostile, UnknownVersion) {
  EXPECT_IO_ERROR(parse(npy_file(4, kGoodDict, f32_bytes(iota(4)))), "version 4.0");
  EXPECT_IO_ERROR(parse(npy_file(1, kGoodDict, f32_bytes(iota(4)), true, 1)), "version 1.1");
  auto f = npy_file(1, kGoodDict, f32_bytes(iota(4)));
  f[6] = 0;
  EXPECT_IO_ERROR(parse(f), "version 0.0");
}

TEST(NpyHostile, HeaderLengthPastEndOfFile) {
  auto f = npy_file(1, kGoodDict, {});
  kvq::io::detail::store_u16le(f.data() + 8, static_cast<uint16_t>(f.size()));
  EXPECT_IO_ERROR(parse(f), "header length", "past the end");
}

TEST(NpyHostile, HeaderLengthAbsurd) {
  auto f = npy_file(2, kGoodDict, f32_bytes(iota(4)));
  kvq::io::detail::store_u32le(f.data() + 8, 0xffffffffu);
  EXPECT_IO_ERROR(parse(f), "header length 4294967295", "limit");
  kvq::io::detail::store_u32le(f.data() + 8, 70000);
  EXPECT_IO_ERROR(parse(f), "header length 70000", "limit");
}

TEST(NpyHostile, TruncatedData) {
  const auto f = npy_file(1, kGoodDict, f32_bytes(iota(4)));
  EXPECT_IO_ERROR(read_npy_bytes(f.data(), f.size() - 1, {}, "t.npy"), "t.npy", "truncated",
                  "needs 16 data bytes", "has 15");
  // Truncated inside the header.
  EXPECT_IO_ERROR(read_npy_bytes(f.data(), 40, {}, "t.npy"), "past the end");
}

TEST(NpyHostile, TruncatedFileOnDisk) {
  TempDir dir;
  auto f = npy_file(1, kGoodDict, f32_bytes(iota(4)));
  f.resize(f.size() - 3);
  kvq_test::write_bytes(dir / "cut.npy", f);
  EXPECT_IO_ERROR(read_npy(dir / "cut.npy"), "cut.npy", "truncated");
}

TEST(NpyHostile, TrailingBytesAfterData) {
  auto f = npy_file(1, kGoodDict, f32_bytes(iota(5)));
  EXPECT_IO_ERROR(parse(f), "4 unexpected bytes");
}

TEST(NpyHostile, BigEndianDescr) {
  EXPECT_IO_ERROR(parse(npy_file(1, "{'descr': '>f4', 'fortran_order': False, 'shape': (2, 2)}",
                                 f32_bytes(iota(4)))),
                  "'>f4'", "big-endian");
  EXPECT_IO_ERROR(parse(npy_file(1, "{'descr': '>f2', 'fortran_order': False, 'shape': (2,)}",
                                 f32_bytes(iota(1)))),
                  "'>f2'", "big-endian");
}

TEST(NpyHostile, UnsupportedDescr) {
  for (const char* d : {"<f8", "|u1", "<i4", "<c8", "O", "<U3", ""}) {
    EXPECT_IO_ERROR(
        parse(npy_file(1,
                       std::string("{'descr': '") + d + "', 'fortran_order': False, 'shape': (2,)}",
                       f32_bytes(iota(2)))),
        "unsupported descr", std::string("'") + d + "'");
  }
}

TEST(NpyHostile, StructuredDescr) {
  EXPECT_IO_ERROR(
      parse(npy_file(1, "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,)}",
                     f32_bytes(iota(1)))),
      "'descr'", "structured");
}

TEST(NpyHostile, NegativeShapeEntry) {
  EXPECT_IO_ERROR(
      parse(npy_file(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3)}", {})),
      "'shape' entry 1 is -3");
}

TEST(NpyHostile, NonIntegerShapeEntry) {
  EXPECT_IO_ERROR(
      parse(npy_file(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2.5, 2)}", {})),
      "'shape' entry 0 is 2.5", "not an integer");
  EXPECT_IO_ERROR(
      parse(npy_file(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1e3,)}", {})),
      "'shape' entry 0 is 1e3");
  EXPECT_IO_ERROR(
      parse(npy_file(1, "{'descr': '<f4', 'fortran_order': False, 'shape': ('2',)}", {})),
      "'shape' entry 0 is '2'");
  EXPECT_IO_ERROR(
      parse(npy_file(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (True,)}", {})),
      "'shape' entry 0 is True");
}

TEST(NpyHostile, ShapeNotATuple) {
  EXPECT_IO_ERROR(parse(npy_file(1, "{'descr': '<f4', 'fortran_order': False, 'shape': [2, 2]}",
                                 f32_bytes(iota(4)))),
                  "'shape' is a list", "not a tuple");
  // "(4)" is the int 4 in parentheses, not a tuple (numpy rejects it too).
  EXPECT_IO_ERROR(parse(npy_file(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (4)}",
                                 f32_bytes(iota(4)))),
                  "'shape' is 4", "not a tuple");
}

TEST(NpyHostile, ShapeProductOverflowsInt64) {
  EXPECT_IO_ERROR(parse(npy_file(1,
                                 "{'descr': '<f4', 'fortran_order': False, 'shape': "
                                 "(4294967296, 4294967296)}",
                                 {})),
                  "overflows int64");
}

TEST(NpyHostile, ByteCountOverflowsInt64) {
  // 2^62 elements fit in int64, 2^62 * 4 bytes do not.
  EXPECT_IO_ERROR(parse(npy_file(1,
                                 "{'descr': '<f4', 'fortran_order': False, 'shape': "
                                 "(4611686018427387904,)}",
                                 {})),
                  "overflow int64");
}

TEST(NpyHostile, HugeShapeWithZeroExtent) {
  // No data, but any consumer's stride arithmetic would overflow: rejected.
  EXPECT_IO_ERROR(parse(npy_file(1,
                                 "{'descr': '<f4', 'fortran_order': False, 'shape': "
                                 "(0, 4294967296, 4294967296)}",
                                 {})),
                  "overflows int64");
}

TEST(NpyHostile, HugeButConsistentShapeIsTruncation) {
  // Fits in int64 but the file obviously does not hold it: no allocation, a clear error.
  EXPECT_IO_ERROR(parse(npy_file(1,
                                 "{'descr': '<f4', 'fortran_order': False, 'shape': "
                                 "(1000000, 1000000)}",
                                 f32_bytes(iota(4)))),
                  "truncated", "4000000000000 data bytes");
}

TEST(NpyHostile, HugeShapeOnDiskFailsBeforeAllocating) {
  // read_npy validates the header against the file size before it allocates anything.
  TempDir dir;
  kvq_test::write_bytes(dir / "huge.npy",
                        npy_file(1,
                                 "{'descr': '<f4', 'fortran_order': False, 'shape': "
                                 "(1000000000, 1000000000)}",
                                 f32_bytes(iota(4))));
  EXPECT_IO_ERROR(read_npy(dir / "huge.npy"), "huge.npy", "truncated",
                  "4000000000000000000 data bytes", "the file has 16");
}

TEST(NpyHostile, IntegerLiteralOutOfRange) {
  EXPECT_IO_ERROR(parse(npy_file(1,
                                 "{'descr': '<f4', 'fortran_order': False, 'shape': "
                                 "(99999999999999999999,)}",
                                 {})),
                  "does not fit in int64");
}

TEST(NpyHostile, RankAboveLimit) {
  std::string shape = "(";
  for (int i = 0; i < 65; ++i) shape += "1, ";
  shape += ")";
  EXPECT_IO_ERROR(
      parse(npy_file(1, "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape + "}",
                     f32_bytes(iota(1)))),
      "65 dimensions");
}

TEST(NpyHostile, MissingKey) {
  EXPECT_IO_ERROR(parse(npy_file(1, "{'descr': '<f4', 'shape': (2, 2)}", f32_bytes(iota(4)))),
                  "lacks the key 'fortran_order'");
  EXPECT_IO_ERROR(
      parse(npy_file(1, "{'descr': '<f4', 'fortran_order': False}", f32_bytes(iota(4)))),
      "lacks the key 'shape'");
}

TEST(NpyHostile, UnexpectedKey) {
  EXPECT_IO_ERROR(parse(npy_file(1,
                                 "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), "
                                 "'extra': 1}",
                                 f32_bytes(iota(4)))),
                  "unexpected .npy header key 'extra'");
}

TEST(NpyHostile, DuplicateKey) {
  EXPECT_IO_ERROR(parse(npy_file(1,
                                 "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), "
                                 "'shape': (4,)}",
                                 f32_bytes(iota(4)))),
                  "duplicate .npy header key 'shape'");
}

TEST(NpyHostile, NonStringKey) {
  EXPECT_IO_ERROR(
      parse(npy_file(1, "{1: '<f4', 'fortran_order': False, 'shape': (2, 2)}", f32_bytes(iota(4)))),
      "key 1 is not a string");
}

TEST(NpyHostile, FortranOrderNotBool) {
  EXPECT_IO_ERROR(parse(npy_file(1, "{'descr': '<f4', 'fortran_order': 0, 'shape': (2, 2)}",
                                 f32_bytes(iota(4)))),
                  "'fortran_order' is 0");
}

TEST(NpyHostile, HeaderNotADict) {
  EXPECT_IO_ERROR(parse(npy_file(1, "('<f4', False, (2, 2))", f32_bytes(iota(4)))),
                  "header is a tuple, not a dict");
}

TEST(NpyHostile, MalformedHeaders) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "expected a value"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2)", "expected ',' or '}'"},
      {"{'descr' '<f4', 'fortran_order': False, 'shape': (2, 2)}", "expected ':'"},
      {"{'descr': '<f4, 'fortran_order': False, 'shape': (2, 2)}", "malformed"},
      {"{'descr': '<f4', 'fortran_order': false, 'shape': (2, 2)}", "unknown name 'false'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2 2)}", "expected ',' or ')'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,, 2)}", "expected a value"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (02, 2)}", "leading zero"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2x, 2)}", "malformed number"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2)} junk", "after the header dict"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2)}{}", "after the header dict"},
      {"{'descr': '<\\q4', 'fortran_order': False, 'shape': (2, 2)}", "unsupported escape"},
      {"{'descr': '<f4\n', 'fortran_order': False, 'shape': (2, 2)}", "newline inside a string"},
      {std::string("{'descr': '<f4', ") + '\0' + "'fortran_order': False, 'shape': (2, 2)}",
       "expected a value, found '\\x00"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (-, 2)}", "malformed number"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (1e, 2)}", "malformed exponent"},
  };
  for (const auto& [dict, why] : cases) {
    EXPECT_IO_ERROR(parse(npy_file(1, dict, f32_bytes(iota(4)))), "test.npy",
                    "malformed .npy header", why);
  }
}

TEST(NpyHostile, NestingDepthLimit) {
  std::string deep = std::string(100, '(') + std::string(100, ')');
  EXPECT_IO_ERROR(
      parse(npy_file(1, "{'descr': '<f4', 'fortran_order': False, 'shape': " + deep + "}", {})),
      "nested deeper than 16");
}

TEST(NpyHostile, Version3HeaderMustBeUtf8) {
  std::string dict = kGoodDict + "\xff";
  EXPECT_IO_ERROR(parse(npy_file(3, dict, f32_bytes(iota(4)))), "not valid UTF-8");
  // The same byte in a 1.0 header is latin-1, which the parser then rejects as a token.
  EXPECT_IO_ERROR(parse(npy_file(1, dict, f32_bytes(iota(4)))), "after the header dict");
  // Valid UTF-8 (in a string value) is fine in 3.0, and reaches the descr check.
  EXPECT_IO_ERROR(
      parse(npy_file(3, "{'descr': '<f\xc3\xa9', 'fortran_order': False, 'shape': (2, 2)}",
                     f32_bytes(iota(4)))),
      "unsupported descr");
}

// ---------------------------------------------------------------------------------------------
// Fuzz: mutants of valid files must parse or throw kvq::Error, never crash.

TEST(NpyFuzz, MutatedFilesParseOrThrowKvqError) {
  std::vector<std::vector<uint8_t>> seeds;
  seeds.push_back(kvq::io::encode_npy(Array::from_float(iota(24), {2, 3, 4}, DType::kF16), 1));
  seeds.push_back(kvq::io::encode_npy(Array::from_float(iota(6), {6}, DType::kBF16), 3));
  seeds.push_back(
      npy_file(2, "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3)}", f32_bytes(iota(6))));
  seeds.push_back(npy_file(1, "{\"shape\": (3L,), \"fortran_order\": False, \"descr\": \"<f4\", }",
                           f32_bytes(iota(3)), false));
  int ok = kvq_test::fuzz(seeds, 3000, 12345, [](const std::vector<uint8_t>& b) {
    const Array a = read_npy_bytes(b.data(), b.size(), {}, "fuzz.npy");
    // A successful parse must be self-consistent.
    try {
      a.validate();
    } catch (const kvq::Error& e) {
      ADD_FAILURE() << "parsed array is inconsistent: " << e.what();
    }
    (void)a.to_float();
  });
  EXPECT_GT(ok, 0) << "no mutant parsed: the fuzz loop is not exercising the success path";
}

TEST(NpyFuzz, EveryTruncationOfAValidFileThrows) {
  const auto f = kvq::io::encode_npy(Array::from_float(iota(10), {2, 5}, DType::kF32), 2);
  for (size_t n = 0; n < f.size(); ++n) {
    EXPECT_IO_ERROR(read_npy_bytes(f.data(), n, {}, "cut.npy"), "cut.npy");
  }
  const Array whole = read_npy_bytes(f.data(), f.size(), {}, "cut.npy");
  EXPECT_EQ(whole.dtype, DType::kF32);
  EXPECT_EQ(whole.shape, (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(whole.to_float(), iota(10));
}

}  // namespace

// Tests for kvq/io/kv_dump.hpp: save/load round trips in both storage forms, auto-detection,
// GQA shapes, extras that must be ignored, and one test per convention violation.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "io/io_test_util.hpp"
#include "kvq/io/kv_dump.hpp"
#include "kvq/io/npy.hpp"
#include "kvq/io/safetensors.hpp"

namespace {

using kvq::DType;
using kvq::ErrorKind;
using kvq::io::Array;
using kvq::io::DumpFormat;
using kvq::io::KVDump;
using kvq::io::load_kv_dump;
using kvq::io::save_kv_dump;
using kvq_test::TempDir;

Array rand_array(std::vector<int64_t> shape, DType dt, uint32_t seed) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = nd(rng);
  return Array::from_float(v, std::move(shape), dt);
}

/// 3 layers, 6 tokens, 2 kv heads, head_dim 8; q (4 heads: GQA) on layers 0 and 2, pre-RoPE
/// keys on layer 1, mixed dtypes.
KVDump make_dump() {
  KVDump d;
  const DType dts[3] = {DType::kF32, DType::kF16, DType::kBF16};
  for (int i = 0; i < 3; ++i) {
    KVDump::Layer l;
    l.k = rand_array({6, 2, 8}, dts[i], 10 + i);
    l.v = rand_array({6, 2, 8}, dts[(i + 1) % 3], 20 + i);
    if (i != 1) l.q = rand_array({6, 4, 8}, dts[i], 30 + i);
    if (i == 1) l.k_prerope = rand_array({6, 2, 8}, DType::kF32, 40 + i);
    d.layers.push_back(std::move(l));
  }
  return d;
}

void expect_same(const KVDump& a, const KVDump& b) {
  ASSERT_EQ(a.layers.size(), b.layers.size());
  for (size_t i = 0; i < a.layers.size(); ++i) {
    EXPECT_EQ(a.layers[i].k, b.layers[i].k) << "layer " << i;
    EXPECT_EQ(a.layers[i].v, b.layers[i].v) << "layer " << i;
    EXPECT_EQ(a.layers[i].q, b.layers[i].q) << "layer " << i;
    EXPECT_EQ(a.layers[i].k_prerope, b.layers[i].k_prerope) << "layer " << i;
  }
}

/// All tensors of a dump by convention name (for building broken files).
std::map<std::string, Array> named(const KVDump& d) {
  std::map<std::string, Array> m;
  for (size_t i = 0; i < d.layers.size(); ++i) {
    const auto li = static_cast<int64_t>(i);
    m[kvq::io::kv_dump_name(li, "k")] = d.layers[i].k;
    m[kvq::io::kv_dump_name(li, "v")] = d.layers[i].v;
    if (d.layers[i].q) m[kvq::io::kv_dump_name(li, "q")] = *d.layers[i].q;
    if (d.layers[i].k_prerope) m[kvq::io::kv_dump_name(li, "k_prerope")] = *d.layers[i].k_prerope;
  }
  return m;
}

/// Writes `m` both ways (a .safetensors file and a .npy directory) and checks that loading
/// either fails with kIo and a message containing `parts`.
void expect_both_fail(const std::map<std::string, Array>& m,
                      std::initializer_list<std::string> parts) {
  TempDir dir;
  const auto st = dir / "d.safetensors";
  kvq::io::write_safetensors(st, m);
  EXPECT_TRUE(kvq_test::throws_error([&] { load_kv_dump(st); }, ErrorKind::kIo, parts))
      << "safetensors form";
  const std::vector<uint8_t> img = kvq::io::encode_safetensors(m);
  EXPECT_TRUE(kvq_test::throws_error(
      [&] { kvq::io::load_kv_dump_bytes(img.data(), img.size(), "mem"); }, ErrorKind::kIo, parts))
      << "safetensors image in memory";
  const auto nd = dir / "npy";
  std::filesystem::create_directories(nd);
  for (const auto& [name, a] : m) kvq::io::write_npy(nd / (name + ".npy"), a);
  EXPECT_TRUE(kvq_test::throws_error([&] { load_kv_dump(nd); }, ErrorKind::kIo, parts))
      << "npy directory form";
}

TEST(KVDump, SafetensorsRoundTrip) {
  TempDir dir;
  const KVDump d = make_dump();
  const auto p = dir / "dump.safetensors";
  save_kv_dump(p, d, DumpFormat::kSafetensors);
  ASSERT_TRUE(std::filesystem::is_regular_file(p));
  const KVDump e = load_kv_dump(p);
  expect_same(d, e);
  EXPECT_EQ(e.num_layers(), 3);
  EXPECT_EQ(e.tokens(), 6);
  EXPECT_EQ(e.layers[0].k.kv_shape(), (kvq::Shape{6, 2, 8}));
  // The file is a plain .safetensors with the convention's names.
  const auto h = kvq::io::read_safetensors_header(p);
  EXPECT_NE(h.find("layers.1.k_prerope"), nullptr);
  EXPECT_NE(h.find("layers.2.q"), nullptr);
  EXPECT_EQ(h.find("layers.1.q"), nullptr);
}

TEST(KVDump, InMemorySafetensorsImageLoadsLikeTheFile) {
  const KVDump d = make_dump();
  const std::vector<uint8_t> img = kvq::io::encode_safetensors(named(d));
  expect_same(d, kvq::io::load_kv_dump_bytes(img.data(), img.size()));
  // A truncated image is refused with the source name, as a truncated file is.
  EXPECT_TRUE(kvq_test::throws_error(
      [&] { kvq::io::load_kv_dump_bytes(img.data(), img.size() - 1, "dump-in-memory"); },
      ErrorKind::kIo, {"dump-in-memory"}));
  EXPECT_TRUE(kvq_test::throws_error([&] { kvq::io::load_kv_dump_bytes(nullptr, 5); },
                                     ErrorKind::kInvalidArgument, {"null buffer"}));
}

TEST(KVDump, NpyDirectoryRoundTrip) {
  TempDir dir;
  const KVDump d = make_dump();
  const auto p = dir / "dump";
  save_kv_dump(p, d, DumpFormat::kNpyDir);
  ASSERT_TRUE(std::filesystem::is_directory(p));
  EXPECT_TRUE(std::filesystem::is_regular_file(p / "layers.0.k.npy"));
  EXPECT_TRUE(std::filesystem::is_regular_file(p / "layers.1.k_prerope.npy"));
  EXPECT_EQ(kvq::io::read_npy(p / "layers.2.v.npy"), d.layers[2].v);
  expect_same(d, load_kv_dump(p));
}

TEST(KVDump, SavingOverAnOlderDumpRemovesStaleLayerFiles) {
  TempDir dir;
  const auto p = dir / "dump";
  save_kv_dump(p, make_dump(), DumpFormat::kNpyDir);
  kvq_test::write_bytes(p / "notes.txt", {'h', 'i'});
  kvq_test::write_bytes(p / "layers.01.k.npy", {'x'});  // not of the convention: left alone
  KVDump small = make_dump();
  small.layers.resize(1);
  small.layers[0].q.reset();
  save_kv_dump(p, small, DumpFormat::kNpyDir);
  EXPECT_FALSE(std::filesystem::exists(p / "layers.2.k.npy"));
  EXPECT_FALSE(std::filesystem::exists(p / "layers.0.q.npy"));
  EXPECT_TRUE(std::filesystem::exists(p / "notes.txt"));
  EXPECT_TRUE(std::filesystem::exists(p / "layers.01.k.npy"));
  EXPECT_IO_ERROR(load_kv_dump(p), "layers.01.k", "leading zero");
  std::filesystem::remove(p / "layers.01.k.npy");
  expect_same(small, load_kv_dump(p));
}

TEST(KVDump, MultiQueryAndExtrasAreAccepted) {
  TempDir dir;
  KVDump d;
  KVDump::Layer l;
  l.k = rand_array({5, 1, 4}, DType::kF16, 1);  // MQA: one kv head
  l.v = rand_array({5, 1, 4}, DType::kF16, 2);
  l.q = rand_array({5, 8, 4}, DType::kF16, 3);
  d.layers.push_back(l);
  auto m = named(d);
  // Extras outside "layers." are ignored, whatever their dtype.
  m["input_ids"] = rand_array({5}, DType::kF32, 4);
  const auto st = dir / "d.safetensors";
  kvq::io::write_safetensors(st, m, {{"model", "tiny"}});
  expect_same(d, load_kv_dump(st));
  // An I64 extra in a hand-made file: readable because it is never read.
  std::string header = R"({"ids":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},)"
                       R"("layers.0.k":{"dtype":"F32","shape":[1,1,1],"data_offsets":[8,12]},)"
                       R"("layers.0.v":{"dtype":"F32","shape":[1,1,1],"data_offsets":[12,16]}})";
  std::vector<uint8_t> f(8);
  kvq::io::detail::store_u64le(f.data(), header.size());
  f.insert(f.end(), header.begin(), header.end());
  f.resize(f.size() + 16, 0);
  kvq_test::write_bytes(dir / "ids.safetensors", f);
  EXPECT_EQ(load_kv_dump(dir / "ids.safetensors").num_layers(), 1);
  // Directory form: other files and non-convention .npy files are ignored.
  const auto nd = dir / "npy";
  save_kv_dump(nd, d, DumpFormat::kNpyDir);
  kvq_test::write_bytes(nd / "README", {'x'});
  kvq::io::write_npy(nd / "tokens.npy", rand_array({5}, DType::kF32, 5));
  std::filesystem::create_directories(nd / "layers.9.k.npy.d");
  expect_same(d, load_kv_dump(nd));
}

// ---------------------------------------------------------------------------------------------
// Convention violations: one test per case, each checked in both storage forms.

TEST(KVDumpInvalid, NoDumpTensors) {
  std::map<std::string, Array> m;
  m["other"] = rand_array({2}, DType::kF32, 1);
  expect_both_fail(m, {"no dump tensors found"});
}

TEST(KVDumpInvalid, LayerGap) {
  auto m = named(make_dump());
  m.erase("layers.1.k");
  m.erase("layers.1.v");
  m.erase("layers.1.k_prerope");
  expect_both_fail(m, {"layer 1 is missing", "found layer 2"});
}

TEST(KVDumpInvalid, LayersNotStartingAtZero) {
  auto m = named(make_dump());
  for (const char* k : {"k", "v", "q"}) m.erase(std::string("layers.0.") + k);
  expect_both_fail(m, {"layer 0 is missing"});
}

TEST(KVDumpInvalid, MissingK) {
  auto m = named(make_dump());
  m.erase("layers.2.k");
  expect_both_fail(m, {"layers.2.k is missing"});
}

TEST(KVDumpInvalid, MissingV) {
  auto m = named(make_dump());
  m.erase("layers.0.v");
  expect_both_fail(m, {"layers.0.v is missing"});
}

TEST(KVDumpInvalid, WrongRank) {
  auto m = named(make_dump());
  m["layers.1.v"] = rand_array({6, 16}, DType::kF32, 1);
  expect_both_fail(m, {"layers.1.v has shape [6, 16]", "rank 3"});
}

TEST(KVDumpInvalid, ZeroExtent) {
  auto m = named(make_dump());
  m["layers.0.k"] = rand_array({6, 0, 8}, DType::kF32, 1);
  m["layers.0.v"] = rand_array({6, 0, 8}, DType::kF32, 1);
  expect_both_fail(m, {"layers.0.k has shape [6, 0, 8]", "must be > 0"});
}

TEST(KVDumpInvalid, KAndVShapesDiffer) {
  auto m = named(make_dump());
  m["layers.2.v"] = rand_array({6, 2, 4}, DType::kF32, 1);
  expect_both_fail(m, {"layers.2.v has shape [tokens=6, heads=2, head_dim=4]",
                       "layers.2.k has [tokens=6, heads=2, head_dim=8]"});
}

TEST(KVDumpInvalid, KPreropeShapeDiffers) {
  auto m = named(make_dump());
  m["layers.1.k_prerope"] = rand_array({5, 2, 8}, DType::kF32, 1);
  expect_both_fail(m, {"layers.1.k_prerope has shape [tokens=5"});
}

TEST(KVDumpInvalid, QHeadsNotAMultipleOfKVHeads) {
  auto m = named(make_dump());
  m["layers.0.q"] = rand_array({6, 3, 8}, DType::kF32, 1);
  expect_both_fail(m, {"layers.0.q has 3 heads", "multiple of the 2 kv heads"});
}

TEST(KVDumpInvalid, QTokensOrHeadDimDiffer) {
  auto m = named(make_dump());
  m["layers.2.q"] = rand_array({6, 4, 16}, DType::kF32, 1);
  expect_both_fail(m, {"layers.2.q has shape", "same tokens and head_dim"});
  m["layers.2.q"] = rand_array({7, 4, 8}, DType::kF32, 1);
  expect_both_fail(m, {"layers.2.q has shape [tokens=7"});
}

TEST(KVDumpInvalid, TokenCountDiffersBetweenLayers) {
  auto m = named(make_dump());
  m["layers.2.k"] = rand_array({5, 2, 8}, DType::kF32, 1);
  m["layers.2.v"] = rand_array({5, 2, 8}, DType::kF32, 1);
  m.erase("layers.2.q");
  expect_both_fail(m, {"layers.2.k has 5 tokens but layers.0.k has 6"});
}

TEST(KVDumpInvalid, MalformedLayerNames) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"layers.01.k", "leading zero"},  {"layers.x.k", "no layer index"},
      {"layers.0.key", "unknown kind"}, {"layers.0", "lacks the '.'"},
      {"layers.0k", "lacks the '.'"},   {"layers.99999999999999999999.k", "overflows"},
      {"layers.", "no layer index"},
  };
  for (const auto& [name, why] : cases) {
    auto m = named(make_dump());
    m[name] = rand_array({6, 2, 8}, DType::kF32, 1);
    expect_both_fail(m, {name, why});
  }
}

TEST(KVDumpInvalid, CorruptFileInDirectory) {
  TempDir dir;
  const auto p = dir / "dump";
  save_kv_dump(p, make_dump(), DumpFormat::kNpyDir);
  kvq_test::write_bytes(p / "layers.1.v.npy", {0x93, 'N', 'U', 'M'});
  EXPECT_IO_ERROR(load_kv_dump(p), "layers.1.v.npy", "too short");
}

TEST(KVDumpInvalid, UnsupportedDTypeInConventionTensor) {
  TempDir dir;
  std::string header = R"({"layers.0.k":{"dtype":"I32","shape":[1,1,1],"data_offsets":[0,4]},)"
                       R"("layers.0.v":{"dtype":"F32","shape":[1,1,1],"data_offsets":[4,8]}})";
  std::vector<uint8_t> f(8);
  kvq::io::detail::store_u64le(f.data(), header.size());
  f.insert(f.end(), header.begin(), header.end());
  f.resize(f.size() + 8, 0);
  kvq_test::write_bytes(dir / "d.safetensors", f);
  EXPECT_IO_ERROR(load_kv_dump(dir / "d.safetensors"), "tensor 'layers.0.k'", "dtype 'I32'");
}

TEST(KVDumpInvalid, PathDoesNotExist) {
  TempDir dir;
  EXPECT_IO_ERROR(load_kv_dump(dir / "nothing"), "nothing", "no such file or directory");
}

TEST(KVDumpInvalid, SaveRejectsInvalidDump) {
  TempDir dir;
  KVDump d = make_dump();
  d.layers[1].v = rand_array({6, 2, 4}, DType::kF32, 1);
  EXPECT_TRUE(kvq_test::throws_error(
      [&] { save_kv_dump(dir / "x.safetensors", d, DumpFormat::kSafetensors); },
      ErrorKind::kShapeMismatch, {"layers.1.v", "same shape"}));
  EXPECT_FALSE(std::filesystem::exists(dir / "x.safetensors"));
  EXPECT_TRUE(
      kvq_test::throws_error([&] { save_kv_dump(dir / "x", KVDump{}, DumpFormat::kNpyDir); },
                             ErrorKind::kShapeMismatch, {"no layers"}));
  KVDump bad_payload = make_dump();
  bad_payload.layers[0].k.bytes.pop_back();
  EXPECT_TRUE(
      kvq_test::throws_error([&] { save_kv_dump(dir / "y", bad_payload, DumpFormat::kNpyDir); },
                             ErrorKind::kShapeMismatch, {"layers.0.k", "payload of"}));
}

}  // namespace

/// \file make_corpus.cpp
/// Writes the seed corpora of kvq's fuzz targets (tests/fuzz/corpus/<target>/) with kvq's own
/// writers: small, valid inputs that reach every branch of a format's happy path, from which
/// libFuzzer mutates. Run from the build: `fuzz_make_corpus tests/fuzz/corpus` (the files are
/// committed; rerun only when a format grows). Crash inputs found later are added beside them
/// by hand (named crash-<target>-<what>), never regenerated.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kvq/io/archive.hpp"
#include "kvq/io/kv_dump.hpp"
#include "kvq/io/npy.hpp"
#include "kvq/io/safetensors.hpp"
#include "kvq/policy/spec.hpp"
#include "kvq/io/calibration_file.hpp"
#include "kvq/quant/quantize.hpp"

namespace fs = std::filesystem;

namespace {

fs::path g_root;

void put(const std::string& target, const std::string& name, const std::vector<uint8_t>& bytes) {
  const fs::path dir = g_root / target;
  fs::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()),
             static_cast<std::streamsize>(bytes.size()));
}
void put(const std::string& target, const std::string& name, const std::string& text) {
  put(target, name, std::vector<uint8_t>(text.begin(), text.end()));
}
std::vector<uint8_t> slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)),
                              std::istreambuf_iterator<char>());
}

kvq::io::Array arr(std::vector<int64_t> shape, kvq::DType dt, uint32_t seed) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 2.f);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = nd(rng);
  return kvq::io::Array::from_float(v.data(), shape, dt);
}

void npy_seeds() {
  using kvq::DType;
  put("npy", "f32_2x3.npy", kvq::io::encode_npy(arr({2, 3}, DType::kF32, 1)));
  put("npy", "f16_4.npy", kvq::io::encode_npy(arr({4}, DType::kF16, 2)));
  put("npy", "bf16_2x2x2.npy", kvq::io::encode_npy(arr({2, 2, 2}, DType::kBF16, 3)));
  put("npy", "f32_scalar.npy", kvq::io::encode_npy(arr({}, DType::kF32, 4)));
  put("npy", "f32_empty_0x3.npy", kvq::io::encode_npy(arr({0, 3}, DType::kF32, 5)));
  put("npy", "f32_v2.npy", kvq::io::encode_npy(arr({3, 1, 2}, DType::kF32, 6), 2));
  put("npy", "f16_v3.npy", kvq::io::encode_npy(arr({2, 2}, DType::kF16, 7), 3));
  // Hand-written headers: Fortran order, odd spacing and key order, u2 (raw bf16 option),
  // Python 2 long integers.
  auto hand = [](const std::string& dict, std::vector<uint8_t> payload) {
    std::string h = dict;
    while ((10 + h.size() + 1) % 64 != 0) h += ' ';
    h += '\n';
    std::vector<uint8_t> out = {0x93,
                                'N',
                                'U',
                                'M',
                                'P',
                                'Y',
                                1,
                                0,
                                static_cast<uint8_t>(h.size() & 0xff),
                                static_cast<uint8_t>(h.size() >> 8)};
    out.insert(out.end(), h.begin(), h.end());
    out.insert(out.end(), payload.begin(), payload.end());
    return out;
  };
  const auto f23 = arr({2, 3}, DType::kF32, 8).bytes;
  put("npy", "fortran_2x3.npy",
      hand("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", f23));
  put("npy", "spacing_order.npy",
      hand("{ \"shape\" :(2,3,) ,'fortran_order':False,'descr':'<f4'}", f23));
  put("npy", "u2_raw_bf16.npy",
      hand("{'descr': '<u2', 'fortran_order': False, 'shape': (3L,), }", {1, 0x3f, 2, 0x40, 0, 0}));
  put("npy", "void_bf16.npy",
      hand("{'descr': '|V2', 'fortran_order': False, 'shape': (1,), }", {0x80, 0x3f}));
}

void safetensors_seeds() {
  using kvq::DType;
  std::map<std::string, kvq::io::Array> t;
  t["a"] = arr({2, 2}, DType::kF32, 10);
  t["b"] = arr({3}, DType::kF16, 11);
  put("safetensors", "two_tensors.safetensors", kvq::io::encode_safetensors(t));
  put("safetensors", "with_metadata.safetensors",
      kvq::io::encode_safetensors(t, {{"format", "pt"}, {"note", "caf\xc3\xa9"}}));
  std::map<std::string, kvq::io::Array> one;
  one["x.y"] = arr({1, 2, 2}, DType::kBF16, 12);
  one["s"] = arr({}, DType::kF32, 13);
  one["e"] = arr({0}, DType::kF16, 14);
  put("safetensors", "bf16_scalar_empty.safetensors", kvq::io::encode_safetensors(one));
  put("safetensors", "empty.safetensors", kvq::io::encode_safetensors({}));
}

void json_seeds() {
  put("json", "object.json",
      "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]},"
      "\"__metadata__\":{\"format\":\"pt\"}}");
  put("json", "scalars.json", "[null,true,false,0,-1,3.25,1e10,-2.5E-3,\"\",12345678901234567890]");
  put("json", "strings.json",
      "[\"esc \\\" \\\\ \\/ \\b \\f \\n \\r "
      "\\t\",\"\\u00e9\\u20ac\\ud83d\\ude00\",\"caf\xc3\xa9\"]");
  put("json", "nested.json", "{\"a\":[[[[{}]]]],\"b\":{\"c\":{\"d\":[1,[2,[3]]]}}}");
  put("json", "whitespace.json", " \t\r\n{ \"k\" : [ 1 , 2 ] } \n");
}

void policy_seeds() {
  int i = 0;
  auto spec = [&](const std::string& s) { put("policy_spec", "spec" + std::to_string(i++), s); };
  for (const kvq::Preset& p : kvq::policy_presets()) spec(p.name);
  spec("kivi2,residual=128,sinks=4,skip=1:2,skipas=fp8");
  spec("k=int8/channel/g16/f32meta,v=sint4/token/g64,k@3=lm3/rot/qjl,v@3=f16");
  spec("k=lm3/rot/qjl,v=lm4/f32meta");
  spec("k8v4;fp8;turbo4");
  spec("k=e5m2/tensor/g0,v=e4m3/token,skip=2,skipas=e4m3/head");
  spec("f32,k@0=int2/channel/g32,skip=0:1");
  spec(" k = bf16 , v = int3/head/g8 , residual = 0 ");
  spec("int4/channel/g32");
  spec("k=nvfp4,v=mxfp4,k@1=e4m3/head,v@1=nvfp4");
}

void dump_seeds() {
  using kvq::DType;
  const fs::path tmp = fs::temp_directory_path() / "kvq_fuzz_corpus_dump.safetensors";
  auto one = [&](const std::string& name, const kvq::io::KVDump& d) {
    kvq::io::save_kv_dump(tmp, d, kvq::io::DumpFormat::kSafetensors);
    put("kv_dump", name, slurp(tmp));
  };
  kvq::io::KVDump d;
  d.layers.resize(1);
  d.layers[0].k = arr({3, 1, 4}, DType::kF32, 20);
  d.layers[0].v = arr({3, 1, 4}, DType::kF32, 21);
  one("one_layer.safetensors", d);
  d.layers.resize(2);
  d.layers[1].k = arr({3, 2, 2}, DType::kF16, 22);
  d.layers[1].v = arr({3, 2, 2}, DType::kF16, 23);
  d.layers[1].q = arr({3, 4, 2}, DType::kBF16, 24);
  d.layers[1].k_prerope = arr({3, 2, 2}, DType::kF16, 25);
  one("two_layers_q_prerope.safetensors", d);
  fs::remove(tmp);
  // Extras outside the convention are ignored by the loader.
  std::map<std::string, kvq::io::Array> t;
  t["layers.0.k"] = arr({2, 1, 2}, DType::kF32, 26);
  t["layers.0.v"] = arr({2, 1, 2}, DType::kF32, 27);
  t["token_ids"] = arr({2}, DType::kF32, 28);
  put("kv_dump", "with_extra.safetensors", kvq::io::encode_safetensors(t));
}

/// fuzz_packed inputs: the 9-byte header fuzz_packed.cpp documents, then the buffers of a real
/// quantize() of random data, in the order the target reads them.
void packed_seeds() {
  struct Case {
    const char* name;
    const char* term;
    uint8_t tokens, heads, dim_sel, out_kind;
    int outliers = 0;  ///< dense-and-sparse entries per vector
    int nuq_bits = 0;  ///< > 0: the term is replaced by nuq<bits> on its axis and group
  };
  // dim_sel indexes fuzz_packed.cpp's kHeadDims: 3 -> 4, 5 -> 8, 7 -> 16, 9 -> 32.
  const Case cases[] = {
      {"f32", "f32", 2, 1, 3, 0},
      {"f16", "f16", 2, 2, 3, 1},
      {"bf16", "bf16", 1, 1, 5, 2},
      {"int4_token_g8", "int4/token/g8", 2, 2, 7, 0},
      {"int2_channel_g4", "int2/channel/g4", 4, 1, 5, 3},
      {"sint8_head", "sint8/head/g2", 2, 2, 3, 1},
      {"int3_tensor_f32meta", "int3/tensor/g4/f32meta", 4, 2, 3, 2},
      {"e4m3_head", "e4m3/head", 2, 2, 5, 0},
      {"e5m2_token_g4", "e5m2/token/g4", 2, 1, 5, 3},
      {"lm3", "lm3", 2, 2, 5, 0},
      {"lm2_qjl", "lm2/qjl", 1, 2, 7, 1},
      {"lm4_f32meta", "lm4/f32meta", 2, 1, 9, 2},
      {"int4_token_g8_out2", "int4/token/g8", 2, 2, 7, 1, 2},
      {"e4m3_token_out1", "e4m3/token", 2, 1, 5, 3, 1},
      {"nuq3_token_g8", "int3/token/g8", 2, 1, 5, 0, 0, 3},
      {"nuq2_channel_g4_out3_f32meta", "int2/channel/g4/f32meta", 4, 2, 7, 2, 3, 2},
      {"nvfp4", "nvfp4", 2, 2, 9, 1},
      {"mxfp4", "mxfp4", 2, 1, 9, 3},
  };
  const int64_t dims[] = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32};
  for (const Case& cs : cases) {
    kvq::QuantConfig c = kvq::parse_quant_config(cs.term);
    c.outliers = cs.outliers;
    // nuq levels as fuzz_packed derives them: -1, then steps of (1 + byte) / 128.
    std::vector<uint8_t> level_steps;
    if (cs.nuq_bits > 0) {
      c.format = kvq::Format::kNuq;
      c.bits = cs.nuq_bits;
      c.nuq_ready = true;
      const int levels = 1 << c.bits;
      const auto step = static_cast<uint8_t>(256 / (levels - 1) - 1);  // spans about [-1, 1]
      float level = -1.f;
      for (int i = 0; i < levels; ++i) {
        c.nuq_levels[static_cast<std::size_t>(i)] = level;
        level += static_cast<float>(1 + step) / 128.f;
        level_steps.push_back(step);
      }
    }
    const kvq::Shape s{cs.tokens, cs.heads, dims[cs.dim_sel]};
    std::vector<float> x(static_cast<std::size_t>(s.numel()));
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& v : x) v = nd(rng);
    const kvq::QTensor q =
        kvq::quantize(c, kvq::KVView<const float>::nhd(x.data(), s.tokens, s.heads, s.head_dim));
    // Header: format, bits selector, flags, group selector, tokens-1, heads-1, dim, seed, out.
    const uint8_t bits_sel = c.format == kvq::Format::kInt   ? (c.bits == 2   ? 0
                                                                : c.bits == 3 ? 1
                                                                : c.bits == 4 ? 2
                                                                              : 3)
                             : c.format == kvq::Format::kNuq ? static_cast<uint8_t>(c.bits - 2)
                                                             : static_cast<uint8_t>(c.bits - 1);
    const uint8_t flags =
        static_cast<uint8_t>((c.symmetric ? 1 : 0) | (c.meta == kvq::MetaDType::kF32 ? 2 : 0) |
                             (c.qjl ? 4 : 0) | (static_cast<int>(c.axis) << 3) | (c.outliers << 5));
    // Group selector: index of c.group among fuzz_packed's candidate list (0 first for
    // non-int formats, then the divisors of the axis extent in increasing order).
    const int64_t extent = c.axis == kvq::Axis::kToken ? s.head_dim : s.tokens;
    int sel = c.format == kvq::Format::kInt ? 0 : 1;
    if (c.group == 0 || c.is_raw() || c.format == kvq::Format::kLloydMax) {
      sel = 0;
    } else {
      for (int64_t g = 1; g < c.group; ++g)
        if (extent % g == 0) ++sel;
    }
    // (FP4 format bytes: 240 nvfp4, 241 mxfp4; their bits, axis and group are implied.)
    const uint8_t format_byte = c.format == kvq::Format::kNvfp4   ? 240
                                : c.format == kvq::Format::kMxfp4 ? 241
                                                                  : static_cast<uint8_t>(c.format);
    std::vector<uint8_t> b = {format_byte,
                              bits_sel,
                              flags,
                              static_cast<uint8_t>(sel),
                              static_cast<uint8_t>(cs.tokens - 1),
                              static_cast<uint8_t>(cs.heads - 1),
                              cs.dim_sel,
                              0,
                              cs.out_kind};
    auto add = [&](const std::vector<uint8_t>& v) { b.insert(b.end(), v.begin(), v.end()); };
    add(level_steps);
    add(q.codes);
    add(q.scales.raw());
    add(q.zeros.raw());
    add(q.norms.raw());
    add(q.qjl_signs);
    add(q.qjl_norms.raw());
    add(q.outlier_values);
    add(q.outlier_pos);
    put("packed", cs.name, b);
  }
}

/// GGUF files written by hand (the format is simple enough that an independent writer here
/// also cross-checks the reader's reading of the spec): every metadata value type, nested
/// arrays, and one tensor of every type the reader dequantizes.
void gguf_seeds() {
  struct W {
    std::vector<uint8_t> b;
    void u32(uint32_t v) {
      for (int i = 0; i < 4; ++i) b.push_back(static_cast<uint8_t>(v >> (8 * i)));
    }
    void u64(uint64_t v) {
      for (int i = 0; i < 8; ++i) b.push_back(static_cast<uint8_t>(v >> (8 * i)));
    }
    void str(const std::string& s) {
      u64(s.size());
      b.insert(b.end(), s.begin(), s.end());
    }
  };
  struct T {
    const char* name;
    std::vector<uint64_t> ne;
    uint32_t type;
    std::size_t bytes;
  };
  auto file = [](uint32_t version, bool with_meta, const std::vector<T>& tensors, uint32_t align) {
    W w;
    w.b = {'G', 'G', 'U', 'F'};
    w.u32(version);
    w.u64(tensors.size());
    w.u64(with_meta ? 9 : (align != 32 ? 1 : 0));
    if (with_meta) {
      w.str("general.architecture");
      w.u32(8);
      w.str("llama");
      w.str("llama.block_count");
      w.u32(4);
      w.u32(2);
      w.str("llama.rope.freq_base");
      w.u32(6);
      w.u32(0x461c4000);  // 10000.0f
      w.str("general.flag");
      w.u32(7);
      w.b.push_back(1);
      w.str("tokenizer.ggml.tokens");
      w.u32(9);
      w.u32(8);
      w.u64(2);
      w.str("a");
      w.str("bc");
      w.str("tokenizer.ggml.token_type");
      w.u32(9);
      w.u32(5);
      w.u64(3);
      w.u32(1);
      w.u32(2);
      w.u32(0xffffffff);
      w.str("x.nested");
      w.u32(9);
      w.u32(9);
      w.u64(1);
      w.u32(0);  // the inner array: element type u8 (no type code in front, as gguf-py writes)
      w.u64(2);
      w.b.push_back(7);
      w.b.push_back(8);
      w.str("x.f64");
      w.u32(12);
      w.u64(0x3ff8000000000000ULL);  // 1.5
      w.str("x.i64");
      w.u32(11);
      w.u64(static_cast<uint64_t>(-5));
    }
    if (align != 32) {
      w.str("general.alignment");
      w.u32(4);
      w.u32(align);
    }
    uint64_t off = 0;
    for (const T& t : tensors) {
      w.str(t.name);
      w.u32(static_cast<uint32_t>(t.ne.size()));
      for (uint64_t e : t.ne) w.u64(e);
      w.u32(t.type);
      w.u64(off);
      off += (t.bytes + align - 1) / align * align;
    }
    while (w.b.size() % align) w.b.push_back(0);
    std::mt19937 rng(99);
    for (const T& t : tensors) {
      std::vector<uint8_t> d(t.bytes);
      for (auto& x : d) x = static_cast<uint8_t>(rng());
      // Keep the fp16 scale fields of quantized blocks small and finite (0x3c00 = 1.0).
      if (t.type != 0 && t.type != 1 && t.type != 30) {
        for (std::size_t i = 0; i + 1 < d.size(); i += 2) {
          if (d[i + 1] >= 0x7c) d[i + 1] = 0x3c;
        }
      }
      w.b.insert(w.b.end(), d.begin(), d.end());
      while (w.b.size() % align) w.b.push_back(0);
    }
    return w.b;
  };
  put("gguf", "meta_only_v3.gguf", file(3, true, {}, 32));
  put("gguf", "float_tensors_v2.gguf",
      file(2, false, {{"f32", {4}, 0, 16}, {"f16", {8, 2}, 1, 32}, {"bf16", {4}, 30, 8}}, 32));
  put("gguf", "q_legacy.gguf",
      file(3, true,
           {{"q4_0", {32}, 2, 18},
            {"q4_1", {32}, 3, 20},
            {"q5_0", {32}, 6, 22},
            {"q5_1", {32}, 7, 24},
            {"q8_0", {32, 2}, 8, 68}},
           32));
  put("gguf", "q_k.gguf",
      file(3, false, {{"q4_k", {256}, 12, 144}, {"q5_k", {256}, 13, 176}, {"q6_k", {256}, 14, 210}},
           64));
  put("gguf", "unsupported_type.gguf", file(3, false, {{"q2_k", {256}, 10, 84}}, 32));
}

/// Calibration files written by kvq's own writer (calibration_json) for policies whose nuq
/// configs carry hand-set ascending codebooks.
void calibration_seeds() {
  auto levels = [](kvq::QuantConfig& c, float lo, float hi) {
    c.nuq_ready = true;
    const int n = 1 << c.bits;
    for (int i = 0; i < n; ++i)
      c.nuq_levels[static_cast<std::size_t>(i)] = lo + (hi - lo) * static_cast<float>(i) / (n - 1);
  };
  kvq::Policy a = kvq::parse_policy("k=nuq3/channel/g32,v=nuq2/token/g16/out2,residual=0");
  levels(a.key, -1.f, 1.f);
  levels(a.value, -0.9f, 0.7f);
  put("calibration", "two_layers_k_and_v.json", kvq::calibration_json(a, 2, "synthetic"));
  kvq::Policy b = kvq::parse_policy("k=nuq4/token/g8,v=int4/token/g32,skip=1,sinks=2");
  levels(b.key, -1.f, 1.f);
  put("calibration", "skip_uniform.json",
      kvq::calibration_json(b, 3, "caf\xc3\xa9", kvq::CalibrationWeights::kUniform));
  put("calibration", "no_nuq.json", kvq::calibration_json(kvq::parse_policy("kivi2"), 1));
}

/// Small archives (io/archive.hpp) with every record kind, several config kinds and both record
/// orders (save_archive's, and pages streamed as they flush).
void archive_seeds() {
  auto fill = [](kvq::KVCache& c, int64_t tokens, uint32_t seed, kvq::io::ArchiveWriter* w) {
    const int H = c.kv_heads(), D = c.head_dim();
    std::vector<std::vector<float>> k, v;
    for (int l = 0; l < c.n_layers(); ++l) {
      k.push_back(arr({tokens, H, D}, kvq::DType::kF32, seed + 2 * static_cast<uint32_t>(l)).to_float());
      v.push_back(arr({tokens, H, D}, kvq::DType::kF32, seed + 2 * static_cast<uint32_t>(l) + 1).to_float());
    }
    for (int64_t t = 0; t < tokens; t += 5) {
      const int64_t n = std::min<int64_t>(5, tokens - t);
      for (int l = 0; l < c.n_layers(); ++l)
        c.append(l, kvq::KVView<const float>::nhd(k[static_cast<std::size_t>(l)].data() + t * H * D, n, H, D),
                 kvq::KVView<const float>::nhd(v[static_cast<std::size_t>(l)].data() + t * H * D, n, H, D));
      if (w) w->append_pages(c);
    }
  };
  {
    kvq::KVCache c(kvq::parse_policy("kivi2,sinks=2,residual=4,k@1=lm3,v@1=int4/token/g8"), 2, 1, 8, 0,
                   kvq::KVCacheOptions{true});  // with rollback rows
    fill(c, 39, 11, nullptr);
    put("archive", "kivi2_sinks_override.kvqa", kvq::io::save_archive_bytes(c));
  }
  {
    kvq::KVCache c(kvq::parse_policy("k8v4,residual=2"), 1, 2, 8, 0, kvq::KVCacheOptions{true});
    std::vector<uint8_t> out;
    kvq::io::ArchiveWriter w(out, c);
    fill(c, 40, 21, &w);
    w.finish(c);
    put("archive", "k8v4_streamed.kvqa", out);
  }
  {
    kvq::Policy p = kvq::parse_policy("k=nuq3/channel/g16/out1,v=e5m2/token/f32meta,sinks=1");
    p.key.nuq_ready = true;
    for (int i = 0; i < 8; ++i) p.key.nuq_levels[static_cast<std::size_t>(i)] = -1.f + 2.f * static_cast<float>(i) / 7.f;
    kvq::KVCache c(p, 1, 1, 8, 0, kvq::KVCacheOptions{true});
    fill(c, 20, 31, nullptr);
    kvq::io::ArchiveOptions o;
    o.key_rope = kvq::RopeConfig{10000.0, kvq::RopeStyle::kHalf};
    o.note = "seed";
    put("archive", "nuq_outliers_prerope.kvqa", kvq::io::save_archive_bytes(c, o));
  }
  {
    kvq::KVCacheOptions o;
    o.exact_rollback = false;
    kvq::KVCache c(kvq::parse_policy("turbo3,skip=1,skipas=f16"), 3, 1, 8, 64, o);
    fill(c, 18, 41, nullptr);
    put("archive", "turbo3_skip_norollback.kvqa", kvq::io::save_archive_bytes(c));
  }
  {
    kvq::KVCache c(kvq::parse_policy("f16,sinks=4"), 1, 1, 4);
    put("archive", "empty.kvqa", kvq::io::save_archive_bytes(c));
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_make_corpus CORPUS_DIR\n");
    return 2;
  }
  g_root = argv[1];
  npy_seeds();
  safetensors_seeds();
  json_seeds();
  policy_seeds();
  dump_seeds();
  packed_seeds();
  gguf_seeds();
  calibration_seeds();
  archive_seeds();
  std::printf("seed corpora written under %s\n", g_root.string().c_str());
  return 0;
}

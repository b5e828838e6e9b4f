// kvq_make_dump: writes a KV dump (docs/dump-format.md) from kvq's synthetic generator or from
// a real model run over one line of a text file (keys after and before RoPE, values, and the
// model's queries), so kvq_quantize_dump and the comparison can be tried without Python.
//
//   kvq_make_dump --synthetic [--layers N --tokens T --kv-heads H --q-heads Q --head-dim D] OUT
//   kvq_make_dump --model M [--tokenizer T] [--text F] [--line I] OUT
// M: a llama2.c checkpoint (with its tokenizer T) or a GGUF file (detected by magic; `smollm2` /
// `gemma3` name the ones fetched by ./kvq.sh model NAME). The text defaults to tinystories-dev.txt.
// OUT ending in .safetensors writes one file; anything else writes a directory of .npy files.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "eval_model.hpp"
#include "kvq/core/rows.hpp"
#include "kvq/eval/llama2c.hpp"
#include "kvq/eval/synthetic.hpp"
#include "kvq/io/kv_dump.hpp"

#ifndef KVQ_SHARED_DIR
#define KVQ_SHARED_DIR "../shared"
#endif

namespace {
int parse_pos(const std::string& flag, const char* v) {
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (!end || *end || x < 0 || x > 1 << 20) {
    std::fprintf(stderr, "kvq_make_dump: %s needs a non-negative integer, got '%s'\n", flag.c_str(), v);
    std::exit(2);
  }
  return static_cast<int>(x);
}
kvq::io::Array arr(const float* p, int64_t t, int64_t h, int64_t d) {
  return kvq::io::Array::from_float(p, {t, h, d}, kvq::DType::kF32);
}
}  // namespace

int main(int argc, char** argv) {
  kvq::eval::SyntheticSpec spec;
  bool synthetic = false;
  const std::string base = std::string(KVQ_SHARED_DIR) + "/data/stories260K/";
  std::string model, tok = base + "tok512.bin", text = base + "tinystories-dev.txt", out;
  int line_index = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "kvq_make_dump: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--synthetic") synthetic = true;
    else if (a == "--layers") spec.layers = parse_pos(a, next());
    else if (a == "--tokens") spec.tokens = parse_pos(a, next());
    else if (a == "--kv-heads") spec.kv_heads = parse_pos(a, next());
    else if (a == "--q-heads") spec.q_heads = parse_pos(a, next());
    else if (a == "--head-dim") spec.head_dim = parse_pos(a, next());
    else if (a == "--model") model = next();
    else if (a == "--tokenizer") tok = next();
    else if (a == "--text") text = next();
    else if (a == "--line") line_index = parse_pos(a, next());
    else if (!a.empty() && a[0] == '-') {
      std::fprintf(stderr, "kvq_make_dump: unknown option '%s'\n", a.c_str());
      return 2;
    } else {
      out = a;
    }
  }
  if (out.empty() || (synthetic == !model.empty())) {
    std::fprintf(stderr,
                 "usage: kvq_make_dump --synthetic [--layers N --tokens T --kv-heads H "
                 "--q-heads Q --head-dim D] OUT\n"
                 "       kvq_make_dump --model M [--tokenizer T] [--text F] [--line I] OUT\n"
                 "M: llama2.c checkpoint (with T), GGUF file, or smollm2 / gemma3 (./kvq.sh model NAME)\n");
    return 2;
  }
  try {
    kvq::io::KVDump dump;
    if (synthetic) {
      const auto layers = kvq::eval::make_synthetic_kv(spec);
      for (const auto& L : layers) {
        kvq::io::KVDump::Layer ly;
        ly.k = arr(L.k.data(), spec.tokens, spec.kv_heads, spec.head_dim);
        ly.v = arr(L.v.data(), spec.tokens, spec.kv_heads, spec.head_dim);
        ly.k_prerope = arr(L.k_prerope.data(), spec.tokens, spec.kv_heads, spec.head_dim);
        dump.layers.push_back(std::move(ly));
      }
    } else {
      kvq_tools::EvalModel m(model, tok);
      std::vector<std::string> lines;
      for (auto& l : m.read_lines(text))
        if (!l.empty()) lines.push_back(l);
      KVQ_REQUIRE(line_index < static_cast<int>(lines.size()), kInvalidArgument, "--line ",
                  line_index, " but ", text, " has ", lines.size(), " non-empty lines");
      const auto ids = m.encode_line(lines[static_cast<size_t>(line_index)]);
      KVQ_REQUIRE(!ids.empty(), kInvalidArgument, "--line ", line_index, " has no tokens");
      kvq_tools::RecordingBackend be(m.kv_geometry());
      m.run(ids, be);
      const auto geo = m.kv_geometry();
      for (int l = 0; l < geo.n_layers; ++l) {
        auto copy = [&](kvq::KVView<const float> v) {
          return arr(kvq::to_float_nhd(v).data(), v.tokens(), v.heads(), v.head_dim());
        };
        kvq::io::KVDump::Layer ly;
        ly.k = copy(be.inner().keys(l));
        ly.v = copy(be.inner().values(l));
        ly.k_prerope = copy(be.inner().keys_prerope(l));
        const auto& q = be.queries(l);
        ly.q = arr(q.data(), static_cast<int64_t>(ids.size()), be.n_heads(), geo.head_dim);
        dump.layers.push_back(std::move(ly));
      }
      std::printf("model: %s; RoPE theta %g, %s pairs (pass --rope-theta/--rope-style to "
                  "kvq_compare --dump)\n",
                  m.describe().c_str(), m.rope().theta,
                  m.rope().style == kvq::RopeStyle::kAdjacent ? "adjacent" : "half");
      const auto lr = m.layer_ropes();
      std::string others;
      double other_theta = 0;
      for (size_t l = 0; l < lr.size(); ++l) {
        if (lr[l].theta != m.rope().theta) {
          others += (others.empty() ? "" : ",") + std::to_string(l);
          other_theta = lr[l].theta;
        }
      }
      if (!others.empty()) {
        std::printf("note: layers %s (sliding-window) rotate with RoPE theta %g; a dump holds one "
                    "theta, the one above\n",
                    others.c_str(), other_theta);
      }
    }
    const bool st = out.size() > 12 && out.substr(out.size() - 12) == ".safetensors";
    kvq::io::save_kv_dump(out, dump,
                          st ? kvq::io::DumpFormat::kSafetensors : kvq::io::DumpFormat::kNpyDir);
    std::printf("wrote %s: %lld layers x %lld tokens%s\n", out.c_str(),
                static_cast<long long>(dump.num_layers()), static_cast<long long>(dump.tokens()),
                synthetic ? " (SYNTHETIC)" : "");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvq_make_dump: %s\n", e.what());
    return 1;
  }
  return 0;
}

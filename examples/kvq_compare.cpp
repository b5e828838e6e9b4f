// kvq_compare: the geometry-vs-bits comparison (kvq's main job).
//
// Quantizes keys and values under a grid of schemes (grouping axis x bits x group size, raw
// formats) and reports, for each, the effective bits (metadata included, checked against the
// packed bytes) and the error where the tensors are consumed: key/value relative MSE, attention
// score error, attention weight KL and attention output error. Default input: kvq's built-in
// synthetic KV generator (keys with fixed outlier channels and RoPE, values without).
//
// Writes <out>/compare.csv, <out>/compare.json and <out>/compare.svg (error vs effective bits,
// Pareto front marked).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kvq/accounting/accountant.hpp"
#include "kvq/eval/metrics.hpp"
#include "kvq/eval/synthetic.hpp"
#include "kvq/quant/quantize.hpp"
#include "report.hpp"

namespace {

struct Scheme {
  std::string name;      // e.g. "int2 K:channel V:token g32"
  std::string geometry;  // plot group
  kvq::QuantConfig k, v;
};

kvq::QuantConfig raw(kvq::Format f) {
  kvq::QuantConfig c;
  c.format = f;
  return c;
}
kvq::QuantConfig integer(int bits, kvq::Axis axis, int64_t group, bool sym = false) {
  kvq::QuantConfig c;
  c.format = kvq::Format::kInt;
  c.bits = bits;
  c.axis = axis;
  c.group = group;
  c.symmetric = sym;
  return c;
}

std::vector<Scheme> default_grid() {
  using kvq::Axis;
  std::vector<Scheme> g;
  g.push_back({"f16", "raw", raw(kvq::Format::kF16), raw(kvq::Format::kF16)});
  g.push_back({"bf16", "raw", raw(kvq::Format::kBF16), raw(kvq::Format::kBF16)});
  struct Geo {
    const char* name;
    Axis k, v;
  };
  const Geo geos[] = {{"K channel / V token", Axis::kChannel, Axis::kToken},
                      {"K token / V channel", Axis::kToken, Axis::kChannel},
                      {"K token / V token", Axis::kToken, Axis::kToken},
                      {"K channel / V channel", Axis::kChannel, Axis::kChannel}};
  for (int bits : {2, 3, 4, 8})
    for (const Geo& geo : geos)
      g.push_back({"int" + std::to_string(bits) + " " + geo.name + " g32", geo.name,
                   integer(bits, geo.k, 32), integer(bits, geo.v, 32)});
  for (int bits : {2, 4})
    for (int group : {64, 128})
      g.push_back({"int" + std::to_string(bits) + " K channel / V token g" +
                       std::to_string(group),
                   "K channel / V token", integer(bits, Axis::kChannel, group),
                   integer(bits, Axis::kToken, group)});
  for (int bits : {4, 8})
    g.push_back({"sint" + std::to_string(bits) + " K token / V token g32 (q" +
                     std::to_string(bits) + "_0)",
                 "K token / V token", integer(bits, Axis::kToken, 32, true),
                 integer(bits, Axis::kToken, 32, true)});
  auto fp8 = [](kvq::Format f, Axis a) {
    kvq::QuantConfig c;
    c.format = f;
    c.bits = 8;
    c.axis = a;
    return c;
  };
  g.push_back({"e4m3 per-head scale", "fp8", fp8(kvq::Format::kE4M3, Axis::kHead),
               fp8(kvq::Format::kE4M3, Axis::kHead)});
  g.push_back({"e4m3 per-token scale", "fp8", fp8(kvq::Format::kE4M3, Axis::kToken),
               fp8(kvq::Format::kE4M3, Axis::kToken)});
  g.push_back({"e5m2 per-head scale", "fp8", fp8(kvq::Format::kE5M2, Axis::kHead),
               fp8(kvq::Format::kE5M2, Axis::kHead)});
  g.push_back({"k8v4 (e4m3 K per-head, int4 V token g32)", "fp8",
               fp8(kvq::Format::kE4M3, Axis::kHead), integer(4, Axis::kToken, 32)});
  auto lm = [](int bits, bool qjl) {
    kvq::QuantConfig c;
    c.format = kvq::Format::kLloydMax;
    c.bits = bits;
    c.qjl = qjl;
    return c;
  };
  for (int bits : {2, 3, 4})
    g.push_back({"lm" + std::to_string(bits) + " rotated K and V", "rotation + Lloyd-Max",
                 lm(bits, false), lm(bits, false)});
  for (int bits : {2, 3})
    g.push_back({"lm" + std::to_string(bits) + "+qjl K, lm" + std::to_string(bits + 1) + " V",
                 "rotation + Lloyd-Max + QJL (keys)", lm(bits, true), lm(bits + 1, false)});
  return g;
}

void usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--out DIR] [--layers N] [--tokens T] [--kv-heads H] [--q-heads Q]\n"
               "          [--head-dim D] [--seed S] [--json]\n"
               "Runs the geometry-vs-bits comparison on kvq's built-in synthetic KV data.\n",
               argv0);
}

int parse_int(const char* flag, const char* v) {
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (!end || *end || x <= 0 || x > 1 << 20) {
    std::fprintf(stderr, "kvq_compare: %s needs a positive integer, got '%s'\n", flag, v);
    std::exit(2);
  }
  return static_cast<int>(x);
}

}  // namespace

int main(int argc, char** argv) {
  kvq::eval::SyntheticSpec spec;
  std::string out_dir = "kvq_compare_out";
  bool json_stdout = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "kvq_compare: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--out") out_dir = next();
    else if (a == "--layers") spec.layers = parse_int("--layers", next());
    else if (a == "--tokens") spec.tokens = parse_int("--tokens", next());
    else if (a == "--kv-heads") spec.kv_heads = parse_int("--kv-heads", next());
    else if (a == "--q-heads") spec.q_heads = parse_int("--q-heads", next());
    else if (a == "--head-dim") spec.head_dim = parse_int("--head-dim", next());
    else if (a == "--seed") spec.seed = static_cast<uint32_t>(parse_int("--seed", next()));
    else if (a == "--json") json_stdout = true;
    else if (a == "-h" || a == "--help") {
      usage(argv[0]);
      return 0;
    } else {
      std::fprintf(stderr, "kvq_compare: unknown argument '%s'\n", a.c_str());
      usage(argv[0]);
      return 2;
    }
  }
  try {
    const auto t0 = std::chrono::steady_clock::now();
    const auto data = kvq::eval::make_synthetic_kv(spec);
    const kvq::Shape shape{spec.tokens, spec.kv_heads, spec.head_dim};
    std::fprintf(stderr,
                 "kvq_compare: input is SYNTHETIC (kvq's built-in generator: keys with fixed "
                 "outlier channels + RoPE, values without; %d layers x %s)\n",
                 spec.layers, shape.str().c_str());
    const auto grid = default_grid();
    std::vector<kvq_tools::Row> rows;
    std::vector<float> kq(static_cast<size_t>(shape.numel())), vq(kq.size());
    for (size_t si = 0; si < grid.size(); ++si) {
      const Scheme& sc = grid[si];
      std::fprintf(stderr, "\r[%zu/%zu] %-48s", si + 1, grid.size(), sc.name.c_str());
      double bytes = 0, acct = 0, kerr = 0, verr = 0, serr = 0, wkl = 0, oerr = 0;
      for (const auto& L : data) {
        kvq::KVView<const float> k(L.k.data(), shape), v(L.v.data(), shape);
        const auto qk = kvq::quantize(sc.k, k);
        const auto qv = kvq::quantize(sc.v, v);
        bytes += static_cast<double>(qk.bytes() + qv.bytes());
        acct += static_cast<double>(kvq::account(sc.k, shape).total() +
                                    kvq::account(sc.v, shape).total());
        kvq::KVView<float> kd(kq.data(), shape), vd(vq.data(), shape);
        kvq::dequantize(qk, kd);
        kvq::dequantize(qv, vd);
        kerr += kvq::eval::relative_mse(k, kvq::KVView<const float>(kd));
        verr += kvq::eval::relative_mse(v, kvq::KVView<const float>(vd));
        const auto e = kvq::eval::attention_errors(L.q.data(), spec.q_heads, k, v, kd, vd);
        serr += e.score_rel_error;
        wkl += e.weight_kl;
        oerr += e.output_rel_error;
      }
      if (bytes != acct) {
        std::fprintf(stderr, "\nkvq_compare: internal error: packed bytes %.0f != accountant %.0f\n",
                     bytes, acct);
        return 1;
      }
      const double n = static_cast<double>(data.size());
      kvq_tools::Row r;
      r.text = {{"scheme", sc.name}, {"geometry", sc.geometry}};
      r.num = {{"effective_bits", 8.0 * bytes / (2.0 * n * static_cast<double>(shape.numel()))},
               {"key_rel_mse", kerr / n},
               {"value_rel_mse", verr / n},
               {"attn_score_rel_err", serr / n},
               {"attn_kl", wkl / n},
               {"attn_output_rel_err", oerr / n}};
      rows.push_back(r);
    }
    std::fprintf(stderr, "\r%-60s\r", "");
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    std::vector<double> x, y;
    std::vector<std::string> labels, groups;
    for (auto& r : rows) {
      x.push_back(r.get("effective_bits"));
      y.push_back(r.get("attn_output_rel_err"));
      labels.push_back(r.get_text("scheme"));
      groups.push_back(r.get_text("geometry"));
    }
    const std::string input = "synthetic (kvq built-in generator), " + std::to_string(spec.layers) +
                              " layers x " + shape.str();
    std::string cmd;
    for (int i = 0; i < argc; ++i) cmd += (i ? " " : "") + std::string(argv[i]);
    const std::string json =
        kvq_tools::to_json(rows, {{"tool", "kvq_compare"}, {"input", input}, {"command", cmd}});
    std::string mk = "mkdir -p '" + out_dir + "'";
    if (std::system(mk.c_str()) != 0) throw std::runtime_error("cannot create " + out_dir);
    kvq_tools::write_file(out_dir + "/compare.json", json);
    kvq_tools::write_file(out_dir + "/compare.csv", kvq_tools::to_csv(rows));
    kvq_tools::write_file(
        out_dir + "/compare.svg",
        kvq_tools::svg_plot(x, y, labels, groups,
                            "Attention output error vs effective bits (" + input + ")",
                            "effective bits per value (K and V, metadata included)",
                            "attention output relative error (log scale)"));
    if (json_stdout) {
      std::fputs(json.c_str(), stdout);
    } else {
      std::printf("Geometry vs bits on %s\n", input.c_str());
      std::printf("(SYNTHETIC input: keys have fixed outlier channels and RoPE, values do not)\n\n");
      kvq_tools::print_table(rows);
      std::printf("\nWrote %s/compare.{csv,json,svg} in %.1f s\n", out_dir.c_str(), secs);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "\nkvq_compare: %s\n", e.what());
    return 1;
  }
  return 0;
}

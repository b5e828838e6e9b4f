// kvq_quantize_dump: quantizes every layer of a KV dump under each policy and reports where the
// error lands.
//
//   kvq_quantize_dump --policy SPEC[;SPEC...] [--json] [--queries N] [--prerope
//                     [--rope-theta T] [--rope-style adjacent|half]] PATH
//
// PATH is a .safetensors file or a directory of .npy files following docs/dump-format.md
// (layers.<i>.k, layers.<i>.v, optional layers.<i>.q and layers.<i>.k_prerope, each
// [tokens, heads, head_dim]). Each layer's K and V are appended to kvq's streaming cache as one
// prefill chunk (so residual window, sinks and layer skips apply exactly as in an engine) and
// read back. Reported per policy: effective bits with the byte breakdown, key and value
// relative MSE, and for the last N query positions (causal): attention-score error,
// attention-weight KL and attention-output relative error — with the dump's queries when
// present, else with the keys' own rows as stand-in queries (the output says which).
// --prerope quantizes the pre-RoPE keys and applies RoPE after dequantization (KVQuant).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kvq/cache/kv_cache.hpp"
#include "kvq/core/rope.hpp"
#include "kvq/eval/metrics.hpp"
#include "kvq/eval/synthetic.hpp"
#include "kvq/io/kv_dump.hpp"
#include "kvq/policy/spec.hpp"
#include "calibration_source.hpp"
#include "report.hpp"

namespace {

void usage() {
  std::fprintf(stderr,
               "usage: kvq_quantize_dump --policy SPEC[;SPEC...] [--json] [--queries N]\n"
               "                         [--prerope [--rope-theta T] [--rope-style adjacent|half]]\n"
               "                         [--calibrate CAL]... [--save-calibration FILE] PATH\n"
               "%s",
               kvq_tools::CalibrationArgs::usage(false).c_str());
}

}  // namespace

int main(int argc, char** argv) {
  std::string policy_arg, path, rope_style = "adjacent";
  bool json = false, prerope = false;
  kvq_tools::CalibrationArgs calib;
  int n_queries = 16;
  double theta = 10000.0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "kvq_quantize_dump: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (calib.parse("kvq_quantize_dump", argc, argv, i)) continue;
    if (a == "--policy") policy_arg = next();
    else if (a == "--json") json = true;
    else if (a == "--prerope") prerope = true;
    else if (a == "--rope-style") rope_style = next();
    else if (a == "--rope-theta") {
      char* end = nullptr;
      const char* v = next();
      theta = std::strtod(v, &end);
      if (!end || *end || !(theta > 1)) {
        std::fprintf(stderr, "kvq_quantize_dump: --rope-theta needs a number > 1, got '%s'\n", v);
        return 2;
      }
    } else if (a == "--queries") {
      char* end = nullptr;
      const char* v = next();
      const long n = std::strtol(v, &end, 10);
      if (!end || *end || n <= 0 || n > 1 << 20) {
        std::fprintf(stderr, "kvq_quantize_dump: --queries needs a positive integer, got '%s'\n", v);
        return 2;
      }
      n_queries = static_cast<int>(n);
    } else if (a == "-h" || a == "--help") {
      usage();
      return 0;
    } else if (!a.empty() && a[0] == '-') {
      std::fprintf(stderr, "kvq_quantize_dump: unknown option '%s'\n", a.c_str());
      usage();
      return 2;
    } else if (path.empty()) {
      path = a;
    } else {
      std::fprintf(stderr, "kvq_quantize_dump: more than one PATH ('%s', '%s')\n", path.c_str(),
                   a.c_str());
      return 2;
    }
  }
  if (policy_arg.empty() || path.empty()) {
    usage();
    return 2;
  }
  if (rope_style != "adjacent" && rope_style != "half") {
    std::fprintf(stderr, "kvq_quantize_dump: --rope-style must be adjacent or half, got '%s'\n",
                 rope_style.c_str());
    return 2;
  }
  try {
    auto policies = kvq::parse_policies(policy_arg);
    const kvq::io::KVDump dump = kvq::io::load_kv_dump(path);
    const int L = static_cast<int>(dump.num_layers());
    std::vector<std::string> names;  // specs as given (a calibrated policy lists every layer)
    for (const kvq::Policy& p : policies) names.push_back(p.spec());
    const std::string calib_what = kvq_tools::calibrate_policies(
        policies, calib, L, nullptr, prerope, [](const std::string&, kvq::eval::KVBackend&) {},
        "kvq_quantize_dump");
    const kvq::Shape shape = dump.layers[0].k.kv_shape();
    for (int l = 0; l < L; ++l)
      KVQ_REQUIRE(dump.layers[static_cast<size_t>(l)].k.kv_shape() == shape, kShapeMismatch,
                  "kvq_quantize_dump needs every layer to have the same shape; layer ", l, " is ",
                  dump.layers[static_cast<size_t>(l)].k.kv_shape().str(), ", layer 0 is ",
                  shape.str());
    const bool have_q = dump.layers[0].q.has_value();
    if (prerope)
      for (int l = 0; l < L; ++l)
        KVQ_REQUIRE(dump.layers[static_cast<size_t>(l)].k_prerope.has_value(), kInvalidArgument,
                    "--prerope needs layers.", l, ".k_prerope in the dump");
    const std::string query_source =
        have_q ? "dump queries" : "keys as stand-in queries (the dump has no layers.<i>.q)";
    std::fprintf(stderr, "kvq_quantize_dump: %d layers x %s; attention measured with %s\n", L,
                 shape.str().c_str(), query_source.c_str());

    // Per-layer float copies.
    std::vector<std::vector<float>> K(static_cast<size_t>(L)), V(K.size()), Q(K.size()),
        KP(K.size());
    int q_heads = static_cast<int>(shape.heads);
    for (int l = 0; l < L; ++l) {
      const auto& ly = dump.layers[static_cast<size_t>(l)];
      K[static_cast<size_t>(l)] = ly.k.to_float();
      V[static_cast<size_t>(l)] = ly.v.to_float();
      if (ly.q) {
        Q[static_cast<size_t>(l)] = ly.q->to_float();
        q_heads = static_cast<int>(ly.q->shape[1]);
      }
      if (prerope) KP[static_cast<size_t>(l)] = ly.k_prerope->to_float();
    }
    const int64_t T = shape.tokens, H = shape.heads, D = shape.head_dim;
    const int64_t nq = std::min<int64_t>(n_queries, T);

    std::vector<kvq_tools::Row> rows;
    for (std::size_t pi = 0; pi < policies.size(); ++pi) {
      const kvq::Policy& p = policies[pi];
      kvq::KVCache cache(p, L, static_cast<int>(H), static_cast<int>(D));
      std::vector<float> kd(static_cast<size_t>(shape.numel())), vd(kd.size());
      double kerr = 0, verr = 0, serr = 0, wkl = 0, oerr = 0;
      int64_t nmeas = 0;
      for (int l = 0; l < L; ++l) {
        const auto li = static_cast<size_t>(l);
        const float* kin = prerope ? KP[li].data() : K[li].data();
        cache.append(l, kvq::KVView<const float>(kin, shape),
                     kvq::KVView<const float>(V[li].data(), shape));
        cache.read(l, 0, T, kvq::KVView<float>(kd.data(), shape),
                   kvq::KVView<float>(vd.data(), shape));
        if (prerope) {
          kvq::RopeConfig rc;
          rc.theta = theta;
          rc.style = rope_style == "half" ? kvq::RopeStyle::kHalf : kvq::RopeStyle::kAdjacent;
          kvq::apply_rope_pairs(kd.data(), T, H, D, 0, rc);
        }
        kvq::KVView<const float> kref(K[li].data(), shape), vref(V[li].data(), shape);
        kvq::KVView<const float> kt(kd.data(), shape), vt(vd.data(), shape);
        kerr += kvq::eval::relative_mse(kref, kt);
        verr += kvq::eval::relative_mse(vref, vt);
        std::vector<float> qrow(static_cast<size_t>(q_heads * D));
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t pos = T - nq + i;  // causal: attend to tokens [0, pos]
          if (have_q) {
            std::copy_n(Q[li].data() + pos * q_heads * D, q_heads * D, qrow.begin());
          } else {
            std::copy_n(K[li].data() + pos * H * D, H * D, qrow.begin());
          }
          const auto e = kvq::eval::attention_errors(
              qrow.data(), q_heads, kref.slice_tokens(0, pos + 1), vref.slice_tokens(0, pos + 1),
              kt.slice_tokens(0, pos + 1), vt.slice_tokens(0, pos + 1));
          serr += e.score_rel_error;
          wkl += e.weight_kl;
          oerr += e.output_rel_error;
          ++nmeas;
        }
      }
      const auto rep = cache.memory_report();
      const auto kb = rep.key_total(), vb = rep.value_total();
      kvq_tools::Row r;
      r.text = {{"policy", names[pi]}, {"queries", have_q ? "dump" : "keys (stand-in)"}};
      r.num = {{"effective_bits", rep.effective_bits()},
               {"bytes", static_cast<double>(rep.total())},
               {"codes_bytes", static_cast<double>(kb.packed.codes + vb.packed.codes)},
               {"scales_bytes", static_cast<double>(kb.packed.scales + vb.packed.scales)},
               {"zeros_bytes", static_cast<double>(kb.packed.zeros + vb.packed.zeros)},
               {"norms_bytes", static_cast<double>(kb.packed.norms + vb.packed.norms)},
               {"other_packed_bytes",
                static_cast<double>(kb.packed.residual + vb.packed.residual + kb.packed.padding +
                                    vb.packed.padding + kb.packed.outliers + vb.packed.outliers +
                                    kb.packed.codebooks + vb.packed.codebooks)},
               {"full_precision_bytes",
                static_cast<double>(kb.sinks + vb.sinks + kb.residual + vb.residual)},
               {"rollback_bytes", static_cast<double>(kb.rollback + vb.rollback)},
               {"key_rel_mse", kerr / L},
               {"value_rel_mse", verr / L},
               {"attn_score_rel_err", nmeas ? serr / static_cast<double>(nmeas) : 0.0},
               {"attn_kl", nmeas ? wkl / static_cast<double>(nmeas) : 0.0},
               {"attn_output_rel_err", nmeas ? oerr / static_cast<double>(nmeas) : 0.0}};
      rows.push_back(r);
    }
    if (json) {
      std::fputs(kvq_tools::to_json(rows, {{"tool", "kvq_quantize_dump"},
                                           {"dump", path},
                                           {"shape", shape.str()},
                                           {"query_source", query_source},
                                           {"calibration", calib_what.empty() ? std::string("none") : calib_what}})
                     .c_str(),
                 stdout);
    } else {
      std::printf("KV dump %s: %d layers x %s; attention error over the last %lld positions "
                  "with %s%s\n\n",
                  path.c_str(), L, shape.str().c_str(), static_cast<long long>(nq),
                  query_source.c_str(), prerope ? "; keys quantized before RoPE" : "");
      kvq_tools::print_table(rows);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvq_quantize_dump: %s\n", e.what());
    return 1;
  }
  return 0;
}

// kvq_compare: the geometry-vs-bits comparison (kvq's main job).
//
// Quantizes keys and values under a grid of schemes (grouping axis x bits x group size, FP8,
// rotation + Lloyd-Max, the presets) and reports, for each, the effective bits (metadata
// included, checked against the packed bytes) and the error where the tensors are consumed:
// key/value relative MSE, attention score error, attention weight KL and attention output
// error. Inputs:
//   (default)                     kvq's built-in synthetic KV generator (eval/synthetic.hpp)
//   --dump PATH                   a KV dump (docs/dump-format.md): .safetensors or .npy dir
//   --model M [--tokenizer T] --text F
//                                 a real model — llama2.c checkpoint (with its tokenizer T) or
//                                 GGUF file (detected by magic; `smollm2` / `gemma3` name the ones
//                                 fetched by ./kvq.sh model NAME) —: its real K/V/Q on one sequence
//                                 of F, and perplexity + next-token KL over F with the cache
//                                 held under each scheme (residual 0: every complete block
//                                 quantized)
//
// KVQuant's nuq<b> schemes need per-layer codebooks: --calibrate PATH (a calibration file, a KV
// dump, or for --model a text; repeatable, see calibration_source.hpp) supplies them. On the
// built-in synthetic input without --calibrate they are learned on a separate synthetic draw
// (seed + 1): data disjoint from the evaluation's. On a dump or model input without --calibrate
// the nuq schemes are skipped (and the output says why): calibrating on the evaluation data
// would leak it.
//
// Prints a table of at most 120 columns (numbers first, rows grouped by code width and sorted
// best first; print_compare_table) and writes <out>/compare.csv, <out>/compare.json (every
// field, the policy spec included; field names are stable) and <out>/compare.svg (error vs
// effective bits, Pareto front marked). docs/compare.md describes the output.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <unistd.h>

#include "calibration_source.hpp"
#include "eval_model.hpp"
#include "kvq/accounting/accountant.hpp"
#include "kvq/eval/cache_backend.hpp"
#include "kvq/core/rope.hpp"
#include "kvq/core/rows.hpp"
#include "kvq/eval/llama2c.hpp"
#include "kvq/eval/metrics.hpp"
#include "kvq/eval/synthetic.hpp"
#include "kvq/io/kv_dump.hpp"
#include "kvq/policy/plan.hpp"
#include "kvq/policy/spec.hpp"
#include "kvq/io/calibration_file.hpp"
#include "kvq/quant/quantize.hpp"
#include "report.hpp"

namespace {

struct Scheme {
  std::string name;      // e.g. "int2 K:channel V:token g32"
  std::string geometry;  // plot group
  kvq::QuantConfig k, v;
  bool prerope = false;  // keys quantized before RoPE, RoPE applied after dequantization
  /// The scheme as a cache policy (residual 0); for nuq schemes, after calibration, with the
  /// per-layer codebooks as overrides.
  kvq::Policy policy() const {
    if (calibrated) return *calibrated;
    kvq::Policy p;
    p.key = k;
    p.value = v;
    return p;
  }
  bool needs_calibration() const {
    return k.format == kvq::Format::kNuq || v.format == kvq::Format::kNuq;
  }
  std::shared_ptr<const kvq::Policy> calibrated = nullptr;
  /// A kvq_plan policy (per-layer overrides in `calibrated`; k and v are its base configs).
  bool planned = false;
};

kvq::QuantConfig raw(kvq::Format f) { return kvq::raw_config(f); }
kvq::QuantConfig integer(int bits, kvq::Axis axis, int64_t group, bool sym = false) {
  return kvq::int_config(bits, axis, group, sym);
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
  auto fp8 = [](kvq::Format f, Axis a) { return kvq::fp8_config(f, a, 0); };
  g.push_back({"e4m3 per-head scale", "fp8", fp8(kvq::Format::kE4M3, Axis::kHead),
               fp8(kvq::Format::kE4M3, Axis::kHead)});
  g.push_back({"e4m3 per-token scale", "fp8", fp8(kvq::Format::kE4M3, Axis::kToken),
               fp8(kvq::Format::kE4M3, Axis::kToken)});
  g.push_back({"e5m2 per-head scale", "fp8", fp8(kvq::Format::kE5M2, Axis::kHead),
               fp8(kvq::Format::kE5M2, Axis::kHead)});
  g.push_back({"k8v4 (e4m3 K per-head, int4 V token g32)", "fp8",
               fp8(kvq::Format::kE4M3, Axis::kHead), integer(4, Axis::kToken, 32)});
  auto lm = [](int bits, bool qjl) { return kvq::lm_config(bits, qjl); };
  for (int bits : {2, 3, 4})
    g.push_back({"lm" + std::to_string(bits) + " rotated K and V", "rotation + Lloyd-Max",
                 lm(bits, false), lm(bits, false)});
  for (int bits : {2, 3})
    g.push_back({"lm" + std::to_string(bits) + "+qjl K, lm" + std::to_string(bits + 1) + " V",
                 "rotation + Lloyd-Max + QJL (keys)", lm(bits, true), lm(bits + 1, false)});
  // KVQuant: per-channel key groups formed before RoPE (only where the input has pre-RoPE keys).
  for (int bits : {2, 3, 4})
    g.push_back({"int" + std::to_string(bits) + " K channel pre-RoPE / V token g32",
                 "K channel pre-RoPE / V token", integer(bits, Axis::kChannel, 32),
                 integer(bits, Axis::kToken, 32), true});
  // KVQuant dense-and-sparse: the same, with ceil(1% x head_dim) exact outliers per vector
  // (docs/outliers.md). nuq<b> needs per-layer calibrated codebooks: kvq_perplexity --calibrate.
  for (int bits : {2, 3, 4}) {
    kvq::QuantConfig k = integer(bits, Axis::kChannel, 32), v = integer(bits, Axis::kToken, 32);
    k.outlier_pct = v.outlier_pct = 1.f;
    g.push_back({"int" + std::to_string(bits) + "+1% outliers K channel pre-RoPE / V token g32",
                 "K channel pre-RoPE / V token + 1% outliers", k, v, true});
  }
  // KVQuant's non-uniform datatype: nuq<b> codebooks learned per layer (K and V) on calibration
  // data, alone and with 1% outliers (KVQuant's full recipe with the pre-RoPE per-channel keys).
  for (int out : {0, 1})
    for (int bits : {2, 3, 4}) {
      kvq::QuantConfig k = kvq::nuq_config(bits, Axis::kChannel, 32),
                       v = kvq::nuq_config(bits, Axis::kToken, 32);
      k.outlier_pct = v.outlier_pct = static_cast<float>(out);
      g.push_back({"nuq" + std::to_string(bits) + (out ? "+1% outliers" : "") +
                       " K channel pre-RoPE / V token g32",
                   std::string("nuq K channel pre-RoPE / V token") + (out ? " + 1% outliers" : ""),
                   k, v, true});
    }
  return g;
}

/// One layer of the input: K and V [tokens, kv_heads, head_dim], and nq queries
/// [nq, q_heads, head_dim] at positions tokens - nq .. tokens - 1 (each attends causally).
struct Layer {
  std::vector<float> k, v, q;
  std::vector<float> kp;  // pre-RoPE keys (empty when the input has none)
  int64_t nq = 0;
};

struct Input {
  std::string description;   // one line, for the table header, JSON and plot title
  std::string query_source;  // where the attention queries come from
  /// RoPE that turns the pre-RoPE keys into the keys (positions 0..tokens-1), when kp is set.
  std::function<void(float*, const kvq::Shape&)> rope;
  /// Per-layer RoPE of a model whose layers differ (Gemma 3's local and global layers); when
  /// set, it replaces `rope` for layer i.
  std::vector<kvq::RopeConfig> layer_rope;
  kvq::Shape shape;
  int q_heads = 0;
  std::vector<Layer> layers;
};

Input synthetic_input(const kvq::eval::SyntheticSpec& spec) {
  Input in;
  in.shape = kvq::Shape{spec.tokens, spec.kv_heads, spec.head_dim};
  in.q_heads = spec.q_heads;
  in.description = "SYNTHETIC (kvq built-in generator: keys with fixed outlier channels + RoPE, "
                   "values without), " +
                   std::to_string(spec.layers) + " layers x " + in.shape.str();
  in.query_source = "synthetic queries (last " + std::to_string(spec.queries) +
                    " positions, causal)";
  in.rope = [](float* x, const kvq::Shape& s) {  // the generator's own RoPE
    kvq::eval::apply_rope(x, s.tokens, s.heads, s.head_dim, 0);
  };
  for (auto& L : kvq::eval::make_synthetic_kv(spec)) {
    Layer l;
    l.k = std::move(L.k);
    l.v = std::move(L.v);
    l.q = std::move(L.q);
    l.kp = std::move(L.k_prerope);
    l.nq = spec.queries;
    in.layers.push_back(std::move(l));
  }
  return in;
}

Input dump_input(const std::string& path, int n_queries, const kvq::RopeConfig& rc) {
  const kvq::io::KVDump dump = kvq::io::load_kv_dump(path);
  Input in;
  in.shape = dump.layers.at(0).k.kv_shape();
  in.q_heads = static_cast<int>(in.shape.heads);
  const bool have_q = dump.layers[0].q.has_value();
  const int64_t T = in.shape.tokens, H = in.shape.heads, D = in.shape.head_dim;
  for (size_t li = 0; li < dump.layers.size(); ++li) {
    const auto& d = dump.layers[li];
    KVQ_REQUIRE(d.k.kv_shape() == in.shape, kShapeMismatch,
                "kvq_compare needs every layer of the dump to have the same shape; layer ", li,
                " is ", d.k.kv_shape().str(), ", layer 0 is ", in.shape.str());
    KVQ_REQUIRE(d.q.has_value() == have_q, kInvalidArgument,
                "kvq_compare: layers.0 ", have_q ? "has" : "has no", " q but layers.", li,
                have_q ? " has none" : " has one");
    Layer l;
    l.k = d.k.to_float();
    l.v = d.v.to_float();
    if (d.k_prerope) l.kp = d.k_prerope->to_float();
    l.nq = std::min<int64_t>(n_queries, T);
    const int64_t first = T - l.nq;
    if (have_q) {
      const std::vector<float> q = d.q->to_float();
      in.q_heads = static_cast<int>(d.q->shape[1]);
      l.q.assign(q.begin() + first * in.q_heads * D, q.end());
    } else {
      l.q.assign(l.k.begin() + first * H * D, l.k.end());
    }
    in.layers.push_back(std::move(l));
  }
  in.query_source = have_q ? "the dump's queries (last " + std::to_string(in.layers[0].nq) +
                                 " positions, causal)"
                           : "keys as stand-in queries (the dump has no layers.<i>.q; last " +
                                 std::to_string(in.layers[0].nq) + " positions, causal)";
  in.description = "KV dump " + path + ", " + std::to_string(in.layers.size()) + " layers x " +
                   in.shape.str();
  bool all_kp = true;
  for (const Layer& l : in.layers) all_kp = all_kp && !l.kp.empty();
  if (!all_kp) {
    for (Layer& l : in.layers) l.kp.clear();
  } else {  // RoPE of the dump's pre-RoPE keys, as given by --rope-style / --rope-theta
    in.rope = [rc](float* x, const kvq::Shape& s) {
      kvq::apply_rope_pairs(x, s.tokens, s.heads, s.head_dim, 0, rc);
    };
  }
  return in;
}

/// The model's K, V and queries on the longest of the first 64 non-empty lines of the text.
Input model_input(kvq_tools::EvalModel& model, const std::vector<std::string>& lines,
                  int n_queries) {
  std::vector<int> ids;
  size_t which = 0, seen = 0;
  for (size_t i = 0; i < lines.size() && seen < 64; ++i) {
    if (lines[i].empty()) continue;
    ++seen;
    auto t = model.encode_line(lines[i]);  // cut to the model's evaluation length
    if (t.size() > ids.size()) {
      ids = std::move(t);
      which = i;
    }
  }
  KVQ_REQUIRE(ids.size() >= 2, kInvalidArgument, "kvq_compare: the text has no non-empty line");
  kvq_tools::RecordingBackend be(model.kv_geometry());
  model.run(ids, be);
  Input in;
  const auto geo = model.kv_geometry();
  const int64_t T = static_cast<int64_t>(ids.size());
  in.shape = kvq::Shape{T, geo.n_kv_heads, geo.head_dim};
  in.q_heads = be.n_heads();
  for (int l = 0; l < geo.n_layers; ++l) {
    Layer L;
    L.k = kvq::to_float_nhd(be.inner().keys(l));
    L.kp = kvq::to_float_nhd(be.inner().keys_prerope(l));
    L.v = kvq::to_float_nhd(be.inner().values(l));
    L.nq = std::min<int64_t>(n_queries, T);
    const auto& q = be.queries(l);
    L.q.assign(q.end() - L.nq * in.q_heads * geo.head_dim, q.end());
    in.layers.push_back(std::move(L));
  }
  in.query_source = "the model's own queries (last " + std::to_string(in.layers[0].nq) +
                    " positions, causal)";
  const kvq::RopeConfig rc = model.rope();
  in.rope = [rc](float* x, const kvq::Shape& s) {  // the model's own RoPE
    kvq::apply_rope_pairs(x, s.tokens, s.heads, s.head_dim, 0, rc);
  };
  in.layer_rope = model.layer_ropes();
  in.description = "model " + model.path() + " (K/V of text line " + std::to_string(which + 1) +
                   "), " + std::to_string(geo.n_layers) + " layers x " + in.shape.str();
  return in;
}

/// Tensor-level metrics of one scheme over every layer of the input; effective bits from the
/// packed bytes, which must equal the accountant's figure.
kvq_tools::Row evaluate_scheme(const Scheme& sc, const Input& in) {
  const kvq::Shape shape = in.shape;
  std::vector<float> kq(static_cast<size_t>(shape.numel())), vq(kq.size());
  double bytes = 0, acct = 0, kerr = 0, verr = 0, serr = 0, wkl = 0, oerr = 0;
  int64_t nmeas = 0;
  const int64_t qstride = static_cast<int64_t>(in.q_heads) * shape.head_dim;
  KVQ_REQUIRE(!sc.prerope || !in.layers.front().kp.empty(), kUnsupported,
              "the input has no pre-RoPE keys");
  const kvq::Policy pol = sc.policy();
  const int n_layers = static_cast<int>(in.layers.size());
  for (int li = 0; li < n_layers; ++li) {
    const Layer& L = in.layers[static_cast<size_t>(li)];
    const kvq::QuantConfig kc = pol.key_for(li, n_layers), vc = pol.value_for(li, n_layers);
    kvq::KVView<const float> k(L.k.data(), shape), v(L.v.data(), shape);
    const auto qk = kvq::quantize(
        kc, sc.prerope ? kvq::KVView<const float>(L.kp.data(), shape) : k);
    const auto qv = kvq::quantize(vc, v);
    // Packed bytes plus the per-layer metadata (a nuq layer's codebooks) on both sides.
    const auto layer_meta = kvq::layer_metadata_bytes(kc) + kvq::layer_metadata_bytes(vc);
    bytes += static_cast<double>(qk.bytes() + qv.bytes() + layer_meta);
    acct += static_cast<double>(kvq::account(kc, shape).total() +
                                kvq::account(vc, shape).total() + layer_meta);
    kvq::KVView<float> kd(kq.data(), shape), vd(vq.data(), shape);
    kvq::dequantize(qk, kd);
    kvq::dequantize(qv, vd);
    if (sc.prerope && !in.layer_rope.empty()) {
      kvq::apply_rope_pairs(kq.data(), shape.tokens, shape.heads, shape.head_dim, 0,
                            in.layer_rope[static_cast<size_t>(li)]);
    } else if (sc.prerope) {
      in.rope(kq.data(), shape);
    }
    const kvq::KVView<const float> kt(kq.data(), shape), vt(vq.data(), shape);
    kerr += kvq::eval::relative_mse(k, kt);
    verr += kvq::eval::relative_mse(v, vt);
    for (int64_t i = 0; i < L.nq; ++i) {
      const int64_t n = shape.tokens - L.nq + i + 1;  // causal: tokens [0, pos]
      const auto e = kvq::eval::attention_errors(L.q.data() + i * qstride, in.q_heads,
                                                 k.slice_tokens(0, n), v.slice_tokens(0, n),
                                                 kt.slice_tokens(0, n), vt.slice_tokens(0, n));
      serr += e.score_rel_error;
      wkl += e.weight_kl;
      oerr += e.output_rel_error;
      ++nmeas;
    }
  }
  if (bytes != acct) {  // a logic_error, not a kvq::Error: never mistaken for a skipped scheme
    throw std::logic_error("kvq_compare: internal error: " + sc.name + " packed " +
                           std::to_string(bytes) + " bytes but the accountant says " +
                           std::to_string(acct));
  }
  const double n = static_cast<double>(in.layers.size());
  const double m = static_cast<double>(std::max<int64_t>(nmeas, 1));
  kvq_tools::Row r;
  r.text = {{"scheme", sc.name}, {"geometry", sc.geometry}};
  r.num = {{"effective_bits", 8.0 * bytes / (2.0 * n * static_cast<double>(shape.numel()))},
           {"key_rel_mse", kerr / n},
           {"value_rel_mse", verr / n},
           {"attn_score_rel_err", serr / m},
           {"attn_kl", wkl / m},
           {"attn_output_rel_err", oerr / m}};
  return r;
}

/// The scheme as a policy spec (residual 0), for kvq_perplexity / kvq_quantize_dump.
std::string scheme_spec(const Scheme& sc) {
  if (sc.planned) return sc.calibrated->spec();
  return "k=" + kvq::config_spec(sc.k) + ",v=" + kvq::config_spec(sc.v) + ",residual=0" +
         (sc.prerope ? " (keys pre-RoPE: kvq_perplexity --prerope)" : "") +
         (sc.needs_calibration() ? " (per-layer codebooks: --calibrate)" : "");
}

/// A calibration set from a synthetic draw: keys as quantized (pre-RoPE when `prerope`), the
/// post-RoPE keys and queries at every position (sensitivity weights), values.
kvq::CalibrationSet synthetic_calibration_set(kvq::eval::SyntheticSpec spec, bool prerope) {
  spec.queries = spec.tokens;
  kvq::CalibrationSet set;
  set.n_layers = spec.layers;
  set.kv_heads = spec.kv_heads;
  set.q_heads = spec.q_heads;
  set.head_dim = spec.head_dim;
  kvq::CalibrationSet::Sequence seq;
  seq.tokens = spec.tokens;
  for (auto& L : kvq::eval::make_synthetic_kv(spec)) {
    kvq::CalibrationSet::Layer cl;
    cl.k = prerope ? L.k_prerope : L.k;
    cl.k_attn = std::move(L.k);
    cl.v = std::move(L.v);
    cl.q = std::move(L.q);
    seq.layers.push_back(std::move(cl));
  }
  set.sequences.push_back(std::move(seq));
  return set;
}

/// Gives every nuq scheme of `grid` its per-layer codebooks (Scheme::calibrated): from
/// --calibrate when given, else on the synthetic input from a separate synthetic draw (seed + 1,
/// disjoint from the evaluation data); on a dump or model input without --calibrate, and for a
/// scheme no --calibrate file fits, the scheme is skipped with the reason. Saves each learned
/// calibration when --save-calibration is given. Returns the source description ("" when the
/// grid has no calibrated scheme).
std::string calibrate_grid(std::vector<Scheme>& grid, const kvq_tools::CalibrationArgs& args,
                           const Input& in, const kvq::eval::SyntheticSpec& spec,
                           kvq_tools::EvalModel* model, const kvq::eval::EvalOptions& opt,
                           std::vector<std::string>& skipped) {
  const int n_layers = static_cast<int>(in.layers.size());
  const bool synthetic = in.description.rfind("SYNTHETIC", 0) == 0;
  std::size_t n_cal = 0, i_cal = 0;
  for (const Scheme& sc : grid) n_cal += sc.needs_calibration() ? 1 : 0;
  kvq_tools::CalibrationFiles files;
  std::string all;
  std::unique_ptr<kvq::eval::KVGeometry> geo;
  if (model) geo = std::make_unique<kvq::eval::KVGeometry>(model->kv_geometry());
  kvq::eval::SyntheticSpec cal_spec = spec;
  cal_spec.seed = spec.seed + 1;
  std::map<bool, kvq::CalibrationSet> synth_sets;  // by prerope
  for (Scheme& sc : grid) {
    if (!sc.needs_calibration()) continue;
    if (sc.prerope && in.layers.front().kp.empty()) continue;  // evaluate_scheme skips it
    std::string what;
    kvq::Policy p = sc.policy();
    if (args.paths.empty()) {
      if (!synthetic) {
        skipped.push_back(sc.name + ": nuq needs per-layer codebooks: pass --calibrate PATH (a "
                          "calibration file, another KV dump" +
                          std::string(model ? ", or a text other than --text" : "") +
                          "); kvq_compare does not calibrate on the data it evaluates");
        continue;
      }
      auto it = synth_sets.find(sc.prerope);
      if (it == synth_sets.end())
        it = synth_sets.emplace(sc.prerope, synthetic_calibration_set(cal_spec, sc.prerope)).first;
      p = kvq::calibrate(p, it->second);
      what = "a separate synthetic draw (seed " + std::to_string(cal_spec.seed) +
             ", same shape), disjoint from the evaluation data (seed " +
             std::to_string(spec.seed) + ")";
    } else {
      std::optional<kvq::Policy> c = kvq_tools::try_calibrate_policy(
          p, args, n_layers, geo.get(), sc.prerope,
          [&](const std::string& path, kvq::eval::KVBackend& rec) {
            model->evaluate(rec, model->read_lines(path), opt);
          },
          files, &what);
      if (!c) {  // other files may serve other schemes
        skipped.push_back(sc.name + ": none of the --calibrate files holds codebooks for " +
                          kvq::config_spec(sc.k) + " / " + kvq::config_spec(sc.v));
        continue;
      }
      p = std::move(*c);
    }
    if (!args.save.empty()) {
      std::fprintf(stderr, "kvq_compare: %s: ", sc.name.c_str());
      kvq_tools::save_calibration_for(args.save, i_cal, n_cal, p, n_layers, what);
    }
    ++i_cal;
    sc.calibrated = std::make_shared<const kvq::Policy>(std::move(p));
    if (all.find(what) == std::string::npos) all += (all.empty() ? "" : "; ") + what;
  }
  kvq_tools::check_calibration_files(args, files);
  return all;
}

/// Width of one side's codes: the format's bits (16 for f16/bf16, 32 for f32, 8 for fp8), plus
/// the QJL residual's bit.
/// Budgets of the planned rows: the storage bits the grid's schemes span.
constexpr double kPlanBudgets[] = {2.5, 3.0, 3.5, 4.0, 5.0};

/// The budget planner's schemes (docs/plan.md) on this input: for every layer, the attention
/// output error of each default candidate (nuq aside) on the keys alone and on the values alone (the other
/// side exact), summed over the query positions; policy/plan.hpp's knapsack then picks the
/// least summed error per budget. Unlike kvq_plan there is no end-to-end probe (a dump has no
/// model), so every layer's error counts alike. Budgets no choice fits are listed in `skipped`.
std::vector<Scheme> planned_schemes(const Input& in, std::vector<std::string>& skipped) {
  // The default candidates but nuq: its codebooks would be learned on the evaluation rows
  // themselves here (kvq_plan learns them on its calibration text).
  auto cands = kvq::default_plan_candidates();
  cands.erase(std::remove_if(cands.begin(), cands.end(),
                             [](const kvq::PlanCandidate& c) { return c.needs_codebooks(); }),
              cands.end());
  const kvq::Shape shape = in.shape;
  const int64_t qstride = static_cast<int64_t>(in.q_heads) * shape.head_dim;
  kvq::PlanProblem p;
  p.n_layers = static_cast<int>(in.layers.size());
  p.candidates = cands;
  std::vector<float> deq(static_cast<size_t>(shape.numel()));
  auto quantized = [&](const kvq::QuantConfig& c, const std::vector<float>& x) {
    kvq::KVView<float> d(deq.data(), shape);
    kvq::dequantize(kvq::quantize(c, kvq::KVView<const float>(x.data(), shape)), d);
    return kvq::KVView<const float>(deq.data(), shape);
  };
  for (const Layer& L : in.layers) {
    const kvq::KVView<const float> k(L.k.data(), shape), v(L.v.data(), shape);
    for (int side = 0; side < 2; ++side) {
      std::vector<double> dmg, bits;
      for (const auto& c : cands) {
        const kvq::QuantConfig& cfg = side == 0 ? c.key : c.value;
        bits.push_back(kvq::storage_bits(cfg, static_cast<int>(shape.heads),
                                         static_cast<int>(shape.head_dim)));
        double e = std::numeric_limits<double>::infinity();
        try {
          const auto t = quantized(cfg, side == 0 ? L.k : L.v);
          e = 0;
          for (int64_t i = 0; i < L.nq; ++i) {
            const int64_t n = shape.tokens - L.nq + i + 1;
            const auto kt = side == 0 ? t : k, vt = side == 0 ? v : t;
            e += kvq::eval::attention_errors(L.q.data() + i * qstride, in.q_heads,
                                             k.slice_tokens(0, n), v.slice_tokens(0, n),
                                             kt.slice_tokens(0, n), vt.slice_tokens(0, n))
                     .output_rel_error;
          }
        } catch (const kvq::Error& err) {  // a candidate whose groups do not fit this shape
          if (err.kind() != kvq::ErrorKind::kShapeMismatch &&
              err.kind() != kvq::ErrorKind::kInvalidArgument)
            throw;
        }
        dmg.push_back(e);
      }
      p.damage.push_back(dmg);
      p.bits.push_back(bits);
    }
  }
  std::vector<Scheme> out;
  for (double budget : kPlanBudgets) {
    char name[48];
    std::snprintf(name, sizeof name, "planned <= %.1f storage bits", budget);
    try {
      const kvq::PlanChoice r = kvq::plan_allocate(p, budget, kvq::PlanGranularity::kLayerKV);
      auto pol = std::make_shared<kvq::Policy>(kvq::plan_policy(p, r));
      Scheme sc;
      sc.name = name;
      sc.geometry = "planned per layer and K/V";
      sc.k = pol->key;
      sc.v = pol->value;
      sc.calibrated = pol;
      sc.planned = true;
      out.push_back(sc);
    } catch (const kvq::Error& e) {
      skipped.push_back(std::string(name) + ": " + e.what());
    }
  }
  return out;
}

int code_bits(const kvq::QuantConfig& c) {
  switch (c.format) {
    case kvq::Format::kF32:
      return 32;
    case kvq::Format::kF16:
    case kvq::Format::kBF16:
      return 16;
    case kvq::Format::kE4M3:
    case kvq::Format::kE5M2:
      return 8;
    default:
      return c.bits + (c.qjl ? 1 : 0);
  }
}

/// The terminal table (at most 120 columns): numbers first, then the scheme's name; rows grouped
/// by code width (K and V), best first within a group by `ykey` (the plot's error), so the
/// geometries of one width sit next to each other; '*' marks the plot's Pareto front. The spec
/// strings and the attention-score error are in the CSV/JSON only.
void print_compare_table(const std::vector<kvq_tools::Row>& rows, const std::vector<Scheme>& grid,
                         const std::string& ykey, bool with_ppl) {
  struct Col {
    const char* head;
    const char* key;
    int sig;
  };
  std::vector<Col> cols = {{"K mse", "key_rel_mse", 3},
                           {"V mse", "value_rel_mse", 3},
                           {"attn KL", "attn_kl", 3},
                           {"out err", "attn_output_rel_err", 3}};
  if (with_ppl) {
    cols.push_back({"ppl", "perplexity", 5});
    cols.push_back({"KL", "kl", 3});
  }
  std::vector<double> x, y;
  for (const auto& r : rows) {
    x.push_back(r.get("effective_bits"));
    y.push_back(std::max(r.get(ykey), 1e-9));
  }
  std::vector<bool> front(rows.size(), false);
  for (size_t i : kvq_tools::pareto_front(x, y)) front[i] = true;
  // Groups: (K bits, V bits), ordered by their mean, then K bits.
  std::vector<size_t> order(rows.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  // Planned schemes (mixed widths per layer) form the last group.
  auto kb = [&](size_t i) { return grid[i].planned ? 1000 : code_bits(grid[i].k); };
  auto vb = [&](size_t i) { return grid[i].planned ? 1000 : code_bits(grid[i].v); };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (grid[a].planned != grid[b].planned) return grid[b].planned;
    if (grid[a].planned) return rows[a].get("effective_bits") < rows[b].get("effective_bits");
    const int sa = kb(a) + vb(a), sb = kb(b) + vb(b);
    if (sa != sb) return sa < sb;
    if (kb(a) != kb(b)) return kb(a) > kb(b);
    const double ya = rows[a].get(ykey), yb = rows[b].get(ykey);
    if (std::isnan(ya) || std::isnan(yb)) return !std::isnan(ya) && std::isnan(yb);
    return ya < yb;
  });
  const int w = 8;  // every number column
  std::string head = "   bits";
  for (const Col& c : cols)
    head += "  " + std::string(static_cast<size_t>(w - std::strlen(c.head)), ' ') + c.head;
  head += "  scheme";
  std::printf("%s\n", head.c_str());
  int group = -1;
  for (size_t i : order) {
    const int g = kb(i) * 100 + vb(i);
    if (g != group) {
      group = g;
      const std::string label =
          grid[i].planned ? std::string("planned per layer and K/V (docs/plan.md)")
          : kb(i) == vb(i) ? "K and V " + std::to_string(kb(i)) + "-bit codes"
                                               : "K " + std::to_string(kb(i)) + "-bit, V " +
                                                     std::to_string(vb(i)) + "-bit codes";
      const size_t dashes = head.size() > label.size() + 4 ? head.size() - label.size() - 4 : 2;
      std::printf("-- %s %s\n", label.c_str(), std::string(dashes, '-').c_str());
    }
    std::printf("%s%6.2f", front[i] ? "*" : " ", rows[i].get("effective_bits"));
    for (const Col& c : cols)
      std::printf("  %*s", w, kvq_tools::fmt_sig(rows[i].get(c.key), c.sig).c_str());
    std::printf("  %s\n", rows[i].get_text("scheme").c_str());
  }
  std::printf(
      "\nbits: effective bits per value (K and V, every metadata byte included, checked against "
      "the packed bytes)\n"
      "K mse, V mse: relative MSE of the keys and values; attn KL: KL divergence of the attention "
      "weights (nats);\n"
      "out err: relative error of the attention output%s\n"
      "Grouped by code width, best first by %s; * = on the Pareto front of bits against %s "
      "(compare.svg).\n"
      "Each scheme's policy spec and the attention-score error: compare.csv / compare.json.\n",
      with_ppl ? "; ppl, KL: perplexity and mean next-token KL (nats) with the\n"
                 "cache held under the scheme (residual 0)"
               : "",
      with_ppl ? "KL" : "out err", with_ppl ? "KL" : "out err");
}

#ifndef KVQ_SHARED_DIR
#define KVQ_SHARED_DIR "../shared"
#endif

void usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--out DIR] [--json] [input]\n"
               "input (default: kvq's built-in SYNTHETIC KV generator):\n"
               "  [--layers N] [--tokens T] [--kv-heads H] [--q-heads Q] [--head-dim D] [--seed S]\n"
               "                        shape of the synthetic input (default 4 x 1024 x 4 x 128)\n"
               "  --dump PATH [--rope-style adjacent|half] [--rope-theta T]\n"
               "                        a KV dump (.safetensors or directory of .npy files); the\n"
               "                        RoPE of its k_prerope keys (default adjacent, 10000)\n"
               "  --model M [--tokenizer T] [--text F] [--max-seqs N] [--no-perplexity]\n"
               "                        a llama2.c model (with T) or a GGUF file (its own\n"
               "                        tokenizer; 'smollm2'/'gemma3' = ./kvq.sh model NAME): tensor\n"
               "                        errors on its real K/V/Q, plus perplexity and KL over F\n"
               "                        per scheme (tokenizer and text default to\n"
               "                        %s/data/stories260K/)\n"
               "  --queries N           query positions per layer (the last N, causal; default 16)\n"
               "nuq schemes (per-layer codebooks; synthetic input: learned on a separate draw,\n"
               "seed + 1; dump and model inputs: skipped without --calibrate):\n"
               "%s"
               "Writes DIR/compare.{csv,json,svg} (DIR defaults to kvq_compare_out).\n",
               argv0, KVQ_SHARED_DIR, kvq_tools::CalibrationArgs::usage(true).c_str());
}

/// Progress on stderr: a rewritten line on a terminal, a line per quarter of the work otherwise
/// (logs stay readable).
const bool kStderrIsTty = isatty(2) != 0;
void progress(const char* what, size_t i, size_t n, const std::string& name) {
  if (kStderrIsTty) {
    std::fprintf(stderr, "\r[%s%zu/%zu] %-56s", what, i + 1, n, name.c_str());
  } else if (i == 0 || (4 * i) / n != (4 * (i + 1)) / n) {
    std::fprintf(stderr, "kvq_compare: %s%zu/%zu schemes\n", what, i + 1, n);
  }
}
void progress_done() {
  if (kStderrIsTty) std::fprintf(stderr, "\r%-72s\r", "");
}

int parse_int(const char* flag, const char* v, int min = 1) {
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (!end || *end || x < min || x > 1 << 20) {
    std::fprintf(stderr, "kvq_compare: %s needs an integer >= %d, got '%s'\n", flag, min, v);
    std::exit(2);
  }
  return static_cast<int>(x);
}

}  // namespace

int main(int argc, char** argv) {
  kvq::eval::SyntheticSpec spec;
  spec.queries = 16;
  const std::string base = std::string(KVQ_SHARED_DIR) + "/data/stories260K/";
  std::string out_dir = "kvq_compare_out", dump_path, model_path, tok_path = base + "tok512.bin",
              text_path = base + "tinystories-dev.txt";
  bool json_stdout = false, perplexity = true, synthetic_flags = false;
  int n_queries = 16, max_seqs = 0;
  kvq::RopeConfig dump_rope;
  kvq_tools::CalibrationArgs calib;
  for (int i = 1; i < argc; ++i) {
    if (calib.parse("kvq_compare", argc, argv, i)) continue;
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "kvq_compare: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    auto synth = [&](int& field) {
      field = parse_int(a.c_str(), next());
      synthetic_flags = true;
    };
    if (a == "--out") out_dir = next();
    else if (a == "--layers") synth(spec.layers);
    else if (a == "--tokens") synth(spec.tokens);
    else if (a == "--kv-heads") synth(spec.kv_heads);
    else if (a == "--q-heads") synth(spec.q_heads);
    else if (a == "--head-dim") synth(spec.head_dim);
    else if (a == "--seed") {
      spec.seed = static_cast<uint32_t>(parse_int("--seed", next(), 0));
      synthetic_flags = true;
    } else if (a == "--dump") dump_path = next();
    else if (a == "--model") model_path = next();
    else if (a == "--tokenizer") tok_path = next();
    else if (a == "--text") text_path = next();
    else if (a == "--queries") n_queries = spec.queries = parse_int("--queries", next());
    else if (a == "--max-seqs") max_seqs = parse_int("--max-seqs", next(), 0);
    else if (a == "--no-perplexity") perplexity = false;
    else if (a == "--rope-style") {
      const std::string v = next();
      if (v != "adjacent" && v != "half") {
        std::fprintf(stderr, "kvq_compare: --rope-style must be adjacent or half, got '%s'\n",
                     v.c_str());
        return 2;
      }
      dump_rope.style = v == "half" ? kvq::RopeStyle::kHalf : kvq::RopeStyle::kAdjacent;
    } else if (a == "--rope-theta") {
      const char* v = next();
      char* end = nullptr;
      dump_rope.theta = std::strtod(v, &end);
      if (!end || *end || !(dump_rope.theta > 1)) {
        std::fprintf(stderr, "kvq_compare: --rope-theta needs a number > 1, got '%s'\n", v);
        return 2;
      }
    }
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
  if (!dump_path.empty() + !model_path.empty() + synthetic_flags > 1) {
    std::fprintf(stderr,
                 "kvq_compare: choose one input: --dump, --model, or the synthetic shape flags\n");
    return 2;
  }
  try {
    const auto t0 = std::chrono::steady_clock::now();
    Input in;
    std::unique_ptr<kvq_tools::EvalModel> model;
    std::vector<std::string> lines;
    if (!dump_path.empty()) {
      in = dump_input(dump_path, n_queries, dump_rope);
    } else if (!model_path.empty()) {
      model = std::make_unique<kvq_tools::EvalModel>(model_path, tok_path);
      lines = model->read_lines(text_path);
      in = model_input(*model, lines, n_queries);
    } else {
      in = synthetic_input(spec);
    }
    std::fprintf(stderr, "kvq_compare: input: %s\nkvq_compare: attention measured with %s\n",
                 in.description.c_str(), in.query_source.c_str());
    auto full_grid = default_grid();
    std::vector<std::string> skipped;
    kvq::eval::EvalOptions opt;  // the model runs' options (perplexity, calibration texts)
    opt.max_sequences = max_seqs;
    std::string calib_what = calibrate_grid(full_grid, calib, in, spec, model.get(), opt, skipped);
    for (const std::string& cp : calib.paths) {  // calibration data that is evaluation data
      const std::string& eval_path = model ? text_path : dump_path;
      std::error_code ec;
      if (!eval_path.empty() && std::filesystem::equivalent(cp, eval_path, ec)) {
        std::fprintf(stderr, "kvq_compare: WARNING: --calibrate %s is also the evaluation data: "
                             "the nuq rows have seen what they are measured on\n", cp.c_str());
        calib_what += " (WARNING: the evaluation data itself)";
      }
    }
    if (!calib_what.empty())
      std::fprintf(stderr, "kvq_compare: nuq codebooks from %s\n", calib_what.c_str());
    for (Scheme& sc : planned_schemes(in, skipped)) full_grid.push_back(std::move(sc));
    std::vector<Scheme> grid;
    std::vector<kvq_tools::Row> rows;
    for (size_t si = 0; si < full_grid.size(); ++si) {
      if (full_grid[si].needs_calibration() && !full_grid[si].calibrated) continue;  // skipped
      progress("", si, full_grid.size(), full_grid[si].name);
      try {
        rows.push_back(evaluate_scheme(full_grid[si], in));
      } catch (const kvq::Error& e) {
        // A scheme whose groups do not fit this shape (e.g. a 64-channel token group at
        // head_dim 96) is left out, and the output says so.
        if (e.kind() != kvq::ErrorKind::kShapeMismatch &&
            e.kind() != kvq::ErrorKind::kInvalidArgument && e.kind() != kvq::ErrorKind::kUnsupported)
          throw;
        skipped.push_back(full_grid[si].name + ": " + e.what());
        continue;
      }
      rows.back().text.push_back({"spec", scheme_spec(full_grid[si])});
      grid.push_back(full_grid[si]);
    }
    progress_done();
    for (const std::string& why : skipped)
      std::fprintf(stderr, "kvq_compare: skipped %s\n", why.c_str());
    if (rows.empty()) throw std::runtime_error("no scheme of the grid fits this input's shape");

    // Real model: perplexity and KL of the next-token distribution with the cache under each
    // scheme, against one recorded f32 run.
    const bool run_ppl = model && perplexity;
    double ref_ppl = 0;
    int64_t ppl_tokens = 0;
    if (run_ppl) {
      kvq::eval::LogitTrace trace;
      kvq::eval::Fp32Backend ref(model->kv_geometry());
      kvq::eval::EvalOptions ropt = opt;
      ropt.record_trace = &trace;
      const auto r0 = model->evaluate(ref, lines, ropt);
      ref_ppl = r0.test.perplexity();
      ppl_tokens = r0.test.tokens;
      for (size_t si = 0; si < grid.size(); ++si) {
        progress("perplexity ", si, grid.size(), grid[si].name);
        kvq::CacheBackend be(grid[si].policy(), model->kv_geometry(), grid[si].prerope,
                             model->rope());
        be.set_layer_ropes(model->layer_ropes());
        kvq::eval::EvalOptions popt = opt;
        popt.reference_trace = &trace;
        const auto r = model->evaluate(be, lines, popt);
        rows[si].num.push_back({"perplexity", r.test.perplexity()});
        rows[si].num.push_back({"kl", r.mean_kl});
      }
      progress_done();
    }
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    const std::string ykey = run_ppl ? "kl" : "attn_output_rel_err";
    std::vector<double> x, y;
    std::vector<std::string> labels, groups;
    for (auto& r : rows) {
      x.push_back(r.get("effective_bits"));
      y.push_back(std::max(r.get(ykey), 1e-9));  // log axis: f32-exact rows sit at the floor
      labels.push_back(r.get_text("scheme"));
      groups.push_back(r.get_text("geometry"));
    }
    std::string cmd;
    for (int i = 0; i < argc; ++i) cmd += (i ? " " : "") + std::string(argv[i]);
    std::vector<std::pair<std::string, std::string>> meta = {
        {"tool", "kvq_compare"},
        {"input", in.description},
        {"synthetic", kvq_tools::raw_json(dump_path.empty() && model_path.empty() ? "true" : "false")},
        {"query_source", in.query_source},
        {"calibration", calib_what.empty() ? std::string("none") : calib_what},
        {"command", cmd}};
    if (run_ppl) {
      meta.push_back({"text", text_path});
      meta.push_back({"perplexity_tokens", kvq_tools::raw_json(std::to_string(ppl_tokens))});
      meta.push_back({"reference_perplexity", kvq_tools::raw_json(kvq_tools::json_number(ref_ppl))});
    }
    const std::string json = kvq_tools::to_json(rows, meta);
    std::error_code ec;
    std::filesystem::create_directories(out_dir, ec);
    if (ec) throw std::runtime_error("cannot create " + out_dir + ": " + ec.message());
    kvq_tools::write_file(out_dir + "/compare.json", json);
    kvq_tools::write_file(out_dir + "/compare.csv", kvq_tools::to_csv(rows));
    kvq_tools::write_file(
        out_dir + "/compare.svg",
        kvq_tools::svg_plot(x, y, labels, groups,
                            run_ppl ? "Next-token KL vs effective bits"
                                    : "Attention output error vs effective bits",
                            in.description,
                            "effective bits per value (K and V, metadata included)",
                            run_ppl ? "mean KL divergence of next-token distribution, nats (log)"
                                    : "attention output relative error (log scale)"));
    if (json_stdout) {
      std::fputs(json.c_str(), stdout);
    } else {
      // Every line fits 120 columns (long paths wrap at spaces).
      kvq_tools::print_wrapped("Geometry vs bits on " + in.description);
      if (dump_path.empty() && model_path.empty())
        kvq_tools::print_wrapped(
            "(SYNTHETIC input: keys have fixed outlier channels and RoPE, "
            "values do not; pass --dump or --model for real data)");
      if (!calib_what.empty()) kvq_tools::print_wrapped("nuq codebooks: " + calib_what);
      kvq_tools::print_wrapped("attention errors with " + in.query_source);
      if (run_ppl) {
        char ref[32];
        std::snprintf(ref, sizeof ref, "%.4f", ref_ppl);
        kvq_tools::print_wrapped("perplexity/KL over " + std::to_string(ppl_tokens) +
                                 " tokens of " + text_path + " (f32 reference " + ref + ")");
      }
      std::printf("\n");
      print_compare_table(rows, grid, ykey, run_ppl);
      if (!skipped.empty()) std::printf("\n");
      for (const std::string& why : skipped) kvq_tools::print_wrapped("skipped " + why);
      std::printf("\nWrote %s/compare.{csv,json,svg} in %.1f s\n", out_dir.c_str(), secs);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "\nkvq_compare: %s\n", e.what());
    return 1;
  }
  return 0;
}

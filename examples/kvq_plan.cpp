// kvq_plan: the budget planner. Chooses, per layer and per K/V, a scheme from a candidate set
// that does the least damage to a real model for a mean storage budget in bits per value, and
// writes the plan as a policy spec (per-layer overrides) and a JSON report.
//
//   kvq_plan --model M [--tokenizer T] --calibrate TEXT (--budget BITS | --sweep B1,B2,...)
//            [--granularity model|layer|layer-kv] [--candidates SPEC;SPEC...]
//            [--objective kl|ppl] [--probe SPEC] [--eval TEXT] [--out plan.json]
//            [--measurements FILE] [--save-calibration FILE] [--threads N] [--max-seqs N]
//            [--seq-len N] [--prerope]
//
// How (docs/policy.md, "The budget planner"):
//  1. One f32 forward over the calibration text records every layer's queries, keys, values
//     and attention outputs; nuq candidates learn their per-layer codebooks on them.
//  2. Each candidate's keys (then values) are replayed through a one-layer streaming KVCache
//     under that candidate, layer by layer, and the squared error of the attention output
//     against the f32 output is summed: e[l][K|V][c].
//  3. One probe per layer (the probe scheme on that layer's keys and values, f32 elsewhere)
//     measures the objective end to end (next-token KL against the f32 run, or the increase of
//     the mean NLL); w[l] = objective / (e[l][K][probe] + e[l][V][probe]) turns attention error
//     into predicted damage, d[l][K|V][c] = w[l] e[l][K|V][c].
//  4. policy/plan.hpp's exact knapsack picks the least predicted damage within the budget.
//  5. The chosen policy runs end to end on the calibration text (its real KL), and with --eval
//     on held-out text: perplexity and KL against f32, next to every uniform candidate of no
//     more storage bits.
// Steps 1-3 are saved in --measurements FILE (when given): a later run with the same model,
// calibration text, candidates, probe and objective re-plans from the file in seconds.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "eval_model.hpp"
#include "kvq/eval/cache_backend.hpp"
#include "kvq/eval/kv_backend.hpp"
#include "kvq/eval/llama2c.hpp"
#include "kvq/io/calibration_file.hpp"
#include "kvq/policy/plan.hpp"
#include "kvq/policy/spec.hpp"
#include "report.hpp"

namespace {

#ifndef KVQ_SHARED_DIR
#define KVQ_SHARED_DIR "../shared"
#endif

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::vector<double> parse_budgets(const std::string& s) {
  std::vector<double> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const double b = std::strtod(item.c_str(), &end);
    KVQ_REQUIRE(end && *end == '\0' && !item.empty() && std::isfinite(b) && b > 0 && b <= 32,
                kInvalidArgument, "budget '", item, "' is not a number of bits in (0, 32]");
    out.push_back(b);
  }
  KVQ_REQUIRE(!out.empty(), kInvalidArgument, "no budget given");
  return out;
}

/// The f32 run over the calibration text, every layer's rows kept per sequence.
class CaptureBackend final : public kvq::eval::KVBackend {
 public:
  struct Layer {
    std::vector<float> kp, k, v, q, out;
  };
  struct Sequence {
    int tokens = 0;
    std::vector<Layer> layers;
  };
  explicit CaptureBackend(const kvq::eval::KVGeometry& g) : g_(g), inner_(g) {}
  void reset() override {
    inner_.reset();
    if (seqs_.empty() || seqs_.back().tokens > 0) seqs_.emplace_back();
    seqs_.back().layers.assign(static_cast<size_t>(g_.n_layers), Layer{});
  }
  void append(int layer, int pos, const float* kp, const float* k, const float* v) override {
    inner_.append(layer, pos, kp, k, v);
    auto& L = seqs_.back().layers[static_cast<size_t>(layer)];
    const size_t n = static_cast<size_t>(g_.n_kv_heads) * static_cast<size_t>(g_.head_dim);
    L.kp.insert(L.kp.end(), kp, kp + n);
    L.k.insert(L.k.end(), k, k + n);
    L.v.insert(L.v.end(), v, v + n);
    if (layer == 0) seqs_.back().tokens = pos + 1;
  }
  void attend(int layer, int pos, const float* q, int n_heads, float* out) override {
    inner_.attend(layer, pos, q, n_heads, out);
    auto& L = seqs_.back().layers[static_cast<size_t>(layer)];
    const size_t n = static_cast<size_t>(n_heads) * static_cast<size_t>(g_.head_dim);
    L.q.insert(L.q.end(), q, q + n);
    L.out.insert(L.out.end(), out, out + n);
    n_heads_ = n_heads;
  }
  const std::vector<Sequence>& sequences() const { return seqs_; }
  int n_heads() const { return n_heads_; }
  /// The captured rows as a calibration set (nuq codebooks): keys as the cache stores them
  /// (pre-RoPE with `prerope`), post-RoPE keys and queries for the sensitivity weights.
  kvq::CalibrationSet calibration_set(bool prerope) const {
    kvq::CalibrationSet cs;
    cs.n_layers = g_.n_layers;
    cs.kv_heads = g_.n_kv_heads;
    cs.head_dim = g_.head_dim;
    cs.q_heads = n_heads_;
    for (const Sequence& s : seqs_) {
      if (s.tokens == 0) continue;
      kvq::CalibrationSet::Sequence cq;
      cq.tokens = s.tokens;
      for (const Layer& L : s.layers) {
        kvq::CalibrationSet::Layer cl;
        cl.k = prerope ? L.kp : L.k;
        cl.k_attn = L.k;
        cl.v = L.v;
        cl.q = L.q;
        cq.layers.push_back(std::move(cl));
      }
      cs.sequences.push_back(std::move(cq));
    }
    return cs;
  }

 private:
  kvq::eval::KVGeometry g_;
  kvq::eval::Fp32Backend inner_;
  std::vector<Sequence> seqs_;
  int n_heads_ = 0;
};

/// Summed squared attention-output error of `layer` replayed through a one-layer streaming
/// cache storing keys under `kc` and values under `vc`.
double replay_error(const CaptureBackend& cap, const kvq::eval::KVGeometry& g, int layer,
                    const kvq::QuantConfig& kc, const kvq::QuantConfig& vc, bool prerope,
                    const kvq::RopeConfig& rope) {
  kvq::Policy pol;
  pol.key = kc;
  pol.value = vc;
  kvq::eval::KVGeometry g1 = g;
  g1.n_layers = 1;
  kvq::CacheBackend be(pol, g1, prerope, rope);
  const int nh = cap.n_heads();
  const size_t kv = static_cast<size_t>(g.n_kv_heads) * static_cast<size_t>(g.head_dim);
  const size_t qn = static_cast<size_t>(nh) * static_cast<size_t>(g.head_dim);
  std::vector<float> out(qn);
  double err = 0;
  for (const auto& s : cap.sequences()) {
    if (s.tokens == 0) continue;
    be.reset();
    const auto& L = s.layers[static_cast<size_t>(layer)];
    for (int t = 0; t < s.tokens; ++t) {
      const size_t o = static_cast<size_t>(t);
      be.append(0, t, L.kp.data() + o * kv, L.k.data() + o * kv, L.v.data() + o * kv);
      be.attend(0, t, L.q.data() + o * qn, nh, out.data());
      const float* ref = L.out.data() + o * qn;
      for (size_t i = 0; i < qn; ++i) {
        const double d = static_cast<double>(out[i]) - ref[i];
        err += d * d;
      }
    }
  }
  return err;
}

/// Steps 1-3's results, the per-layer measurements a plan is made from.
struct Measurements {
  std::string key;  // what they were measured on (model, text, candidates, probe, objective)
  int n_layers = 0;
  std::vector<std::vector<double>> err_k, err_v;  // [layer][candidate]
  std::vector<double> probe_err, probe_objective, weight;  // [layer]
  double seconds = 0;

  void save(const std::string& path) const {
    std::ofstream f(path);
    KVQ_REQUIRE(f.good(), kIo, "cannot write measurements to '", path, "'");
    f.precision(17);
    f << "kvq-plan-measurements 1\n" << key << "\n" << n_layers << " "
      << (err_k.empty() ? 0 : err_k[0].size()) << " " << seconds << "\n";
    for (int l = 0; l < n_layers; ++l) {
      const size_t L = static_cast<size_t>(l);
      f << probe_err[L] << " " << probe_objective[L] << " " << weight[L];
      for (double e : err_k[L]) f << " " << e;
      for (double e : err_v[L]) f << " " << e;
      f << "\n";
    }
    KVQ_REQUIRE(f.good(), kIo, "writing measurements to '", path, "' failed");
  }
  /// Loads `path` when it exists and was measured under `want_key` with `nc` candidates on
  /// `layers` layers; false (and a reason) otherwise. A damaged file is an error.
  bool load(const std::string& path, const std::string& want_key, int layers, size_t nc,
            std::string& why) {
    std::ifstream f(path);
    if (!f.good()) {
      why = "no file yet";
      return false;
    }
    std::string magic, line;
    int version = 0;
    f >> magic >> version;
    std::getline(f, line);
    KVQ_REQUIRE(magic == "kvq-plan-measurements" && version == 1, kIo, "'", path,
                "' is not a kvq_plan measurements file");
    std::getline(f, line);
    if (line != want_key) {
      why = "measured on other inputs";
      return false;
    }
    size_t file_nc = 0;
    f >> n_layers >> file_nc >> seconds;
    KVQ_REQUIRE(f.good() && n_layers == layers && file_nc == nc, kIo, "'", path,
                "': layer or candidate count does not match its header");
    err_k.assign(static_cast<size_t>(layers), std::vector<double>(nc));
    err_v = err_k;
    probe_err.assign(static_cast<size_t>(layers), 0);
    probe_objective = weight = probe_err;
    for (size_t l = 0; l < static_cast<size_t>(layers); ++l) {
      f >> probe_err[l] >> probe_objective[l] >> weight[l];
      for (double& e : err_k[l]) f >> e;
      for (double& e : err_v[l]) f >> e;
    }
    KVQ_REQUIRE(!f.fail(), kIo, "'", path, "' is truncated or damaged");
    for (size_t l = 0; l < static_cast<size_t>(layers); ++l) {
      for (double e : err_k[l]) KVQ_REQUIRE(std::isfinite(e) && e >= 0, kIo, "'", path, "': bad error value");
      for (double e : err_v[l]) KVQ_REQUIRE(std::isfinite(e) && e >= 0, kIo, "'", path, "': bad error value");
      KVQ_REQUIRE(std::isfinite(weight[l]) && weight[l] >= 0, kIo, "'", path, "': bad weight");
    }
    return true;
  }
};

/// FNV-1a of a file's bytes (identifies the calibration text in the measurements key).
std::string file_digest(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  KVQ_REQUIRE(f.good(), kIo, "cannot read '", path, "'");
  uint64_t h = 1469598103934665603ull;
  char c;
  while (f.get(c)) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

/// A streaming cache that also measures what it stores at the end of every sequence.
class MeasuredCache final : public kvq::eval::KVBackend {
 public:
  MeasuredCache(kvq::Policy p, const kvq::eval::KVGeometry& g, bool prerope, kvq::RopeConfig rope,
                std::vector<kvq::RopeConfig> layer_ropes = {})
      : be_(std::move(p), g, prerope, rope) {
    be_.set_layer_ropes(std::move(layer_ropes));  // Gemma: a rope base per layer kind
  }
  void reset() override {
    measure();
    be_.reset();
  }
  void append(int layer, int pos, const float* kp, const float* k, const float* v) override {
    be_.append(layer, pos, kp, k, v);
  }
  void attend(int layer, int pos, const float* q, int n_heads, float* out) override {
    be_.attend(layer, pos, q, n_heads, out);
  }
  void measure() {
    const auto m = be_.cache().memory_report();
    for (const auto& lm : m.layers) {
      stored_ += static_cast<double>(lm.key.packed.total() - lm.key.packed.padding +
                                     lm.value.packed.total() - lm.value.packed.padding);
      packed_values_ += 2.0 * static_cast<double>(lm.packed_tokens) * m.kv_heads * m.head_dim;
    }
    all_bytes_ += static_cast<double>(m.total());
    all_values_ += static_cast<double>(m.elements());
  }
  /// Bits per value of the complete blocks held (page padding aside): the storage bits.
  double storage_bits() const { return packed_values_ > 0 ? 8 * stored_ / packed_values_ : 0; }
  /// Bits per value of everything held (pages with padding, f32 tails): the effective bits.
  double effective_bits() const { return all_values_ > 0 ? 8 * all_bytes_ / all_values_ : 0; }

 private:
  kvq::CacheBackend be_;
  double stored_ = 0, packed_values_ = 0, all_bytes_ = 0, all_values_ = 0;
};

struct RunResult {
  double kl = 0, nll_increase = 0, perplexity = 0, storage_bits = 0, effective_bits = 0;
};

void usage() {
  std::fprintf(stderr,
      "usage: kvq_plan --model M [--tokenizer T] --calibrate TEXT (--budget BITS | --sweep B1,B2,..)\n"
      "  [--granularity model|layer|layer-kv] [--candidates SPEC;SPEC...] [--objective kl|ppl]\n"
      "  [--probe SPEC] [--eval TEXT] [--out plan.json] [--measurements FILE]\n"
      "  [--save-calibration FILE] [--threads N] [--max-seqs N] [--seq-len N] [--prerope]\n"
      "--model: a llama2.c checkpoint (with --tokenizer), a GGUF file, or 'smollm2' / 'gemma3'\n"
      "--calibrate: text the damage is measured on (one sequence per line, the model's protocol)\n"
      "--budget: mean storage bits per K/V value (complete groups, metadata included)\n"
      "--sweep: several budgets, one plan each (the measurements are shared)\n"
      "--granularity: one scheme for all keys and one for all values (model), one per layer\n"
      "  (layer), or one per layer and K/V (layer-kv, default)\n"
      "--candidates: ';'-separated [name=]spec, each one key and one value term (default:\n"
      "  int2/3/4/8 and nuq2/3/4 (plain and +1%% outliers) keys per channel and values per token,\n"
      "  lm2/3/4 rotated, fp8, f16); nuq codebooks are learned per layer on the --calibrate text\n"
      "--objective: kl (next-token KL against f32, default) or ppl (increase of the mean NLL)\n"
      "--probe: the scheme whose end-to-end damage per layer calibrates the attention-error\n"
      "  proxy (default k=int3/channel/g32,v=int3/token/g32)\n"
      "--eval: held-out text: each plan's perplexity and KL there, next to every uniform\n"
      "  candidate of no more storage bits\n"
      "--measurements: cache of the per-layer measurements (re-planning reuses it)\n"
      "--save-calibration: write the nuq codebooks of each plan that has nuq layers (FILE, or\n"
      "  FILE.<i>.json for the i-th budget of a sweep); other tools take it with --calibrate\n"
      "defaults: %s/data/stories260K/{stories260K.bin,tok512.bin}\n",
      KVQ_SHARED_DIR);
}

int parse_count(const std::string& flag, const char* v) {
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (!end || *end || x < 0 || x > 1 << 24) {
    std::fprintf(stderr, "kvq_plan: %s needs a non-negative integer, got '%s'\n", flag.c_str(), v);
    std::exit(2);
  }
  return static_cast<int>(x);
}

std::string fmt(double v, int prec = 4) { return kvq_tools::json_number(std::round(v * std::pow(10.0, prec)) / std::pow(10.0, prec)); }

}  // namespace

int main(int argc, char** argv) {
  const std::string base = std::string(KVQ_SHARED_DIR) + "/data/stories260K/";
  std::string model_path = base + "stories260K.bin", tok_path = base + "tok512.bin";
  std::string calib_path, eval_path, out_path, meas_path, budget_arg, sweep_arg, save_cal;
  std::string granularity = "layer-kv", objective = "kl", cand_arg = kvq::kDefaultPlanCandidates;
  std::string probe_arg = "k=int3/channel/g32,v=int3/token/g32";
  bool prerope = false;
  int threads = 0;
  kvq::eval::EvalOptions opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "kvq_plan: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--model") model_path = next();
    else if (a == "--tokenizer") tok_path = next();
    else if (a == "--calibrate") calib_path = next();
    else if (a == "--eval") eval_path = next();
    else if (a == "--budget") budget_arg = next();
    else if (a == "--sweep") sweep_arg = next();
    else if (a == "--granularity") granularity = next();
    else if (a == "--candidates") cand_arg = next();
    else if (a == "--objective") objective = next();
    else if (a == "--probe") probe_arg = next();
    else if (a == "--out") out_path = next();
    else if (a == "--measurements") meas_path = next();
    else if (a == "--save-calibration") save_cal = next();
    else if (a == "--prerope") prerope = true;
    else if (a == "--threads") threads = parse_count(a, next());
    else if (a == "--max-seqs") opt.max_sequences = parse_count(a, next());
    else if (a == "--seq-len") opt.max_seq_len = parse_count(a, next());
    else if (a == "-h" || a == "--help") {
      usage();
      return 0;
    } else {
      std::fprintf(stderr, "kvq_plan: unknown argument '%s'\n", a.c_str());
      usage();
      return 2;
    }
  }
  if (calib_path.empty() || (budget_arg.empty() == sweep_arg.empty())) {
    std::fprintf(stderr, "kvq_plan: needs --calibrate TEXT and exactly one of --budget, --sweep\n");
    usage();
    return 2;
  }
  if (objective != "kl" && objective != "ppl") {
    std::fprintf(stderr, "kvq_plan: --objective must be kl or ppl, got '%s'\n", objective.c_str());
    return 2;
  }
  try {
    const auto t_all = Clock::now();
    const std::vector<double> budgets = parse_budgets(budget_arg.empty() ? sweep_arg : budget_arg);
    const kvq::PlanGranularity gran = kvq::parse_granularity(granularity);
    auto cands = kvq::parse_plan_candidates(cand_arg);
    auto probes = kvq::parse_plan_candidates("probe=" + probe_arg);
    const kvq::PlanCandidate& probe = probes.front();
    kvq_tools::EvalModel model(model_path, tok_path);
    if (threads > 0) model.set_threads(threads);
    const auto geo = model.kv_geometry();
    const kvq::RopeConfig rope = model.rope();
    const std::vector<kvq::RopeConfig> layer_ropes = model.layer_ropes();  // empty: all `rope`
    auto rope_of = [&](int l) -> const kvq::RopeConfig& {
      return layer_ropes.empty() ? rope : layer_ropes[static_cast<size_t>(l)];
    };
    const int L = geo.n_layers;
    const auto calib_lines = model.read_lines(calib_path);

    // Reference logits on the calibration text (also recorded: rows for the replay).
    kvq::eval::LogitTrace calib_trace;
    CaptureBackend cap(geo);
    kvq::eval::EvalOptions copt = opt;
    copt.record_trace = &calib_trace;
    const auto t_measure = Clock::now();
    const auto r_calib = model.evaluate(cap, calib_lines, copt);
    // nuq candidates (and a nuq probe): their per-layer codebooks, learned on the same rows.
    bool any_nuq = probe.needs_codebooks();
    for (const auto& c : cands) any_nuq = any_nuq || c.needs_codebooks();
    if (any_nuq) {
      const auto t_cal = Clock::now();
      const kvq::CalibrationSet cset = cap.calibration_set(prerope);
      kvq::calibrate_plan_candidates(cands, cset);
      kvq::calibrate_plan_candidates(probes, cset);
      std::fprintf(stderr, "kvq_plan: nuq codebooks learned (%.0f s)\n", since(t_cal));
    }
    // A candidate used on every layer (the uniform comparison): per-layer codebooks as overrides.
    auto uniform_policy = [&](const kvq::PlanCandidate& c) {
      kvq::Policy up;
      up.key = c.key;
      up.value = c.value;
      if (!c.per_layer.empty())
        for (int l = 0; l < L; ++l) up.overrides[l] = {c.key_at(l), c.value_at(l)};
      return up;
    };

    auto run_policy = [&](const kvq::Policy& pol, const std::vector<std::string>& lines,
                          const kvq::eval::LogitTrace& trace, const kvq::eval::EvalResult& ref) {
      MeasuredCache be(model.bind(pol), geo, prerope, rope, layer_ropes);
      kvq::eval::EvalOptions o = opt;
      o.reference_trace = &trace;
      const auto r = model.evaluate(be, lines, o);
      be.measure();
      RunResult rr;
      rr.kl = r.mean_kl;
      rr.perplexity = r.test.perplexity();
      rr.nll_increase = (r.test.total_nll - ref.test.total_nll) / std::max<int64_t>(1, r.test.tokens);
      rr.storage_bits = be.storage_bits();
      rr.effective_bits = be.effective_bits();
      return rr;
    };

    // Steps 2-3, or the cached measurements.
    std::string key = "model=" + model.path() + " text=" + file_digest(calib_path) +
                      " objective=" + objective + " probe=" + kvq::config_spec(probe.key) + "|" +
                      kvq::config_spec(probe.value) + (prerope ? " prerope" : "") +
                      " max_seqs=" + std::to_string(opt.max_sequences) +
                      " seq_len=" + std::to_string(opt.max_seq_len) + " candidates=";
    for (const auto& c : cands) key += kvq::config_spec(c.key) + "|" + kvq::config_spec(c.value) + ";";
    Measurements m;
    std::string why = "no --measurements file";
    bool cached = !meas_path.empty() && m.load(meas_path, key, L, cands.size(), why);
    if (!cached) {
      std::fprintf(stderr, "kvq_plan: measuring %d layers x %zu candidates (%s)\n", L, cands.size(),
                   why.c_str());
      m = Measurements{};
      m.key = key;
      m.n_layers = L;
      m.err_k.assign(static_cast<size_t>(L), std::vector<double>(cands.size()));
      m.err_v = m.err_k;
      m.probe_err.assign(static_cast<size_t>(L), 0);
      m.probe_objective = m.weight = m.probe_err;
      const kvq::QuantConfig f32 = kvq::raw_config(kvq::Format::kF32);
      for (int l = 0; l < L; ++l) {
        const size_t li = static_cast<size_t>(l);
        for (size_t c = 0; c < cands.size(); ++c) {
          m.err_k[li][c] = replay_error(cap, geo, l, cands[c].key_at(l), f32, prerope, rope_of(l));
          m.err_v[li][c] = replay_error(cap, geo, l, f32, cands[c].value_at(l), prerope, rope_of(l));
        }
        m.probe_err[li] = replay_error(cap, geo, l, probe.key_at(l), f32, prerope, rope_of(l)) +
                          replay_error(cap, geo, l, f32, probe.value_at(l), prerope, rope_of(l));
        kvq::Policy pp;  // f32 everywhere but the probe on layer l
        pp.overrides[l] = {probe.key_at(l), probe.value_at(l)};
        const RunResult pr = run_policy(pp, calib_lines, calib_trace, r_calib);
        const double obj = objective == "kl" ? pr.kl : std::max(0.0, pr.nll_increase);
        m.probe_objective[li] = obj;
        m.weight[li] = m.probe_err[li] > 0 ? obj / m.probe_err[li] : 0.0;
        std::fprintf(stderr, "kvq_plan: layer %d: probe %s %.3g, weight %.3g (%.0f s)\n", l,
                     objective.c_str(), obj, m.weight[li], since(t_measure));
      }
      m.seconds = since(t_measure);
      if (!meas_path.empty()) m.save(meas_path);
    } else {
      std::fprintf(stderr, "kvq_plan: measurements from %s (measured in %.0f s)\n",
                   meas_path.c_str(), m.seconds);
    }

    kvq::PlanProblem prob;
    prob.n_layers = L;
    prob.candidates = cands;
    for (int l = 0; l < L; ++l) {
      const size_t li = static_cast<size_t>(l);
      std::vector<double> dk, dv, bk, bv;
      for (size_t c = 0; c < cands.size(); ++c) {
        dk.push_back(m.weight[li] * m.err_k[li][c]);
        dv.push_back(m.weight[li] * m.err_v[li][c]);
        bk.push_back(kvq::storage_bits(cands[c].key, geo.n_kv_heads, geo.head_dim));
        bv.push_back(kvq::storage_bits(cands[c].value, geo.n_kv_heads, geo.head_dim));
      }
      prob.damage.push_back(dk);
      prob.damage.push_back(dv);
      prob.bits.push_back(bk);
      prob.bits.push_back(bv);
    }

    // Held-out reference and the uniform candidates (each measured once, shared by budgets).
    std::vector<std::string> eval_lines;
    kvq::eval::LogitTrace eval_trace;
    kvq::eval::EvalResult r_eval;
    std::map<size_t, RunResult> uniform;
    if (!eval_path.empty()) {
      eval_lines = model.read_lines(eval_path);
      kvq::eval::Fp32Backend ref(geo);
      kvq::eval::EvalOptions o = opt;
      o.record_trace = &eval_trace;
      r_eval = model.evaluate(ref, eval_lines, o);
    }

    std::printf("candidates (key/value storage bits):");
    for (size_t c = 0; c < cands.size(); ++c)
      std::printf(" %s %s/%s", cands[c].name.c_str(), fmt(prob.bits[0][c], 3).c_str(),
                  fmt(prob.bits[1][c], 3).c_str());
    std::printf("\n");
    std::vector<kvq_tools::Row> rows;
    std::ostringstream plans_json;
    bool first_plan = true;
    for (size_t bi = 0; bi < budgets.size(); ++bi) {
      const double budget = budgets[bi];
      const auto t_plan = Clock::now();
      kvq::PlanChoice choice;
      try {
        choice = kvq::plan_allocate(prob, budget, gran);
      } catch (const kvq::Error& e) {
        if (budgets.size() == 1) throw;
        std::printf("budget %s bits: no plan (%s)\n", fmt(budget, 3).c_str(), e.what());
        continue;
      }
      const kvq::Policy pol = kvq::plan_policy(prob, choice);
      const double plan_seconds = since(t_plan);
      const std::string spec = pol.spec();
      // nuq layers: the spec names their configs, the codebooks go to a calibration file.
      const bool plan_nuq = kvq::needs_calibration(pol, L);
      std::string cal_file;
      if (plan_nuq && !save_cal.empty()) {
        cal_file = save_cal;
        if (budgets.size() > 1) {
          const std::filesystem::path fp(save_cal);
          cal_file = (fp.parent_path() / (fp.stem().string() + "." + std::to_string(bi) + ".json")).string();
        }
        kvq::save_calibration(cal_file, pol, L, "kvq_plan --calibrate " + calib_path);
      }
      const RunResult rc = run_policy(pol, calib_lines, calib_trace, r_calib);
      RunResult re;
      std::string best_uniform = "-";
      RunResult ru;
      double ru_bits = 0;
      if (!eval_path.empty()) {
        re = run_policy(pol, eval_lines, eval_trace, r_eval);
        double best = INFINITY;
        for (size_t c = 0; c < cands.size(); ++c) {
          const double ub = 0.5 * (prob.bits[0][c] + prob.bits[1][c]);
          if (ub > budget + 1e-9) continue;
          if (!uniform.count(c)) {
            uniform[c] = run_policy(uniform_policy(cands[c]), eval_lines, eval_trace, r_eval);
          }
          const RunResult& u = uniform[c];
          const double obj = objective == "kl" ? u.kl : u.nll_increase;
          if (obj < best) {
            best = obj;
            best_uniform = cands[c].name;
            ru = u;
            ru_bits = ub;
          }
        }
      }
      kvq_tools::Row row;
      row.text = {{"budget", fmt(budget, 3)}};
      row.num = {{"bits", choice.mean_bits},
                 {"predicted", choice.damage / (2.0 * L)},
                 {"calib_kl", rc.kl}};
      if (!eval_path.empty()) {
        const double p0 = r_eval.test.perplexity();
        row.num.push_back({"eval_ppl", re.perplexity});
        row.num.push_back({"dppl_%", 100.0 * (re.perplexity / p0 - 1.0)});
        row.num.push_back({"eval_kl", re.kl});
        row.text.push_back({"best_uniform", best_uniform});
        row.num.push_back({"uniform_bits", ru_bits});
        row.num.push_back({"uniform_dppl_%",
                           best_uniform == "-" ? NAN : 100.0 * (ru.perplexity / p0 - 1.0)});
        row.num.push_back({"uniform_kl", best_uniform == "-" ? NAN : ru.kl});
      }
      rows.push_back(row);

      // JSON for this plan.
      std::ostringstream j;
      j << "    {\n      \"budget\": " << kvq_tools::json_number(budget)
        << ",\n      \"granularity\": \"" << kvq::granularity_name(gran) << "\""
        << ",\n      \"spec\": \"" << kvq_tools::json_escape(spec) << "\""
        << ",\n      \"needs_calibration\": " << (plan_nuq ? "true" : "false")
        << ",\n      \"calibration_file\": \"" << kvq_tools::json_escape(cal_file) << "\""
        << ",\n      \"storage_bits\": " << kvq_tools::json_number(choice.mean_bits)
        << ",\n      \"predicted_damage\": " << kvq_tools::json_number(choice.damage / (2.0 * L))
        << ",\n      \"plan_seconds\": " << kvq_tools::json_number(plan_seconds)
        << ",\n      \"calibration\": {\"kl\": " << kvq_tools::json_number(rc.kl)
        << ", \"perplexity\": " << kvq_tools::json_number(rc.perplexity)
        << ", \"reference_perplexity\": " << kvq_tools::json_number(r_calib.test.perplexity())
        << ", \"measured_storage_bits\": " << kvq_tools::json_number(rc.storage_bits)
        << ", \"effective_bits\": " << kvq_tools::json_number(rc.effective_bits) << "}";
      if (!eval_path.empty()) {
        j << ",\n      \"eval\": {\"kl\": " << kvq_tools::json_number(re.kl)
          << ", \"perplexity\": " << kvq_tools::json_number(re.perplexity)
          << ", \"reference_perplexity\": " << kvq_tools::json_number(r_eval.test.perplexity())
          << ", \"measured_storage_bits\": " << kvq_tools::json_number(re.storage_bits)
          << ", \"effective_bits\": " << kvq_tools::json_number(re.effective_bits) << "}"
          << ",\n      \"best_uniform\": {\"name\": \"" << kvq_tools::json_escape(best_uniform)
          << "\", \"storage_bits\": " << kvq_tools::json_number(ru_bits)
          << ", \"kl\": " << kvq_tools::json_number(ru.kl)
          << ", \"perplexity\": " << kvq_tools::json_number(ru.perplexity) << "}";
      }
      j << ",\n      \"layers\": [";
      for (int l = 0; l < L; ++l) {
        const size_t kc = static_cast<size_t>(choice.choice[static_cast<size_t>(2 * l)]);
        const size_t vc = static_cast<size_t>(choice.choice[static_cast<size_t>(2 * l + 1)]);
        j << (l ? ",\n" : "\n") << "        {\"layer\": " << l << ", \"key\": \""
          << kvq_tools::json_escape(cands[kc].name) << "\", \"key_spec\": \""
          << kvq::config_spec(cands[kc].key) << "\", \"key_bits\": "
          << kvq_tools::json_number(prob.bits[static_cast<size_t>(2 * l)][kc])
          << ", \"key_damage\": " << kvq_tools::json_number(prob.damage[static_cast<size_t>(2 * l)][kc])
          << ", \"value\": \"" << kvq_tools::json_escape(cands[vc].name) << "\", \"value_spec\": \""
          << kvq::config_spec(cands[vc].value) << "\", \"value_bits\": "
          << kvq_tools::json_number(prob.bits[static_cast<size_t>(2 * l + 1)][vc])
          << ", \"value_damage\": "
          << kvq_tools::json_number(prob.damage[static_cast<size_t>(2 * l + 1)][vc]) << "}";
      }
      j << "\n      ]\n    }";
      plans_json << (first_plan ? "" : ",\n") << j.str();
      first_plan = false;

      std::printf("budget %s bits: %s\n", fmt(budget, 3).c_str(), spec.c_str());
      if (plan_nuq)
        std::printf("  nuq codebooks: %s\n",
                    cal_file.empty() ? "learned on the --calibrate text (--save-calibration FILE "
                                       "writes them for --calibrate in the other tools)"
                                     : cal_file.c_str());
      std::printf("  layer keys:   ");
      for (int l = 0; l < L; ++l)
        std::printf("%s%s", l ? " " : "", cands[static_cast<size_t>(choice.choice[static_cast<size_t>(2 * l)])].name.c_str());
      std::printf("\n  layer values: ");
      for (int l = 0; l < L; ++l)
        std::printf("%s%s", l ? " " : "", cands[static_cast<size_t>(choice.choice[static_cast<size_t>(2 * l + 1)])].name.c_str());
      std::printf("\n");
    }
    std::printf("\n%s; calibration %s (%lld tokens, f32 perplexity %.4f)%s\n",
                model.describe().c_str(), calib_path.c_str(),
                static_cast<long long>(r_calib.test.tokens), r_calib.test.perplexity(),
                cached ? "; measurements cached" : "");
    if (!eval_path.empty())
      std::printf("held-out %s: %lld tokens, f32 perplexity %.4f\n", eval_path.c_str(),
                  static_cast<long long>(r_eval.test.tokens), r_eval.test.perplexity());
    std::printf("bits = planned mean storage bits per K/V value (complete groups, metadata "
                "included); predicted = mean predicted %s per slot; measure %.0f s, total %.0f s\n\n",
                objective.c_str(), m.seconds, since(t_all));
    kvq_tools::print_table(rows);

    if (!out_path.empty()) {
      std::ostringstream js;
      js << "{\n  \"tool\": \"kvq_plan\",\n  \"model\": \"" << kvq_tools::json_escape(model.path())
         << "\",\n  \"model_description\": \"" << kvq_tools::json_escape(model.describe())
         << "\",\n  \"calibration_text\": \"" << kvq_tools::json_escape(calib_path)
         << "\",\n  \"eval_text\": \"" << kvq_tools::json_escape(eval_path)
         << "\",\n  \"objective\": \"" << objective << "\",\n  \"probe\": \""
         << kvq_tools::json_escape(kvq::config_spec(probe.key) + "," + kvq::config_spec(probe.value))
         << "\",\n  \"candidates\": [";
      for (size_t c = 0; c < cands.size(); ++c)
        js << (c ? ", " : "") << "{\"name\": \"" << kvq_tools::json_escape(cands[c].name)
           << "\", \"key\": \"" << kvq::config_spec(cands[c].key) << "\", \"value\": \""
           << kvq::config_spec(cands[c].value) << "\", \"key_bits\": "
           << kvq_tools::json_number(prob.bits[0][c]) << ", \"value_bits\": "
           << kvq_tools::json_number(prob.bits[1][c]) << "}";
      js << "],\n  \"measure_seconds\": " << kvq_tools::json_number(m.seconds)
         << ",\n  \"measurements_cached\": " << (cached ? "true" : "false")
         << ",\n  \"layer_weights\": [";
      for (int l = 0; l < L; ++l) js << (l ? ", " : "") << kvq_tools::json_number(m.weight[static_cast<size_t>(l)]);
      js << "],\n  \"plans\": [\n" << plans_json.str() << "\n  ]\n}\n";
      kvq_tools::write_file(out_path, js.str());
      std::printf("\nWrote %s\n", out_path.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvq_plan: %s\n", e.what());
    return 1;
  }
  return 0;
}

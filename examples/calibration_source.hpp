#pragma once
// --calibrate PATH / --save-calibration FILE for the tools (kvq_perplexity, kvq_compare,
// kvq_quantize_dump): PATH is a calibration file (JSON, quant/calibrate.hpp), a KV dump
// (.safetensors file or .npy directory, io/kv_dump.hpp), or, for tools that run a model, a text
// file whose lines the model is run over (the evaluation protocol's lines) to record keys
// (pre-RoPE when the cache quantizes them so), values and queries.
//
// The three tools share the flags through CalibrationArgs (parsing, usage text) and
// calibrate_policy / check_calibration_files (which source serves which policy): --calibrate may
// be given several times; a policy that needs nuq codebooks takes the first calibration file
// whose codebooks fit its normalization, else the first KV dump or text among the paths. A
// calibration file that does not parse, or that fits none of the tool's policies, is an error
// (exit 1), as is a nuq policy that no path calibrates. With --calibrate, NVFP4 layers left at
// the default tensor scale 1 take theirs from the same source (kvq::calibrate).
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "kvq/eval/kv_backend.hpp"
#include "kvq/io/kv_dump.hpp"
#include "kvq/io/calibration_file.hpp"

namespace kvq_tools {

/// A KVBackend that attends in f32 and records every sequence's keys, values and queries.
class CalibrationRecorder final : public kvq::eval::KVBackend {
 public:
  CalibrationRecorder(const kvq::eval::KVGeometry& g, bool prerope) : g_(g), prerope_(prerope), fp_(g) {
    set_.n_layers = g.n_layers;
    set_.kv_heads = g.n_kv_heads;
    set_.head_dim = g.head_dim;
  }
  void reset() override {
    flush();
    fp_.reset();
  }
  void append(int layer, int pos, const float* kp, const float* k, const float* v) override {
    fp_.append(layer, pos, kp, k, v);
    Seq& s = at(layer, pos);
    const std::size_t row = static_cast<std::size_t>(g_.n_kv_heads) * g_.head_dim;
    auto put = [&](std::vector<float>& dst, const float* src) {
      if (dst.size() < (static_cast<std::size_t>(pos) + 1) * row) dst.resize((static_cast<std::size_t>(pos) + 1) * row);
      std::copy(src, src + row, dst.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(pos) * row));
    };
    put(s.layers[static_cast<std::size_t>(layer)].k, prerope_ ? kp : k);
    put(s.layers[static_cast<std::size_t>(layer)].k_attn, k);
    put(s.layers[static_cast<std::size_t>(layer)].v, v);
  }
  void attend(int layer, int pos, const float* q, int n_heads, float* out) override {
    fp_.attend(layer, pos, q, n_heads, out);
    set_.q_heads = n_heads;
    Seq& s = at(layer, pos);
    const std::size_t row = static_cast<std::size_t>(n_heads) * g_.head_dim;
    auto& dst = s.layers[static_cast<std::size_t>(layer)].q;
    if (dst.size() < (static_cast<std::size_t>(pos) + 1) * row) dst.resize((static_cast<std::size_t>(pos) + 1) * row);
    std::copy(q, q + row, dst.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(pos) * row));
  }
  /// The recorded sequences (call after the last one has run).
  kvq::CalibrationSet take() {
    flush();
    return std::move(set_);
  }

 private:
  using Seq = kvq::CalibrationSet::Sequence;
  Seq& at(int layer, int pos) {
    if (cur_.layers.empty()) cur_.layers.resize(static_cast<std::size_t>(g_.n_layers));
    if (layer == 0) cur_.tokens = std::max<int64_t>(cur_.tokens, pos + 1);
    return cur_;
  }
  void flush() {
    if (cur_.tokens > 0) {
      for (auto& l : cur_.layers)
        if (l.q.size() != static_cast<std::size_t>(cur_.tokens * set_.q_heads * g_.head_dim)) l.q.clear();
      set_.sequences.push_back(std::move(cur_));
    }
    cur_ = Seq{};
  }
  kvq::eval::KVGeometry g_;
  bool prerope_;
  kvq::eval::Fp32Backend fp_;
  kvq::CalibrationSet set_;
  Seq cur_;
};

/// True when `path` holds a calibration file (a JSON object) rather than a dump or a text.
inline bool is_calibration_file(const std::string& path) {
  if (std::filesystem::is_directory(path)) return false;
  std::ifstream f(path, std::ios::binary);
  char c = 0;
  while (f.get(c))
    if (c != ' ' && c != '\n' && c != '\r' && c != '\t') return c == '{';
  return false;
}

inline bool is_kv_dump(const std::string& path) {
  if (std::filesystem::is_directory(path)) return true;
  const std::string ext = std::filesystem::path(path).extension().string();
  return ext == ".safetensors";
}

/// Resolves --calibrate PATH for `p` (a policy that needs calibration) on an n_layers model.
/// `run_text(path, recorder)` runs a model over a text's lines (null when the tool has no
/// model). `what` gets a description of the source for reports.
template <class RunText>
kvq::Policy calibrate_from(const kvq::Policy& p, const std::string& path, int n_layers,
                           const kvq::eval::KVGeometry* geo, bool prerope, RunText&& run_text,
                           std::string* what) {
  if (is_calibration_file(path)) {
    if (what) *what = "calibration file " + path;
    return kvq::apply_calibration(p, kvq::load_calibration(path), n_layers);
  }
  if (is_kv_dump(path)) {
    if (what) *what = "KV dump " + path;
    const kvq::io::KVDump d = kvq::io::load_kv_dump(path);
    KVQ_REQUIRE(d.num_layers() == n_layers, kInvalidArgument, "--calibrate: the KV dump has ",
                d.num_layers(), " layers, the model ", n_layers);
    return kvq::calibrate(p, d, prerope);
  }
  KVQ_REQUIRE(geo != nullptr, kInvalidArgument, "--calibrate ", path,
              ": neither a calibration file nor a KV dump (text files need a tool that runs a "
              "model)");
  if (what) *what = "model run over the lines of " + path;
  // One model run per (text, key convention): later policies reuse the recording.
  static std::string memo_key;
  static kvq::CalibrationSet memo;
  const std::string key = path + (prerope ? "|prerope" : "|postrope");
  if (memo_key != key) {
    CalibrationRecorder rec(*geo, prerope);
    run_text(path, rec);
    memo = rec.take();
    memo_key = key;
  }
  return kvq::calibrate(p, memo);
}

/// Writes `p`'s calibration to FILE (FILE.<i>.json for the i-th of several policies).
inline void save_calibration_for(const std::string& file, std::size_t index, std::size_t count,
                                 const kvq::Policy& p, int n_layers, const std::string& source) {
  std::string out = file;
  if (count > 1) {
    const std::filesystem::path fp(file);
    out = (fp.parent_path() / (fp.stem().string() + "." + std::to_string(index) + ".json")).string();
  }
  kvq::save_calibration(out, p, n_layers, source);
  std::fprintf(stderr, "calibration written to %s\n", out.c_str());
}

/// --calibrate PATH (repeatable) and --save-calibration FILE.
struct CalibrationArgs {
  std::vector<std::string> paths;
  std::string save;

  /// Consumes argv[i] (and its value) when it is one of the two flags; a missing value is a
  /// usage error (exit 2).
  bool parse(const char* tool, int argc, char** argv, int& i) {
    const std::string a = argv[i];
    if (a != "--calibrate" && a != "--save-calibration") return false;
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s: %s needs a value\n", tool, a.c_str());
      std::exit(2);
    }
    (a == "--calibrate" ? paths.emplace_back() : save) = argv[++i];
    return true;
  }
  /// Usage lines of the two flags; `text_ok`: the tool runs a model (PATH may be a text).
  static std::string usage(bool text_ok) {
    return std::string(
               "--calibrate PATH: nuq codebooks from PATH: a calibration file (JSON, from\n"
               "  --save-calibration), a KV dump") +
           (text_ok ? ", or a text file the model is run over (keys, values, queries\n"
                      "  recorded)"
                    : "") +
           "; use other data than the evaluation's (no leak). May be given\n"
           "  several times: each nuq policy takes the first calibration file made for its\n"
           "  normalization, else the first dump or text\n"
           "--save-calibration FILE: write what was learned (FILE.<i>.json for several\n"
           "  calibrated policies, i counting them in order)\n";
  }
};

/// Calibration files read so far (by path) and which of them served a policy.
struct CalibrationFiles {
  std::map<std::string, kvq::CalibrationFile> loaded;
  std::set<std::string> used;
  std::map<std::string, std::string> specs;  // path -> the spec it was made for
  std::map<std::string, std::string> why;    // path -> why it did not fit (first policy tried)
};

/// `p` calibrated from args.paths (see the file comment), or nullopt when the paths are all
/// calibration files and none fits `p` (`why` then lists each file's mismatch). `run_text` runs
/// the tool's model over a text (a no-op for tools without one: then `geo` is null and a text
/// is an error). `what` gets the source. Throws kInvalidArgument naming the layer when there is
/// no path at all, kParse for a calibration file that does not parse.
template <class RunText>
std::optional<kvq::Policy> try_calibrate_policy(const kvq::Policy& p, const CalibrationArgs& args,
                                                int n_layers, const kvq::eval::KVGeometry* geo,
                                                bool prerope, RunText&& run_text,
                                                CalibrationFiles& files, std::string* what,
                                                std::string* why = nullptr) {
  if (args.paths.empty()) kvq::check_calibrated(p, n_layers);  // throws, naming the layer
  for (const std::string& path : args.paths) {
    if (!is_calibration_file(path))
      return calibrate_from(p, path, n_layers, geo, prerope, run_text, what);
    auto it = files.loaded.find(path);
    if (it == files.loaded.end()) {
      it = files.loaded.emplace(path, kvq::load_calibration(path)).first;
      files.specs[path] = it->second.policy.spec();
    }
    try {
      kvq::Policy out = kvq::apply_calibration(p, it->second, n_layers);
      files.used.insert(path);
      if (what) *what = "calibration file " + path;
      return out;
    } catch (const kvq::Error& e) {
      if (e.kind() != kvq::ErrorKind::kInvalidArgument) throw;
      files.why.emplace(path, e.what());
      if (why) *why += "\n  " + path + ": " + e.what();
    }
  }
  return std::nullopt;
}

/// try_calibrate_policy, with "no calibration file fits" an error (kInvalidArgument naming the
/// policy and each file's mismatch).
template <class RunText>
kvq::Policy calibrate_policy(const kvq::Policy& p, const CalibrationArgs& args, int n_layers,
                             const kvq::eval::KVGeometry* geo, bool prerope, RunText&& run_text,
                             CalibrationFiles& files, std::string* what) {
  std::string why;
  std::optional<kvq::Policy> out =
      try_calibrate_policy(p, args, n_layers, geo, prerope, run_text, files, what, &why);
  if (!out)
    kvq::fail(kvq::ErrorKind::kInvalidArgument, p.spec(),
              " needs nuq codebooks, and no --calibrate file holds them:", why);
  return *out;
}

/// Throws kInvalidArgument when a calibration file given to --calibrate served no policy.
inline void check_calibration_files(const CalibrationArgs& args, const CalibrationFiles& files) {
  for (const auto& [path, file] : files.loaded)
    KVQ_REQUIRE(files.used.count(path) > 0, kInvalidArgument, "--calibrate ", path,
                ": its codebooks (", files.specs.at(path),
                ") fit none of the policies that need calibration",
                files.why.count(path) ? " (" + files.why.at(path) + ")" : std::string());
  for (const std::string& path : args.paths)  // files never reached (an earlier source won)
    if (files.loaded.count(path) == 0 && is_calibration_file(path)) {
      const kvq::CalibrationFile f = kvq::load_calibration(path);  // a bad file is an error
      kvq::fail(kvq::ErrorKind::kInvalidArgument, "--calibrate ", path, ": its codebooks (",
                f.policy.spec(), ") fit none of the policies that need calibration");
    }
}

/// Calibrates, in place, every policy of `ps` that needs it (kvq_perplexity,
/// kvq_quantize_dump), saves each to args.save when given, checks that every calibration file
/// served, and returns the source description ("" when nothing needed calibration).
template <class RunText>
std::string calibrate_policies(std::vector<kvq::Policy>& ps, const CalibrationArgs& args,
                               int n_layers, const kvq::eval::KVGeometry* geo, bool prerope,
                               RunText&& run_text, const char* tool) {
  std::size_t n_cal = 0, i_cal = 0;
  // nuq policies always; NVFP4 policies at the default tensor scale when --calibrate is given.
  auto wants = [&](const kvq::Policy& p) {
    return kvq::needs_calibration(p, n_layers) ||
           (!args.paths.empty() && kvq::calibrates(p, n_layers));
  };
  for (const kvq::Policy& p : ps) n_cal += wants(p) ? 1 : 0;
  CalibrationFiles files;
  std::string all;  // distinct sources, in order
  for (kvq::Policy& p : ps) {
    if (!wants(p)) continue;
    std::fprintf(stderr, "%s: calibrating %s ...\n", tool, p.spec().c_str());
    std::string what;
    p = calibrate_policy(p, args, n_layers, geo, prerope, run_text, files, &what);
    if (!args.save.empty()) save_calibration_for(args.save, i_cal, n_cal, p, n_layers, what);
    if (all.find(what) == std::string::npos) all += (all.empty() ? "" : "; ") + what;
    ++i_cal;
  }
  check_calibration_files(args, files);
  return all;
}

}  // namespace kvq_tools

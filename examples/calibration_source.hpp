#pragma once
// --calibrate PATH / --save-calibration FILE for the tools (kvq_perplexity, kvq_compare,
// kvq_quantize_dump): PATH is a calibration file (JSON, quant/calibrate.hpp), a KV dump
// (.safetensors file or .npy directory, io/kv_dump.hpp), or, for tools that run a model, a text
// file whose lines the model is run over (the evaluation protocol's lines) to record keys
// (pre-RoPE when the cache quantizes them so), values and queries.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "kvq/eval/kv_backend.hpp"
#include "kvq/io/kv_dump.hpp"
#include "kvq/quant/calibrate.hpp"

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

}  // namespace kvq_tools

#pragma once
/// \file kv_dump.hpp
/// The KV dump convention: the keys, values (and optionally queries and pre-RoPE keys) of
/// every attention layer of one forward pass, as kvq's experiments and tests consume them.
///
/// Tensor names, each [tokens, heads, head_dim] row-major, f32/f16/bf16:
///   layers.<i>.k          keys as cached (after RoPE), heads = kv_heads      (required)
///   layers.<i>.v          values, same shape as k                            (required)
///   layers.<i>.q          queries as attention consumes them (after RoPE);
///                         heads = q_heads, a multiple of kv_heads (GQA/MQA)  (optional)
///   layers.<i>.k_prerope  keys before RoPE, same shape as k                  (optional)
/// <i> is a decimal layer index without leading zeros; layers are 0..L-1 without gaps. All
/// layers cover the same tokens; heads and head_dim may differ between layers.
///
/// Storage: one .safetensors file holding those names, or a directory of .npy files named
/// `<name>.npy` (layers.0.k.npy, ...). Other tensors/files are ignored, so a dump can carry
/// extras (token ids, logits) in any dtype; a name that starts with "layers." but does not fit
/// the pattern is an error, because it is almost certainly a typo of a required tensor.
/// See docs/dump-format.md for a script that produces dumps from Hugging Face models.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "kvq/core/error.hpp"
#include "kvq/core/tensor.hpp"
#include "kvq/io/array.hpp"
#include "kvq/io/npy.hpp"
#include "kvq/io/safetensors.hpp"

namespace kvq::io {

/// The two storage forms of a dump.
enum class DumpFormat : uint8_t {
  kSafetensors,  ///< one .safetensors file
  kNpyDir,       ///< a directory of layers.<i>.<kind>.npy files
};

/// All layers of one dump.
struct KVDump {
  struct Layer {
    Array k;                         ///< [tokens, kv_heads, head_dim], post-RoPE
    Array v;                         ///< [tokens, kv_heads, head_dim]
    std::optional<Array> q;          ///< [tokens, q_heads, head_dim], post-RoPE
    std::optional<Array> k_prerope;  ///< [tokens, kv_heads, head_dim]
  };
  std::vector<Layer> layers;

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }
  /// Tokens per layer (all layers agree once validated); 0 for an empty dump.
  int64_t tokens() const {
    return layers.empty() || layers[0].k.shape.empty() ? 0 : layers[0].k.shape[0];
  }
};

/// "layers.<layer>.<kind>" (kind: k, v, q, k_prerope).
inline std::string kv_dump_name(int64_t layer, const std::string& kind) {
  return detail::cat("layers.", layer, ".", kind);
}

namespace detail {

enum class KVKind { kK, kV, kQ, kKPrerope };

/// KVQ_REQUIRE with the error kind as a runtime value (validation serves loads, which report
/// kIo, and saves, which report kShapeMismatch).
template <class... A>
void require(bool ok, ErrorKind kind, const A&... parts) {
  if (!ok) ::kvq::fail(kind, parts...);
}

/// Splits a name of the convention into (layer, kind). Returns false for names outside the
/// "layers." namespace (ignored); throws `kind` errors for malformed "layers.*" names.
inline bool parse_kv_name(const std::string& name, int64_t* layer, KVKind* kind,
                          const std::string& source, ErrorKind ekind) {
  static const std::string kPrefix = "layers.";
  if (name.compare(0, kPrefix.size(), kPrefix) != 0) return false;
  auto bad = [&](const char* why) {
    fail(ekind, source, ": tensor ", printable(name), " ", why,
         "; dump tensors are named layers.<i>.k, layers.<i>.v, layers.<i>.q, "
         "layers.<i>.k_prerope");
  };
  size_t p = kPrefix.size();
  const size_t d0 = p;
  int64_t idx = 0;
  while (p < name.size() && name[p] >= '0' && name[p] <= '9') {
    if (!checked_mul(idx, 10, &idx) || !checked_add(idx, name[p] - '0', &idx)) {
      bad("has a layer index that overflows int64");
    }
    ++p;
  }
  if (p == d0) bad("has no layer index");
  if (p - d0 > 1 && name[d0] == '0') bad("has a layer index with a leading zero");
  if (p >= name.size() || name[p] != '.') bad("lacks the '.' after the layer index");
  const std::string k = name.substr(p + 1);
  if (k == "k") {
    *kind = KVKind::kK;
  } else if (k == "v") {
    *kind = KVKind::kV;
  } else if (k == "q") {
    *kind = KVKind::kQ;
  } else if (k == "k_prerope") {
    *kind = KVKind::kKPrerope;
  } else {
    bad("has an unknown kind");
  }
  *layer = idx;
  return true;
}

struct PartialLayer {
  std::optional<Array> k, v, q, k_prerope;
};

/// Checks one array of the dump: consistent payload, rank 3, every extent positive.
inline Shape check_kv_array(const Array& a, const std::string& name, const std::string& source,
                            ErrorKind kind) {
  int64_t nb = dtype_size(a.dtype);
  bool sane = a.shape.size() <= static_cast<size_t>(kMaxRank);
  for (size_t i = 0; sane && i < a.shape.size(); ++i) sane = checked_mul(nb, a.shape[i], &nb);
  require(sane && static_cast<uint64_t>(nb) == a.bytes.size(), kind, source, ": ", name,
          ": payload of ", a.bytes.size(), " bytes does not match shape ", shape_str(a.shape),
          " of ", to_string(a.dtype));
  require(a.shape.size() == 3, kind, source, ": ", name, " has shape ", shape_str(a.shape),
          "; dump tensors are rank 3 [tokens, heads, head_dim]");
  require(a.shape[0] > 0 && a.shape[1] > 0 && a.shape[2] > 0, kind, source, ": ", name,
          " has shape ", shape_str(a.shape), "; tokens, heads and head_dim must be > 0");
  return Shape{a.shape[0], a.shape[1], a.shape[2]};
}

}  // namespace detail

/// Throws kvq::Error(kind) naming `source`, the tensor and the offending shapes unless `dump`
/// follows the convention: at least one layer; per layer k and v rank 3 with positive extents
/// and equal shapes; k_prerope (if any) the shape of k; q (if any) the tokens and head_dim of
/// k with a head count that is a positive multiple of k's; the same token count in all layers.
inline void validate_kv_dump(const KVDump& dump, const std::string& source = "KV dump",
                             ErrorKind kind = ErrorKind::kShapeMismatch) {
  detail::require(!dump.layers.empty(), kind, source, ": no layers (expected layers.0.k, ...)");
  int64_t tokens = -1;
  for (size_t i = 0; i < dump.layers.size(); ++i) {
    const KVDump::Layer& l = dump.layers[i];
    const auto name = [&](const char* k) { return kv_dump_name(static_cast<int64_t>(i), k); };
    const Shape ks = detail::check_kv_array(l.k, name("k"), source, kind);
    const Shape vs = detail::check_kv_array(l.v, name("v"), source, kind);
    detail::require(vs == ks, kind, source, ": ", name("v"), " has shape ", vs.str(), " but ",
                    name("k"), " has ", ks.str(), "; k and v must have the same shape");
    if (l.k_prerope) {
      const Shape ps = detail::check_kv_array(*l.k_prerope, name("k_prerope"), source, kind);
      detail::require(ps == ks, kind, source, ": ", name("k_prerope"), " has shape ", ps.str(),
                      " but ", name("k"), " has ", ks.str());
    }
    if (l.q) {
      const Shape qs = detail::check_kv_array(*l.q, name("q"), source, kind);
      detail::require(qs.tokens == ks.tokens && qs.head_dim == ks.head_dim, kind, source, ": ",
                      name("q"), " has shape ", qs.str(), " but ", name("k"), " has ", ks.str(),
                      "; q must have the same tokens and head_dim");
      detail::require(qs.heads % ks.heads == 0, kind, source, ": ", name("q"), " has ", qs.heads,
                      " heads, not a multiple of the ", ks.heads, " kv heads of ", name("k"),
                      " (GQA needs q_heads = group * kv_heads)");
    }
    if (tokens < 0) tokens = ks.tokens;
    detail::require(ks.tokens == tokens, kind, source, ": ", name("k"), " has ", ks.tokens,
                    " tokens but layers.0.k has ", tokens,
                    "; all layers must cover the same tokens");
  }
}

namespace detail {

/// Turns the tensors found (by layer) into a dump and validates it; errors are kIo.
inline KVDump assemble_kv_dump(std::map<int64_t, PartialLayer>&& parts, const std::string& src) {
  KVQ_REQUIRE(!parts.empty(), kIo, src, ": no dump tensors found (expected layers.0.k, ...)");
  // Keys are sorted and unique, so 0..L-1 without gaps means last key == L-1 and first == 0.
  int64_t expect = 0;
  for (const auto& kv : parts) {
    KVQ_REQUIRE(kv.first == expect, kIo, src, ": layer ", expect, " is missing (found layer ",
                kv.first, " next); layers must be numbered 0..L-1 without gaps");
    ++expect;
  }
  KVDump dump;
  dump.layers.reserve(parts.size());
  for (auto& [i, p] : parts) {
    KVQ_REQUIRE(p.k.has_value(), kIo, src, ": ", kv_dump_name(i, "k"), " is missing");
    KVQ_REQUIRE(p.v.has_value(), kIo, src, ": ", kv_dump_name(i, "v"), " is missing");
    KVDump::Layer l;
    l.k = std::move(*p.k);
    l.v = std::move(*p.v);
    l.q = std::move(p.q);
    l.k_prerope = std::move(p.k_prerope);
    dump.layers.push_back(std::move(l));
  }
  validate_kv_dump(dump, src, ErrorKind::kIo);
  return dump;
}

inline void put_part(std::map<int64_t, PartialLayer>& parts, int64_t layer, KVKind kind, Array a,
                     const std::string& name, const std::string& src) {
  PartialLayer& p = parts[layer];
  std::optional<Array>& slot = kind == KVKind::kK   ? p.k
                               : kind == KVKind::kV ? p.v
                               : kind == KVKind::kQ ? p.q
                                                    : p.k_prerope;
  KVQ_REQUIRE(!slot.has_value(), kIo, src, ": tensor ", printable(name), " appears twice");
  slot = std::move(a);
}

/// The regular .npy files of a directory, as stem -> path (the caller filters by name).
inline std::map<std::string, std::filesystem::path> npy_dump_files(const std::filesystem::path& dir,
                                                                   const std::string& src) {
  std::map<std::string, std::filesystem::path> out;
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  KVQ_REQUIRE(!ec, kIo, src, ": cannot list directory: ", ec.message());
  for (; it != std::filesystem::directory_iterator(); it.increment(ec)) {
    KVQ_REQUIRE(!ec, kIo, src, ": cannot list directory: ", ec.message());
    const std::filesystem::path& p = it->path();
    if (p.extension() != ".npy") continue;
    std::error_code ec2;
    if (!std::filesystem::is_regular_file(p, ec2)) continue;
    out.emplace(p.stem().string(), p);
  }
  KVQ_REQUIRE(!ec, kIo, src, ": cannot list directory: ", ec.message());
  return out;
}

/// The dump held by a .safetensors file or buffer (`Reader`: FileReader or MemReader). Only
/// tensors of the convention are read.
template <class Reader>
KVDump kv_dump_from_safetensors(Reader& r, const std::string& src) {
  std::map<int64_t, PartialLayer> parts;
  int64_t layer = 0;
  KVKind kind{};
  const SafetensorsHeader h = st_read_header(r, src);
  for (const SafetensorsEntry& e : h.tensors) {
    if (!parse_kv_name(e.name, &layer, &kind, src, ErrorKind::kIo)) continue;
    put_part(parts, layer, kind, st_read_tensor(r, h, e, src), e.name, src);
  }
  return assemble_kv_dump(std::move(parts), src);
}

}  // namespace detail

/// Loads a dump from a .safetensors file or a directory of .npy files (decided by what `path`
/// is) and validates it. Throws kvq::Error(kIo) naming the path and the offending tensor.
/// Only tensors of the convention are read, so extra tensors of other dtypes do no harm.
inline KVDump load_kv_dump(const std::filesystem::path& path, const NpyReadOptions& npy_opt = {}) {
  const std::string src = path.string();
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  KVQ_REQUIRE(!ec && std::filesystem::exists(st), kIo, src, ": no such file or directory");
  std::map<int64_t, detail::PartialLayer> parts;
  int64_t layer = 0;
  detail::KVKind kind{};
  if (std::filesystem::is_directory(st)) {
    for (const auto& [name, file] : detail::npy_dump_files(path, src)) {
      if (!detail::parse_kv_name(name, &layer, &kind, file.string(), ErrorKind::kIo)) continue;
      detail::put_part(parts, layer, kind, read_npy(file, npy_opt), name, src);
    }
  } else {
    detail::FileReader r(path);
    return detail::kv_dump_from_safetensors(r, src);
  }
  return detail::assemble_kv_dump(std::move(parts), src);
}

/// Same as load_kv_dump, from the image of a .safetensors dump held in memory (a dump received
/// over a socket, or a fuzzer's input). `source` names it in error messages.
inline KVDump load_kv_dump_bytes(const uint8_t* data, size_t size,
                                 const std::string& source = "<memory>") {
  KVQ_REQUIRE(data != nullptr || size == 0, kInvalidArgument, source, ": null buffer");
  detail::MemReader r(data, size, source);
  return detail::kv_dump_from_safetensors(r, source);
}

/// Saves `dump` (validated first; kShapeMismatch/kInvalidArgument if it breaks the
/// convention) as one .safetensors file or as a directory of .npy files. The directory is
/// created if needed; stale layers.*.npy files of the convention that are not part of this
/// dump are removed, so that loading the directory gives back exactly `dump`.
inline void save_kv_dump(const std::filesystem::path& path, const KVDump& dump, DumpFormat format) {
  validate_kv_dump(dump, "save_kv_dump(" + path.string() + ")");
  detail::NamedArrays named;
  for (size_t i = 0; i < dump.layers.size(); ++i) {
    const KVDump::Layer& l = dump.layers[i];
    const auto li = static_cast<int64_t>(i);
    named.emplace_back(kv_dump_name(li, "k"), &l.k);
    named.emplace_back(kv_dump_name(li, "v"), &l.v);
    if (l.q) named.emplace_back(kv_dump_name(li, "q"), &*l.q);
    if (l.k_prerope) named.emplace_back(kv_dump_name(li, "k_prerope"), &*l.k_prerope);
  }
  const std::string src = path.string();
  if (format == DumpFormat::kSafetensors) {
    detail::st_write(path, named,
                     {{"format", "kvq.kv_dump"}, {"layers", std::to_string(dump.layers.size())}});
    return;
  }
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  KVQ_REQUIRE(!ec, kIo, src, ": cannot create directory: ", ec.message());
  KVQ_REQUIRE(std::filesystem::is_directory(path, ec), kIo, src, ": exists and is not a directory");
  std::set<std::string> keep;
  for (const auto& n : named) keep.insert(n.first);
  for (const auto& [name, file] : detail::npy_dump_files(path, src)) {
    int64_t layer = 0;
    detail::KVKind kind{};
    bool ours = false;
    try {
      ours = detail::parse_kv_name(name, &layer, &kind, src, ErrorKind::kIo);
    } catch (const Error&) {
      ours = false;  // not of the convention: leave it alone
    }
    if (ours && !keep.count(name)) {
      std::filesystem::remove(file, ec);
      KVQ_REQUIRE(!ec, kIo, file.string(), ": cannot remove stale dump file: ", ec.message());
    }
  }
  for (const auto& [name, a] : named) write_npy(path / (name + ".npy"), *a);
}

}  // namespace kvq::io

// kvq_archive: kvq's checksummed cache archives (.kvqa, include/kvq/io/archive.hpp,
// docs/archive.md) for people and scripts.
//
//   kvq_archive write --policy SPEC [--calibrate CAL] [--chunk N] [--no-rollback]
//                     [--prerope [--rope-theta T] [--rope-style adjacent|half]] DUMP OUT.kvqa
//       quantizes a KV dump (docs/dump-format.md) into a streaming cache, N tokens of every
//       layer at a time (default 64), offloading the pages to OUT as they are flushed; the f32
//       sinks/residual/rollback rows, the footer and the trailer go last. --prerope stores the
//       dump's pre-RoPE keys and records the RoPE config in the archive. --no-rollback leaves
//       out the f32 originals of each layer's newest page (ArchiveOptions::rollback_rows).
//   kvq_archive verify FILE
//       checks every byte (exit 0 and a one-line summary; exit 1 and the damaged record named).
//   kvq_archive info FILE [--json]
//       policy, shapes, per-layer token split, file bytes by kind, the stored bytes by kind and
//       effective bits (kvq's accountant, as the loaded cache reports them).
//   kvq_archive read FILE OUT
//       dequantizes every layer back to a KV dump (OUT ending in .safetensors: one file, else a
//       directory of .npy files); for a pre-RoPE archive, layers.<i>.k_prerope holds the stored
//       keys and layers.<i>.k the keys with the archive's RoPE applied.
// Exit codes: 0 success, 1 kvq reported an error (damaged file, bad input), 2 usage error.
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "calibration_source.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/core/rope.hpp"
#include "kvq/io/archive.hpp"
#include "kvq/io/json.hpp"
#include "kvq/io/kv_dump.hpp"
#include "kvq/policy/spec.hpp"

namespace {

namespace io = kvq::io;

void usage() {
  std::fprintf(stderr,
               "usage: kvq_archive write --policy SPEC [--calibrate CAL] [--chunk N] [--no-rollback]\n"
               "                         [--prerope [--rope-theta T] [--rope-style adjacent|half]]\n"
               "                         DUMP OUT.kvqa\n"
               "       kvq_archive verify FILE\n"
               "       kvq_archive info FILE [--json]\n"
               "       kvq_archive read FILE OUT   (OUT.safetensors, or a directory of .npy)\n");
}

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "kvq_archive: %s\n", msg.c_str());
  usage();
  std::exit(2);
}

/// s as a JSON string: valid UTF-8 passes through (quotes, backslashes and control characters
/// escaped by io::json_quote); a byte that starts no valid UTF-8 sequence (file names and notes
/// are bytes) becomes U+FFFD, so the output is always JSON a strict parser accepts.
std::string json_str(const std::string& s) {
  std::string clean;
  const std::string_view v(s);
  for (std::size_t i = 0; i < v.size();) {
    const auto c = static_cast<unsigned char>(v[i]);
    const std::size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n > 0 && i + n <= v.size() && io::detail::valid_utf8(v.substr(i, n))) {
      clean.append(v.substr(i, n));
      i += n;
    } else {
      clean += "\xEF\xBF\xBD";  // U+FFFD
      ++i;
    }
  }
  return io::json_quote(clean);
}

std::string crc_hex(uint32_t c) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08x", c);
  return b;
}

std::string shape_line(const io::ArchiveInfo& in) {
  return kvq::detail::cat(in.n_layers, " layers x ", in.kv_heads, " kv heads x head_dim ", in.head_dim);
}

int cmd_write(int argc, char** argv) {
  std::string spec, calib, dump_path, out, rope_style = "adjacent";
  bool prerope = false, rollback_rows = true;
  double theta = 10000.0;
  long chunk = 64;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--policy") {
      spec = next();
    } else if (a == "--calibrate") {
      calib = next();
    } else if (a == "--prerope") {
      prerope = true;
    } else if (a == "--no-rollback") {
      rollback_rows = false;
    } else if (a == "--rope-style") {
      rope_style = next();
    } else if (a == "--rope-theta") {
      const std::string v = next();
      char* end = nullptr;
      theta = std::strtod(v.c_str(), &end);
      if (!end || *end || !(theta > 1)) usage_error("--rope-theta needs a number > 1, got '" + v + "'");
    } else if (a == "--chunk") {
      const std::string v = next();
      char* end = nullptr;
      chunk = std::strtol(v.c_str(), &end, 10);
      if (!end || *end || chunk <= 0 || chunk > (1 << 24))
        usage_error("--chunk needs a positive integer, got '" + v + "'");
    } else if (!a.empty() && a[0] == '-') {
      usage_error("write: unknown option '" + a + "'");
    } else if (dump_path.empty()) {
      dump_path = a;
    } else if (out.empty()) {
      out = a;
    } else {
      usage_error("write: more than two paths ('" + a + "')");
    }
  }
  if (spec.empty() || dump_path.empty() || out.empty()) usage_error("write needs --policy SPEC, DUMP and OUT");
  if (spec.find(';') != std::string::npos) usage_error("write takes one policy, got '" + spec + "'");
  if (rope_style != "adjacent" && rope_style != "half")
    usage_error("--rope-style must be adjacent or half, got '" + rope_style + "'");

  kvq::Policy policy = kvq::parse_policy(spec);
  const io::KVDump dump = io::load_kv_dump(dump_path);
  const int L = static_cast<int>(dump.num_layers());
  const kvq::Shape shape = dump.layers[0].k.kv_shape();
  for (int l = 0; l < L; ++l)
    KVQ_REQUIRE(dump.layers[static_cast<std::size_t>(l)].k.kv_shape() == shape, kShapeMismatch,
                "kvq_archive write needs every layer to have the same shape; layer ", l, " is ",
                dump.layers[static_cast<std::size_t>(l)].k.kv_shape().str(), ", layer 0 is ", shape.str());
  if (prerope)
    for (int l = 0; l < L; ++l)
      KVQ_REQUIRE(dump.layers[static_cast<std::size_t>(l)].k_prerope.has_value(), kInvalidArgument,
                  "--prerope needs layers.", l, ".k_prerope in the dump");
  if (kvq::needs_calibration(policy, L)) {
    if (calib.empty()) kvq::check_calibrated(policy, L);
    std::string what;
    policy = kvq_tools::calibrate_from(policy, calib, L, nullptr, prerope,
                                       [](const std::string&, kvq::eval::KVBackend&) {}, &what);
    std::fprintf(stderr, "kvq_archive: nuq codebooks from %s\n", what.c_str());
  }
  const int64_t T = shape.tokens, H = shape.heads, D = shape.head_dim;
  std::vector<std::vector<float>> K, V;
  for (const auto& ly : dump.layers) {
    K.push_back(prerope ? ly.k_prerope->to_float() : ly.k.to_float());
    V.push_back(ly.v.to_float());
  }
  kvq::KVCache cache(policy, L, static_cast<int>(H), static_cast<int>(D));
  io::ArchiveOptions opt;
  opt.rollback_rows = rollback_rows;
  if (prerope) opt.key_rope = kvq::RopeConfig{theta, rope_style == "half" ? kvq::RopeStyle::kHalf : kvq::RopeStyle::kAdjacent};
  opt.note = "kvq_archive write --policy " + spec + " " + std::filesystem::path(dump_path).filename().string();
  io::ArchiveWriter w(out, cache, opt);
  std::size_t streamed = 0;
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {  // offload: pages leave as they are flushed
    const int64_t n = std::min<int64_t>(chunk, T - t0);
    for (int l = 0; l < L; ++l)
      cache.append(l, kvq::KVView<const float>::nhd(K[static_cast<std::size_t>(l)].data() + t0 * H * D, n, H, D),
                   kvq::KVView<const float>::nhd(V[static_cast<std::size_t>(l)].data() + t0 * H * D, n, H, D));
    streamed += w.append_pages(cache);
  }
  const io::ArchiveSummary s = w.finish(cache);
  const kvq::MemoryReport rep = cache.memory_report();
  const double elems = static_cast<double>(rep.elements());
  std::printf("wrote %s: %d layers x [%" PRId64 " tokens, %" PRId64 " kv heads, %" PRId64
              " head_dim] under %s%s; %zu records (%zu pages streamed while appending %ld-token chunks), "
              "%" PRIu64 " bytes, %.3f bits/value in the file, %.3f stored; CRC-32C %s\n",
              s.path.string().c_str(), L, T, H, D, cache.policy().spec().c_str(),
              prerope ? " (pre-RoPE keys)" : "", s.records, streamed, chunk, s.bytes,
              elems > 0 ? 8.0 * static_cast<double>(s.bytes) / elems : 0.0, rep.effective_bits(),
              crc_hex(s.file_crc).c_str());
  return 0;
}

int cmd_verify(const std::string& path) {
  io::ArchiveReader r(path);
  r.verify();
  const io::ArchiveInfo& in = r.info();
  std::printf("%s: OK: kvq archive v%u, %s, %" PRId64 " tokens, %zu records, %" PRIu64
              " bytes, CRC-32C %s, policy %s\n",
              path.c_str(), in.version, shape_line(in).c_str(), in.total_tokens(), in.records.size(),
              in.file_bytes, crc_hex(in.file_crc).c_str(), in.spec.c_str());
  return 0;
}

int cmd_info(const std::string& path, bool json) {
  io::ArchiveReader r(path);
  const io::ArchiveInfo& in = r.info();
  const kvq::KVCache cache = r.load();  // verifies every byte
  const kvq::MemoryReport rep = cache.memory_report();
  const uint64_t pages = in.payload_bytes(io::RecordKind::kPage), sinks = in.payload_bytes(io::RecordKind::kSinks),
                 resid = in.payload_bytes(io::RecordKind::kResidual),
                 roll = in.payload_bytes(io::RecordKind::kRollback);
  const uint64_t framing = in.footer_offset - in.header_bytes - pages - sinks - resid - roll;
  const double elems = static_cast<double>(rep.elements());
  const double file_bits = elems > 0 ? 8.0 * static_cast<double>(in.file_bytes) / elems : 0.0;
  const kvq::StreamBytes kb = rep.key_total(), vb = rep.value_total();
  if (json) {
    std::printf("{\n  \"file\": %s,\n  \"version\": %u,\n  \"writer\": %s,\n  \"bytes\": %" PRIu64
                ",\n  \"crc32c\": %s,\n  \"policy\": %s,\n  \"note\": %s,\n",
                json_str(path).c_str(), in.version, json_str(in.writer_version_string()).c_str(), in.file_bytes,
                json_str(crc_hex(in.file_crc)).c_str(), json_str(in.spec).c_str(), json_str(in.note).c_str());
    std::printf("  \"layers\": %d,\n  \"kv_heads\": %d,\n  \"head_dim\": %d,\n  \"max_tokens\": %d,\n"
                "  \"exact_rollback\": %s,\n  \"keys_prerope\": %s,\n",
                in.n_layers, in.kv_heads, in.head_dim, in.max_tokens,
                in.options.exact_rollback ? "true" : "false", in.key_rope ? "true" : "false");
    if (in.key_rope)
      std::printf("  \"rope_theta\": %.17g,\n  \"rope_style\": %s,\n", in.key_rope->theta,
                  in.key_rope->style == kvq::RopeStyle::kHalf ? "\"half\"" : "\"adjacent\"");
    std::printf("  \"per_layer\": [");
    for (int l = 0; l < in.n_layers; ++l) {
      const io::ArchiveLayer& A = in.layers[static_cast<std::size_t>(l)];
      std::printf("%s\n    {\"layer\": %d, \"tokens\": %" PRId64 ", \"sinks\": %" PRId64 ", \"pages\": %" PRId64
                  ", \"block_tokens\": %" PRId64 ", \"page_bytes\": %zu, \"residual\": %" PRId64
                  ", \"rollback\": %s, \"key\": %s, \"value\": %s}",
                  l ? "," : "", l, A.tokens, A.sink_tokens, A.pages, A.block_tokens, A.layout.bytes,
                  A.residual_tokens, A.rollback ? "true" : "false",
                  json_str(kvq::config_spec(A.layout.key)).c_str(),
                  json_str(kvq::config_spec(A.layout.value)).c_str());
    }
    std::printf("\n  ],\n  \"file_bytes\": {\"header\": %" PRIu64 ", \"pages\": %" PRIu64 ", \"sinks\": %" PRIu64
                ", \"residual\": %" PRIu64 ", \"rollback\": %" PRIu64 ", \"record_framing\": %" PRIu64
                ", \"footer\": %" PRIu64 ", \"trailer\": %zu},\n",
                in.header_bytes, pages, sinks, resid, roll, framing, in.footer_bytes, io::kArchiveTrailerBytes);
    std::printf("  \"stored_bytes\": {\"codes\": %zu, \"scales\": %zu, \"zeros\": %zu, \"norms\": %zu, "
                "\"qjl\": %zu, \"outliers\": %zu, \"padding\": %zu, \"sinks\": %zu, \"residual\": %zu, "
                "\"rollback\": %zu, \"total\": %zu},\n",
                kb.packed.codes + vb.packed.codes, kb.packed.scales + vb.packed.scales,
                kb.packed.zeros + vb.packed.zeros, kb.packed.norms + vb.packed.norms,
                kb.packed.residual + vb.packed.residual, kb.packed.outliers + vb.packed.outliers,
                kb.packed.padding + vb.packed.padding, kb.sinks + vb.sinks, kb.residual + vb.residual,
                kb.rollback + vb.rollback, rep.total());
    std::printf("  \"values\": %" PRId64 ",\n  \"effective_bits\": %.6f,\n  \"file_bits\": %.6f\n}\n",
                rep.elements(), rep.effective_bits(), file_bits);
    return 0;
  }
  std::printf("%s: kvq archive v%u (written by kvq %s), %" PRIu64 " bytes, CRC-32C %s, verified\n",
              path.c_str(), in.version, in.writer_version_string().c_str(), in.file_bytes,
              crc_hex(in.file_crc).c_str());
  std::printf("policy: %s\n", in.spec.c_str());
  if (!in.note.empty()) std::printf("note: %s\n", in.note.c_str());
  std::printf("shape: %s, max_tokens %d, exact rollback %s\n", shape_line(in).c_str(), in.max_tokens,
              in.options.exact_rollback ? "on" : "off");
  if (in.key_rope)
    std::printf("keys stored before RoPE (theta %g, %s pairs)\n", in.key_rope->theta,
                in.key_rope->style == kvq::RopeStyle::kHalf ? "half" : "adjacent");
  std::printf("\n%5s %7s %6s %6s %5s %10s %9s %9s  %s / %s\n", "layer", "tokens", "sinks", "pages", "B",
              "page_bytes", "residual", "rollback", "key", "value");
  for (int l = 0; l < in.n_layers; ++l) {
    const io::ArchiveLayer& A = in.layers[static_cast<std::size_t>(l)];
    std::printf("%5d %7" PRId64 " %6" PRId64 " %6" PRId64 " %5" PRId64 " %10zu %9" PRId64 " %9s  %s / %s\n", l,
                A.tokens, A.sink_tokens, A.pages, A.block_tokens, A.layout.bytes, A.residual_tokens,
                A.rollback ? "yes" : "no", kvq::config_spec(A.layout.key).c_str(),
                kvq::config_spec(A.layout.value).c_str());
  }
  std::printf("\nfile bytes by kind: header %" PRIu64 ", pages %" PRIu64 ", sinks %" PRIu64 ", residual %" PRIu64
              ", rollback %" PRIu64 ", record headers + padding %" PRIu64 ", footer %" PRIu64
              ", trailer %zu (%zu records)\n",
              in.header_bytes, pages, sinks, resid, roll, framing, in.footer_bytes, io::kArchiveTrailerBytes,
              in.records.size());
  std::printf("\nstored data as the loaded cache holds it (kvq's accountant):\n%s", rep.str().c_str());
  std::printf("effective bits: %.3f bits/value stored, %.3f bits/value in the file (%" PRId64 " values)\n",
              rep.effective_bits(), file_bits, rep.elements());
  return 0;
}

int cmd_read(const std::string& path, const std::string& out) {
  io::ArchiveReader r(path);
  const io::ArchiveInfo& in = r.info();
  const kvq::KVCache cache = r.load();
  const int64_t T = in.layers[0].tokens, H = in.kv_heads, D = in.head_dim;
  for (int l = 0; l < in.n_layers; ++l)
    KVQ_REQUIRE(in.layers[static_cast<std::size_t>(l)].tokens == T, kShapeMismatch, path, ": layer ", l, " holds ",
                in.layers[static_cast<std::size_t>(l)].tokens, " tokens and layer 0 ", T,
                "; a KV dump needs the same tokens in every layer");
  KVQ_REQUIRE(T > 0, kShapeMismatch, path, ": the archive holds no tokens; a KV dump needs at least one");
  io::KVDump dump;
  for (int l = 0; l < in.n_layers; ++l) {
    std::vector<float> k(static_cast<std::size_t>(T * H * D)), v(k.size());
    cache.read(l, 0, T, kvq::KVView<float>::nhd(k.data(), T, H, D), kvq::KVView<float>::nhd(v.data(), T, H, D));
    io::KVDump::Layer ly;
    if (in.key_rope) {
      ly.k_prerope = io::Array::from_float(k, {T, H, D}, kvq::DType::kF32);
      kvq::apply_rope_pairs(k.data(), T, H, D, 0, *in.key_rope);
    }
    ly.k = io::Array::from_float(k, {T, H, D}, kvq::DType::kF32);
    ly.v = io::Array::from_float(v, {T, H, D}, kvq::DType::kF32);
    dump.layers.push_back(std::move(ly));
  }
  const bool st = std::filesystem::path(out).extension() == ".safetensors";
  io::save_kv_dump(out, dump, st ? io::DumpFormat::kSafetensors : io::DumpFormat::kNpyDir);
  std::printf("wrote %s: %d layers x [%" PRId64 ", %" PRId64 ", %" PRId64 "] f32, dequantized from %s%s\n",
              out.c_str(), in.n_layers, T, H, D, path.c_str(),
              in.key_rope ? " (k_prerope as stored, k with the archive's RoPE)" : "");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    usage();
    return 2;
  }
  const std::string cmd = argv[1];
  if (cmd == "-h" || cmd == "--help") {
    usage();
    return 0;
  }
  std::vector<std::string> pos;
  bool json = false;
  if (cmd != "write") {
    for (int i = 2; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--json" && cmd == "info") json = true;
      else if (!a.empty() && a[0] == '-') usage_error(cmd + ": unknown option '" + a + "'");
      else pos.push_back(a);
    }
  }
  try {
    if (cmd == "write") return cmd_write(argc - 2, argv + 2);
    if (cmd == "verify") {
      if (pos.size() != 1) usage_error("verify takes one FILE");
      return cmd_verify(pos[0]);
    }
    if (cmd == "info") {
      if (pos.size() != 1) usage_error("info takes one FILE");
      return cmd_info(pos[0], json);
    }
    if (cmd == "read") {
      if (pos.size() != 2) usage_error("read takes FILE and OUT");
      return cmd_read(pos[0], pos[1]);
    }
    usage_error("unknown command '" + cmd + "' (write, verify, info, read)");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvq_archive: %s: %s\n", cmd.c_str(), e.what());
    return 1;
  }
}

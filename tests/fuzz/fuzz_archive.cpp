/// \file fuzz_archive.cpp
/// Fuzz target: the kvq archive reader (io/archive.hpp): header, trailer, footer and index
/// validation, record reads, restoring a KVCache, partial loads and token-range reads.
///
/// Each input runs twice: as it is (the checksums must refuse almost every mutation), and
/// resealed — every CRC recomputed by io::detail::reseal_archive — so that mutated fields reach
/// the structural and semantic checks behind the checksums (counts, offsets, token ranges,
/// configs, f32 rows, page outlier positions). Errors must be kvq::Error of the file kinds
/// (kIo, kUnsupported); kInvalidArgument from dequantizing hostile page bytes (an outlier
/// position beyond head_dim, the decoders' own check) is still allowed, although the reader
/// now refuses such pages first (kIo).
/// Properties on success: verify() accepts what the reader accepted; the loaded cache's
/// token split matches the archive's footer; re-saving it gives an archive that loads to the
/// same stored bytes and re-saves to the same bytes; prefix and layer loads succeed and give
/// the truncated cache; read() of a range equals KVCache::read of the loaded cache.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "fuzz_util.hpp"
#include "kvq/io/archive.hpp"

namespace {

namespace io = kvq::io;

bool file_error(const kvq::Error& e) {
  return e.kind() == kvq::ErrorKind::kIo || e.kind() == kvq::ErrorKind::kUnsupported;
}

/// Same stored state (tokens, page bytes, f32 rows) of two caches.
bool same_state(const kvq::KVCache& a, const kvq::KVCache& b) {
  if (a.n_layers() != b.n_layers() || !(a.policy() == b.policy())) return false;
  for (int l = 0; l < a.n_layers(); ++l) {
    if (a.tokens(l) != b.tokens(l) || a.sink_tokens(l) != b.sink_tokens(l) ||
        a.residual_tokens(l) != b.residual_tokens(l))
      return false;
    const kvq::PageTable ta = a.page_table(l), tb = b.page_table(l);
    if (ta.n_pages != tb.n_pages) return false;
    for (int64_t j = 0; j < ta.n_pages; ++j)
      if (std::memcmp(ta.pages[j], tb.pages[j], ta.layout.bytes) != 0) return false;
    std::vector<float> ra, rb;
    auto rows = [](const kvq::KVCache& c, int layer, std::vector<float>& out) {
      c.for_each_segment(layer, [&](const kvq::CacheSegment& s) {
        if (s.packed()) return;
        out.insert(out.end(), s.key_rows.data(), s.key_rows.data() + s.key_rows.numel());
        out.insert(out.end(), s.value_rows.data(), s.value_rows.data() + s.value_rows.numel());
      });
    };
    rows(a, l, ra);
    rows(b, l, rb);
    if (ra.size() != rb.size() || (!ra.empty() && std::memcmp(ra.data(), rb.data(), ra.size() * 4) != 0))
      return false;
  }
  return true;
}

void run(const uint8_t* data, std::size_t size) {
  io::ArchiveReadOptions opt;
  opt.max_cache_bytes = 16u << 20;  // keep hostile headers cheap for the fuzzer
  std::optional<io::ArchiveReader> r;
  try {
    r.emplace(data, size, "fuzz.kvqa", opt);
  } catch (const kvq::Error& e) {
    KVQ_FUZZ_CHECK(file_error(e));
    return;
  }
  const io::ArchiveInfo& info = r->info();
  KVQ_FUZZ_CHECK(info.file_bytes == size);
  KVQ_FUZZ_CHECK(info.footer_offset + info.footer_bytes + io::kArchiveTrailerBytes == size);
  std::optional<kvq::KVCache> c;
  try {
    c.emplace(r->load());
  } catch (const kvq::Error& e) {
    KVQ_FUZZ_CHECK(file_error(e));
    return;
  }
  r->verify();  // a throw escapes: load() accepted what verify() refuses
  for (int l = 0; l < info.n_layers; ++l) {
    const io::ArchiveLayer& A = info.layers[static_cast<std::size_t>(l)];
    KVQ_FUZZ_CHECK(c->tokens(l) == A.tokens && c->sink_tokens(l) == A.sink_tokens &&
                   c->packed_tokens(l) == A.pages * A.block_tokens &&
                   c->residual_tokens(l) == A.residual_tokens);
  }
  io::ArchiveOptions wo;
  wo.key_rope = info.key_rope;
  wo.note = info.note;
  const std::vector<uint8_t> again = io::save_archive_bytes(*c, wo);
  io::ArchiveReader r2(again.data(), again.size(), "resaved.kvqa");
  const kvq::KVCache c2 = r2.load();
  KVQ_FUZZ_CHECK(same_state(*c, c2));
  KVQ_FUZZ_CHECK(io::save_archive_bytes(c2, wo) == again);
  // A prefix of half the longest layer, and the first layer alone.
  int64_t longest = 0;
  for (const io::ArchiveLayer& A : info.layers) longest = std::max(longest, A.tokens);
  kvq::KVCache want = *c;
  for (int l = 0; l < info.n_layers; ++l) want.truncate(l, std::min(longest / 2, want.tokens(l)));
  KVQ_FUZZ_CHECK(same_state(r->load(io::ArchiveSelection{{}, longest / 2}), want));
  KVQ_FUZZ_CHECK(r->load(io::ArchiveSelection{{0}, -1}).tokens(0) == c->tokens(0));
  // read() of a token range of layer 0 equals the loaded cache's read().
  const int64_t t = c->tokens(0), H = c->kv_heads(), D = c->head_dim();
  const int64_t a = t / 3, b = std::min<int64_t>(t, a + 40);
  if (b > a && (b - a) * H * D <= (int64_t{1} << 20)) {
    std::vector<float> k1(static_cast<std::size_t>((b - a) * H * D)), v1(k1.size()), k2(k1.size()),
        v2(k1.size());
    bool ok1 = true, ok2 = true;
    try {
      c->read(0, a, b, kvq::KVView<float>::nhd(k1.data(), b - a, H, D),
              kvq::KVView<float>::nhd(v1.data(), b - a, H, D));
    } catch (const kvq::Error& e) {
      KVQ_FUZZ_CHECK(e.kind() == kvq::ErrorKind::kInvalidArgument);  // hostile page bytes
      ok1 = false;
    }
    try {
      r->read(0, a, b, kvq::KVView<float>::nhd(k2.data(), b - a, H, D),
              kvq::KVView<float>::nhd(v2.data(), b - a, H, D));
    } catch (const kvq::Error& e) {
      KVQ_FUZZ_CHECK(e.kind() == kvq::ErrorKind::kInvalidArgument);
      ok2 = false;
    }
    KVQ_FUZZ_CHECK(ok1 == ok2);
    if (ok1)
      for (std::size_t i = 0; i < k1.size(); ++i)
        KVQ_FUZZ_CHECK(kvq::fuzz::same_float(k1[i], k2[i]) && kvq::fuzz::same_float(v1[i], v2[i]));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  run(data, size);
  std::vector<uint8_t> img(data, data + size);
  if (io::detail::reseal_archive(img) > 0 && std::memcmp(img.data(), data, size) != 0)
    run(img.data(), img.size());
  return 0;
}

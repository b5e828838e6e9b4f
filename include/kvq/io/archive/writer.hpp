#pragma once
/// \file writer.hpp
/// Writing archives (part of kvq/io/archive.hpp): byte sinks (memory, file), resealing,
/// and ArchiveWriter, which streams a KVCache's pages as they are flushed.
#include "kvq/io/archive/reader.hpp"

namespace kvq {
namespace io {

namespace detail {

/// For tests and fuzzing only (readers never call it): recomputes every checksum of an archive
/// image as far as its structure can be walked (the header size, the record lengths, the
/// trailer's footer position), so that a deliberately edited field is judged by the semantic
/// checks behind the CRCs. Returns the number of checksums written.
inline std::size_t reseal_archive(std::vector<uint8_t>& img) {
  const std::size_t size = img.size();
  uint8_t* b = img.data();
  std::size_t n = 0;
  if (size < kArchiveHeaderFixedBytes + kArchiveTrailerBytes) return 0;
  const uint64_t H = get_u32(b + 16);
  if (H < kArchiveHeaderFixedBytes || H > size) return 0;
  put_u32(b + H - 4, crc32c(b, static_cast<std::size_t>(H - 4)));
  ++n;
  std::map<uint64_t, std::pair<uint32_t, uint32_t>> crcs;  // record offset -> (payload, header)
  uint64_t off = H;
  while (off + kArchiveRecordHeaderBytes <= size && std::memcmp(b + off, kArchiveRecordMagic, 4) == 0) {
    uint8_t* h = b + off;
    const uint64_t pb = get_u64(h + 48);
    if (pb > size - off - kArchiveRecordHeaderBytes) break;
    put_u32(h + 56, crc32c(h + kArchiveRecordHeaderBytes, static_cast<std::size_t>(pb)));
    put_u32(h + 60, crc32c(h, 60));
    crcs[off] = {get_u32(h + 56), get_u32(h + 60)};
    n += 2;
    off += kArchiveRecordHeaderBytes + align_up(pb);
  }
  uint8_t* t = b + size - kArchiveTrailerBytes;
  const uint64_t fo = get_u64(t), fb = get_u64(t + 8);
  if (fo <= size - kArchiveTrailerBytes && fb >= kArchiveFooterFixedBytes + 4 &&
      fb <= size - kArchiveTrailerBytes - fo) {
    uint8_t* f = b + fo;
    const uint64_t N = get_u64(f + 8);
    for (uint64_t i = 0; i < N && kArchiveFooterFixedBytes + (i + 1) * kArchiveIndexEntryBytes <= fb - 4; ++i) {
      uint8_t* e = f + kArchiveFooterFixedBytes + i * kArchiveIndexEntryBytes;
      const auto it = crcs.find(get_u64(e));
      if (it == crcs.end()) continue;
      put_u32(e + 48, it->second.first);
      put_u32(e + 52, it->second.second);
    }
    put_u32(f + fb - 4, crc32c(f, static_cast<std::size_t>(fb - 4)));
    put_u32(t + 16, crc32c(b, static_cast<std::size_t>(fo + fb)));
    n += 2;
  }
  put_u32(t + 20, crc32c(t, 20));
  return n + 1;
}

/// Output sink of the writer: a file or a byte vector.
class Sink {
 public:
  virtual ~Sink() = default;
  virtual void write(const void* p, std::size_t n) = 0;
};

class VectorSink final : public Sink {
 public:
  explicit VectorSink(std::vector<uint8_t>& out) : out_(out) { out_.clear(); }
  void write(const void* p, std::size_t n) override {
    const auto* b = static_cast<const uint8_t*>(p);
    out_.insert(out_.end(), b, b + n);
  }

 private:
  std::vector<uint8_t>& out_;
};

class FileSink final : public Sink {
 public:
  explicit FileSink(const std::filesystem::path& path) : path_(path) {
    f_ = std::fopen(path.string().c_str(), "wb");
    KVQ_REQUIRE(f_ != nullptr, kIo, path.string(), ": cannot create: ", std::strerror(errno));
  }
  ~FileSink() override {
    if (f_) std::fclose(f_);
  }
  FileSink(const FileSink&) = delete;
  FileSink& operator=(const FileSink&) = delete;
  void write(const void* p, std::size_t n) override {
    KVQ_REQUIRE(f_ != nullptr, kIo, path_.string(), ": write after close");
    KVQ_REQUIRE(n == 0 || std::fwrite(p, 1, n, f_) == n, kIo, path_.string(), ": write of ", n,
                " bytes failed: ", std::strerror(errno));
  }
  /// Flushes to the device (fsync on POSIX) and closes.
  void close() {
    if (!f_) return;
    bool ok = std::fflush(f_) == 0;
#if KVQ_ARCHIVE_POSIX
    ok = ok && ::fsync(::fileno(f_)) == 0;
#endif
    const int err = errno;
    ok = std::fclose(f_) == 0 && ok;
    f_ = nullptr;
    KVQ_REQUIRE(ok, kIo, path_.string(), ": flushing to disk failed: ", std::strerror(err));
  }

 private:
  std::filesystem::path path_;
  std::FILE* f_ = nullptr;
};

}  // namespace detail

/// Streams a KVCache into an archive. Open it on a cache, call append_pages() whenever the
/// cache may have flushed pages (after each decode step or prefill chunk: it writes only the
/// pages not yet written, so pages leave for disk as they are packed), then finish() to add
/// the f32 regions of the cache's state at that moment (sinks, residual window, rollback rows),
/// the footer and the trailer. A file archive is written to "<path>.part" and renamed to `path`
/// by finish() (after an fsync); a writer destroyed unfinished removes the .part file.
///
/// The pages already written must stay what they were: a cache truncated below a written page
/// makes append_pages()/finish() throw kInvalidArgument (start a new archive after a rollback
/// past archived pages). finish() compares every written page's CRC with the cache's page.
class ArchiveWriter {
 public:
  ArchiveWriter(const std::filesystem::path& path, const KVCache& cache, const ArchiveOptions& opt = {})
      : path_(path), part_(path.string() + ".part") {
    file_ = std::make_unique<detail::FileSink>(part_);
    sink_ = file_.get();
    try {
      start(cache, opt);
    } catch (...) {
      abandon();
      throw;
    }
  }
  /// An archive in memory: `out` receives the bytes (complete after finish()).
  ArchiveWriter(std::vector<uint8_t>& out, const KVCache& cache, const ArchiveOptions& opt = {})
      : mem_(std::make_unique<detail::VectorSink>(out)) {
    sink_ = mem_.get();
    start(cache, opt);
  }
  ArchiveWriter(const ArchiveWriter&) = delete;
  ArchiveWriter& operator=(const ArchiveWriter&) = delete;
  ~ArchiveWriter() {
    if (!finished_) abandon();
  }

  /// Appends every page of every layer flushed since the last call; returns the pages written.
  std::size_t append_pages(const KVCache& cache) {
    check_cache(cache, "append_pages");
    std::size_t n = 0;
    for (int l = 0; l < policy_layers_; ++l) n += append_layer(cache, l);
    return n;
  }
  /// Appends the pages of `layer` flushed since the last call.
  std::size_t append_pages(const KVCache& cache, int layer) {
    check_cache(cache, "append_pages");
    KVQ_REQUIRE(layer >= 0 && layer < policy_layers_, kInvalidArgument,
                "ArchiveWriter::append_pages: layer ", layer, " does not exist");
    return append_layer(cache, layer);
  }

  /// Writes the remaining pages, the f32 regions of `cache` as it is now, the footer and the
  /// trailer, and (file archives) moves the file into place.
  ArchiveSummary finish(const KVCache& cache) {
    KVQ_REQUIRE(!finished_, kInvalidArgument, "ArchiveWriter::finish: already finished");
    check_cache(cache, "finish");
    for (int l = 0; l < policy_layers_; ++l) {
      append_layer(cache, l);
      const PageTable t = cache.page_table(l);
      for (std::size_t j = 0; j < written_[static_cast<std::size_t>(l)].size(); ++j) {
        const uint32_t c = io::crc32c(t.pages[j], t.layout.bytes);
        KVQ_REQUIRE(c == written_[static_cast<std::size_t>(l)][j], kInvalidArgument,
                    "ArchiveWriter::finish: layer ", l, " page ", j,
                    " changed after it was archived (the cache was truncated past it and refilled);"
                    " start a new archive");
      }
    }
    const int64_t row = ::kvq::detail::KVCacheAccess::row(cache);
    std::vector<std::array<int64_t, 5>> layer_entries;
    for (int l = 0; l < policy_layers_; ++l) {
      const int64_t s = cache.sink_tokens(l), r = cache.residual_tokens(l);
      const int64_t B = cache.block_tokens(l);
      const int64_t p = static_cast<int64_t>(written_[static_cast<std::size_t>(l)].size());
      cache.for_each_segment(l, [&](const CacheSegment& seg) {
        if (seg.packed()) return;
        const auto n = static_cast<std::size_t>(seg.tokens() * row) * sizeof(float);
        add_record(l, seg.kind == CacheSegment::Kind::kSinks ? RecordKind::kSinks : RecordKind::kResidual, 0,
                   seg.begin, seg.end, seg.key_rows.data(), n, seg.value_rows.data(), n);
      });
      const bool roll = rollback_rows_ && ::kvq::detail::KVCacheAccess::has_rollback(cache, l) && p > 0;
      if (roll) {
        const auto& ok = ::kvq::detail::KVCacheAccess::roll_k(cache, l);
        const auto& ov = ::kvq::detail::KVCacheAccess::roll_v(cache, l);
        const int64_t end = s + p * B;
        add_record(l, RecordKind::kRollback, 0, end - B, end, ok.data(), ok.size() * sizeof(float),
                   ov.data(), ov.size() * sizeof(float));
      }
      layer_entries.push_back({cache.tokens(l), s, p, r, roll ? 1 : 0});
    }
    // Footer.
    const uint64_t N = index_.size();
    const uint64_t body = kArchiveFooterFixedBytes + N * kArchiveIndexEntryBytes +
                          static_cast<uint64_t>(policy_layers_) * kArchiveLayerEntryBytes;
    const uint64_t F = detail::align_up(body + 4);
    std::vector<uint8_t> f(static_cast<std::size_t>(F), 0);
    std::memcpy(f.data(), kArchiveFooterMagic, 8);
    detail::put_u64(f.data() + 8, N);
    detail::put_u64(f.data() + 16, F);
    detail::put_i32(f.data() + 24, policy_layers_);
    for (uint64_t i = 0; i < N; ++i) {
      uint8_t* e = f.data() + kArchiveFooterFixedBytes + i * kArchiveIndexEntryBytes;
      const ArchiveRecord& r = index_[static_cast<std::size_t>(i)];
      detail::put_u64(e, r.offset);
      detail::put_u64(e + 8, r.payload_bytes);
      detail::put_i32(e + 16, r.layer);
      detail::put_u16(e + 20, static_cast<uint16_t>(r.kind));
      detail::put_i64(e + 24, r.index);
      detail::put_i64(e + 32, r.begin);
      detail::put_i64(e + 40, r.end);
      detail::put_u32(e + 48, r.payload_crc);
      detail::put_u32(e + 52, r.header_crc);
    }
    for (int l = 0; l < policy_layers_; ++l) {
      uint8_t* e = f.data() + kArchiveFooterFixedBytes + N * kArchiveIndexEntryBytes +
                   static_cast<uint64_t>(l) * kArchiveLayerEntryBytes;
      const auto& le = layer_entries[static_cast<std::size_t>(l)];
      for (int k = 0; k < 4; ++k) detail::put_i64(e + 8 * k, le[static_cast<std::size_t>(k)]);
      detail::put_u32(e + 32, static_cast<uint32_t>(le[4]));
    }
    detail::put_u32(f.data() + F - 4, io::crc32c(f.data(), static_cast<std::size_t>(F - 4)));
    const uint64_t footer_offset = offset_;
    write(f.data(), f.size());
    uint8_t t[kArchiveTrailerBytes] = {};
    detail::put_u64(t, footer_offset);
    detail::put_u64(t + 8, F);
    const uint32_t file_crc = crc_;  // of every byte before the trailer
    detail::put_u32(t + 16, file_crc);
    detail::put_u32(t + 20, io::crc32c(t, 20));
    std::memcpy(t + 24, kArchiveTrailerMagic, 8);
    write(t, sizeof t);
    ArchiveSummary s;
    s.bytes = offset_;
    s.records = index_.size();
    s.file_crc = file_crc;
    if (file_) {
      file_->close();
      std::error_code ec;
      std::filesystem::rename(part_, path_, ec);
      KVQ_REQUIRE(!ec, kIo, part_.string(), ": cannot rename to ", path_.string(), ": ", ec.message());
      s.path = path_;
    }
    finished_ = true;
    return s;
  }

  bool finished() const { return finished_; }
  uint64_t bytes_written() const { return offset_; }
  std::size_t records() const { return index_.size(); }

 private:
  void start(const KVCache& cache, const ArchiveOptions& opt) {
    KVQ_REQUIRE(detail::host_little_endian(), kUnsupported,
                "ArchiveWriter: kvq archives are little-endian and this host is not");
    policy_ = cache.policy();
    rollback_rows_ = opt.rollback_rows;
    policy_layers_ = cache.n_layers();
    kv_heads_ = cache.kv_heads();
    head_dim_ = cache.head_dim();
    written_.resize(static_cast<std::size_t>(policy_layers_));
    const std::vector<uint8_t> h = detail::encode_header(cache, opt);
    write(h.data(), h.size());
  }

  void abandon() noexcept {
    if (file_) {
      try {
        file_->close();
      } catch (...) {
      }
      std::error_code ec;
      std::filesystem::remove(part_, ec);
    }
  }

  void check_cache(const KVCache& cache, const char* what) const {
    KVQ_REQUIRE(!finished_, kInvalidArgument, "ArchiveWriter::", what, ": already finished");
    KVQ_REQUIRE(cache.n_layers() == policy_layers_ && cache.kv_heads() == kv_heads_ &&
                    cache.head_dim() == head_dim_ && cache.policy() == policy_,
                kInvalidArgument, "ArchiveWriter::", what,
                ": this cache is not the one the archive was opened on (policy or shape differ)");
    for (int l = 0; l < policy_layers_; ++l) {
      KVQ_REQUIRE(cache.released_tokens(l) == 0, kUnsupported, "ArchiveWriter::", what,
                  ": layer ", l, " released its first ", cache.released_tokens(l),
                  " tokens (sliding window, KVCache::release_before); an archive holds whole "
                  "sequences");
      const std::size_t w = written_[static_cast<std::size_t>(l)].size();
      KVQ_REQUIRE(static_cast<std::size_t>(cache.page_table(l).n_pages) >= w, kInvalidArgument,
                  "ArchiveWriter::", what, ": layer ", l, " holds ", cache.page_table(l).n_pages,
                  " pages, but ", w, " were archived (the cache was truncated past archived "
                  "pages); start a new archive");
    }
  }

  std::size_t append_layer(const KVCache& cache, int l) {
    auto& w = written_[static_cast<std::size_t>(l)];
    const PageTable t = cache.page_table(l);
    const int64_t B = t.layout.page_tokens;
    std::size_t n = 0;
    for (auto j = static_cast<int64_t>(w.size()); j < t.n_pages; ++j, ++n) {
      const int64_t b = t.first_token + j * B;
      const uint32_t c = add_record(l, RecordKind::kPage, j, b, b + B, t.pages[j], t.layout.bytes);
      w.push_back(c);
    }
    return n;
  }

  /// Writes one record (payload = a ++ b); returns its payload CRC.
  uint32_t add_record(int layer, RecordKind kind, int64_t index, int64_t begin, int64_t end,
                      const void* a, std::size_t na, const void* b = nullptr, std::size_t nb = 0) {
    ArchiveRecord r;
    r.seq = index_.size();
    r.offset = offset_;
    r.payload_bytes = na + nb;
    r.layer = layer;
    r.kind = kind;
    r.index = index;
    r.begin = begin;
    r.end = end;
    r.payload_crc = io::crc32c(b, nb, io::crc32c(a, na));
    const auto h = detail::encode_record_header(r);
    r.header_crc = detail::get_u32(h.data() + 60);
    write(h.data(), h.size());
    write(a, na);
    write(b, nb);
    static const uint8_t zeros[kArchiveAlign] = {};
    write(zeros, static_cast<std::size_t>(detail::align_up(r.payload_bytes) - r.payload_bytes));
    index_.push_back(r);
    return r.payload_crc;
  }

  void write(const void* p, std::size_t n) {
    if (n == 0) return;
    sink_->write(p, n);
    crc_ = io::crc32c(p, n, crc_);
    offset_ += n;
  }

  std::filesystem::path path_, part_;
  std::unique_ptr<detail::FileSink> file_;
  std::unique_ptr<detail::VectorSink> mem_;
  detail::Sink* sink_ = nullptr;
  Policy policy_;
  bool rollback_rows_ = true;
  int policy_layers_ = 0, kv_heads_ = 0, head_dim_ = 0;
  std::vector<std::vector<uint32_t>> written_;  // per layer: payload CRC of each archived page
  std::vector<ArchiveRecord> index_;
  uint64_t offset_ = 0;
  uint32_t crc_ = 0;
  bool finished_ = false;
};

}  // namespace io
}  // namespace kvq

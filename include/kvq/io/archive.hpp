#pragma once
/// \file archive.hpp
/// kvq archives (.kvqa): a versioned, checksummed file holding a KVCache's stored state byte for
/// byte — the policy (canonical spec, every config field, seeds, nuq codebooks), the shape, the
/// packed pages, and the f32 sinks, residual window and rollback rows — so a cache can be
/// offloaded to disk as it fills, saved for prefix reuse, or shipped between workers, and come
/// back identical. docs/archive.md gives the format byte by byte.
///
/// Layout: header | records | footer | trailer, all integers little-endian.
///   header   magic, version, endianness marker, shape, options, the policy's configs, the
///            per-layer page geometry, the canonical spec; its own CRC-32C.
///   records  one per page (kind page, index j: tokens [S + jB, S + (j+1)B)) and per f32 region
///            of a layer (sinks, residual, rollback; keys then values), each a 64-byte record
///            header (sequence number, layer, kind, index, token range, length, payload CRC-32C,
///            header CRC-32C), the payload, zero padding to 64 bytes (pages stay 64-byte
///            aligned, so a memory-mapped archive hands its pages to the kernels in place).
///   footer   the record index (offset, identity, CRCs of every record) and per-layer token
///            counts; its own CRC-32C.
///   trailer  32 bytes at the end: footer offset and size, the CRC-32C of every byte before
///            the trailer, the trailer's CRC, a magic.
///
/// Writers stream: ArchiveWriter appends the pages a cache has flushed since the last call
/// (offload while decoding) and finish() adds the f32 regions, footer and trailer; a file is
/// written under "<path>.part" and renamed into place only when complete, so `path` never holds
/// half an archive. Readers: ArchiveReader loads everything, some layers, or a token prefix
/// (reading only the records needed), or dequantizes any token range; MappedArchive maps the
/// file (POSIX mmap), verifies it and gives page tables and f32 rows without copying.
///
/// Trust. Every read is checked: the header, footer and trailer CRCs and their fields before
/// anything is allocated from them (lengths against the file size, counts against the
/// structure), each record's header against the index (a record found where another belongs —
/// reordered, duplicated or shifted — is named as such), its payload CRC, its padding, and on a
/// full read the whole-file CRC. Errors are kvq::Error(kIo) naming the file, the record
/// (number, layer, kind, index, token range) and the byte offset; a truncated or unfinished file
/// is walked record by record to say where it ends. Restored f32 rows obey the cache's own
/// acceptance rules (finite; fp16 range where the layer's formats need it). A load builds a new
/// cache and hands it over only when everything checked out (the strong guarantee).
#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "kvq/cache/kv_cache.hpp"
#include "kvq/core/error.hpp"
#include "kvq/core/rope.hpp"
#include "kvq/io/crc32c.hpp"
#include "kvq/layout/page_layout.hpp"
#include "kvq/policy/spec.hpp"

#if defined(__unix__) || defined(__APPLE__)
#define KVQ_ARCHIVE_POSIX 1
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#else
#define KVQ_ARCHIVE_POSIX 0
#endif

namespace kvq {

namespace detail {

/// The friend of KVCache that reads and restores its stored state (see kv_cache.hpp).
struct KVCacheAccess {
  using Layer = KVCache::Layer;
  static const Layer& layer(const KVCache& c, int l) {
    return c.layers_[static_cast<std::size_t>(l)];
  }
  static Layer& layer(KVCache& c, int l) { return c.layers_[static_cast<std::size_t>(l)]; }
  static int64_t row(const KVCache& c) { return c.row_; }
  static bool has_rollback(const KVCache& c, int l) { return layer(c, l).roll; }
  static const std::vector<float>& roll_k(const KVCache& c, int l) { return layer(c, l).roll_k; }
  static const std::vector<float>& roll_v(const KVCache& c, int l) { return layer(c, l).roll_v; }
  static std::size_t layer_struct_bytes() { return sizeof(Layer); }
  /// Page slots [0, n) of a layer (allocated, not yet in use).
  static void reserve_pages(KVCache& c, int l, std::size_t n) { layer(c, l).pages.reserve(n); }
  static std::byte* page_slot(KVCache& c, int l, std::size_t i) { return layer(c, l).pages.page(i); }
  /// Publishes pages [0, n_pages) and the f32 windows of a layer of a cache built for restoring
  /// (no allocation, nothing throws).
  static void commit(KVCache& c, int l, std::size_t n_pages, std::vector<float>&& sk,
                     std::vector<float>&& sv, std::vector<float>&& rk, std::vector<float>&& rv,
                     std::vector<float>&& ok, std::vector<float>&& ov, bool roll) noexcept {
    Layer& L = layer(c, l);
    L.pages.resize(n_pages);
    L.sink_k = std::move(sk);
    L.sink_v = std::move(sv);
    L.res_k = std::move(rk);
    L.res_v = std::move(rv);
    L.roll_k = std::move(ok);
    L.roll_v = std::move(ov);
    L.roll = roll;
    const int64_t row = c.row_;
    L.tokens = static_cast<int64_t>(L.sink_k.size()) / row +
               static_cast<int64_t>(n_pages) * L.block + static_cast<int64_t>(L.res_k.size()) / row;
  }
};

}  // namespace detail

namespace io {

/// Format version this kvq writes and reads.
inline constexpr uint32_t kArchiveVersion = 1;
/// Alignment of records (and of page payloads) in the file.
inline constexpr uint64_t kArchiveAlign = 64;
inline constexpr std::size_t kArchiveHeaderFixedBytes = 96;
inline constexpr std::size_t kArchiveConfigBytes = 128;
inline constexpr std::size_t kArchiveLayerGeomBytes = 16;
inline constexpr std::size_t kArchiveRecordHeaderBytes = 64;
inline constexpr std::size_t kArchiveFooterFixedBytes = 32;
inline constexpr std::size_t kArchiveIndexEntryBytes = 64;
inline constexpr std::size_t kArchiveLayerEntryBytes = 48;
inline constexpr std::size_t kArchiveTrailerBytes = 32;
/// Limits a header may declare (far beyond real models; they keep hostile headers small).
inline constexpr int64_t kArchiveMaxLayers = int64_t{1} << 16;
inline constexpr uint64_t kArchiveMaxHeaderBytes = uint64_t{64} << 20;
inline constexpr uint64_t kArchiveMaxText = uint64_t{1} << 20;

inline constexpr uint8_t kArchiveMagic[8] = {0x89, 'K', 'V', 'Q', 'A', '\r', '\n', 0x1A};
inline constexpr uint8_t kArchiveRecordMagic[4] = {'K', 'V', 'Q', 'R'};
inline constexpr uint8_t kArchiveFooterMagic[8] = {'K', 'V', 'Q', 'A', 'I', 'D', 'X', 0};
inline constexpr uint8_t kArchiveTrailerMagic[8] = {'K', 'V', 'Q', 'A', 'E', 'N', 'D', 0x1A};
inline constexpr uint32_t kArchiveEndianMarker = 0x0A0B0C0Du;

/// What a record holds.
enum class RecordKind : uint16_t {
  kPage = 1,      ///< one page of packed keys and values (PageLayout bytes)
  kSinks = 2,     ///< f32 sink tokens: keys [s, H, D] then values [s, H, D]
  kResidual = 3,  ///< f32 residual window: keys then values, [r, H, D] each
  kRollback = 4,  ///< f32 originals of the newest page (exact rollback): keys then values, [B, H, D]
};

inline const char* to_string(RecordKind k) {
  switch (k) {
    case RecordKind::kPage: return "page";
    case RecordKind::kSinks: return "sinks";
    case RecordKind::kResidual: return "residual";
    case RecordKind::kRollback: return "rollback";
  }
  return "?";
}

/// One record as the footer's index describes it.
struct ArchiveRecord {
  uint64_t seq = 0;     ///< position in the file (0-based)
  uint64_t offset = 0;  ///< file offset of the record header
  uint64_t payload_bytes = 0;
  int layer = 0;
  RecordKind kind = RecordKind::kPage;
  int64_t index = 0;  ///< page index within the layer (0 for f32 regions)
  int64_t begin = 0;  ///< first token position
  int64_t end = 0;    ///< one past the last token position
  uint32_t payload_crc = 0;
  uint32_t header_crc = 0;

  uint64_t payload_offset() const { return offset + kArchiveRecordHeaderBytes; }
  /// Bytes the record takes in the file (header, payload, padding).
  uint64_t extent() const {
    return kArchiveRecordHeaderBytes + (payload_bytes + kArchiveAlign - 1) / kArchiveAlign * kArchiveAlign;
  }
  /// "record #3 (layer 1, page 2, tokens [36, 68), offset 4160)"
  std::string name() const {
    std::string s = ::kvq::detail::cat("record #", seq, " (layer ", layer, ", ", to_string(kind));
    if (kind == RecordKind::kPage) s += ::kvq::detail::cat(" ", index);
    return s + ::kvq::detail::cat(", tokens [", begin, ", ", end, "), offset ", offset, ")");
  }
};

/// One layer as the archive stores it.
struct ArchiveLayer {
  int64_t tokens = 0;
  int64_t sink_tokens = 0;
  int64_t pages = 0;
  int64_t residual_tokens = 0;
  bool rollback = false;  ///< the rollback rows of the newest page are stored
  int64_t block_tokens = 0;  ///< B
  PageLayout layout;         ///< the layer's page layout (computed from the policy and shape)
  std::vector<std::size_t> records;  ///< indices into ArchiveInfo::records, by kind then index
  int64_t packed_end() const { return sink_tokens + pages * block_tokens; }
};

/// Everything an archive's header, footer and trailer say, validated.
struct ArchiveInfo {
  std::string source;  ///< file name (or the name given to a memory buffer), for messages
  uint32_t version = kArchiveVersion;
  std::string spec;  ///< Policy::spec() as written
  Policy policy;     ///< every config field, seeds and nuq codebooks included
  int n_layers = 0;
  int kv_heads = 0;
  int head_dim = 0;
  int max_tokens = 0;
  KVCacheOptions options;
  std::optional<RopeConfig> key_rope;  ///< set when the keys were stored before RoPE
  std::string note;
  uint32_t writer_version = 0;  ///< kvq version of the writer: major << 16 | minor << 8 | patch
  std::vector<ArchiveLayer> layers;
  std::vector<ArchiveRecord> records;  ///< in file order
  uint64_t file_bytes = 0;
  uint64_t header_bytes = 0;
  uint64_t footer_offset = 0;
  uint64_t footer_bytes = 0;
  uint32_t file_crc = 0;  ///< CRC-32C of bytes [0, footer_offset + footer_bytes)

  int64_t total_tokens() const {
    int64_t n = 0;
    for (const ArchiveLayer& l : layers) n += l.tokens;
    return n;
  }
  /// Payload bytes by kind.
  uint64_t payload_bytes(RecordKind k) const {
    uint64_t n = 0;
    for (const ArchiveRecord& r : records)
      if (r.kind == k) n += r.payload_bytes;
    return n;
  }
  std::string writer_version_string() const {
    return ::kvq::detail::cat(writer_version >> 16, ".", (writer_version >> 8) & 0xFF, ".",
                       writer_version & 0xFF);
  }
};

/// What the writer records beside the cache.
struct ArchiveOptions {
  /// The cache holds keys *before* RoPE (KVQuant): readers that reconstruct post-RoPE keys
  /// (kvq_archive read) rotate them with this config; attention takes it as `key_rope`.
  std::optional<RopeConfig> key_rope;
  /// Free text (UTF-8, at most 1 MiB): where the data came from.
  std::string note;
  /// Store the f32 originals of each layer's newest page (the cache's exact-rollback rows), so
  /// the loaded cache is identical in every byte. false saves B rows of f32 keys and values per
  /// layer; the loaded cache then holds the same tokens and pages but no rollback rows, as a
  /// cache does after a truncate (a later rollback into its newest page re-rounds that page).
  bool rollback_rows = true;
};

/// Reader limits.
struct ArchiveReadOptions {
  /// Most bytes a header may make the reader spend on building the (empty) cache it describes
  /// (per-layer bookkeeping, the probe page and f32 staging of a block) before any record is
  /// read. 0: max(64 MiB, 16 x the file size). Page and row bytes are bounded by the file.
  uint64_t max_cache_bytes = 0;
};

/// Which part of an archive to load into a cache.
struct ArchiveSelection {
  std::vector<int> layers;  ///< layers to fill (empty: all); the others stay empty
  int64_t tokens = -1;      ///< keep positions [0, tokens) of each (-1: all); as KVCache::truncate
};

/// What a finished archive holds.
struct ArchiveSummary {
  std::filesystem::path path;  ///< empty for a memory archive
  uint64_t bytes = 0;
  std::size_t records = 0;
  uint32_t file_crc = 0;
};

namespace detail {

using ::kvq::detail::cat;

inline bool host_little_endian() {
  const uint32_t x = 1;
  unsigned char b;
  std::memcpy(&b, &x, 1);
  return b == 1;
}

inline uint64_t align_up(uint64_t n) { return (n + kArchiveAlign - 1) / kArchiveAlign * kArchiveAlign; }

inline uint16_t get_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | p[1] << 8); }
inline uint32_t get_u32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}
inline uint64_t get_u64(const uint8_t* p) {
  return static_cast<uint64_t>(get_u32(p)) | static_cast<uint64_t>(get_u32(p + 4)) << 32;
}
inline int32_t get_i32(const uint8_t* p) {
  const uint32_t u = get_u32(p);
  int32_t v;
  std::memcpy(&v, &u, 4);
  return v;
}
inline int64_t get_i64(const uint8_t* p) {
  const uint64_t u = get_u64(p);
  int64_t v;
  std::memcpy(&v, &u, 8);
  return v;
}
inline float get_f32(const uint8_t* p) {
  const uint32_t u = get_u32(p);
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}
inline double get_f64(const uint8_t* p) {
  const uint64_t u = get_u64(p);
  double v;
  std::memcpy(&v, &u, 8);
  return v;
}
inline void put_u16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}
inline void put_u32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
inline void put_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
inline void put_i32(uint8_t* p, int32_t v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  put_u32(p, u);
}
inline void put_i64(uint8_t* p, int64_t v) {
  uint64_t u;
  std::memcpy(&u, &v, 8);
  put_u64(p, u);
}
inline void put_f32(uint8_t* p, float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  put_u32(p, u);
}
inline void put_f64(uint8_t* p, double v) {
  uint64_t u;
  std::memcpy(&u, &v, 8);
  put_u64(p, u);
}
inline bool all_zero(const uint8_t* p, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    if (p[i] != 0) return false;
  return true;
}
inline std::string hex32(uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08x", v);
  return b;
}

// Stable file codes of the enums (independent of their C++ values).
inline uint8_t format_code(Format f) {
  switch (f) {
    case Format::kF32: return 0;
    case Format::kF16: return 1;
    case Format::kBF16: return 2;
    case Format::kInt: return 3;
    case Format::kE4M3: return 4;
    case Format::kE5M2: return 5;
    case Format::kLloydMax: return 6;
    case Format::kNuq: return 7;
  }
  return 255;
}
inline bool format_from_code(uint8_t c, Format* f) {
  static constexpr Format kF[] = {Format::kF32,  Format::kF16,  Format::kBF16,     Format::kInt,
                                  Format::kE4M3, Format::kE5M2, Format::kLloydMax, Format::kNuq};
  if (c >= 8) return false;
  *f = kF[c];
  return true;
}
inline uint8_t axis_code(Axis a) {
  switch (a) {
    case Axis::kToken: return 0;
    case Axis::kChannel: return 1;
    case Axis::kHead: return 2;
    case Axis::kTensor: return 3;
  }
  return 255;
}
inline bool axis_from_code(uint8_t c, Axis* a) {
  static constexpr Axis kA[] = {Axis::kToken, Axis::kChannel, Axis::kHead, Axis::kTensor};
  if (c >= 4) return false;
  *a = kA[c];
  return true;
}

// Config roles in the header.
enum : uint8_t { kRoleKey = 0, kRoleValue = 1, kRoleSkip = 2, kRoleOverrideKey = 3, kRoleOverrideValue = 4 };

inline void encode_config(uint8_t* p, uint8_t role, int layer, const QuantConfig& c) {
  std::memset(p, 0, kArchiveConfigBytes);
  p[0] = role;
  p[1] = format_code(c.format);
  p[2] = axis_code(c.axis);
  p[3] = c.meta == MetaDType::kF32 ? 1 : 0;
  p[4] = static_cast<uint8_t>((c.symmetric ? 1 : 0) | (c.qjl ? 2 : 0) | (c.nuq_ready ? 4 : 0));
  put_i32(p + 8, c.bits);
  put_i32(p + 12, layer);
  put_i32(p + 16, c.outliers);
  put_f32(p + 20, c.outlier_pct);
  put_f32(p + 24, c.fp8_margin);
  put_i64(p + 32, c.group);
  put_u64(p + 40, c.seed);
  for (int i = 0; i < kNuqMaxLevels; ++i)
    put_f32(p + 48 + 4 * i, c.nuq_levels[static_cast<std::size_t>(i)]);
}

/// An archive's bytes, from a file or from memory. read() is only called for ranges inside
/// size() (callers check first).
class Source {
 public:
  virtual ~Source() = default;
  virtual uint64_t size() const = 0;
  virtual void read(uint64_t off, void* dst, std::size_t n) const = 0;
  /// The bytes themselves when they are in memory (no copy needed), else nullptr.
  virtual const uint8_t* data() const { return nullptr; }
};

class MemorySource final : public Source {
 public:
  MemorySource(const uint8_t* p, std::size_t n) : p_(p), n_(n) {}
  uint64_t size() const override { return n_; }
  void read(uint64_t off, void* dst, std::size_t n) const override {
    if (n) std::memcpy(dst, p_ + off, n);
  }
  const uint8_t* data() const override { return p_; }

 private:
  const uint8_t* p_;
  std::size_t n_;
};

class FileSource final : public Source {
 public:
  explicit FileSource(const std::filesystem::path& path) : name_(path.string()) {
    std::error_code ec;
    const auto st = std::filesystem::status(path, ec);
    KVQ_REQUIRE(!ec && std::filesystem::exists(st), kIo, name_, ": no such file");
    KVQ_REQUIRE(std::filesystem::is_regular_file(st), kIo, name_, ": not a regular file");
#if KVQ_ARCHIVE_POSIX
    fd_ = ::open(name_.c_str(), O_RDONLY | O_CLOEXEC);
    KVQ_REQUIRE(fd_ >= 0, kIo, name_, ": cannot open: ", std::strerror(errno));
    struct stat sb;
    if (::fstat(fd_, &sb) != 0) {
      ::close(fd_);
      fail(ErrorKind::kIo, name_, ": cannot stat: ", std::strerror(errno));
    }
    size_ = static_cast<uint64_t>(sb.st_size);
#else
    in_.open(path, std::ios::binary);
    KVQ_REQUIRE(in_.good(), kIo, name_, ": cannot open");
    in_.seekg(0, std::ios::end);
    size_ = static_cast<uint64_t>(in_.tellg());
#endif
  }
  ~FileSource() override {
#if KVQ_ARCHIVE_POSIX
    if (fd_ >= 0) ::close(fd_);
#endif
  }
  FileSource(const FileSource&) = delete;
  FileSource& operator=(const FileSource&) = delete;
  uint64_t size() const override { return size_; }
  void read(uint64_t off, void* dst, std::size_t n) const override {
#if KVQ_ARCHIVE_POSIX
    auto* d = static_cast<char*>(dst);
    while (n > 0) {
      const ssize_t got = ::pread(fd_, d, n, static_cast<off_t>(off));
      if (got < 0 && errno == EINTR) continue;
      KVQ_REQUIRE(got > 0, kIo, name_, ": read of ", n, " bytes at offset ", off, " failed",
                  got < 0 ? std::string(": ") + std::strerror(errno)
                          : std::string(" (the file shrank while being read)"));
      d += got;
      off += static_cast<uint64_t>(got);
      n -= static_cast<std::size_t>(got);
    }
#else
    in_.clear();
    in_.seekg(static_cast<std::streamoff>(off));
    in_.read(static_cast<char*>(dst), static_cast<std::streamsize>(n));
    KVQ_REQUIRE(in_.good(), kIo, name_, ": read of ", n, " bytes at offset ", off, " failed");
#endif
  }

 private:
  std::string name_;
  uint64_t size_ = 0;
#if KVQ_ARCHIVE_POSIX
  int fd_ = -1;
#else
  mutable std::ifstream in_;
#endif
};

/// Record header bytes for `r` (CRC fields filled).
inline std::array<uint8_t, kArchiveRecordHeaderBytes> encode_record_header(const ArchiveRecord& r) {
  std::array<uint8_t, kArchiveRecordHeaderBytes> h{};
  std::memcpy(h.data(), kArchiveRecordMagic, 4);
  put_u64(h.data() + 8, r.seq);
  put_i32(h.data() + 16, r.layer);
  put_u16(h.data() + 20, static_cast<uint16_t>(r.kind));
  put_i64(h.data() + 24, r.index);
  put_i64(h.data() + 32, r.begin);
  put_i64(h.data() + 40, r.end);
  put_u64(h.data() + 48, r.payload_bytes);
  put_u32(h.data() + 56, r.payload_crc);
  put_u32(h.data() + 60, crc32c(h.data(), 60));
  return h;
}

/// Decodes a record header; false (with `why`) when its magic, CRC or reserved bytes are wrong.
inline bool decode_record_header(const uint8_t* h, ArchiveRecord* r, std::string* why) {
  if (std::memcmp(h, kArchiveRecordMagic, 4) != 0) {
    *why = "no record magic 'KVQR'";
    return false;
  }
  const uint32_t want = get_u32(h + 60), got = crc32c(h, 60);
  if (want != got) {
    *why = cat("record header CRC-32C mismatch (stored ", hex32(want), ", computed ", hex32(got), ")");
    return false;
  }
  if (!all_zero(h + 4, 4) || !all_zero(h + 22, 2)) {
    *why = "nonzero reserved bytes in the record header";
    return false;
  }
  r->seq = get_u64(h + 8);
  r->layer = get_i32(h + 16);
  r->kind = static_cast<RecordKind>(get_u16(h + 20));
  r->index = get_i64(h + 24);
  r->begin = get_i64(h + 32);
  r->end = get_i64(h + 40);
  r->payload_bytes = get_u64(h + 48);
  r->payload_crc = get_u32(h + 56);
  r->header_crc = want;
  return true;
}

inline bool same_identity(const ArchiveRecord& a, const ArchiveRecord& b) {
  return a.seq == b.seq && a.layer == b.layer && a.kind == b.kind && a.index == b.index &&
         a.begin == b.begin && a.end == b.end && a.payload_bytes == b.payload_bytes &&
         a.payload_crc == b.payload_crc && a.header_crc == b.header_crc;
}

/// A policy reduced to what its spec string expresses (seeds, fp8 margins and codebooks reset).
inline Policy spec_part(Policy p) {
  auto strip = [](QuantConfig& c) {
    const QuantConfig d;
    c.seed = d.seed;
    c.fp8_margin = d.fp8_margin;
    c.nuq_ready = false;
    c.nuq_levels = {};
  };
  strip(p.key);
  strip(p.value);
  strip(p.skip_config);
  for (auto& kv : p.overrides) {
    strip(kv.second.first);
    strip(kv.second.second);
  }
  return p;
}

/// Builds the header bytes of an archive of `cache`.
inline std::vector<uint8_t> encode_header(const KVCache& cache, const ArchiveOptions& opt) {
  const Policy& p = cache.policy();
  const std::string spec = p.spec();
  KVQ_REQUIRE(opt.note.size() <= kArchiveMaxText, kInvalidArgument, "archive note of ",
              opt.note.size(), " bytes exceeds ", kArchiveMaxText);
  const int L = cache.n_layers();
  const std::size_t n_cfg = 3 + 2 * p.overrides.size();
  const std::size_t body = kArchiveHeaderFixedBytes + n_cfg * kArchiveConfigBytes +
                           static_cast<std::size_t>(L) * kArchiveLayerGeomBytes + spec.size() +
                           opt.note.size();
  const auto H = static_cast<std::size_t>(align_up(body + 4));
  std::vector<uint8_t> h(H, 0);
  uint8_t* b = h.data();
  std::memcpy(b, kArchiveMagic, 8);
  put_u32(b + 8, kArchiveVersion);
  put_u32(b + 12, kArchiveEndianMarker);
  put_u32(b + 16, static_cast<uint32_t>(H));
  put_u32(b + 20, (cache.options().exact_rollback ? 1u : 0u) | (opt.key_rope ? 2u : 0u));
  put_i32(b + 24, L);
  put_i32(b + 28, cache.kv_heads());
  put_i32(b + 32, cache.head_dim());
  put_i32(b + 36, cache.max_tokens());
  put_i32(b + 40, p.residual);
  put_i32(b + 44, p.sinks);
  put_i32(b + 48, p.skip_first);
  put_i32(b + 52, p.skip_last);
  put_u32(b + 56, static_cast<uint32_t>(n_cfg));
  put_u32(b + 60, static_cast<uint32_t>(spec.size()));
  put_u32(b + 64, static_cast<uint32_t>(opt.note.size()));
  if (opt.key_rope) {
    put_u32(b + 68, opt.key_rope->style == RopeStyle::kHalf ? 1u : 0u);
    put_f64(b + 72, opt.key_rope->theta);
  }
  put_u32(b + 80, static_cast<uint32_t>(KVQ_VERSION_MAJOR << 16 | KVQ_VERSION_MINOR << 8 |
                                        KVQ_VERSION_PATCH));
  std::size_t off = kArchiveHeaderFixedBytes;
  encode_config(b + off, kRoleKey, -1, p.key);
  off += kArchiveConfigBytes;
  encode_config(b + off, kRoleValue, -1, p.value);
  off += kArchiveConfigBytes;
  encode_config(b + off, kRoleSkip, -1, p.skip_config);
  off += kArchiveConfigBytes;
  for (const auto& [layer, kv] : p.overrides) {
    encode_config(b + off, kRoleOverrideKey, layer, kv.first);
    off += kArchiveConfigBytes;
    encode_config(b + off, kRoleOverrideValue, layer, kv.second);
    off += kArchiveConfigBytes;
  }
  for (int l = 0; l < L; ++l) {
    put_u32(b + off, static_cast<uint32_t>(cache.block_tokens(l)));
    put_u32(b + off + 4, static_cast<uint32_t>(cache.page_layout(l).bytes));
    off += kArchiveLayerGeomBytes;
  }
  std::memcpy(b + off, spec.data(), spec.size());
  off += spec.size();
  if (!opt.note.empty()) std::memcpy(b + off, opt.note.data(), opt.note.size());
  put_u32(b + H - 4, crc32c(b, H - 4));
  return h;
}

/// Parses one config record (`at()` names it in messages).
template <class At>
QuantConfig decode_config(const uint8_t* p, const At& at) {
  QuantConfig c;
  KVQ_REQUIRE(format_from_code(p[1], &c.format), kIo, at(), ": unknown format code ", int{p[1]});
  KVQ_REQUIRE(axis_from_code(p[2], &c.axis), kIo, at(), ": unknown axis code ", int{p[2]});
  KVQ_REQUIRE(p[3] <= 1, kIo, at(), ": unknown metadata type code ", int{p[3]});
  c.meta = p[3] == 1 ? MetaDType::kF32 : MetaDType::kF16;
  KVQ_REQUIRE(p[4] <= 7, kIo, at(), ": unknown flag bits ", int{p[4]});
  c.symmetric = (p[4] & 1) != 0;
  c.qjl = (p[4] & 2) != 0;
  c.nuq_ready = (p[4] & 4) != 0;
  KVQ_REQUIRE(all_zero(p + 5, 3) && all_zero(p + 28, 4) && all_zero(p + 112, 16), kIo, at(),
              ": nonzero reserved bytes");
  c.bits = get_i32(p + 8);
  c.outliers = get_i32(p + 16);
  c.outlier_pct = get_f32(p + 20);
  c.fp8_margin = get_f32(p + 24);
  c.group = get_i64(p + 32);
  c.seed = get_u64(p + 40);
  for (int i = 0; i < kNuqMaxLevels; ++i)
    c.nuq_levels[static_cast<std::size_t>(i)] = get_f32(p + 48 + 4 * i);
  KVQ_REQUIRE(std::isfinite(c.fp8_margin) && c.fp8_margin > 0.f, kIo, at(), ": fp8 margin ",
              c.fp8_margin, " is not a positive finite number");
  if (c.format != Format::kNuq || !c.nuq_ready) {
    KVQ_REQUIRE(!c.nuq_ready && all_zero(p + 48, 64), kIo, at(),
                ": codebook levels given for a config without a calibrated nuq codebook");
  } else {
    KVQ_REQUIRE(c.bits >= 2 && c.bits <= 4, kIo, at(), ": nuq with ", c.bits, " bits");
    KVQ_REQUIRE(all_zero(p + 48 + 4 * (std::size_t{1} << c.bits), 64 - 4 * (std::size_t{1} << c.bits)),
                kIo, at(), ": codebook levels beyond the 2^", c.bits, " a nuq", c.bits, " uses");
  }
  return c;
}

/// Walks the records of a file whose trailer is missing or damaged and says where it ends:
/// after which complete record, inside which record (or footer), or where it is damaged.
inline std::string salvage_message(const Source& src, const std::string& name, uint64_t H,
                                   const std::string& trailer_problem) {
  const uint64_t size = src.size();
  uint64_t off = H;
  uint64_t n = 0;
  std::string last = "the header";
  std::array<uint8_t, kArchiveRecordHeaderBytes> h{};
  const std::string pre = cat(name, ": ");
  auto so_far = [&] {
    return n == 0 ? std::string("no complete record") : cat(n, " complete records (last: ", last, ")");
  };
  for (;;) {
    if (off == size)
      return cat(pre, "truncated or unfinished archive: ", trailer_problem, "; the file ends at byte ",
                 size, " right after ", last, " (", so_far(),
                 "), where another record or the footer and trailer should follow");
    if (off + 8 <= size) {
      uint8_t m[8];
      src.read(off, m, 8);
      if (std::memcmp(m, kArchiveFooterMagic, 8) == 0) {
        if (off + kArchiveFooterFixedBytes > size)
          return cat(pre, "truncated archive: ", trailer_problem, "; the file ends at byte ", size,
                     " inside the footer (offset ", off, "), after ", so_far());
        uint8_t fsz[8];
        src.read(off + 16, fsz, 8);
        const uint64_t fb = get_u64(fsz);
        if (fb <= size - off && off + fb + kArchiveTrailerBytes == size)
          return cat(pre, "damaged trailer (last ", kArchiveTrailerBytes, " bytes, offset ",
                     size - kArchiveTrailerBytes, "): ", trailer_problem, "; ", so_far(),
                     " and the footer at offset ", off, " precede it");
        if (fb > size - off || off + fb + kArchiveTrailerBytes > size)
          return cat(pre, "truncated archive: ", trailer_problem, "; the file ends at byte ", size,
                     " inside the footer (offset ", off, ", ", fb, " bytes) or the trailer after it, after ",
                     so_far());
        return cat(pre, "damaged archive: ", trailer_problem, "; the footer at offset ", off, " (", fb,
                   " bytes) and a trailer are followed by ", size - off - fb - kArchiveTrailerBytes,
                   " more bytes");
      }
    }
    if (off + kArchiveRecordHeaderBytes > size)
      return cat(pre, "truncated archive: ", trailer_problem, "; the file ends at byte ", size,
                 " inside the header of record #", n, " (offset ", off, ") or of the footer, after ",
                 so_far());
    src.read(off, h.data(), h.size());
    ArchiveRecord r;
    std::string why;
    if (!decode_record_header(h.data(), &r, &why))
      return cat(pre, "damaged archive: ", trailer_problem, "; no valid record #", n, " at offset ", off,
                 " (", why, "), after ", so_far());
    r.offset = off;
    if (r.payload_bytes > size || off + r.extent() > size)
      return cat(pre, "truncated archive: ", trailer_problem, "; the file ends at byte ", size,
                 " inside ", r.name(), ", whose payload of ", r.payload_bytes, " bytes starts at ",
                 r.payload_offset());
    last = r.name();
    off += r.extent();
    ++n;
  }
}

/// Validates the header, footer and trailer of `src` and returns what they say.
inline ArchiveInfo parse_archive(const Source& src, const std::string& name,
                                 const ArchiveReadOptions& opt) {
  KVQ_REQUIRE(host_little_endian(), kUnsupported, name,
              ": kvq archives are little-endian and this host is not; reading them here is not "
              "supported");
  const uint64_t size = src.size();
  ArchiveInfo info;
  info.source = name;
  info.file_bytes = size;

  // 1. The header's fixed part: magic, version, endianness, size, then its CRC.
  KVQ_REQUIRE(size >= 8, kIo, name, ": truncated: ", size,
              " bytes, shorter than the 8-byte magic of a kvq archive");
  uint8_t fx[kArchiveHeaderFixedBytes] = {};
  src.read(0, fx, std::min<uint64_t>(size, kArchiveHeaderFixedBytes));
  KVQ_REQUIRE(std::memcmp(fx, kArchiveMagic, 8) == 0, kIo, name,
              ": not a kvq archive: header (offset 0): the first 8 bytes are not the magic 89 4B "
              "56 51 41 0D 0A 1A");
  KVQ_REQUIRE(size >= kArchiveHeaderFixedBytes, kIo, name, ": truncated: the file ends at byte ",
              size, " inside the header's fixed part (", kArchiveHeaderFixedBytes, " bytes)");
  const uint32_t version = get_u32(fx + 8), marker = get_u32(fx + 12);
  const uint64_t H = get_u32(fx + 16);
  KVQ_REQUIRE(marker != 0x0D0C0B0Au, kUnsupported, name,
              ": written big-endian (endianness marker 0A 0B 0C 0D); kvq archives are little-endian");
  KVQ_REQUIRE(H >= kArchiveHeaderFixedBytes + 3 * kArchiveConfigBytes + 4 && H % kArchiveAlign == 0 &&
                  H <= kArchiveMaxHeaderBytes,
              kIo, name, ": header (offset 0): header size ", H,
              " is impossible (a multiple of 64, at least ",
              kArchiveHeaderFixedBytes + 3 * kArchiveConfigBytes + 4, ", at most ",
              kArchiveMaxHeaderBytes, ")", version != kArchiveVersion ? cat("; format version field reads ", version) : std::string());
  KVQ_REQUIRE(H <= size, kIo, name, ": truncated: the file ends at byte ", size,
              " inside the header (", H, " bytes)");
  std::vector<uint8_t> hb(static_cast<std::size_t>(H));
  src.read(0, hb.data(), hb.size());
  {
    const uint32_t want = get_u32(hb.data() + H - 4), got = crc32c(hb.data(), H - 4);
    KVQ_REQUIRE(want == got, kIo, name, ": header (offset 0, ", H, " bytes): CRC-32C mismatch (stored ",
                hex32(want), ", computed ", hex32(got), ")");
  }
  KVQ_REQUIRE(version == kArchiveVersion, kUnsupported, name, ": format version ", version,
              " (this kvq reads version ", kArchiveVersion, ")");
  KVQ_REQUIRE(marker == kArchiveEndianMarker, kIo, name, ": header: bad endianness marker ",
              hex32(marker));
  info.version = version;
  info.header_bytes = H;

  // 2. The trailer (then the salvage walk says where an unfinished file ends).
  std::string trailer_problem;
  uint8_t tr[kArchiveTrailerBytes] = {};
  if (size < H + kArchiveTrailerBytes) {
    trailer_problem = "no room for a trailer";
  } else {
    src.read(size - kArchiveTrailerBytes, tr, kArchiveTrailerBytes);
    const uint64_t fo = get_u64(tr), fb = get_u64(tr + 8);
    if (std::memcmp(tr + 24, kArchiveTrailerMagic, 8) != 0) {
      trailer_problem = "no trailer magic in the last 8 bytes";
    } else if (get_u32(tr + 20) != crc32c(tr, 20)) {
      trailer_problem = cat("trailer CRC-32C mismatch (stored ", hex32(get_u32(tr + 20)),
                            ", computed ", hex32(crc32c(tr, 20)), ")");
    } else if (fo < H || fo % kArchiveAlign != 0 || fb % kArchiveAlign != 0 ||
               fb < align_up(kArchiveFooterFixedBytes + 4) || fo > size || fb > size - fo ||
               fo + fb + kArchiveTrailerBytes != size) {
      trailer_problem = cat("trailer points at a footer of ", fb, " bytes at offset ", fo,
                            ", which does not end where the trailer starts (", size - kArchiveTrailerBytes, ")");
    } else {
      info.footer_offset = fo;
      info.footer_bytes = fb;
      info.file_crc = get_u32(tr + 16);
    }
  }
  if (!trailer_problem.empty()) fail(ErrorKind::kIo, salvage_message(src, name, H, trailer_problem));

  // 3. The header's fields.
  const uint8_t* b = hb.data();
  const uint32_t flags = get_u32(b + 20);
  const int32_t L = get_i32(b + 24), Hk = get_i32(b + 28), D = get_i32(b + 32), MT = get_i32(b + 36);
  const uint64_t n_cfg = get_u32(b + 56), spec_n = get_u32(b + 60), note_n = get_u32(b + 64);
  const uint32_t rope_style = get_u32(b + 68);
  const double rope_theta = get_f64(b + 72);
  const std::string hdr = name + ": header";
  KVQ_REQUIRE(flags <= 3, kIo, hdr, ": unknown flag bits ", hex32(flags));
  KVQ_REQUIRE(L >= 1 && L <= kArchiveMaxLayers && Hk >= 1 && Hk <= (1 << 24) && D >= 1 &&
                  D <= (1 << 24) && MT >= 0,
              kIo, hdr, ": impossible shape: ", L, " layers, ", Hk, " kv heads, head_dim ", D,
              ", max_tokens ", MT);
  KVQ_REQUIRE(n_cfg >= 3 && n_cfg % 2 == 1 && n_cfg <= 3 + 2 * static_cast<uint64_t>(L) &&
                  spec_n <= kArchiveMaxText && note_n <= kArchiveMaxText,
              kIo, hdr, ": impossible counts: ", n_cfg, " configs, spec of ", spec_n,
              " bytes, note of ", note_n, " bytes");
  const uint64_t body = kArchiveHeaderFixedBytes + n_cfg * kArchiveConfigBytes +
                        static_cast<uint64_t>(L) * kArchiveLayerGeomBytes + spec_n + note_n;
  KVQ_REQUIRE(align_up(body + 4) == H, kIo, hdr, ": its fields take ", body,
              " bytes, which does not give its size ", H);
  KVQ_REQUIRE(all_zero(b + 84, 12) && all_zero(b + body, static_cast<std::size_t>(H - 4 - body)), kIo,
              hdr, ": nonzero reserved or padding bytes");
  if (flags & 2) {
    KVQ_REQUIRE(rope_style <= 1 && std::isfinite(rope_theta) && rope_theta > 1.0, kIo, hdr,
                ": key RoPE style ", rope_style, ", theta ", rope_theta, " is not a RoPE config");
    RopeConfig rc;
    rc.theta = rope_theta;
    rc.style = rope_style == 1 ? RopeStyle::kHalf : RopeStyle::kAdjacent;
    info.key_rope = rc;
  } else {
    KVQ_REQUIRE(rope_style == 0 && get_u64(b + 72) == 0, kIo, hdr,
                ": a key RoPE config without the pre-RoPE flag");
  }
  info.n_layers = L;
  info.kv_heads = Hk;
  info.head_dim = D;
  info.max_tokens = MT;
  info.options.exact_rollback = (flags & 1) != 0;
  info.writer_version = get_u32(b + 80);
  Policy& p = info.policy;
  p.residual = get_i32(b + 40);
  p.sinks = get_i32(b + 44);
  p.skip_first = get_i32(b + 48);
  p.skip_last = get_i32(b + 52);
  std::size_t off = kArchiveHeaderFixedBytes;
  int prev_layer = -1;
  for (uint64_t i = 0; i < n_cfg; ++i, off += kArchiveConfigBytes) {
    const uint8_t* c = b + off;
    const int32_t layer = get_i32(c + 12);
    const auto at = [&] { return cat(hdr, ": config ", i, " (offset ", off, ")"); };
    const uint8_t want_role = i < 3 ? static_cast<uint8_t>(i)
                                    : static_cast<uint8_t>(i % 2 == 1 ? kRoleOverrideKey : kRoleOverrideValue);
    KVQ_REQUIRE(c[0] == want_role, kIo, at(), ": role ", int{c[0]}, " where role ", int{want_role},
                " belongs (key, value, skip, then key/value pairs of overrides)");
    const QuantConfig q = decode_config(c, at);
    if (i == 0) {
      KVQ_REQUIRE(layer == -1, kIo, at(), ": layer ", layer, " on a base config");
      p.key = q;
    } else if (i == 1) {
      KVQ_REQUIRE(layer == -1, kIo, at(), ": layer ", layer, " on a base config");
      p.value = q;
    } else if (i == 2) {
      KVQ_REQUIRE(layer == -1, kIo, at(), ": layer ", layer, " on a base config");
      p.skip_config = q;
    } else if (i % 2 == 1) {
      KVQ_REQUIRE(layer > prev_layer && layer < L, kIo, at(), ": override of layer ", layer,
                  " (overrides name layers in [0, ", L, ") in increasing order)");
      prev_layer = layer;
      p.overrides[layer].first = q;
    } else {
      KVQ_REQUIRE(layer == prev_layer, kIo, at(), ": value override of layer ", layer,
                  " after the key override of layer ", prev_layer);
      p.overrides[layer].second = q;
    }
  }
  std::vector<std::pair<uint64_t, uint64_t>> geom(static_cast<std::size_t>(L));
  for (int l = 0; l < L; ++l, off += kArchiveLayerGeomBytes) {
    KVQ_REQUIRE(all_zero(b + off + 8, 8), kIo, hdr, ": layer ", l, " geometry: nonzero reserved bytes");
    geom[static_cast<std::size_t>(l)] = {get_u32(b + off), get_u32(b + off + 4)};
  }
  info.spec.assign(reinterpret_cast<const char*>(b + off), static_cast<std::size_t>(spec_n));
  off += static_cast<std::size_t>(spec_n);
  info.note.assign(reinterpret_cast<const char*>(b + off), static_cast<std::size_t>(note_n));
  try {
    p.validate();
    for (const auto& kv : p.overrides)
      KVQ_REQUIRE(kv.first < L, kInvalidArgument, "override of layer ", kv.first);
  } catch (const Error& e) {
    fail(ErrorKind::kIo, hdr, ": invalid policy: ", e.what());
  }
  try {
    KVQ_REQUIRE(parse_policy(info.spec) == spec_part(p), kIo, "does not describe the stored configs (",
                p.spec(), ")");
  } catch (const Error& e) {
    fail(ErrorKind::kIo, hdr, ": policy spec '", info.spec, "': ", e.what());
  }

  // Per-layer geometry, recomputed as the cache computes it and compared with the header's.
  const uint64_t row = static_cast<uint64_t>(Hk) * static_cast<uint64_t>(D);
  uint64_t construct = static_cast<uint64_t>(L) * (::kvq::detail::KVCacheAccess::layer_struct_bytes() + 256);
  info.layers.resize(static_cast<std::size_t>(L));
  for (int l = 0; l < L; ++l) {
    ArchiveLayer& A = info.layers[static_cast<std::size_t>(l)];
    try {
      const QuantConfig kc = ::kvq::detail::streaming_config(p.key_for(l, L));
      const QuantConfig vc = ::kvq::detail::streaming_config(p.value_for(l, L));
      A.block_tokens = ::kvq::detail::stream_block_tokens(kc, vc);
      KVQ_REQUIRE(static_cast<double>(A.block_tokens) * static_cast<double>(row) * 4.0 <=
                      static_cast<double>(kMaxPageBytes),
                  kOutOfRange, "blocks of ", A.block_tokens, " tokens x ", Hk, " x ", D,
                  " exceed the cache's staging limit");
      A.layout = make_page_layout(kc, vc, A.block_tokens, Hk, D);
    } catch (const Error& e) {
      fail(ErrorKind::kIo, hdr, ": layer ", l, ": this policy and shape cannot form a cache: ", e.what());
    }
    const auto& g = geom[static_cast<std::size_t>(l)];
    KVQ_REQUIRE(g.first == static_cast<uint64_t>(A.block_tokens) && g.second == A.layout.bytes, kIo, hdr,
                ": layer ", l, " stores pages of ", g.first, " tokens and ", g.second,
                " bytes, but its policy and shape give ", A.block_tokens, " tokens and ", A.layout.bytes,
                " bytes (an archive from an incompatible kvq)");
    construct = std::max(construct, static_cast<uint64_t>(L) * 512 +
                                        16 * static_cast<uint64_t>(A.block_tokens) * row +
                                        2 * static_cast<uint64_t>(A.layout.bytes));
  }
  const uint64_t limit = opt.max_cache_bytes ? opt.max_cache_bytes
                                             : std::max<uint64_t>(uint64_t{64} << 20, 16 * size);
  KVQ_REQUIRE(construct <= limit, kIo, hdr, ": the cache it declares (", L, " layers of ", Hk,
              " x ", D, ") would take about ", construct, " bytes to set up before any token is read, "
              "beyond the reader's limit of ", limit,
              " bytes for a file of ", size, " bytes (ArchiveReadOptions::max_cache_bytes)");

  // 4. The footer.
  const uint64_t fo = info.footer_offset, fb = info.footer_bytes;
  const auto ftr = [&] { return cat(name, ": footer (offset ", fo, ", ", fb, " bytes)"); };
  std::vector<uint8_t> fbuf(static_cast<std::size_t>(fb));
  src.read(fo, fbuf.data(), fbuf.size());
  const uint8_t* f = fbuf.data();
  {
    const uint32_t want = get_u32(f + fb - 4), got = crc32c(f, fb - 4);
    KVQ_REQUIRE(want == got, kIo, ftr(), ": CRC-32C mismatch (stored ", hex32(want), ", computed ",
                hex32(got), ")");
  }
  KVQ_REQUIRE(std::memcmp(f, kArchiveFooterMagic, 8) == 0, kIo, ftr(), ": no footer magic");
  const uint64_t N = get_u64(f + 8);
  KVQ_REQUIRE(get_u64(f + 16) == fb && get_i32(f + 24) == L && all_zero(f + 28, 4), kIo, ftr(),
              ": its size field (", get_u64(f + 16), ") or layer count (", get_i32(f + 24),
              ") disagrees with the trailer and header (", fb, ", ", L, ")");
  KVQ_REQUIRE(N <= fb / kArchiveIndexEntryBytes &&
                  align_up(kArchiveFooterFixedBytes + N * kArchiveIndexEntryBytes +
                           static_cast<uint64_t>(L) * kArchiveLayerEntryBytes + 4) == fb,
              kIo, ftr(), ": ", N, " records and ", L, " layers do not give its size");
  const uint64_t fbody = kArchiveFooterFixedBytes + N * kArchiveIndexEntryBytes +
                         static_cast<uint64_t>(L) * kArchiveLayerEntryBytes;
  KVQ_REQUIRE(all_zero(f + fbody, static_cast<std::size_t>(fb - 4 - fbody)), kIo, ftr(),
              ": nonzero padding");
  info.records.resize(static_cast<std::size_t>(N));
  uint64_t expect_off = H;
  for (uint64_t i = 0; i < N; ++i) {
    const uint8_t* e = f + kArchiveFooterFixedBytes + i * kArchiveIndexEntryBytes;
    ArchiveRecord& r = info.records[static_cast<std::size_t>(i)];
    r.seq = i;
    r.offset = get_u64(e);
    r.payload_bytes = get_u64(e + 8);
    r.layer = get_i32(e + 16);
    const uint16_t kind = get_u16(e + 20);
    r.kind = static_cast<RecordKind>(kind);
    r.index = get_i64(e + 24);
    r.begin = get_i64(e + 32);
    r.end = get_i64(e + 40);
    r.payload_crc = get_u32(e + 48);
    r.header_crc = get_u32(e + 52);
    const auto at = [&] { return cat(ftr(), ": index entry ", i, " (", r.name(), ")"); };
    KVQ_REQUIRE(all_zero(e + 22, 2) && all_zero(e + 56, 8), kIo, at(), ": nonzero reserved bytes");
    KVQ_REQUIRE(kind >= 1 && kind <= 4, kIo, at(), ": unknown record kind ", kind);
    KVQ_REQUIRE(r.layer >= 0 && r.layer < L, kIo, at(), ": layer ", r.layer, " of ", L);
    KVQ_REQUIRE(r.offset == expect_off, kIo, at(), ": starts at offset ", r.offset, ", but the ",
                i == 0 ? "header ends" : "previous record ends", " at ", expect_off,
                " (records are stored back to back)");
    KVQ_REQUIRE(r.payload_bytes <= fo && r.extent() <= fo - r.offset, kIo, at(), ": payload of ",
                r.payload_bytes, " bytes runs past the footer at ", fo);
    expect_off = r.offset + r.extent();
    info.layers[static_cast<std::size_t>(r.layer)].records.push_back(static_cast<std::size_t>(i));
  }
  KVQ_REQUIRE(expect_off == fo, kIo, ftr(), ": the records end at ", expect_off,
              " but the footer starts at ", fo);

  // 5. Per-layer token counts, and each layer's records against them.
  const int64_t S = p.sinks, R = p.residual;
  for (int l = 0; l < L; ++l) {
    ArchiveLayer& A = info.layers[static_cast<std::size_t>(l)];
    const uint8_t* e = f + kArchiveFooterFixedBytes + N * kArchiveIndexEntryBytes +
                       static_cast<uint64_t>(l) * kArchiveLayerEntryBytes;
    const auto at = [&] { return cat(ftr(), ": layer ", l); };
    A.tokens = get_i64(e);
    A.sink_tokens = get_i64(e + 8);
    A.pages = get_i64(e + 16);
    A.residual_tokens = get_i64(e + 24);
    const uint32_t lf = get_u32(e + 32);
    KVQ_REQUIRE(lf <= 1 && all_zero(e + 36, 12), kIo, at(), ": unknown flags or nonzero reserved bytes");
    A.rollback = lf == 1;
    const int64_t B = A.block_tokens;
    const bool counts_ok =
        A.sink_tokens >= 0 && A.pages >= 0 && A.residual_tokens >= 0 &&
        A.pages <= static_cast<int64_t>(N) && A.sink_tokens <= S && A.residual_tokens <= R + B - 1 &&
        A.tokens == A.sink_tokens + A.pages * B + A.residual_tokens &&
        A.sink_tokens == std::min<int64_t>(A.tokens, S) && (MT == 0 || A.tokens <= MT) &&
        (!A.rollback || (A.pages >= 1 && info.options.exact_rollback));
    KVQ_REQUIRE(counts_ok, kIo, at(), ": ", A.tokens, " tokens as ", A.sink_tokens, " sinks + ",
                A.pages, " pages of ", B, " + ", A.residual_tokens, " residual",
                A.rollback ? " with rollback rows" : "",
                " is not a state a cache can be in (policy sinks=", S, ", residual=", R,
                MT ? cat(", max_tokens=", MT) : std::string(), ")");
    std::vector<int64_t> seen_page(static_cast<std::size_t>(A.pages), -1);
    int64_t seen[5] = {-1, -1, -1, -1, -1};
    for (const std::size_t ri : A.records) {
      const ArchiveRecord& r = info.records[ri];
      const auto rat = [&] { return cat(name, ": ", r.name()); };
      int64_t b0 = 0, b1 = 0, rows = 0;
      uint64_t bytes = 0;
      switch (r.kind) {
        case RecordKind::kPage:
          KVQ_REQUIRE(r.index >= 0 && r.index < A.pages, kIo, rat(), ": page index beyond the ", A.pages,
                      " pages of layer ", l);
          KVQ_REQUIRE(seen_page[static_cast<std::size_t>(r.index)] < 0, kIo, rat(), ": layer ", l,
                      " page ", r.index, " is also record #", seen_page[static_cast<std::size_t>(r.index)],
                      " (duplicated record)");
          seen_page[static_cast<std::size_t>(r.index)] = static_cast<int64_t>(r.seq);
          b0 = A.sink_tokens + r.index * B;
          b1 = b0 + B;
          bytes = A.layout.bytes;
          break;
        case RecordKind::kSinks:
          b0 = 0;
          b1 = rows = A.sink_tokens;
          break;
        case RecordKind::kResidual:
          b0 = A.packed_end();
          b1 = A.tokens;
          rows = A.residual_tokens;
          break;
        case RecordKind::kRollback:
          KVQ_REQUIRE(A.rollback, kIo, rat(), ": rollback rows for a layer whose footer entry has none");
          b0 = A.packed_end() - B;
          b1 = A.packed_end();
          rows = B;
          break;
      }
      if (r.kind != RecordKind::kPage) {
        const auto k = static_cast<std::size_t>(r.kind);
        KVQ_REQUIRE(seen[k] < 0, kIo, rat(), ": layer ", l, " has a second ", to_string(r.kind),
                    " record (the first is record #", seen[k], ": duplicated record)");
        seen[k] = static_cast<int64_t>(r.seq);
        KVQ_REQUIRE(r.index == 0 && rows > 0, kIo, rat(), ": an f32 region of ", rows,
                    " tokens cannot be record index ", r.index);
        bytes = 2 * static_cast<uint64_t>(rows) * row * 4;
      }
      KVQ_REQUIRE(r.begin == b0 && r.end == b1 && r.payload_bytes == bytes, kIo, rat(),
                  ": layer ", l, "'s ", to_string(r.kind), " should cover tokens [", b0, ", ", b1,
                  ") in ", bytes, " bytes");
    }
    for (int64_t j = 0; j < A.pages; ++j)
      KVQ_REQUIRE(seen_page[static_cast<std::size_t>(j)] >= 0, kIo, ftr(), ": layer ", l, " page ", j,
                  " has no record");
    KVQ_REQUIRE((seen[2] >= 0) == (A.sink_tokens > 0) && (seen[3] >= 0) == (A.residual_tokens > 0) &&
                    (seen[4] >= 0) == A.rollback,
                kIo, ftr(), ": layer ", l, " lacks its ",
                (seen[2] >= 0) != (A.sink_tokens > 0) ? "sinks"
                : (seen[3] >= 0) != (A.residual_tokens > 0) ? "residual"
                                                             : "rollback",
                " record");
    // Records of a layer in a fixed order: sinks, pages by index, residual, rollback.
    std::sort(A.records.begin(), A.records.end(), [&](std::size_t x, std::size_t y) {
      const ArchiveRecord &a = info.records[x], &c = info.records[y];
      auto key = [](const ArchiveRecord& r) {
        const int o = r.kind == RecordKind::kSinks ? 0 : r.kind == RecordKind::kPage ? 1
                      : r.kind == RecordKind::kResidual ? 2 : 3;
        return std::pair<int, int64_t>(o, r.index);
      };
      return key(a) < key(c);
    });
  }
  return info;
}

/// Checks f32 rows restored from `r` as KVCache::append checks what it accepts: finite
/// everywhere; for rows that will be (or were) quantized under `cfg` (residual, rollback) also
/// |x| <= 65504 where the format stores fp16, and Lloyd-Max norms <= 65504 with fp16 norms.
inline void check_rows(const std::string& name, const ArchiveRecord& r, const float* x, int64_t rows,
                       int64_t H, int64_t D, const QuantConfig& cfg, bool quantized, const char* what) {
  const bool f16_range = quantized && ::kvq::detail::needs_f16_range(cfg);
  const bool norm_range = quantized && cfg.format == Format::kLloydMax && cfg.meta == MetaDType::kF16;
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const float* v = x + (t * H + h) * D;
      double n2 = 0;
      for (int64_t d = 0; d < D; ++d) {
        KVQ_REQUIRE(std::isfinite(v[d]) && (!f16_range || std::fabs(v[d]) <= kMaxF16Magnitude), kIo,
                    name, ": ", r.name(), ": ", what, " of token ", r.begin + t, ", head ", h,
                    ", channel ", d, " is ", v[d],
                    std::isfinite(v[d]) ? ", beyond the fp16 range the layer's format stores"
                                        : "; a cache holds finite values only");
        n2 += static_cast<double>(v[d]) * v[d];
      }
      KVQ_REQUIRE(!norm_range || std::sqrt(n2) <= kMaxF16Magnitude, kIo, name, ": ", r.name(), ": ",
                  what, " of token ", r.begin + t, ", head ", h, " has norm ", std::sqrt(n2),
                  ", beyond the fp16 range of the layer's Lloyd-Max norms");
    }
}

/// Checks the one kind of index a page's bytes hold: every dense-and-sparse outlier position
/// must be a channel (< head_dim), since the attention kernels and dequantization index codes
/// and queries by it. A CRC cannot vouch for that (a hostile writer reseals), so a page that
/// breaks it is refused here, naming the record, tensor and byte.
inline void check_page_outliers(const ArchiveInfo& info, const ArchiveRecord& r,
                                const uint8_t* page, std::size_t bytes) {
  const PageLayout& L = info.layers[static_cast<std::size_t>(r.layer)].layout;
  const int64_t D = info.head_dim;
  const int pb = outlier_pos_bytes(D);
  const PageRegion* regions[2] = {&L.k.outlier_pos, &L.v.outlier_pos};
  for (int t = 0; t < 2; ++t) {
    const PageRegion& g = *regions[t];
    if (g.bytes == 0) continue;
    KVQ_REQUIRE(g.offset + g.bytes <= bytes, kIo, info.source, ": ", r.name(), ": ", bytes,
                " payload bytes do not hold the outlier positions the layout places at [",
                g.offset, ", ", g.offset + g.bytes, ")");
    const uint8_t* p = page + g.offset;
    for (std::size_t i = 0; i + static_cast<std::size_t>(pb) <= g.bytes; i += static_cast<std::size_t>(pb)) {
      const int64_t c = pb == 1 ? p[i] : (p[i] | (p[i + 1] << 8));
      KVQ_REQUIRE(c < D, kIo, info.source, ": ", r.name(), ": ", t == 0 ? "key" : "value",
                  " outlier position ", c, " at page byte ", g.offset + i,
                  " is not a channel of head_dim ", D, " (corrupt or hostile page)");
    }
  }
}

/// Reads record `r`: its header at r.offset must be the one the index describes (else it is
/// named as reordered, duplicated or damaged), its payload goes to `dst` (nullptr: checked in
/// place when the source is in memory, or through a scratch buffer) and must match its CRC, its
/// padding must be zero; a page's outlier positions must be channels (check_page_outliers).
/// Returns the CRC-32C of the record's bytes continued from `file_crc`.
inline uint32_t read_record(const Source& src, const ArchiveInfo& info, const ArchiveRecord& r,
                            void* dst, uint32_t file_crc, std::vector<uint8_t>& scratch) {
  const std::string& name = info.source;
  std::array<uint8_t, kArchiveRecordHeaderBytes> h{};
  src.read(r.offset, h.data(), h.size());
  ArchiveRecord got;
  std::string why;
  if (!decode_record_header(h.data(), &got, &why))
    fail(ErrorKind::kIo, name, ": ", r.name(), ": ", why);
  got.offset = r.offset;
  if (!same_identity(got, r)) {
    std::string found = got.name();
    if (got.seq < info.records.size() && same_identity(got, info.records[static_cast<std::size_t>(got.seq)]))
      found = cat(found.substr(0, found.rfind(", offset")), ", which belongs at offset ",
                  info.records[static_cast<std::size_t>(got.seq)].offset, ")");
    fail(ErrorKind::kIo, name, ": ", r.name(), ": the record stored there is ", found,
         ": records reordered, duplicated or overwritten");
  }
  file_crc = crc32c(h.data(), h.size(), file_crc);
  const auto n = static_cast<std::size_t>(r.payload_bytes);
  const uint8_t* payload = nullptr;
  if (dst != nullptr) {
    src.read(r.payload_offset(), dst, n);
    payload = static_cast<const uint8_t*>(dst);
  } else if (src.data() != nullptr) {
    payload = src.data() + r.payload_offset();
  } else {
    scratch.resize(n);
    src.read(r.payload_offset(), scratch.data(), n);
    payload = scratch.data();
  }
  const uint32_t pc = crc32c(payload, n);
  KVQ_REQUIRE(pc == r.payload_crc, kIo, name, ": ", r.name(), ": payload CRC-32C mismatch (stored ",
              hex32(r.payload_crc), ", computed ", hex32(pc), ")");
  if (r.kind == RecordKind::kPage) check_page_outliers(info, r, payload, n);
  file_crc = crc32c(payload, n, file_crc);
  const std::size_t pad = static_cast<std::size_t>(r.extent() - kArchiveRecordHeaderBytes - r.payload_bytes);
  if (pad > 0) {
    uint8_t z[kArchiveAlign];
    src.read(r.payload_offset() + r.payload_bytes, z, pad);
    for (std::size_t i = 0; i < pad; ++i)
      KVQ_REQUIRE(z[i] == 0, kIo, name, ": ", r.name(), ": nonzero padding byte at offset ",
                  r.payload_offset() + r.payload_bytes + i);
    file_crc = crc32c(z, pad, file_crc);
  }
  return file_crc;
}

/// Reads the header and footer bytes again and returns the CRC of the header (the start of the
/// whole-file checksum) — parse_archive does not keep them.
inline uint32_t header_crc_start(const Source& src, const ArchiveInfo& info) {
  std::vector<uint8_t> hb(static_cast<std::size_t>(info.header_bytes));
  src.read(0, hb.data(), hb.size());
  return crc32c(hb.data(), hb.size());
}
inline uint32_t footer_crc_continue(const Source& src, const ArchiveInfo& info, uint32_t crc) {
  std::vector<uint8_t> fb(static_cast<std::size_t>(info.footer_bytes));
  src.read(info.footer_offset, fb.data(), fb.size());
  return crc32c(fb.data(), fb.size(), crc);
}
inline void check_file_crc(const ArchiveInfo& info, uint32_t got) {
  KVQ_REQUIRE(got == info.file_crc, kIo, info.source, ": whole-file CRC-32C mismatch (stored ",
              hex32(info.file_crc), " in the trailer, computed ", hex32(got),
              ") although the header, every record and the footer check out");
}

/// A cache shaped as the archive says, empty (construction errors are the file's fault).
inline KVCache empty_cache(const ArchiveInfo& info) {
  try {
    return KVCache(info.policy, info.n_layers, info.kv_heads, info.head_dim, info.max_tokens,
                   info.options);
  } catch (const Error& e) {
    fail(ErrorKind::kIo, info.source, ": header: this policy and shape cannot form a cache: ", e.what());
  }
}

/// The f32 rows of one layer read from the archive (keys and values of each region).
struct LayerRows {
  std::vector<float> sk, sv, rk, rv, ok, ov;
  bool roll = false;
};

/// Checks the keys and values of an f32 record of layer `l` (check_rows).
inline void check_layer_rows(const ArchiveInfo& info, int l, const ArchiveRecord& r, const std::vector<float>& buf,
                             int64_t rows, bool quantized) {
  const ArchiveLayer& A = info.layers[static_cast<std::size_t>(l)];
  const int64_t H = info.kv_heads, D = info.head_dim;
  const auto half = static_cast<std::size_t>(rows * H * D);
  check_rows(info.source, r, buf.data(), rows, H, D, A.layout.key, quantized, "key");
  check_rows(info.source, r, buf.data() + half, rows, H, D, A.layout.value, quantized, "value");
}

inline void split_rows(std::vector<float>&& buf, std::vector<float>& k, std::vector<float>& v) {
  const std::size_t half = buf.size() / 2;
  v.assign(buf.begin() + static_cast<std::ptrdiff_t>(half), buf.end());
  buf.resize(half);
  k = std::move(buf);
}

/// Loads the selected records of `info` from `src` into a new cache (see ArchiveReader::load).
inline KVCache load_cache(const Source& src, const ArchiveInfo& info, const ArchiveSelection& sel,
                          bool whole_file_crc) {
  const int L = info.n_layers;
  std::vector<char> want_layer(static_cast<std::size_t>(L), sel.layers.empty() ? 1 : 0);
  for (int l : sel.layers) {
    KVQ_REQUIRE(l >= 0 && l < L, kInvalidArgument, info.source, ": layer ", l,
                " does not exist (the archive has ", L, " layers)");
    want_layer[static_cast<std::size_t>(l)] = 1;
  }
  KVQ_REQUIRE(sel.tokens >= -1, kInvalidArgument, info.source, ": token prefix ", sel.tokens,
              " (use -1 for all tokens)");
  // Which records to read: per layer, those a prefix of `tokens` needs (see truncate()).
  std::vector<char> want(info.records.size(), 0);
  std::vector<int64_t> keep(static_cast<std::size_t>(L), 0);
  std::vector<int64_t> pages(static_cast<std::size_t>(L), 0);
  for (int l = 0; l < L; ++l) {
    const ArchiveLayer& A = info.layers[static_cast<std::size_t>(l)];
    if (!want_layer[static_cast<std::size_t>(l)]) continue;
    const int64_t n = sel.tokens < 0 ? A.tokens : std::min(sel.tokens, A.tokens);
    keep[static_cast<std::size_t>(l)] = n;
    int64_t np = 0;
    for (int64_t j = 0; j < A.pages; ++j)
      if (A.sink_tokens + j * A.block_tokens < n) np = j + 1;
    pages[static_cast<std::size_t>(l)] = np;
    const bool all_pages = np == A.pages;
    for (const std::size_t ri : A.records) {
      const ArchiveRecord& r = info.records[ri];
      bool w = false;
      switch (r.kind) {
        case RecordKind::kSinks: w = n > 0; break;
        case RecordKind::kPage: w = r.index < np; break;
        case RecordKind::kResidual: w = all_pages && n > A.packed_end(); break;
        case RecordKind::kRollback: w = all_pages && np > 0 && info.options.exact_rollback; break;
      }
      want[ri] = w ? 1 : 0;
    }
  }
  KVCache cache = empty_cache(info);
  using Access = ::kvq::detail::KVCacheAccess;
  for (int l = 0; l < L; ++l) Access::reserve_pages(cache, l, static_cast<std::size_t>(pages[static_cast<std::size_t>(l)]));
  std::vector<LayerRows> rows(static_cast<std::size_t>(L));
  std::vector<uint8_t> scratch;
  uint32_t fcrc = whole_file_crc ? header_crc_start(src, info) : 0;
  for (const ArchiveRecord& r : info.records) {
    if (!whole_file_crc && !want[static_cast<std::size_t>(r.seq)]) continue;
    if (!want[static_cast<std::size_t>(r.seq)]) {
      fcrc = read_record(src, info, r, nullptr, fcrc, scratch);
      continue;
    }
    const int l = r.layer;
    if (r.kind == RecordKind::kPage) {
      fcrc = read_record(src, info, r, Access::page_slot(cache, l, static_cast<std::size_t>(r.index)), fcrc, scratch);
      continue;
    }
    std::vector<float> buf(static_cast<std::size_t>(r.payload_bytes / 4));
    fcrc = read_record(src, info, r, buf.data(), fcrc, scratch);
    const int64_t n_rows = r.end - r.begin;
    check_layer_rows(info, l, r, buf, n_rows, r.kind != RecordKind::kSinks);
    LayerRows& R = rows[static_cast<std::size_t>(l)];
    if (r.kind == RecordKind::kSinks) split_rows(std::move(buf), R.sk, R.sv);
    if (r.kind == RecordKind::kResidual) split_rows(std::move(buf), R.rk, R.rv);
    if (r.kind == RecordKind::kRollback) {
      split_rows(std::move(buf), R.ok, R.ov);
      R.roll = true;
    }
  }
  if (whole_file_crc) check_file_crc(info, footer_crc_continue(src, info, fcrc));
  for (int l = 0; l < L; ++l) {
    LayerRows& R = rows[static_cast<std::size_t>(l)];
    Access::commit(cache, l, static_cast<std::size_t>(pages[static_cast<std::size_t>(l)]), std::move(R.sk),
                   std::move(R.sv), std::move(R.rk), std::move(R.rv), std::move(R.ok), std::move(R.ov),
                   R.roll);
  }
  if (sel.tokens >= 0)  // as truncate(): a cut may also unpack the newest page (exact rollback)
    for (int l = 0; l < L; ++l)
      if (want_layer[static_cast<std::size_t>(l)]) cache.truncate(l, keep[static_cast<std::size_t>(l)]);
  return cache;
}

/// Every byte of the archive: each record (header against the index, payload CRC, padding)
/// and the whole-file CRC.
inline void verify_all(const Source& src, const ArchiveInfo& info) {
  std::vector<uint8_t> scratch;
  std::vector<float> rows_buf;
  uint32_t fcrc = header_crc_start(src, info);
  for (const ArchiveRecord& r : info.records) {
    if (r.kind == RecordKind::kPage) {
      fcrc = read_record(src, info, r, nullptr, fcrc, scratch);
    } else {
      rows_buf.resize(static_cast<std::size_t>(r.payload_bytes / 4));
      fcrc = read_record(src, info, r, rows_buf.data(), fcrc, scratch);
      check_layer_rows(info, r.layer, r, rows_buf, r.end - r.begin, r.kind != RecordKind::kSinks);
    }
  }
  check_file_crc(info, footer_crc_continue(src, info, fcrc));
}

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

/// Reads an archive from a file (positioned reads; only the records asked for) or from memory.
/// The constructor validates the header, trailer and footer (not the payloads: see verify()).
class ArchiveReader {
 public:
  explicit ArchiveReader(const std::filesystem::path& path, const ArchiveReadOptions& opt = {})
      : src_(std::make_unique<detail::FileSource>(path)),
        info_(detail::parse_archive(*src_, path.string(), opt)) {}
  /// An archive image in memory (kept by the caller while the reader lives).
  ArchiveReader(const uint8_t* data, std::size_t size, const std::string& name = "<memory>",
                const ArchiveReadOptions& opt = {})
      : src_(make_mem(data, size, name)), info_(detail::parse_archive(*src_, name, opt)) {}

  const ArchiveInfo& info() const { return info_; }

  /// Checks every byte: each record against the index, its payload CRC and padding, restored
  /// rows against the cache's rules, and the whole-file CRC. Throws kIo naming what is wrong.
  void verify() const { detail::verify_all(*src_, info_); }

  /// The whole cache (every byte verified, whole-file CRC included).
  KVCache load() const { return detail::load_cache(*src_, info_, {}, true); }
  /// Some layers and/or a token prefix: reads and verifies only the records they need (the
  /// whole-file CRC is not computed). The result equals load() followed by truncate(tokens)
  /// of the selected layers, with the other layers empty.
  KVCache load(const ArchiveSelection& sel) const {
    return detail::load_cache(*src_, info_, sel, false);
  }
  /// Loads into `into`, whose policy (every config field) and shape must be the archive's
  /// (kInvalidArgument / kShapeMismatch otherwise, naming both). `into` keeps its options and
  /// max_tokens (the archive's tokens must fit); on any error it is left unchanged.
  void load_into(KVCache& into) const {
    check_compatible(into.policy(), into.n_layers(), into.kv_heads(), into.head_dim());
    for (int l = 0; l < info_.n_layers; ++l)
      KVQ_REQUIRE(into.max_tokens() == 0 || info_.layers[static_cast<std::size_t>(l)].tokens <= into.max_tokens(),
                  kOutOfRange, info_.source, ": layer ", l, " holds ",
                  info_.layers[static_cast<std::size_t>(l)].tokens, " tokens, beyond the cache's max_tokens=",
                  into.max_tokens());
    ArchiveInfo adj = info_;
    adj.options = into.options();
    adj.max_tokens = into.max_tokens();
    KVCache c = detail::load_cache(*src_, adj, {}, true);
    into = std::move(c);
  }

  /// Throws unless the archive holds a cache of this policy and shape.
  void check_compatible(const Policy& policy, int n_layers, int kv_heads, int head_dim) const {
    KVQ_REQUIRE(n_layers == info_.n_layers && kv_heads == info_.kv_heads && head_dim == info_.head_dim,
                kShapeMismatch, info_.source, ": the archive holds ", info_.n_layers, " layers of ",
                info_.kv_heads, " kv heads x head_dim ", info_.head_dim, ", the cache ", n_layers,
                " layers of ", kv_heads, " x ", head_dim);
    if (policy == info_.policy) return;
    const std::string a = info_.policy.spec(), b = policy.spec();
    fail(ErrorKind::kInvalidArgument, info_.source, ": the archive was written under policy '", a,
         "' but the cache's policy is '", b, "'",
         a == b ? " (same spec; they differ in a seed, an fp8 margin or a nuq codebook)" : "");
  }

  /// Dequantizes tokens [begin, end) of `layer` into k_out and v_out ([end - begin, kv_heads,
  /// head_dim], any strides), reading (and verifying) only the records that overlap the range.
  void read(int layer, int64_t begin, int64_t end, KVView<float> k_out, KVView<float> v_out) const {
    KVQ_REQUIRE(layer >= 0 && layer < info_.n_layers, kInvalidArgument, info_.source, ": layer ", layer,
                " does not exist (the archive has ", info_.n_layers, " layers)");
    const ArchiveLayer& A = info_.layers[static_cast<std::size_t>(layer)];
    KVQ_REQUIRE(0 <= begin && begin <= end && end <= A.tokens, kOutOfRange, info_.source,
                ": range [", begin, ", ", end, ") is outside the ", A.tokens, " tokens of layer ", layer);
    const Shape want{end - begin, info_.kv_heads, info_.head_dim};
    KVQ_REQUIRE(k_out.shape() == want && v_out.shape() == want, kShapeMismatch,
                "ArchiveReader::read: outputs must be ", want.str(), ", got keys ", k_out.shape().str(),
                " and values ", v_out.shape().str());
    const int64_t H = info_.kv_heads, D = info_.head_dim;
    PageArena page(A.layout.bytes);
    std::vector<float> rows;
    std::vector<uint8_t> scratch;
    QuantWorkspace ws;
    for (const std::size_t ri : A.records) {
      const ArchiveRecord& r = info_.records[ri];
      if (r.kind == RecordKind::kRollback) continue;
      const int64_t a = std::max(begin, r.begin), b = std::min(end, r.end);
      if (a >= b) continue;
      const KVView<float> ko = k_out.slice_tokens(a - begin, b - a), vo = v_out.slice_tokens(a - begin, b - a);
      if (r.kind == RecordKind::kPage) {
        page.reserve(1);
        detail::read_record(*src_, info_, r, page.page(0), 0, scratch);
        dequantize_tokens(A.layout.key_view(page.page(0)), a - r.begin, ko, ws);
        dequantize_tokens(A.layout.value_view(page.page(0)), a - r.begin, vo, ws);
        continue;
      }
      rows.resize(static_cast<std::size_t>(r.payload_bytes / 4));
      detail::read_record(*src_, info_, r, rows.data(), 0, scratch);
      const int64_t n = r.end - r.begin;
      detail::check_layer_rows(info_, layer, r, rows, n, r.kind != RecordKind::kSinks);
      const auto kv = KVView<const float>::nhd(rows.data(), n, H, D);
      const auto vv = KVView<const float>::nhd(rows.data() + n * H * D, n, H, D);
      for (int64_t t = a; t < b; ++t)
        for (int64_t h = 0; h < H; ++h) {
          ::kvq::detail::store_row(ko, t - a, h, kv.row(t - r.begin, h));
          ::kvq::detail::store_row(vo, t - a, h, vv.row(t - r.begin, h));
        }
    }
  }

 private:
  static std::unique_ptr<detail::Source> make_mem(const uint8_t* data, std::size_t size,
                                                  const std::string& name) {
    KVQ_REQUIRE(data != nullptr || size == 0, kInvalidArgument, name, ": null buffer");
    static const uint8_t empty = 0;
    return std::make_unique<detail::MemorySource>(data ? data : &empty, size);
  }

  std::unique_ptr<detail::Source> src_;
  ArchiveInfo info_;
};

/// A memory-mapped archive (POSIX mmap, read-only; elsewhere the file is read into memory):
/// the constructor verifies every byte as ArchiveReader::verify() does, then page tables,
/// segments and f32 rows point into the mapping, valid while the object lives. Do not let
/// another process truncate the file meanwhile (the mapping would fault).
class MappedArchive {
 public:
  explicit MappedArchive(const std::filesystem::path& path, const ArchiveReadOptions& opt = {}) {
    const std::string name = path.string();
    {
      detail::FileSource probe(path);  // existence, regular file, size
      size_ = static_cast<std::size_t>(probe.size());
    }
    KVQ_REQUIRE(size_ >= 8, kIo, name, ": truncated: ", size_,
                " bytes, shorter than the 8-byte magic of a kvq archive");
#if KVQ_ARCHIVE_POSIX
    const int fd = ::open(name.c_str(), O_RDONLY | O_CLOEXEC);
    KVQ_REQUIRE(fd >= 0, kIo, name, ": cannot open: ", std::strerror(errno));
    void* m = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    const int err = errno;
    ::close(fd);
    KVQ_REQUIRE(m != MAP_FAILED, kIo, name, ": cannot map: ", std::strerror(err));
    map_ = static_cast<const uint8_t*>(m);
#else
    owned_ = std::unique_ptr<uint8_t[], AlignedFree>(static_cast<uint8_t*>(
        ::operator new(size_, std::align_val_t(kArchiveAlign))));
    detail::FileSource(path).read(0, owned_.get(), size_);
    map_ = owned_.get();
#endif
    try {
      detail::MemorySource src(map_, size_);
      info_ = detail::parse_archive(src, name, opt);
      detail::verify_all(src, info_);
      pages_.resize(static_cast<std::size_t>(info_.n_layers));
      for (int l = 0; l < info_.n_layers; ++l) {
        const ArchiveLayer& A = info_.layers[static_cast<std::size_t>(l)];
        auto& pv = pages_[static_cast<std::size_t>(l)];
        for (const std::size_t ri : A.records)
          if (info_.records[ri].kind == RecordKind::kPage)
            pv.push_back(reinterpret_cast<const std::byte*>(map_ + info_.records[ri].payload_offset()));
      }
    } catch (...) {
      unmap();
      throw;
    }
  }
  ~MappedArchive() { unmap(); }
  MappedArchive(const MappedArchive&) = delete;
  MappedArchive& operator=(const MappedArchive&) = delete;

  const ArchiveInfo& info() const { return info_; }
  /// The mapped bytes (the whole file).
  const uint8_t* data() const { return map_; }
  std::size_t size() const { return size_; }

  /// `layer`'s pages as a page table (pointers into the mapping, 64-byte aligned).
  PageTable page_table(int layer) const {
    const ArchiveLayer& A = at(layer);
    PageTable t;
    t.layout = A.layout;
    t.pages = pages_[static_cast<std::size_t>(layer)].data();
    t.n_pages = A.pages;
    t.first_token = A.sink_tokens;
    t.tokens = A.pages * A.block_tokens;
    return t;
  }
  /// Calls fn(const CacheSegment&) for the sinks, every page and the residual of `layer`, in
  /// token order, as KVCache::for_each_segment does (attend_segments() takes them).
  template <class Fn>
  void for_each_segment(int layer, Fn&& fn) const {
    const ArchiveLayer& A = at(layer);
    const int64_t H = info_.kv_heads, D = info_.head_dim;
    for (const std::size_t ri : A.records) {
      const ArchiveRecord& r = info_.records[ri];
      if (r.kind == RecordKind::kRollback) continue;
      CacheSegment s;
      s.begin = r.begin;
      s.end = r.end;
      const uint8_t* p = map_ + r.payload_offset();
      if (r.kind == RecordKind::kPage) {
        s.kind = CacheSegment::Kind::kPacked;
        s.key_view = A.layout.key_view(reinterpret_cast<const std::byte*>(p));
        s.value_view = A.layout.value_view(reinterpret_cast<const std::byte*>(p));
      } else {
        s.kind = r.kind == RecordKind::kSinks ? CacheSegment::Kind::kSinks : CacheSegment::Kind::kResidual;
        const auto* f = reinterpret_cast<const float*>(p);
        const int64_t n = r.end - r.begin;
        s.key_rows = KVView<const float>::nhd(f, n, H, D);
        s.value_rows = KVView<const float>::nhd(f + n * H * D, n, H, D);
      }
      fn(static_cast<const CacheSegment&>(s));
    }
  }
  /// A KVCache holding a copy of the archive (already verified).
  KVCache load() const {
    detail::MemorySource src(map_, size_);
    return detail::load_cache(src, info_, {}, false);
  }

 private:
  const ArchiveLayer& at(int layer) const {
    KVQ_REQUIRE(layer >= 0 && layer < info_.n_layers, kInvalidArgument, info_.source, ": layer ",
                layer, " does not exist (the archive has ", info_.n_layers, " layers)");
    return info_.layers[static_cast<std::size_t>(layer)];
  }
  void unmap() noexcept {
#if KVQ_ARCHIVE_POSIX
    if (map_) ::munmap(const_cast<uint8_t*>(map_), size_);
#endif
    map_ = nullptr;
  }
#if !KVQ_ARCHIVE_POSIX
  struct AlignedFree {
    void operator()(uint8_t* p) const { ::operator delete(p, std::align_val_t(kArchiveAlign)); }
  };
  std::unique_ptr<uint8_t[], AlignedFree> owned_;
#endif
  const uint8_t* map_ = nullptr;
  std::size_t size_ = 0;
  ArchiveInfo info_;
  std::vector<std::vector<const std::byte*>> pages_;
};

/// Writes `cache` to `path` (atomically: "<path>.part", then a rename).
inline ArchiveSummary save_archive(const KVCache& cache, const std::filesystem::path& path,
                                   const ArchiveOptions& opt = {}) {
  ArchiveWriter w(path, cache, opt);
  return w.finish(cache);
}
/// The archive of `cache` as bytes.
inline std::vector<uint8_t> save_archive_bytes(const KVCache& cache, const ArchiveOptions& opt = {}) {
  std::vector<uint8_t> out;
  ArchiveWriter w(out, cache, opt);
  w.finish(cache);
  return out;
}
/// Loads the whole cache of an archive (every byte verified).
inline KVCache load_archive(const std::filesystem::path& path, const ArchiveReadOptions& opt = {}) {
  return ArchiveReader(path, opt).load();
}
/// Loads an archive into `into` (same policy and shape; unchanged on error).
inline void load_archive(const std::filesystem::path& path, KVCache& into,
                         const ArchiveReadOptions& opt = {}) {
  ArchiveReader(path, opt).load_into(into);
}
inline KVCache load_archive_bytes(const uint8_t* data, std::size_t size,
                                  const std::string& name = "<memory>",
                                  const ArchiveReadOptions& opt = {}) {
  return ArchiveReader(data, size, name, opt).load();
}
/// Verifies every byte of an archive file and returns what it holds.
inline ArchiveInfo verify_archive(const std::filesystem::path& path, const ArchiveReadOptions& opt = {}) {
  ArchiveReader r(path, opt);
  r.verify();
  return r.info();
}

}  // namespace io

using io::load_archive;
using io::save_archive;

}  // namespace kvq

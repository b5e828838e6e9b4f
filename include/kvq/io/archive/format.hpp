#pragma once
/// \file format.hpp
/// The kvq archive format (part of kvq/io/archive.hpp): constants, record sizes (checked
/// below), record kinds and the public descriptions (ArchiveInfo, options).
///
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
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "kvq/cache/kv_cache.hpp"
#include "kvq/cache/state.hpp"
#include "kvq/core/endian.hpp"
#include "kvq/core/error.hpp"
#include "kvq/core/rope.hpp"
#include "kvq/io/crc32c.hpp"
#include "kvq/layout/page_layout.hpp"
#include "kvq/policy/spec.hpp"

// KVQ_ARCHIVE_POSIX: positioned reads (pread) and mmap where the platform has them; 0 selects
// the portable path (std::ifstream under a mutex, files read into memory), which a build may
// also ask for on a POSIX system (the tests do, to run it under ThreadSanitizer).
#if !defined(KVQ_ARCHIVE_POSIX)
#if defined(__unix__) || defined(__APPLE__)
#define KVQ_ARCHIVE_POSIX 1
#else
#define KVQ_ARCHIVE_POSIX 0
#endif
#endif
#if KVQ_ARCHIVE_POSIX
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

namespace kvq {
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

// The fixed records keep 8-byte fields 8-byte aligned inside a 64-byte aligned file.
static_assert(kArchiveAlign % 8 == 0 && kArchiveAlign >= kArchiveRecordHeaderBytes,
              "a record header fits in one alignment unit");
static_assert(kArchiveHeaderFixedBytes % 8 == 0 && kArchiveConfigBytes % 8 == 0 &&
                  kArchiveLayerGeomBytes % 8 == 0 && kArchiveRecordHeaderBytes % 8 == 0 &&
                  kArchiveFooterFixedBytes % 8 == 0 && kArchiveIndexEntryBytes % 8 == 0 &&
                  kArchiveLayerEntryBytes % 8 == 0 && kArchiveTrailerBytes % 8 == 0,
              "archive records are whole 8-byte words");
static_assert(sizeof(kArchiveMagic) == 8 && sizeof(kArchiveRecordMagic) == 4 &&
                  sizeof(kArchiveFooterMagic) == 8 && sizeof(kArchiveTrailerMagic) == 8,
              "magic sizes are part of the format");

}  // namespace io
}  // namespace kvq

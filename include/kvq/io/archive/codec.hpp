#pragma once
/// \file codec.hpp
/// Encoding and decoding of the archive's records (part of kvq/io/archive.hpp): field codes,
/// little-endian fields, config and record headers, the header; byte sources (memory, file).
#include "kvq/io/archive/format.hpp"

namespace kvq {
namespace io {

namespace detail {

using ::kvq::detail::cat;

// Little-endian loads and stores: core/endian.hpp.
using ::kvq::endian::host_little_endian;
using ::kvq::endian::get_u16;
using ::kvq::endian::get_u32;
using ::kvq::endian::get_u64;
using ::kvq::endian::get_i32;
using ::kvq::endian::get_i64;
using ::kvq::endian::get_f32;
using ::kvq::endian::get_f64;
using ::kvq::endian::put_u16;
using ::kvq::endian::put_u32;
using ::kvq::endian::put_u64;
using ::kvq::endian::put_i32;
using ::kvq::endian::put_i64;
using ::kvq::endian::put_f32;
using ::kvq::endian::put_f64;

inline uint64_t align_up(uint64_t n) { return (n + kArchiveAlign - 1) / kArchiveAlign * kArchiveAlign; }
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
    case Format::kNvfp4: return 8;
    case Format::kMxfp4: return 9;
  }
  return 255;
}
inline bool format_from_code(uint8_t c, Format* f) {
  static constexpr Format kF[] = {Format::kF32,   Format::kF16,     Format::kBF16,
                                  Format::kInt,   Format::kE4M3,    Format::kE5M2,
                                  Format::kLloydMax, Format::kNuq,  Format::kNvfp4,
                                  Format::kMxfp4};
  if (c >= 10) return false;
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
  // Flag bit 3 (8): the rotation of an int / fp8 / FP4 config (QuantConfig::rotate); archives
  // written before it have the bit clear (they load unchanged; a reader before it refuses the
  // bit as an unknown flag). Lloyd-Max always rotates and never sets it.
  p[4] = static_cast<uint8_t>((c.symmetric ? 1 : 0) | (c.qjl ? 2 : 0) | (c.nuq_ready ? 4 : 0) |
                              (c.rotate && rotation_format(c.format) ? 8 : 0));
  put_i32(p + 8, c.bits);
  put_i32(p + 12, layer);
  put_i32(p + 16, c.outliers);
  put_f32(p + 20, c.outlier_pct);
  put_f32(p + 24, c.fp8_margin);
  // Bytes 28..31: NVFP4's tensor scale; zero (reserved, as in archives before FP4) otherwise.
  if (c.format == Format::kNvfp4) put_f32(p + 28, c.fp4_tensor_scale);
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
    // One stream, one position: readers on several threads take turns (docs/archive.md).
    std::lock_guard<std::mutex> lock(mu_);
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
  mutable std::mutex mu_;
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

/// A policy reduced to what its spec string expresses (seeds, fp8 margins, NVFP4 tensor scales and codebooks reset).
inline Policy spec_part(Policy p) {
  auto strip = [](QuantConfig& c) {
    const QuantConfig d;
    c.seed = d.seed;
    c.fp8_margin = d.fp8_margin;
    c.fp4_tensor_scale = d.fp4_tensor_scale;  // calibration, not grammar (config bytes 28..31)
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
  KVQ_REQUIRE(p[4] <= 15, kIo, at(), ": unknown flag bits ", int{p[4]});
  c.symmetric = (p[4] & 1) != 0;
  c.qjl = (p[4] & 2) != 0;
  c.nuq_ready = (p[4] & 4) != 0;
  c.rotate = (p[4] & 8) != 0;
  KVQ_REQUIRE(!c.rotate || rotation_format(c.format), kIo, at(), ": rotation flag set on format ",
              to_string(c.format), " (only int, fp8 and FP4 configs rotate by flag)");
  KVQ_REQUIRE(all_zero(p + 5, 3) && (c.format == Format::kNvfp4 || all_zero(p + 28, 4)) &&
                  all_zero(p + 112, 16),
              kIo, at(), ": nonzero reserved bytes");
  if (c.format == Format::kNvfp4) {
    c.fp4_tensor_scale = get_f32(p + 28);
    KVQ_REQUIRE(std::isfinite(c.fp4_tensor_scale) && c.fp4_tensor_scale > 0.f, kIo, at(),
                ": nvfp4 tensor scale ", c.fp4_tensor_scale, " is not a positive finite number");
  }
  c.bits = get_i32(p + 8);
  c.outliers = get_i32(p + 16);
  c.outlier_pct = get_f32(p + 20);
  c.fp8_margin = get_f32(p + 24);
  c.group = get_i64(p + 32);
  c.seed = get_u64(p + 40);
  for (int i = 0; i < kNuqMaxLevels; ++i)
    c.nuq_levels[static_cast<std::size_t>(i)] = get_f32(p + 48 + 4 * i);
  KVQ_REQUIRE(!c.rotate || (c.outliers == 0 && c.outlier_pct == 0.f), kIo, at(),
              ": rotation flag set on a config with dense-and-sparse outliers");
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

}  // namespace detail

}  // namespace io
}  // namespace kvq

#pragma once
/// \file mapped.hpp
/// A memory-mapped archive (part of kvq/io/archive.hpp): MappedArchive.
#include "kvq/io/archive/reader.hpp"

namespace kvq {
namespace io {

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

}  // namespace io
}  // namespace kvq

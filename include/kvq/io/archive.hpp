#pragma once
/// \file archive.hpp
/// kvq archives: a KVCache saved to and restored from a file or bytes, with every record
/// checksummed (docs/archive.md). The format and the pieces live in kvq/io/archive/:
/// format.hpp (constants, record sizes, public descriptions), codec.hpp (record encoding),
/// reader.hpp (ArchiveReader), writer.hpp (ArchiveWriter), mapped.hpp (MappedArchive). This
/// header includes them all and adds the one-call functions (save_archive, load_archive, ...).
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <vector>

#include "kvq/io/archive/mapped.hpp"
#include "kvq/io/archive/writer.hpp"

namespace kvq {
namespace io {

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

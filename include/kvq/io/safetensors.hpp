#pragma once
/// \file safetensors.hpp
/// Reader and writer for the .safetensors format: an 8-byte little-endian header length N,
/// N bytes of JSON, then one byte buffer. The JSON maps tensor names to
/// {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]} (offsets relative to the
/// buffer) plus an optional "__metadata__" object of string -> string.
///
/// Validation follows the reference implementation (huggingface/safetensors) and is stricter
/// where that costs nothing:
///   - N <= 100 MB (the reference limit) and within the file; the header starts with '{';
///   - every data_offsets pair satisfies begin <= end <= buffer size and end - begin equals
///     numel(shape) * itemsize (all arithmetic checked for overflow);
///   - sorted by offset, the tensors tile the buffer exactly: no overlap, no gap, no trailing
///     bytes (the reference reader rejects the same files);
///   - duplicate names, unknown fields in an entry, non-string metadata values, shape entries
///     that are negative, fractional or beyond int64, and invalid JSON/UTF-8 are rejected.
/// Any byte-sized dtype of the format (BOOL, U8, I8, F8_*, I16, U16, F16, BF16, I32, U32, F32,
/// F64, I64, U64) passes structural validation; only F32, F16 and BF16 tensors can be
/// returned, and asking for another throws an error naming the tensor and its dtype.
///
/// Errors throw kvq::Error(kIo) whose message names the file, the tensor, the field and the
/// offending value.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvq/core/error.hpp"
#include "kvq/core/tensor.hpp"
#include "kvq/io/array.hpp"
#include "kvq/io/json.hpp"

namespace kvq::io {

/// Largest header accepted (the reference implementation's limit).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

/// Most JSON values in one header entry. A tensor entry needs about 10 (+ rank); the cap keeps
/// one hostile entry (a shape of a million entries) from allocating a huge tree.
inline constexpr size_t kMaxSafetensorsEntryValues = size_t{1} << 16;

/// One tensor as described by the header.
struct SafetensorsEntry {
  std::string name;
  std::string dtype;           ///< as spelled in the file ("F32", "BF16", "I64", ...)
  std::vector<int64_t> shape;  ///< row-major extents ([] = scalar)
  int64_t begin = 0;           ///< byte range [begin, end) relative to the data buffer
  int64_t end = 0;
};

/// A validated header.
struct SafetensorsHeader {
  std::vector<SafetensorsEntry> tensors;        ///< in header order
  std::map<std::string, std::string> metadata;  ///< "__metadata__" (empty when absent)
  uint64_t data_start = 0;                      ///< file offset of the data buffer (8 + N)
  uint64_t data_size = 0;                       ///< bytes in the data buffer

  /// The entry named `name`, or nullptr.
  const SafetensorsEntry* find(const std::string& name) const {
    for (const auto& t : tensors) {
      if (t.name == name) return &t;
    }
    return nullptr;
  }
};

/// All tensors and the metadata of one file.
struct SafetensorsFile {
  std::map<std::string, Array> tensors;
  std::map<std::string, std::string> metadata;
};

namespace detail {

/// Bytes per element of a safetensors dtype, or 0 for a dtype this reader does not know
/// (including the sub-byte F4/F6 types, whose sizes are not whole bytes).
inline int safetensors_itemsize(const std::string& d) {
  if (d == "BOOL" || d == "U8" || d == "I8" || d == "F8_E5M2" || d == "F8_E4M3" || d == "F8_E8M0") {
    return 1;
  }
  if (d == "I16" || d == "U16" || d == "F16" || d == "BF16") return 2;
  if (d == "I32" || d == "U32" || d == "F32") return 4;
  if (d == "I64" || d == "U64" || d == "F64" || d == "C64") return 8;
  return 0;
}

inline const char* safetensors_dtype_name(DType d) {
  return d == DType::kF32 ? "F32" : d == DType::kF16 ? "F16" : "BF16";
}

/// A byte source over memory with the same interface as FileReader.
class MemReader {
 public:
  MemReader(const uint8_t* p, size_t n, std::string name) : p_(p), n_(n), name_(std::move(name)) {}
  uint64_t size() const { return n_; }
  void read(uint64_t offset, size_t n, uint8_t* dst) const {
    KVQ_REQUIRE(offset <= n_ && n <= n_ - offset, kIo, name_, ": read of ", n, " bytes at offset ",
                offset, " runs past the end (", n_, " bytes)");
    if (n) std::memcpy(dst, p_ + offset, n);
  }

 private:
  const uint8_t* p_;
  size_t n_;
  std::string name_;
};

/// A non-negative int64 from a JSON number, or an error naming the tensor, field and value.
inline int64_t st_index(const Json& v, const std::string& where, const char* field, size_t i) {
  const std::string what = v.is_number() ? v.number_text() : std::string(v.described_type());
  const auto x = v.as_int64();
  KVQ_REQUIRE(x.has_value(), kIo, where, ": field '", field, "' entry ", i, " is ", what,
              ", not an integer that fits in int64");
  KVQ_REQUIRE(*x >= 0, kIo, where, ": field '", field, "' entry ", i, " is ", *x, ", must be >= 0");
  return *x;
}

/// Validates one tensor entry's JSON and returns it.
inline SafetensorsEntry st_entry(const std::string& name, const Json& v, uint64_t data_size,
                                 const std::string& source) {
  const std::string where = source + ": tensor " + printable(name);
  KVQ_REQUIRE(v.is_object(), kIo, where, ": entry is ", v.described_type(), ", not an object");
  const Json* dtype = nullptr;
  const Json* shape = nullptr;
  const Json* offsets = nullptr;
  for (size_t i = 0; i < v.keys().size(); ++i) {
    const std::string& k = v.keys()[i];
    if (k == "dtype") {
      dtype = &v.items()[i];
    } else if (k == "shape") {
      shape = &v.items()[i];
    } else if (k == "data_offsets") {
      offsets = &v.items()[i];
    } else {
      fail(ErrorKind::kIo, where, ": unknown field ", printable(k),
           " (expected 'dtype', 'shape', 'data_offsets')");
    }
  }
  KVQ_REQUIRE(dtype, kIo, where, ": missing field 'dtype'");
  KVQ_REQUIRE(shape, kIo, where, ": missing field 'shape'");
  KVQ_REQUIRE(offsets, kIo, where, ": missing field 'data_offsets'");

  SafetensorsEntry e;
  e.name = name;
  KVQ_REQUIRE(dtype->is_string(), kIo, where, ": field 'dtype' is ", dtype->described_type(),
              ", not a string");
  e.dtype = dtype->as_string();
  const int itemsize = safetensors_itemsize(e.dtype);
  KVQ_REQUIRE(itemsize > 0, kIo, where, ": unknown dtype ", printable(e.dtype));

  KVQ_REQUIRE(shape->is_array(), kIo, where, ": field 'shape' is ", shape->described_type(),
              ", not an array");
  KVQ_REQUIRE(shape->size() <= static_cast<size_t>(kMaxRank), kIo, where, ": field 'shape' has ",
              shape->size(), " entries, more than the limit of ", kMaxRank);
  for (size_t i = 0; i < shape->size(); ++i) {
    e.shape.push_back(st_index(shape->items()[i], where, "shape", i));
  }

  KVQ_REQUIRE(offsets->is_array() && offsets->size() == 2, kIo, where,
              ": field 'data_offsets' must be an array [begin, end], got ",
              offsets->is_array() ? cat("an array of ", offsets->size())
                                  : std::string(offsets->described_type()));
  e.begin = st_index(offsets->items()[0], where, "data_offsets", 0);
  e.end = st_index(offsets->items()[1], where, "data_offsets", 1);
  const std::string range = cat("[", e.begin, ", ", e.end, "]");
  KVQ_REQUIRE(e.begin <= e.end, kIo, where, ": data_offsets ", range, " have end < begin");
  KVQ_REQUIRE(static_cast<uint64_t>(e.end) <= data_size, kIo, where, ": data_offsets ", range,
              " exceed the data buffer of ", data_size, " bytes");
  const int64_t numel = checked_numel(e.shape, where + ": field 'shape'");
  const size_t nbytes = checked_nbytes(numel, itemsize, where + ": shape " + shape_str(e.shape));
  KVQ_REQUIRE(static_cast<uint64_t>(e.end - e.begin) == nbytes, kIo, where, ": data_offsets ",
              range, " span ", e.end - e.begin, " bytes but shape ", shape_str(e.shape), " of ",
              e.dtype, " needs ", nbytes);
  return e;
}

/// Reads and validates the length prefix and header of a file or buffer of `total` bytes.
template <class Reader>
SafetensorsHeader st_read_header(Reader& r, const std::string& source) {
  const uint64_t total = r.size();
  KVQ_REQUIRE(total >= 8, kIo, source, ": ", total,
              " bytes is too short for a .safetensors file (the header length alone is 8)");
  uint8_t len8[8];
  r.read(0, 8, len8);
  const uint64_t n = load_u64le(len8);
  KVQ_REQUIRE(n <= kMaxSafetensorsHeaderBytes, kIo, source, ": header length ", n,
              " exceeds the limit of ", kMaxSafetensorsHeaderBytes, " bytes");
  KVQ_REQUIRE(n <= total - 8, kIo, source, ": header length ", n,
              " runs past the end of the file (", total - 8, " bytes follow the length)");
  KVQ_REQUIRE(n > 0, kIo, source, ": header length is 0 (the header must be a JSON object)");
  std::string text(static_cast<size_t>(n), '\0');
  r.read(8, text.size(), reinterpret_cast<uint8_t*>(text.data()));
  KVQ_REQUIRE(text[0] == '{', kIo, source, ": header does not start with '{' (first byte 0x",
              hex_bytes(reinterpret_cast<const uint8_t*>(text.data()), 1), ")");

  SafetensorsHeader h;
  h.data_start = 8 + n;
  h.data_size = total - h.data_start;
  JsonLimits limits;
  limits.max_values = kMaxSafetensorsEntryValues;
  // The top-level object is walked entry by entry so each entry is parsed, checked and
  // dropped; only the compact SafetensorsEntry list is kept.
  JsonParser p(text, source + ": header", ErrorKind::kIo, limits);
  bool saw_metadata = false;
  p.expect('{', "at the start of the header");
  if (!p.consume('}')) {
    while (true) {
      std::string name = p.parse_string();
      p.expect(':', "after a tensor name");
      const Json v = p.parse_value();
      if (name == "__metadata__") {
        KVQ_REQUIRE(!saw_metadata, kIo, source, ": duplicate '__metadata__'");
        saw_metadata = true;
        KVQ_REQUIRE(v.is_object(), kIo, source, ": '__metadata__' is ", v.described_type(),
                    ", not an object of strings");
        for (size_t i = 0; i < v.keys().size(); ++i) {
          const Json& mv = v.items()[i];
          KVQ_REQUIRE(mv.is_string(), kIo, source, ": '__metadata__' value of ",
                      printable(v.keys()[i]), " is ", mv.described_type(), ", not a string");
          h.metadata[v.keys()[i]] = mv.as_string();
        }
      } else {
        h.tensors.push_back(st_entry(name, v, h.data_size, source));
      }
      if (p.consume(',')) continue;
      p.expect('}', "after a header entry");
      break;
    }
  }
  if (!p.at_end()) p.fail("unexpected content after the header object");

  // Duplicate names, then exact tiling of the buffer, both on sorted index lists.
  std::vector<size_t> idx(h.tensors.size());
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  std::sort(idx.begin(), idx.end(),
            [&](size_t a, size_t b) { return h.tensors[a].name < h.tensors[b].name; });
  for (size_t i = 1; i < idx.size(); ++i) {
    KVQ_REQUIRE(h.tensors[idx[i]].name != h.tensors[idx[i - 1]].name, kIo, source,
                ": duplicate tensor name ", printable(h.tensors[idx[i]].name));
  }
  std::sort(idx.begin(), idx.end(), [&](size_t a, size_t b) {
    const auto& x = h.tensors[a];
    const auto& y = h.tensors[b];
    return x.begin != y.begin ? x.begin < y.begin : x.end < y.end;
  });
  int64_t pos = 0;
  const SafetensorsEntry* prev = nullptr;
  for (size_t i : idx) {
    const SafetensorsEntry& t = h.tensors[i];
    const std::string where = source + ": tensor " + printable(t.name);
    if (t.begin < pos) {
      fail(ErrorKind::kIo, where, ": data_offsets [", t.begin, ", ", t.end, "] overlap tensor ",
           printable(prev->name), " at [", prev->begin, ", ", prev->end, "]");
    }
    KVQ_REQUIRE(t.begin == pos, kIo, where, ": data_offsets [", t.begin, ", ", t.end,
                "] leave a gap of ", t.begin - pos, " unused bytes at buffer offset ", pos);
    pos = t.end;
    prev = &t;
  }
  KVQ_REQUIRE(static_cast<uint64_t>(pos) == h.data_size, kIo, source, ": the data buffer has ",
              h.data_size, " bytes but the tensors cover only ", pos);
  return h;
}

/// Reads one validated entry's bytes as an Array; throws unless its dtype is F32/F16/BF16.
template <class Reader>
Array st_read_tensor(Reader& r, const SafetensorsHeader& h, const SafetensorsEntry& e,
                     const std::string& source) {
  Array a;
  if (e.dtype == "F32") {
    a.dtype = DType::kF32;
  } else if (e.dtype == "F16") {
    a.dtype = DType::kF16;
  } else if (e.dtype == "BF16") {
    a.dtype = DType::kBF16;
  } else {
    fail(ErrorKind::kIo, source, ": tensor ", printable(e.name), " has dtype ", printable(e.dtype),
         "; kvq reads only F32, F16 and BF16 tensors");
  }
  a.shape = e.shape;
  a.bytes =
      alloc_bytes(static_cast<size_t>(e.end - e.begin), source + ": tensor " + printable(e.name));
  r.read(h.data_start + static_cast<uint64_t>(e.begin), a.bytes.size(), a.bytes.data());
  return a;
}

template <class Reader>
SafetensorsFile st_read_all(Reader& r, const std::string& source) {
  const SafetensorsHeader h = st_read_header(r, source);
  SafetensorsFile f;
  f.metadata = h.metadata;
  for (const auto& e : h.tensors) f.tensors.emplace(e.name, st_read_tensor(r, h, e, source));
  return f;
}

/// Named tensors in file order (map order: sorted by name), held by pointer so that callers
/// with tensors elsewhere (a KV dump) need not copy them into a map first.
using NamedArrays = std::vector<std::pair<std::string, const Array*>>;

inline NamedArrays st_named(const std::map<std::string, Array>& tensors) {
  NamedArrays v;
  v.reserve(tensors.size());
  for (const auto& kv : tensors) v.emplace_back(kv.first, &kv.second);
  return v;
}

/// The JSON header (padded with spaces to a multiple of 8 bytes, as the reference writer
/// does, so that the buffer starts 8-byte aligned) for `tensors` laid out in the given order.
inline std::string st_header(const NamedArrays& tensors,
                             const std::map<std::string, std::string>& metadata) {
  std::string j = "{";
  bool first = true;
  if (!metadata.empty()) {
    j += "\"__metadata__\":{";
    for (const auto& [k, v] : metadata) {
      if (!first) j += ',';
      first = false;
      j += json_quote(k) + ":" + json_quote(v);
    }
    j += "}";
    first = false;
  }
  std::vector<const std::string*> names;
  int64_t off = 0;
  for (const auto& [name, a] : tensors) {
    KVQ_REQUIRE(name != "__metadata__", kInvalidArgument,
                "write_safetensors: '__metadata__' is reserved and cannot name a tensor");
    a->validate(cat("write_safetensors: tensor ", printable(name)));
    names.push_back(&name);
    if (!first) j += ',';
    first = false;
    j += json_quote(name) + ":{\"dtype\":\"" + safetensors_dtype_name(a->dtype) + "\",\"shape\":[";
    for (size_t i = 0; i < a->shape.size(); ++i) {
      if (i) j += ',';
      j += std::to_string(a->shape[i]);
    }
    const int64_t end = off + static_cast<int64_t>(a->bytes.size());
    j += cat("],\"data_offsets\":[", off, ",", end, "]}");
    off = end;
  }
  std::sort(names.begin(), names.end(),
            [](const std::string* a, const std::string* b) { return *a < *b; });
  for (size_t i = 1; i < names.size(); ++i) {
    KVQ_REQUIRE(*names[i] != *names[i - 1], kInvalidArgument,
                "write_safetensors: duplicate tensor name ", printable(*names[i]));
  }
  j += "}";
  while (j.size() % 8 != 0) j += ' ';
  KVQ_REQUIRE(j.size() <= kMaxSafetensorsHeaderBytes, kInvalidArgument,
              "write_safetensors: header of ", j.size(), " bytes exceeds the format's limit of ",
              kMaxSafetensorsHeaderBytes);
  return j;
}

/// Writes a .safetensors file, streaming each tensor's bytes rather than assembling the file.
inline void st_write(const std::filesystem::path& path, const NamedArrays& tensors,
                     const std::map<std::string, std::string>& metadata) {
  const std::string header = st_header(tensors, metadata);
  FileWriter w(path);
  uint8_t len8[8];
  store_u64le(len8, header.size());
  w.write(len8, 8);
  w.write(reinterpret_cast<const uint8_t*>(header.data()), header.size());
  for (const auto& kv : tensors) w.write(kv.second->bytes.data(), kv.second->bytes.size());
  w.close();
}

}  // namespace detail

/// Reads and validates only the header of a .safetensors file.
inline SafetensorsHeader read_safetensors_header(const std::filesystem::path& path) {
  detail::FileReader r(path);
  return detail::st_read_header(r, path.string());
}

/// Reads every tensor and the metadata of a .safetensors file.
inline SafetensorsFile read_safetensors(const std::filesystem::path& path) {
  detail::FileReader r(path);
  return detail::st_read_all(r, path.string());
}

/// Same as read_safetensors, from a complete file image in memory.
inline SafetensorsFile read_safetensors_bytes(const uint8_t* data, size_t size,
                                              const std::string& source = "<memory>") {
  KVQ_REQUIRE(data != nullptr || size == 0, kInvalidArgument, source, ": null buffer");
  detail::MemReader r(data, size, source);
  return detail::st_read_all(r, source);
}

/// Reads one tensor by name (the whole header is still validated; only that tensor's bytes
/// are read). Throws kIo when the name is absent.
inline Array read_safetensors_tensor(const std::filesystem::path& path, const std::string& name) {
  detail::FileReader r(path);
  const SafetensorsHeader h = detail::st_read_header(r, path.string());
  const SafetensorsEntry* e = h.find(name);
  KVQ_REQUIRE(e != nullptr, kIo, path.string(), ": no tensor named ", detail::printable(name),
              " (the file has ", h.tensors.size(), " tensors)");
  return detail::st_read_tensor(r, h, *e, path.string());
}

/// The .safetensors encoding of `tensors` (laid out in name order) with optional metadata.
/// Throws kInvalidArgument for a payload that does not match its shape, a name that is not
/// UTF-8, or a tensor called "__metadata__".
inline std::vector<uint8_t> encode_safetensors(
    const std::map<std::string, Array>& tensors,
    const std::map<std::string, std::string>& metadata = {}) {
  const std::string header = detail::st_header(detail::st_named(tensors), metadata);
  size_t total = 8 + header.size();
  for (const auto& kv : tensors) total += kv.second.bytes.size();
  std::vector<uint8_t> out(8);
  out.reserve(total);
  detail::store_u64le(out.data(), header.size());
  out.insert(out.end(), header.begin(), header.end());
  for (const auto& kv : tensors) {
    out.insert(out.end(), kv.second.bytes.begin(), kv.second.bytes.end());
  }
  return out;
}

/// Writes `tensors` (in name order) and `metadata` as a .safetensors file.
inline void write_safetensors(const std::filesystem::path& path,
                              const std::map<std::string, Array>& tensors,
                              const std::map<std::string, std::string>& metadata = {}) {
  detail::st_write(path, detail::st_named(tensors), metadata);
}

}  // namespace kvq::io

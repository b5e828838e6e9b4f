#pragma once
/// \file array.hpp
/// The owning n-d array that kvq's file readers return and its writers take, plus the
/// internals every reader shares: checked size arithmetic, little-endian loads, bounded file
/// reads, and quoting of hostile strings for error messages.
///
/// Readers treat every byte of a file as hostile. All size arithmetic on values that come from
/// a file goes through the checked helpers here, so a shape such as (2^40, 2^40) is reported
/// as an overflow instead of wrapping into a small, "valid" size.
#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "kvq/core/endian.hpp"
#include "kvq/core/error.hpp"
#include "kvq/core/half.hpp"
#include "kvq/core/tensor.hpp"

#if defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__) && \
    __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvq::io stores tensor bytes in host order and assumes a little-endian host"
#endif

namespace kvq::io {

/// Largest rank accepted from a file. numpy 2 allows 64 dimensions; a KV tensor has 3, so
/// anything beyond 64 is treated as hostile rather than allocated.
inline constexpr int kMaxRank = 64;

namespace detail {

// kvq::io::detail shadows kvq::detail for unqualified and `detail::` lookups made in here.
using ::kvq::detail::cat;

/// a * b for non-negative values; false (and *out untouched) when the result exceeds int64.
inline bool checked_mul(int64_t a, int64_t b, int64_t* out) {
  if (a < 0 || b < 0) return false;
  if (a != 0 && b > std::numeric_limits<int64_t>::max() / a) return false;
  *out = a * b;
  return true;
}

/// a + b for non-negative values; false when the result exceeds int64.
inline bool checked_add(int64_t a, int64_t b, int64_t* out) {
  if (a < 0 || b < 0) return false;
  if (b > std::numeric_limits<int64_t>::max() - a) return false;
  *out = a + b;
  return true;
}

/// "[3, 4]" (or "[]" for a scalar).
inline std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

/// A string from a file made safe to print: quoted, non-printable bytes as \xNN, and cut
/// after max_len bytes, so a hostile name cannot flood or garble an error message.
inline std::string printable(std::string_view s, size_t max_len = 80) {
  static const char kHex[] = "0123456789abcdef";
  std::string out = "'";
  const size_t n = std::min(s.size(), max_len);
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '\\' || c == '\'') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  out += '\'';
  if (s.size() > max_len) out += detail::cat("... (", s.size(), " bytes)");
  return out;
}

/// Hex dump of up to n bytes ("93 4e 55 ..."), for reporting wrong magic numbers.
inline std::string hex_bytes(const uint8_t* p, size_t n) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    if (i) out += ' ';
    out += kHex[p[i] >> 4];
    out += kHex[p[i] & 15];
  }
  return out;
}

// Little-endian loads and stores: the names the readers use, one implementation
// (core/endian.hpp).
inline uint16_t load_u16le(const uint8_t* p) { return endian::get_u16(p); }
inline uint32_t load_u32le(const uint8_t* p) { return endian::get_u32(p); }
inline uint64_t load_u64le(const uint8_t* p) { return endian::get_u64(p); }
inline void store_u16le(uint8_t* p, uint16_t v) { endian::put_u16(p, v); }
inline void store_u32le(uint8_t* p, uint32_t v) { endian::put_u32(p, v); }
inline void store_u64le(uint8_t* p, uint64_t v) { endian::put_u64(p, v); }

/// True when s is well-formed UTF-8: shortest encodings only, no UTF-16 surrogates, nothing
/// above U+10FFFF. Sets *bad to the offset of the first bad byte otherwise.
inline bool valid_utf8(std::string_view s, size_t* bad = nullptr) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned c = p[i];
    size_t len = 0;
    uint32_t cp = 0;
    uint32_t min = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xe0) == 0xc0) {
      len = 2, cp = c & 0x1f, min = 0x80;
    } else if ((c & 0xf0) == 0xe0) {
      len = 3, cp = c & 0x0f, min = 0x800;
    } else if ((c & 0xf8) == 0xf0) {
      len = 4, cp = c & 0x07, min = 0x10000;
    } else {
      if (bad) *bad = i;
      return false;
    }
    if (n - i < len) {
      if (bad) *bad = i;
      return false;
    }
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xc0) != 0x80) {
        if (bad) *bad = i;
        return false;
      }
      cp = (cp << 6) | (p[i + k] & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
      if (bad) *bad = i;
      return false;
    }
    i += len;
  }
  return true;
}

/// Element count of a shape read from a file, with every failure reported against `what`
/// (e.g. "model.npy: shape"). Beyond numel itself, the product of the non-zero extents must
/// fit in int64 too: a shape like (0, 2^62, 2^62) holds no data but would overflow the stride
/// arithmetic of any consumer, so it is rejected as hostile.
inline int64_t checked_numel(const std::vector<int64_t>& shape, const std::string& what) {
  KVQ_REQUIRE(shape.size() <= static_cast<size_t>(kMaxRank), kIo, what, " has rank ", shape.size(),
              ", more than the limit of ", kMaxRank);
  int64_t nonzero = 1;
  bool any_zero = false;
  for (size_t i = 0; i < shape.size(); ++i) {
    KVQ_REQUIRE(shape[i] >= 0, kIo, what, " ", shape_str(shape), ": entry ", i, " is ", shape[i],
                ", must be >= 0");
    if (shape[i] == 0) {
      any_zero = true;
      continue;
    }
    KVQ_REQUIRE(checked_mul(nonzero, shape[i], &nonzero), kIo, what, " ", shape_str(shape),
                ": element count overflows int64");
  }
  return any_zero ? 0 : nonzero;
}

/// numel * itemsize as a size that fits in both int64 and size_t, or an error naming `what`.
inline size_t checked_nbytes(int64_t numel, int itemsize, const std::string& what) {
  int64_t n = 0;
  KVQ_REQUIRE(checked_mul(numel, itemsize, &n), kIo, what, ": ", numel, " elements of ", itemsize,
              " bytes overflow int64");
  KVQ_REQUIRE(static_cast<uint64_t>(n) <= std::numeric_limits<size_t>::max(), kIo, what, ": ", n,
              " bytes do not fit in size_t");
  return static_cast<size_t>(n);
}

/// A byte buffer of n bytes; allocation failure becomes kvq::Error(kIo) naming `what`, so that
/// a (validated but) huge tensor never escapes as std::bad_alloc.
inline std::vector<uint8_t> alloc_bytes(size_t n, const std::string& what) {
  try {
    return std::vector<uint8_t>(n);
  } catch (const std::bad_alloc&) {
  } catch (const std::length_error&) {
  }
  ::kvq::fail(ErrorKind::kIo, what, ": cannot allocate ", n, " bytes");
}

/// A file opened for bounded, random-access reads. Every read is checked against the size
/// measured at open, and a short read (file truncated meanwhile) is an error, never garbage.
class FileReader {
 public:
  explicit FileReader(const std::filesystem::path& path) : path_(path) {
    std::error_code ec;
    const auto st = std::filesystem::status(path, ec);
    KVQ_REQUIRE(std::filesystem::exists(st), kIo, "cannot open '", path.string(),
                "': no such file");
    KVQ_REQUIRE(!ec, kIo, "cannot open '", path.string(), "': ", ec.message());
    KVQ_REQUIRE(!std::filesystem::is_directory(st), kIo, "cannot read '", path.string(),
                "': it is a directory");
    in_.open(path, std::ios::binary);
    KVQ_REQUIRE(in_.is_open(), kIo, "cannot open '", path.string(), "': ", std::strerror(errno));
    in_.seekg(0, std::ios::end);
    const std::streamoff end = in_.tellg();
    KVQ_REQUIRE(in_ && end >= 0, kIo, "cannot determine the size of '", path.string(), "'");
    size_ = static_cast<uint64_t>(end);
    in_.seekg(0, std::ios::beg);
  }

  uint64_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

  /// Reads bytes [offset, offset + n) into dst; the range must lie inside the file.
  void read(uint64_t offset, size_t n, uint8_t* dst) {
    KVQ_REQUIRE(offset <= size_ && n <= size_ - offset, kIo, "'", path_.string(), "': read of ", n,
                " bytes at offset ", offset, " runs past the end (", size_, " bytes)");
    if (n == 0) return;
    in_.clear();
    in_.seekg(static_cast<std::streamoff>(offset), std::ios::beg);
    size_t done = 0;
    // Chunked so that the streamsize conversion never overflows on huge reads.
    constexpr size_t kChunk = size_t{1} << 30;
    while (done < n && in_) {
      const size_t want = std::min(kChunk, n - done);
      in_.read(reinterpret_cast<char*>(dst + done), static_cast<std::streamsize>(want));
      done += static_cast<size_t>(in_.gcount());
    }
    KVQ_REQUIRE(done == n, kIo, "'", path_.string(), "': short read at offset ", offset + done,
                " (file shrank while reading?)");
  }

  /// The first min(size(), n) bytes.
  std::vector<uint8_t> read_prefix(size_t n) {
    std::vector<uint8_t> buf(static_cast<size_t>(std::min<uint64_t>(size_, n)));
    read(0, buf.size(), buf.data());
    return buf;
  }

 private:
  std::filesystem::path path_;
  std::ifstream in_;
  uint64_t size_ = 0;
};

/// A file opened for writing whose every failure (open, write, flush) becomes kvq::Error.
class FileWriter {
 public:
  explicit FileWriter(const std::filesystem::path& path) : path_(path) {
    out_.open(path, std::ios::binary | std::ios::trunc);
    KVQ_REQUIRE(out_.is_open(), kIo, "cannot create '", path.string(), "': ", std::strerror(errno));
  }
  void write(const uint8_t* p, size_t n) {
    constexpr size_t kChunk = size_t{1} << 30;
    for (size_t done = 0; done < n;) {
      const size_t k = std::min(kChunk, n - done);
      out_.write(reinterpret_cast<const char*>(p + done), static_cast<std::streamsize>(k));
      done += k;
    }
    KVQ_REQUIRE(out_.good(), kIo, "write to '", path_.string(), "' failed");
  }
  void close() {
    out_.close();
    KVQ_REQUIRE(!out_.fail(), kIo, "closing '", path_.string(), "' failed (disk full?)");
  }

 private:
  std::filesystem::path path_;
  std::ofstream out_;
};

}  // namespace detail

/// An owning, row-major (C order) n-d array of f32, f16 or bf16 elements.
///
/// The payload is kept as raw little-endian bytes rather than as floats so that f16/bf16 data
/// read from a file can be written back bit for bit, and so that a 2-byte dump costs 2 bytes
/// per element in memory; to_float() converts when a computation needs floats.
struct Array {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  ///< row-major extents; empty = scalar (one element)
  std::vector<uint8_t> bytes;  ///< numel() * dtype_size(dtype) little-endian bytes

  int rank() const { return static_cast<int>(shape.size()); }

  /// Product of the extents (1 for a scalar). Throws kInvalidArgument on a negative extent or
  /// overflow; arrays returned by the readers have passed that check already.
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) {
      KVQ_REQUIRE(d >= 0 && detail::checked_mul(n, d, &n), kInvalidArgument, "array shape ",
                  detail::shape_str(shape), " is negative or overflows");
    }
    return n;
  }

  /// Throws kInvalidArgument unless bytes.size() matches shape and dtype and the rank is at
  /// most kMaxRank. Writers call this, so that a hand-built Array with a wrong-sized payload is
  /// caught before it reaches a file.
  void validate(const std::string& what = "array") const {
    KVQ_REQUIRE(shape.size() <= static_cast<size_t>(kMaxRank), kInvalidArgument, what, ": rank ",
                shape.size(), " exceeds the limit of ", kMaxRank,
                " (readers would reject the file)");
    const int64_t n = numel();
    int64_t nb = 0;
    KVQ_REQUIRE(
        detail::checked_mul(n, dtype_size(dtype), &nb) && static_cast<uint64_t>(nb) == bytes.size(),
        kInvalidArgument, what, ": shape ", detail::shape_str(shape), " of ", to_string(dtype),
        " needs ", n, " x ", dtype_size(dtype), " bytes, payload has ", bytes.size());
  }

  /// The elements converted to float (exact for every dtype kvq stores).
  std::vector<float> to_float() const {
    validate();
    const size_t n = bytes.size() / static_cast<size_t>(dtype_size(dtype));
    std::vector<float> out(n);
    if (n == 0) return out;
    if (dtype == DType::kF32) {
      std::memcpy(out.data(), bytes.data(), n * sizeof(float));
      return out;
    }
    // Copy through a small typed buffer: the bulk SIMD conversions want f16/bf16 pointers,
    // and reinterpreting the byte vector in place would break strict aliasing.
    constexpr size_t kChunk = 1024;
    for (size_t i = 0; i < n; i += kChunk) {
      const size_t m = std::min(kChunk, n - i);
      if (dtype == DType::kF16) {
        f16 tmp[kChunk];
        std::memcpy(tmp, bytes.data() + 2 * i, 2 * m);
        convert(tmp, out.data() + i, m);
      } else {
        bf16 tmp[kChunk];
        std::memcpy(tmp, bytes.data() + 2 * i, 2 * m);
        convert(tmp, out.data() + i, m);
      }
    }
    return out;
  }

  /// [tokens, heads, head_dim] of a rank-3 array (the KV layout); kShapeMismatch otherwise.
  Shape kv_shape() const {
    KVQ_REQUIRE(shape.size() == 3, kShapeMismatch, "expected a rank-3 [tokens, heads, head_dim]",
                " array, got shape ", detail::shape_str(shape));
    return Shape{shape[0], shape[1], shape[2]};
  }

  /// An array holding data[0 .. numel) rounded to store_as (round to nearest even).
  static Array from_float(const float* data, std::vector<int64_t> shape, DType store_as) {
    Array a;
    a.dtype = store_as;
    a.shape = std::move(shape);
    const int64_t n64 = a.numel();
    KVQ_REQUIRE(data != nullptr || n64 == 0, kInvalidArgument, "null data for array of shape ",
                detail::shape_str(a.shape));
    const size_t n = detail::checked_nbytes(n64, 1, "array");
    a.bytes.resize(detail::checked_nbytes(n64, dtype_size(store_as), "array"));
    if (n == 0) return a;
    if (store_as == DType::kF32) {
      std::memcpy(a.bytes.data(), data, n * sizeof(float));
      return a;
    }
    constexpr size_t kChunk = 1024;
    for (size_t i = 0; i < n; i += kChunk) {
      const size_t m = std::min(kChunk, n - i);
      if (store_as == DType::kF16) {
        f16 tmp[kChunk];
        convert(data + i, tmp, m);
        std::memcpy(a.bytes.data() + 2 * i, tmp, 2 * m);
      } else {
        bf16 tmp[kChunk];
        convert(data + i, tmp, m);
        std::memcpy(a.bytes.data() + 2 * i, tmp, 2 * m);
      }
    }
    return a;
  }
  static Array from_float(const std::vector<float>& data, std::vector<int64_t> shape,
                          DType store_as) {
    Array probe;
    probe.shape = shape;
    KVQ_REQUIRE(static_cast<uint64_t>(probe.numel()) == data.size(), kInvalidArgument, "array of ",
                data.size(), " floats does not match shape ", detail::shape_str(shape));
    return from_float(data.data(), std::move(shape), store_as);
  }

  /// Same dtype, shape and bytes (bit-exact equality, so NaN payloads compare too).
  bool operator==(const Array& o) const {
    return dtype == o.dtype && shape == o.shape && bytes == o.bytes;
  }
  bool operator!=(const Array& o) const { return !(*this == o); }
};

}  // namespace kvq::io

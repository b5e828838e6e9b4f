#pragma once
/// \file gguf.hpp
/// Reader for GGUF files (versions 2 and 3), the model format of llama.cpp and its users, and
/// dequantization of its common tensor types to f32.
///
/// Layout (little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata count;
/// the metadata (key string, u32 value type, value); one info per tensor (name string, u32
/// n_dims, n_dims u64 extents with the fastest-varying first, u32 ggml type, u64 offset
/// relative to the data section); then, aligned to general.alignment (default 32), the data
/// section. A string is a u64 byte count and the bytes; an array is a u32 element type, a u64
/// count and the elements. Arrays of arrays are allowed and laid out as gguf-py's writer does:
/// the outer array's element type is 9 and each inner array follows as its own element type,
/// count and elements, with no type code in front of it. Number and bool arrays are kept as the
/// file's bytes (a u8 array costs one byte per element in memory); inner arrays are capped at
/// kGgufMaxNestedArrays per file.
///
/// Why a hand-written, paranoid reader: a model file comes from the internet. Every count, size
/// and offset is checked against the bytes that remain before anything is allocated or read
/// (so a hostile count cannot ask for terabytes), size arithmetic is overflow-checked, and every
/// error is a kvq::Error(kIo) naming the source, the field, its byte offset and the bad value.
/// The parser works on a byte buffer (GgufFile::parse) so a fuzzer can drive it directly;
/// GgufFile::open maps the file read-only (mmap) and falls back to reading it into memory.
///
/// Block layouts of the quantized types follow llama.cpp's ggml definitions (documented per
/// function below); each is tested against blocks built and decoded by hand.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#define KVQ_GGUF_HAVE_MMAP 1
#else
#define KVQ_GGUF_HAVE_MMAP 0
#endif

#include "kvq/core/error.hpp"
#include "kvq/core/half.hpp"
#include "kvq/io/array.hpp"

namespace kvq::io {

/// Metadata value types (the u32 codes of the format).
enum class GgufValueType : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};

inline const char* to_string(GgufValueType t) {
  switch (t) {
    case GgufValueType::kU8: return "uint8";
    case GgufValueType::kI8: return "int8";
    case GgufValueType::kU16: return "uint16";
    case GgufValueType::kI16: return "int16";
    case GgufValueType::kU32: return "uint32";
    case GgufValueType::kI32: return "int32";
    case GgufValueType::kF32: return "float32";
    case GgufValueType::kBool: return "bool";
    case GgufValueType::kString: return "string";
    case GgufValueType::kArray: return "array";
    case GgufValueType::kU64: return "uint64";
    case GgufValueType::kI64: return "int64";
    case GgufValueType::kF64: return "float64";
  }
  return "unknown";
}

/// ggml tensor types (the u32 codes of the format). Only the ones listed in ggml_type_traits()
/// with a non-zero block size can be read; others are refused by name/code.
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kBF16 = 30,
};

/// Values per block and bytes per block of a ggml type; block 0 for a type this reader cannot
/// size (the tensor is then refused at parse time: its byte size is unknown).
struct GgmlTypeTraits {
  const char* name;
  int64_t block;       ///< values per block
  int64_t block_bytes; ///< bytes per block
  bool dequantizable;  ///< dequantize() supports it
};

/// Super-block size of the K-quants.
inline constexpr int64_t kGgmlQK_K = 256;

inline GgmlTypeTraits ggml_type_traits(uint32_t t) {
  switch (t) {
    case 0: return {"F32", 1, 4, true};
    case 1: return {"F16", 1, 2, true};
    case 2: return {"Q4_0", 32, 2 + 16, true};
    case 3: return {"Q4_1", 32, 2 + 2 + 16, true};
    case 6: return {"Q5_0", 32, 2 + 4 + 16, true};
    case 7: return {"Q5_1", 32, 2 + 2 + 4 + 16, true};
    case 8: return {"Q8_0", 32, 2 + 32, true};
    case 9: return {"Q8_1", 32, 4 + 32, false};
    case 10: return {"Q2_K", kGgmlQK_K, 16 + 64 + 2 + 2, false};
    case 11: return {"Q3_K", kGgmlQK_K, 32 + 64 + 12 + 2, false};
    case 12: return {"Q4_K", kGgmlQK_K, 2 + 2 + 12 + 128, true};
    case 13: return {"Q5_K", kGgmlQK_K, 2 + 2 + 12 + 32 + 128, true};
    case 14: return {"Q6_K", kGgmlQK_K, 128 + 64 + 16 + 2, true};
    case 15: return {"Q8_K", kGgmlQK_K, 4 + 256 + 32, false};
    case 24: return {"I8", 1, 1, false};
    case 25: return {"I16", 1, 2, false};
    case 26: return {"I32", 1, 4, false};
    case 27: return {"I64", 1, 8, false};
    case 28: return {"F64", 1, 8, false};
    case 30: return {"BF16", 1, 2, true};
    default: return {"unknown", 0, 0, false};
  }
}

/// One metadata value. Integers (and bools) are kept in `i` (signed types sign-extended, uint64
/// as its bit pattern in `u`), floats in `f`, strings in `s`. An array keeps its element type
/// and either `strings`, nested `items` (arrays of arrays), or, for numbers and bools, the
/// elements' own little-endian bytes in `raw` (a u8 array costs one byte per element, an f32
/// array four; read them with int_at / float_at, or ints() / floats() for a vector).
struct GgufValue {
  GgufValueType type = GgufValueType::kU8;
  int64_t i = 0;
  uint64_t u = 0;
  double f = 0.0;
  std::string s;
  // Arrays:
  GgufValueType elem_type = GgufValueType::kU8;
  uint64_t count = 0;
  std::vector<std::string> strings;  ///< string arrays
  std::vector<uint8_t> raw;          ///< number / bool arrays: count elements as in the file
  std::vector<GgufValue> items;      ///< arrays of arrays

  /// Element k of an integer or bool array (signed types sign-extended, uint64 as its bit
  /// pattern). Precondition: k < count and an integer/bool element type.
  int64_t int_at(std::size_t k) const {
    const uint8_t* p = raw.data();
    switch (elem_type) {
      case GgufValueType::kU8: case GgufValueType::kBool: return p[k];
      case GgufValueType::kI8: return static_cast<int8_t>(p[k]);
      case GgufValueType::kU16: return load<uint16_t>(p, k);
      case GgufValueType::kI16: return load<int16_t>(p, k);
      case GgufValueType::kU32: return load<uint32_t>(p, k);
      case GgufValueType::kI32: return load<int32_t>(p, k);
      case GgufValueType::kU64: return static_cast<int64_t>(load<uint64_t>(p, k));
      case GgufValueType::kI64: return load<int64_t>(p, k);
      default: return 0;
    }
  }
  /// Element k of an f32 or f64 array (as double).
  double float_at(std::size_t k) const {
    return elem_type == GgufValueType::kF64 ? load<double>(raw.data(), k)
                                            : static_cast<double>(load<float>(raw.data(), k));
  }
  /// The integer/bool elements as int64 (a copy: 8 bytes per element).
  std::vector<int64_t> ints() const {
    std::vector<int64_t> out(static_cast<std::size_t>(count));
    for (std::size_t k = 0; k < out.size(); ++k) out[k] = int_at(k);
    return out;
  }
  /// The f32/f64 elements as double (a copy).
  std::vector<double> floats() const {
    std::vector<double> out(static_cast<std::size_t>(count));
    for (std::size_t k = 0; k < out.size(); ++k) out[k] = float_at(k);
    return out;
  }

  bool is_integer() const {
    switch (type) {
      case GgufValueType::kU8: case GgufValueType::kI8: case GgufValueType::kU16:
      case GgufValueType::kI16: case GgufValueType::kU32: case GgufValueType::kI32:
      case GgufValueType::kU64: case GgufValueType::kI64: return true;
      default: return false;
    }
  }
  bool is_float() const { return type == GgufValueType::kF32 || type == GgufValueType::kF64; }

 private:
  template <class T>
  static T load(const uint8_t* p, std::size_t k) {
    T v;
    std::memcpy(&v, p + k * sizeof(T), sizeof(T));
    return v;
  }
};

/// One tensor's info (validated: its bytes lie inside the data section).
struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> ne;  ///< extents, fastest-varying first (ne[0] = row length)
  uint32_t type = 0;        ///< ggml type code
  uint64_t offset = 0;      ///< relative to the data section
  int64_t n_elements = 0;
  uint64_t n_bytes = 0;

  int64_t rows() const { return ne.empty() || ne[0] == 0 ? 0 : n_elements / ne[0]; }
  const char* type_name() const { return ggml_type_traits(type).name; }
};

/// Limits far above any real model; they bound allocations made from header fields before the
/// remaining-bytes checks can (a hostile count times a tiny element size).
inline constexpr uint64_t kGgufMaxTensors = uint64_t{1} << 20;
inline constexpr uint64_t kGgufMaxMetadata = uint64_t{1} << 20;
inline constexpr uint64_t kGgufMaxStringBytes = uint64_t{1} << 30;
inline constexpr int kGgufMaxArrayDepth = 8;
/// Inner arrays (elements of arrays of arrays) in one file, all depths together. Each is a
/// GgufValue in memory (152 bytes on x86-64, plus its elements) for at least 12 file bytes, so
/// this bounds what such arrays can cost (~10 MiB of values); real models have none.
inline constexpr uint64_t kGgufMaxNestedArrays = uint64_t{1} << 16;
inline constexpr uint32_t kGgufMaxDims = 4;  ///< GGML_MAX_DIMS
inline constexpr uint32_t kGgufDefaultAlignment = 32;

namespace detail {

/// Reads little-endian fields from a byte buffer, checking every read against the end.
class GgufCursor {
 public:
  GgufCursor(const uint8_t* p, size_t n, const std::string& src) : p_(p), n_(n), src_(src) {}
  size_t pos() const { return pos_; }
  size_t remaining() const { return n_ - pos_; }
  const std::string& source() const { return src_; }
  const uint8_t* here() const { return p_ + pos_; }
  void skip(size_t bytes) { pos_ += bytes; }  ///< after need(bytes)
  uint64_t nested_arrays = 0;  ///< inner arrays read so far (kGgufMaxNestedArrays)

  void need(uint64_t bytes, const char* what) const {
    KVQ_REQUIRE(bytes <= remaining(), kIo, src_, ": truncated at byte offset ", pos_, ": ", what,
                " needs ", bytes, " bytes, ", remaining(), " remain");
  }
  template <class T>
  T get(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, p_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string str(const char* what) {
    const size_t at = pos_;
    const uint64_t len = get<uint64_t>(what);
    KVQ_REQUIRE(len <= kGgufMaxStringBytes, kIo, src_, ": ", what, " at byte offset ", at,
                " has length ", len, ", above the limit of ", kGgufMaxStringBytes, " bytes");
    need(len, what);
    std::string s(reinterpret_cast<const char*>(p_ + pos_), static_cast<size_t>(len));
    pos_ += static_cast<size_t>(len);
    return s;
  }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
  const std::string& src_;
};

/// Bytes of one scalar of `t`, 0 for string/array (variable) and -1 for an unknown code.
inline int gguf_scalar_bytes(uint32_t t) {
  switch (t) {
    case 0: case 1: case 7: return 1;
    case 2: case 3: return 2;
    case 4: case 5: case 6: return 4;
    case 10: case 11: case 12: return 8;
    case 8: case 9: return 0;
    default: return -1;
  }
}

/// Reads one scalar (not string/array) of type t into v.
inline void gguf_read_scalar(GgufCursor& c, GgufValueType t, GgufValue* v, const char* what) {
  v->type = t;
  switch (t) {
    case GgufValueType::kU8: v->i = c.get<uint8_t>(what); break;
    case GgufValueType::kI8: v->i = c.get<int8_t>(what); break;
    case GgufValueType::kU16: v->i = c.get<uint16_t>(what); break;
    case GgufValueType::kI16: v->i = c.get<int16_t>(what); break;
    case GgufValueType::kU32: v->i = c.get<uint32_t>(what); break;
    case GgufValueType::kI32: v->i = c.get<int32_t>(what); break;
    case GgufValueType::kU64: v->u = c.get<uint64_t>(what); v->i = static_cast<int64_t>(v->u); break;
    case GgufValueType::kI64: v->i = c.get<int64_t>(what); break;
    case GgufValueType::kF32: v->f = c.get<float>(what); break;
    case GgufValueType::kF64: v->f = c.get<double>(what); break;
    case GgufValueType::kBool: {
      const size_t at = c.pos();
      const uint8_t b = c.get<uint8_t>(what);
      KVQ_REQUIRE(b <= 1, kIo, c.source(), ": ", what, " at byte offset ", at,
                  " is a bool with byte value ", int{b}, " (must be 0 or 1)");
      v->i = b;
      break;
    }
    default: break;
  }
  if (t != GgufValueType::kU64) v->u = static_cast<uint64_t>(v->i);
}

inline GgufValue gguf_read_value(GgufCursor& c, uint32_t type, const std::string& key, int depth) {
  const std::string what = "value of " + detail::printable(key);
  const int sb = gguf_scalar_bytes(type);
  KVQ_REQUIRE(sb >= 0, kIo, c.source(), ": metadata ", detail::printable(key), " has unknown value type ",
              type, " (byte offset ", c.pos() - 4, ")");
  GgufValue v;
  const auto t = static_cast<GgufValueType>(type);
  if (t == GgufValueType::kString) {
    v.type = t;
    v.s = c.str(what.c_str());
    return v;
  }
  if (t != GgufValueType::kArray) {
    gguf_read_scalar(c, t, &v, what.c_str());
    return v;
  }
  KVQ_REQUIRE(depth < kGgufMaxArrayDepth, kIo, c.source(), ": metadata ", detail::printable(key),
              ": arrays nested deeper than ", kGgufMaxArrayDepth, " levels");
  v.type = t;
  const size_t at = c.pos();
  const uint32_t et = c.get<uint32_t>("array element type");
  const int eb = gguf_scalar_bytes(et);
  KVQ_REQUIRE(eb >= 0, kIo, c.source(), ": metadata ", detail::printable(key),
              " is an array of unknown element type ", et, " (byte offset ", at, ")");
  v.elem_type = static_cast<GgufValueType>(et);
  const size_t count_at = c.pos();
  const uint64_t n = c.get<uint64_t>("array count");
  // Every element takes at least min_bytes: a count the rest of the file cannot hold is refused
  // before anything is reserved.
  const uint64_t min_bytes = eb > 0 ? static_cast<uint64_t>(eb) : (et == 8 ? 8u : 12u);
  KVQ_REQUIRE(n <= c.remaining() / min_bytes, kIo, c.source(), ": metadata ", detail::printable(key),
              ": array count ", n, " at byte offset ", count_at, " needs at least ", min_bytes,
              " bytes per element, only ", c.remaining(), " bytes remain");
  v.count = n;
  const auto nn = static_cast<size_t>(n);
  if (v.elem_type == GgufValueType::kString) {
    v.strings.reserve(nn);
    for (size_t k = 0; k < nn; ++k) v.strings.push_back(c.str(what.c_str()));
  } else if (v.elem_type == GgufValueType::kArray) {
    // As gguf-py writes them (GGUFWriter._pack_val: the items of an array are packed without
    // their own type tag): the outer array's element type (9) covers every item, and each item
    // is [u32 element type][u64 count][elements], with no type code of its own in front.
    KVQ_REQUIRE(n <= kGgufMaxNestedArrays - c.nested_arrays, kIo, c.source(), ": metadata ",
                detail::printable(key), ": ", n, " inner arrays at byte offset ", count_at,
                " exceed the limit of ", kGgufMaxNestedArrays, " per file (", c.nested_arrays,
                " read before)");
    c.nested_arrays += n;
    v.items.reserve(nn);
    for (size_t k = 0; k < nn; ++k) v.items.push_back(gguf_read_value(c, 9, key, depth + 1));
  } else {
    // Numbers and bools: the file's bytes, copied once (one byte per u8 element).
    const size_t bytes = nn * static_cast<size_t>(eb);
    c.need(bytes, what.c_str());
    v.raw.assign(c.here(), c.here() + bytes);
    if (v.elem_type == GgufValueType::kBool) {
      for (size_t k = 0; k < nn; ++k)
        KVQ_REQUIRE(v.raw[k] <= 1, kIo, c.source(), ": ", what, " element ", k, " at byte offset ",
                    c.pos() + k, " is a bool with byte value ", int{v.raw[k]}, " (must be 0 or 1)");
    }
    c.skip(bytes);
  }
  return v;
}

/// Owner of the file bytes: an mmap'd region or a heap copy.
class GgufStorage {
 public:
  GgufStorage() = default;
  GgufStorage(const GgufStorage&) = delete;
  GgufStorage& operator=(const GgufStorage&) = delete;
  ~GgufStorage() {
#if KVQ_GGUF_HAVE_MMAP
    if (mapped_ && map_ != nullptr) munmap(map_, size_);
#endif
  }
  static std::shared_ptr<GgufStorage> copy_of(const uint8_t* p, size_t n) {
    auto s = std::make_shared<GgufStorage>();
    s->buf_.assign(p, p + n);
    s->data_ = s->buf_.data();
    s->size_ = n;
    return s;
  }
  static std::shared_ptr<GgufStorage> from_file(const std::string& path) {
    auto s = std::make_shared<GgufStorage>();
#if KVQ_GGUF_HAVE_MMAP
    const int fd = ::open(path.c_str(), O_RDONLY);
    KVQ_REQUIRE(fd >= 0, kIo, "cannot open GGUF file '", path, "'");
    struct stat st;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0) {
      void* m = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
      if (m != MAP_FAILED) {
        ::close(fd);
        s->map_ = m;
        s->mapped_ = true;
        s->data_ = static_cast<const uint8_t*>(m);
        s->size_ = static_cast<size_t>(st.st_size);
        return s;
      }
    }
    ::close(fd);
#endif
    // Fallback: read the whole file (no mmap on this platform, or mmap refused).
    std::ifstream in(path, std::ios::binary);
    KVQ_REQUIRE(in.good(), kIo, "cannot open GGUF file '", path, "'");
    in.seekg(0, std::ios::end);
    const std::streamoff sz = in.tellg();
    KVQ_REQUIRE(sz >= 0, kIo, "cannot determine the size of GGUF file '", path, "'");
    in.seekg(0, std::ios::beg);
    s->buf_.resize(static_cast<size_t>(sz));
    in.read(reinterpret_cast<char*>(s->buf_.data()), sz);
    KVQ_REQUIRE(in.gcount() == sz, kIo, "short read of GGUF file '", path, "'");
    s->data_ = s->buf_.data();
    s->size_ = static_cast<size_t>(sz);
    return s;
  }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  bool mapped() const { return mapped_; }

 private:
  std::vector<uint8_t> buf_;
  void* map_ = nullptr;
  bool mapped_ = false;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_bits_to_float(h);
}

}  // namespace detail

// =============================================================================================
// Dequantization (one function per block layout; n values, n a multiple of the block size)
// =============================================================================================

namespace detail {

/// Q4_0, 18 bytes per 32 values: f16 d, 16 bytes of nibbles. Byte j holds value j (low
/// nibble) and value j + 16 (high nibble); x = d * (q - 8).
inline void dequant_q4_0(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, b += 18, y += 32) {
    const float d = f16_at(b);
    const uint8_t* qs = b + 2;
    for (int j = 0; j < 16; ++j) {
      y[j] = d * static_cast<float>((qs[j] & 0x0F) - 8);
      y[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
    }
  }
}

/// Q4_1, 20 bytes per 32 values: f16 d, f16 m, 16 bytes of nibbles (as Q4_0); x = d * q + m.
inline void dequant_q4_1(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, b += 20, y += 32) {
    const float d = f16_at(b);
    const float m = f16_at(b + 2);
    const uint8_t* qs = b + 4;
    for (int j = 0; j < 16; ++j) {
      y[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
      y[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
    }
  }
}

/// Fifth bits of Q5_0/Q5_1: bit j of the little-endian u32 qh is the high bit of value j.
inline uint32_t q5_high_bits(const uint8_t* p) {
  uint32_t qh;
  std::memcpy(&qh, p, 4);
  return qh;
}

/// Q5_0, 22 bytes per 32 values: f16 d, u32 qh (fifth bits), 16 bytes of nibbles (as Q4_0);
/// x = d * (q - 16) with q = nibble | fifth bit << 4.
inline void dequant_q5_0(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, b += 22, y += 32) {
    const float d = f16_at(b);
    const uint32_t qh = q5_high_bits(b + 2);
    const uint8_t* qs = b + 6;
    for (int j = 0; j < 16; ++j) {
      const int lo = (qs[j] & 0x0F) | static_cast<int>(((qh >> j) & 1u) << 4);
      const int hi = (qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
      y[j] = d * static_cast<float>(lo - 16);
      y[j + 16] = d * static_cast<float>(hi - 16);
    }
  }
}

/// Q5_1, 24 bytes per 32 values: f16 d, f16 m, u32 qh, 16 bytes of nibbles; x = d * q + m.
inline void dequant_q5_1(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, b += 24, y += 32) {
    const float d = f16_at(b);
    const float m = f16_at(b + 2);
    const uint32_t qh = q5_high_bits(b + 4);
    const uint8_t* qs = b + 8;
    for (int j = 0; j < 16; ++j) {
      const int lo = (qs[j] & 0x0F) | static_cast<int>(((qh >> j) & 1u) << 4);
      const int hi = (qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
      y[j] = static_cast<float>(lo) * d + m;
      y[j + 16] = static_cast<float>(hi) * d + m;
    }
  }
}

/// Q8_0, 34 bytes per 32 values: f16 d, 32 int8; x = d * q.
inline void dequant_q8_0(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, b += 34, y += 32) {
    const float d = f16_at(b);
    for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(static_cast<int8_t>(b[2 + j]));
  }
}

/// 6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K super-block, packed in 12 bytes:
/// for j < 4 the low 6 bits of bytes j (scale) and j + 4 (min); for j >= 4 the scale is the low
/// nibble of byte j + 4 with the top two bits of byte j - 4 above it, and the min the high
/// nibble of byte j + 4 with the top two bits of byte j above it.
inline void k4_scale_min(int j, const uint8_t* q, int* sc, int* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

/// Q4_K, 144 bytes per 256 values: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins (8
/// sub-blocks of 32), 128 bytes of nibbles. Values come in four chunks of 64 sharing 32 bytes:
/// the low nibbles are sub-block 2c, the high nibbles sub-block 2c + 1;
/// x = d * scale * q - dmin * min.
inline void dequant_q4_k(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, b += 144) {
    const float d = f16_at(b);
    const float dmin = f16_at(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* q = b + 16;
    for (int c = 0; c < 4; ++c, q += 32) {
      int sc, mn;
      k4_scale_min(2 * c, scales, &sc, &mn);
      const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(mn);
      k4_scale_min(2 * c + 1, scales, &sc, &mn);
      const float d2 = d * static_cast<float>(sc), m2 = dmin * static_cast<float>(mn);
      for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>(q[l] & 0x0F) - m1;
      for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>(q[l] >> 4) - m2;
    }
  }
}

/// Q5_K, 176 bytes per 256 values: f16 d, f16 dmin, 12 bytes of scales/mins (as Q4_K), 32
/// bytes qh, 128 bytes of nibbles (as Q4_K). The fifth bit of value l of sub-block s is bit s of
/// qh[l]; x = d * scale * q - dmin * min.
inline void dequant_q5_k(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, b += 176) {
    const float d = f16_at(b);
    const float dmin = f16_at(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qh = b + 16;
    const uint8_t* q = b + 48;
    for (int c = 0; c < 4; ++c, q += 32) {
      int sc, mn;
      k4_scale_min(2 * c, scales, &sc, &mn);
      const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(mn);
      k4_scale_min(2 * c + 1, scales, &sc, &mn);
      const float d2 = d * static_cast<float>(sc), m2 = dmin * static_cast<float>(mn);
      const int s1 = 2 * c, s2 = 2 * c + 1;
      for (int l = 0; l < 32; ++l)
        *y++ = d1 * static_cast<float>((q[l] & 0x0F) + (((qh[l] >> s1) & 1) << 4)) - m1;
      for (int l = 0; l < 32; ++l)
        *y++ = d2 * static_cast<float>((q[l] >> 4) + (((qh[l] >> s2) & 1) << 4)) - m2;
    }
  }
}

/// Q6_K, 210 bytes per 256 values: 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16
/// int8 scales (one per 16 values), f16 d. Two halves of 128 values, each using 64 bytes of
/// ql, 32 of qh and 8 scales: for l < 32, value l takes the low nibble of ql[l] and bits 0-1
/// of qh[l]; value l + 32 the low nibble of ql[l + 32] and bits 2-3; value l + 64 the high
/// nibble of ql[l] and bits 4-5; value l + 96 the high nibble of ql[l + 32] and bits 6-7.
/// x = d * scale[value / 16] * (q - 32).
inline void dequant_q6_k(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, b += 210) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16_at(b + 208);
    for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, y += 128) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * static_cast<float>(sc[is]) * static_cast<float>(q1);
        y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
        y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
        y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
      }
    }
  }
}

}  // namespace detail

/// Dequantizes n values of ggml type `type` from `src` into `dst` (n must be a multiple of the
/// type's block size; src must hold n / block * block_bytes bytes). Throws kUnsupported for a
/// type without a decoder here.
inline void dequantize(uint32_t type, const uint8_t* src, float* dst, int64_t n) {
  const GgmlTypeTraits tt = ggml_type_traits(type);
  KVQ_REQUIRE(tt.dequantizable, kUnsupported, "GGUF: dequantization of ggml type ", tt.name,
              " (code ", type, ") is not implemented (supported: F32, F16, BF16, Q4_0, Q4_1, "
              "Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)");
  KVQ_REQUIRE(n >= 0 && n % tt.block == 0, kInvalidArgument, "GGUF: ", n, " values of ", tt.name,
              " is not a multiple of its block of ", tt.block);
  if (n == 0) return;  // an empty tensor: nothing to read (dst may be null)
  const int64_t nb = n / tt.block;
  switch (type) {
    case 0: std::memcpy(dst, src, static_cast<size_t>(n) * 4); break;
    case 1:
      for (int64_t i = 0; i < n; ++i) dst[i] = detail::f16_at(src + 2 * i);
      break;
    case 30:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = bf16_bits_to_float(h);
      }
      break;
    case 2: detail::dequant_q4_0(src, dst, nb); break;
    case 3: detail::dequant_q4_1(src, dst, nb); break;
    case 6: detail::dequant_q5_0(src, dst, nb); break;
    case 7: detail::dequant_q5_1(src, dst, nb); break;
    case 8: detail::dequant_q8_0(src, dst, nb); break;
    case 12: detail::dequant_q4_k(src, dst, nb); break;
    case 13: detail::dequant_q5_k(src, dst, nb); break;
    case 14: detail::dequant_q6_k(src, dst, nb); break;
    default: break;
  }
}

/// A parsed GGUF file: metadata, tensor infos, and the bytes (shared, read-only).
class GgufFile {
 public:
  /// Maps (or reads) and parses `path`.
  static GgufFile open(const std::string& path) {
    auto st = detail::GgufStorage::from_file(path);
    GgufFile f;
    f.source_ = "GGUF file '" + path + "'";
    f.storage_ = std::move(st);
    f.parse_storage();
    return f;
  }
  /// Parses a copy of the n bytes at p (the fuzzing entry point: any input either parses or
  /// throws kvq::Error).
  static GgufFile parse(const uint8_t* p, size_t n, const std::string& name = "GGUF buffer") {
    GgufFile f;
    f.source_ = name;
    f.storage_ = detail::GgufStorage::copy_of(p, n);
    f.parse_storage();
    return f;
  }

  /// True when the bytes at p start with the GGUF magic.
  static bool has_magic(const uint8_t* p, size_t n) {
    return n >= 4 && p[0] == 'G' && p[1] == 'G' && p[2] == 'U' && p[3] == 'F';
  }
  /// True when the file at `path` starts with the GGUF magic (false when unreadable).
  static bool is_gguf_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    char m[4] = {0, 0, 0, 0};
    in.read(m, 4);
    return in.gcount() == 4 && has_magic(reinterpret_cast<const uint8_t*>(m), 4);
  }

  uint32_t version() const { return version_; }
  uint32_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }
  const std::string& source() const { return source_; }
  bool mapped() const { return storage_ && storage_->mapped(); }

  const std::map<std::string, GgufValue>& metadata() const { return meta_; }
  /// Metadata keys in file order.
  const std::vector<std::string>& metadata_keys() const { return meta_order_; }
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }

  const GgufValue* find(const std::string& key) const {
    const auto it = meta_.find(key);
    return it == meta_.end() ? nullptr : &it->second;
  }
  bool has(const std::string& key) const { return find(key) != nullptr; }

  /// An integer metadata value (any integer type) within [lo, hi]; errors name the key.
  int64_t get_int(const std::string& key, int64_t lo = std::numeric_limits<int64_t>::min(),
                  int64_t hi = std::numeric_limits<int64_t>::max()) const {
    const GgufValue& v = require(key);
    KVQ_REQUIRE(v.is_integer(), kIo, source_, ": metadata ", detail::printable(key), " is ",
                to_string(v.type), ", expected an integer");
    KVQ_REQUIRE(!(v.type == GgufValueType::kU64 && v.u > uint64_t{std::numeric_limits<int64_t>::max()}),
                kIo, source_, ": metadata ", detail::printable(key), " = ", v.u, " is too large");
    KVQ_REQUIRE(v.i >= lo && v.i <= hi, kIo, source_, ": metadata ", detail::printable(key), " = ", v.i,
                " is outside [", lo, ", ", hi, "]");
    return v.i;
  }
  int64_t get_int_or(const std::string& key, int64_t fallback, int64_t lo, int64_t hi) const {
    return has(key) ? get_int(key, lo, hi) : fallback;
  }
  /// A float metadata value (f32/f64, or an integer) that is finite.
  double get_float(const std::string& key) const {
    const GgufValue& v = require(key);
    double x = 0;
    if (v.is_float()) {
      x = v.f;
    } else {
      KVQ_REQUIRE(v.is_integer(), kIo, source_, ": metadata ", detail::printable(key), " is ",
                  to_string(v.type), ", expected a number");
      x = static_cast<double>(v.i);
    }
    KVQ_REQUIRE(std::isfinite(x), kIo, source_, ": metadata ", detail::printable(key), " = ", x,
                " is not finite");
    return x;
  }
  double get_float_or(const std::string& key, double fallback) const {
    return has(key) ? get_float(key) : fallback;
  }
  bool get_bool_or(const std::string& key, bool fallback) const {
    const GgufValue* v = find(key);
    if (!v) return fallback;
    KVQ_REQUIRE(v->type == GgufValueType::kBool, kIo, source_, ": metadata ", detail::printable(key),
                " is ", to_string(v->type), ", expected a bool");
    return v->i != 0;
  }
  const std::string& get_string(const std::string& key) const {
    const GgufValue& v = require(key);
    KVQ_REQUIRE(v.type == GgufValueType::kString, kIo, source_, ": metadata ", detail::printable(key),
                " is ", to_string(v.type), ", expected a string");
    return v.s;
  }
  std::string get_string_or(const std::string& key, const std::string& fallback) const {
    return has(key) ? get_string(key) : fallback;
  }
  /// A string array.
  const std::vector<std::string>& get_strings(const std::string& key) const {
    const GgufValue& v = require(key);
    KVQ_REQUIRE(v.type == GgufValueType::kArray && v.elem_type == GgufValueType::kString, kIo,
                source_, ": metadata ", detail::printable(key), " is not an array of strings");
    return v.strings;
  }
  /// An integer (or bool) array, as int64 (a copy; GgufValue::int_at reads one element).
  std::vector<int64_t> get_ints(const std::string& key) const {
    const GgufValue& v = require(key);
    const bool ok = v.type == GgufValueType::kArray && v.elem_type != GgufValueType::kString &&
                    v.elem_type != GgufValueType::kArray && v.elem_type != GgufValueType::kF32 &&
                    v.elem_type != GgufValueType::kF64;
    KVQ_REQUIRE(ok, kIo, source_, ": metadata ", detail::printable(key), " is not an array of integers");
    return v.ints();
  }

  const GgufTensorInfo* find_tensor(const std::string& name) const {
    const auto it = tensor_index_.find(name);
    return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
  }
  const GgufTensorInfo& tensor(const std::string& name) const {
    const GgufTensorInfo* t = find_tensor(name);
    KVQ_REQUIRE(t != nullptr, kIo, source_, ": no tensor named ", detail::printable(name));
    return *t;
  }
  /// The bytes of tensor t (n_bytes of them; valid while this object or a copy lives).
  const uint8_t* tensor_data(const GgufTensorInfo& t) const {
    return storage_->data() + data_offset_ + t.offset;
  }
  /// Tensor `name` dequantized to f32 (ne[0]-contiguous), after checking that its extents are
  /// `expect_ne` when given (errors name the tensor, expected and actual shapes).
  std::vector<float> dequantize_tensor(const std::string& name,
                                       const std::vector<int64_t>& expect_ne = {}) const {
    const GgufTensorInfo& t = tensor(name);
    if (!expect_ne.empty()) {
      KVQ_REQUIRE(t.ne == expect_ne, kIo, source_, ": tensor ", detail::printable(name), " has extents ",
                  detail::shape_str(t.ne), ", expected ", detail::shape_str(expect_ne));
    }
    std::vector<float> out(static_cast<size_t>(t.n_elements));
    try {
      dequantize(t.type, tensor_data(t), out.data(), t.n_elements);
    } catch (const Error& e) {
      fail(e.kind(), source_, ": tensor ", detail::printable(name), ": ", e.what());
    }
    return out;
  }

 private:
  const GgufValue& require(const std::string& key) const {
    const GgufValue* v = find(key);
    KVQ_REQUIRE(v != nullptr, kIo, source_, ": metadata key ", detail::printable(key), " is missing");
    return *v;
  }

  void parse_storage() {
    const uint8_t* p = storage_->data();
    const size_t n = storage_->size();
    detail::GgufCursor c(p, n, source_);
    c.need(4, "magic");
    KVQ_REQUIRE(has_magic(p, n), kIo, source_, ": not a GGUF file (magic bytes ",
                detail::printable(std::string_view(reinterpret_cast<const char*>(p), 4)),
                ", expected 'GGUF')");
    c.get<uint32_t>("magic");
    version_ = c.get<uint32_t>("version");
    KVQ_REQUIRE(version_ == 2 || version_ == 3, kIo, source_, ": GGUF version ", version_,
                " is not supported (versions 2 and 3 are)");
    const uint64_t n_tensors = c.get<uint64_t>("tensor count");
    const uint64_t n_kv = c.get<uint64_t>("metadata count");
    // A tensor info takes at least 8 + 4 + 8 + 4 + 8 bytes, a metadata pair 8 + 4 + 1.
    KVQ_REQUIRE(n_tensors <= kGgufMaxTensors && n_tensors <= c.remaining() / 32, kIo, source_,
                ": tensor count ", n_tensors, " (byte offset 8) is impossible for a file of ", n,
                " bytes");
    KVQ_REQUIRE(n_kv <= kGgufMaxMetadata && n_kv <= c.remaining() / 13, kIo, source_,
                ": metadata count ", n_kv, " (byte offset 16) is impossible for a file of ", n,
                " bytes");
    for (uint64_t k = 0; k < n_kv; ++k) {
      const size_t at = c.pos();
      std::string key = c.str("metadata key");
      KVQ_REQUIRE(!key.empty(), kIo, source_, ": metadata entry ", k, " at byte offset ", at,
                  " has an empty key");
      KVQ_REQUIRE(meta_.count(key) == 0, kIo, source_, ": duplicate metadata key ",
                  detail::printable(key), " at byte offset ", at);
      const uint32_t type = c.get<uint32_t>("metadata value type");
      GgufValue v = detail::gguf_read_value(c, type, key, 0);
      meta_order_.push_back(key);
      meta_.emplace(std::move(key), std::move(v));
    }
    alignment_ = kGgufDefaultAlignment;
    if (const GgufValue* a = find("general.alignment")) {
      KVQ_REQUIRE(a->type == GgufValueType::kU32, kIo, source_,
                  ": metadata 'general.alignment' is ", to_string(a->type), ", expected uint32");
      KVQ_REQUIRE(a->i > 0 && (a->i & (a->i - 1)) == 0, kIo, source_,
                  ": general.alignment = ", a->i, " is not a power of two");
      alignment_ = static_cast<uint32_t>(a->i);
    }
    tensors_.reserve(static_cast<size_t>(n_tensors));
    for (uint64_t k = 0; k < n_tensors; ++k) {
      const size_t at = c.pos();
      GgufTensorInfo t;
      t.name = c.str("tensor name");
      const std::string where = source_ + ": tensor " + detail::printable(t.name) + " (info at byte offset " +
                                std::to_string(at) + ")";
      KVQ_REQUIRE(tensor_index_.count(t.name) == 0, kIo, where, ": duplicate tensor name");
      const uint32_t nd = c.get<uint32_t>("tensor n_dims");
      KVQ_REQUIRE(nd >= 1 && nd <= kGgufMaxDims, kIo, where, ": n_dims = ", nd,
                  " is outside [1, ", kGgufMaxDims, "]");
      int64_t numel = 1;
      for (uint32_t d = 0; d < nd; ++d) {
        const uint64_t e = c.get<uint64_t>("tensor extent");
        KVQ_REQUIRE(e <= uint64_t{std::numeric_limits<int64_t>::max()}, kIo, where, ": extent ",
                    d, " = ", e, " is too large");
        t.ne.push_back(static_cast<int64_t>(e));
        KVQ_REQUIRE(detail::checked_mul(numel, static_cast<int64_t>(e), &numel), kIo, where,
                    ": element count overflows (extents ", detail::shape_str(t.ne), "...)");
      }
      t.n_elements = numel;
      t.type = c.get<uint32_t>("tensor type");
      const GgmlTypeTraits tt = ggml_type_traits(t.type);
      KVQ_REQUIRE(tt.block > 0, kIo, where, ": unknown ggml type code ", t.type);
      KVQ_REQUIRE(t.ne[0] % tt.block == 0, kIo, where, ": row length ne[0] = ", t.ne[0],
                  " is not a multiple of the ", tt.name, " block of ", tt.block);
      int64_t bytes = 0;
      KVQ_REQUIRE(detail::checked_mul(numel / tt.block, tt.block_bytes, &bytes), kIo, where,
                  ": byte size overflows");
      t.n_bytes = static_cast<uint64_t>(bytes);
      t.offset = c.get<uint64_t>("tensor offset");
      KVQ_REQUIRE(t.offset % alignment_ == 0, kIo, where, ": offset ", t.offset,
                  " is not a multiple of the alignment ", alignment_);
      tensor_index_.emplace(t.name, tensors_.size());
      tensors_.push_back(std::move(t));
    }
    const uint64_t header_end = c.pos();
    data_offset_ = (header_end + alignment_ - 1) / alignment_ * alignment_;  // no overflow: < 2^63
    const uint64_t data_size = data_offset_ <= n ? n - data_offset_ : 0;
    KVQ_REQUIRE(tensors_.empty() || data_offset_ <= n, kIo, source_, ": data section at byte offset ",
                data_offset_, " lies past the end of the file (", n, " bytes)");
    // Bounds and no overlap: sorted by offset, each tensor ends before the next begins.
    std::vector<const GgufTensorInfo*> order;
    order.reserve(tensors_.size());
    for (const auto& t : tensors_) {
      KVQ_REQUIRE(t.offset <= data_size && t.n_bytes <= data_size - t.offset, kIo, source_,
                  ": tensor ", detail::printable(t.name), " (", t.type_name(), ", extents ",
                  detail::shape_str(t.ne), ") needs bytes [", t.offset, ", ", t.offset + t.n_bytes,
                  ") of the data section, which has ", data_size, " bytes (file truncated?)");
      order.push_back(&t);
    }
    std::sort(order.begin(), order.end(),
              [](const GgufTensorInfo* a, const GgufTensorInfo* b) { return a->offset < b->offset; });
    for (size_t k = 1; k < order.size(); ++k) {
      const GgufTensorInfo& a = *order[k - 1];
      const GgufTensorInfo& b = *order[k];
      KVQ_REQUIRE(a.offset + a.n_bytes <= b.offset, kIo, source_, ": tensors ", detail::printable(a.name),
                  " and ", detail::printable(b.name), " overlap in the data section");
    }
  }

  std::string source_;
  std::shared_ptr<detail::GgufStorage> storage_;
  uint32_t version_ = 0;
  uint32_t alignment_ = kGgufDefaultAlignment;
  uint64_t data_offset_ = 0;
  std::map<std::string, GgufValue> meta_;
  std::vector<std::string> meta_order_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t> tensor_index_;
};

}  // namespace kvq::io

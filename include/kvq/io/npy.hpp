#pragma once
/// \file npy.hpp
/// Reader and writer for numpy's .npy format, versions 1.0, 2.0 and 3.0.
///
/// Layout: magic "\x93NUMPY", major and minor version bytes, header length (little-endian
/// uint16 in 1.0, uint32 in 2.0/3.0), the header (a Python dict literal, latin-1 in 1.0/2.0,
/// UTF-8 in 3.0, padded with spaces and ending in '\n' so the data starts 64-byte aligned),
/// then the raw array data.
///
/// Element types: '<f4' (f32) and '<f2' (f16). bfloat16 has no numpy type; the convention
/// (docs/dump-format.md) is:
///   - written as descr '<V2', because that is exactly what np.save writes for an
///     ml_dtypes.bfloat16 array (the type kvq users get from JAX, or from torch via ml_dtypes);
///     plain np.load reads such a file as 2-byte voids and `.view(ml_dtypes.bfloat16)` restores
///     the values, so every numpy can open kvq's bf16 files.
///   - read from '<V2' or '|V2' (any 2-byte opaque element is taken as bf16: no other common
///     tool writes 2-byte voids) and from 'bfloat16' (what str(dtype) gives under ml_dtypes,
///     used by hand-written headers).
///   - raw '<u2' / '<i2' bit patterns (torch `t.view(torch.uint16).numpy()`) are integers to
///     numpy, so they are read as bf16 only when NpyReadOptions::raw_u16_as_bf16 says so;
///     otherwise they are rejected with a message naming the option.
///
/// fortran_order True is supported: the data is transposed to C order on read.
///
/// The header is parsed by a small Python-literal parser (dicts, tuples, lists, strings,
/// ints, True/False/None), not by pattern matching, so spacing, key order, trailing commas and
/// Python 2's "3L" integers are all accepted, and anything malformed is rejected with its
/// position. As in numpy, the dict must have exactly the keys 'descr', 'fortran_order' and
/// 'shape', and shape must be a tuple.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvq/core/error.hpp"
#include "kvq/core/tensor.hpp"
#include "kvq/io/array.hpp"

namespace kvq::io {

/// Largest header accepted. numpy refuses headers over 10000 bytes unless told otherwise; a
/// header for any rank up to kMaxRank fits in about 1.5 KiB, so 64 KiB leaves room for odd
/// writers while keeping a hostile length field from driving a big allocation.
inline constexpr size_t kMaxNpyHeaderBytes = size_t{64} << 10;

/// Deepest nesting of brackets in a header (numpy's is 2: the dict and the shape tuple).
inline constexpr int kMaxNpyHeaderDepth = 16;

/// Options for reading .npy files.
struct NpyReadOptions {
  /// Read '<u2' and '<i2' arrays as raw bfloat16 bit patterns. Off by default because numpy
  /// gives those descrs to genuine 16-bit integers, which are not KV data.
  bool raw_u16_as_bf16 = false;
};

namespace detail {

/// One value of a Python literal as numpy writes it in a header.
struct PyLit {
  enum class Kind { kNone, kBool, kInt, kFloat, kStr, kTuple, kList, kDict };
  Kind kind = Kind::kNone;
  bool b = false;
  int64_t i = 0;
  std::string text;          ///< str contents, or the source text of a number
  std::vector<PyLit> items;  ///< tuple/list elements, or dict values
  std::vector<PyLit> keys;   ///< dict keys (parallel to items)

  static const char* kind_name(Kind k) {
    switch (k) {
      case Kind::kNone:
        return "None";
      case Kind::kBool:
        return "bool";
      case Kind::kInt:
        return "int";
      case Kind::kFloat:
        return "float";
      case Kind::kStr:
        return "str";
      case Kind::kTuple:
        return "tuple";
      case Kind::kList:
        return "list";
      case Kind::kDict:
        return "dict";
    }
    return "?";
  }
  /// Short rendering for error messages.
  std::string repr() const {
    switch (kind) {
      case Kind::kNone:
        return "None";
      case Kind::kBool:
        return b ? "True" : "False";
      case Kind::kInt:
        return std::to_string(i);
      case Kind::kFloat:
        return text;
      case Kind::kStr:
        return printable(text);
      default:
        return std::string("a ") + kind_name(kind);
    }
  }
};

/// Recursive-descent parser for the subset of Python literal syntax that .npy headers use.
class PyLitParser {
 public:
  PyLitParser(std::string_view text, const std::string& source) : s_(text), source_(source) {}

  /// Parses the whole text as one literal followed only by whitespace.
  PyLit parse_document() {
    PyLit v = value(0);
    skip_ws();
    if (pos_ != s_.size()) fail(cat("unexpected ", next_desc(), " after the header dict"));
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& msg) const {
    ::kvq::fail(ErrorKind::kIo, source_, ": malformed .npy header at header byte ", pos_, ": ",
                msg);
  }
  std::string next_desc() const {
    if (pos_ >= s_.size()) return "end of header";
    return printable(s_.substr(pos_, 12));
  }
  void skip_ws() {
    while (pos_ < s_.size()) {
      const char c = s_[pos_];
      if (c != ' ' && c != '\t' && c != '\n' && c != '\r' && c != '\f' && c != '\v') break;
      ++pos_;
    }
  }
  bool consume(char c) {
    skip_ws();
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  static bool ident_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
  }

  PyLit value(int depth) {
    skip_ws();
    if (pos_ >= s_.size()) fail("expected a value, found end of header");
    const char c = s_[pos_];
    if (c == '{' || c == '(' || c == '[') {
      if (depth >= kMaxNpyHeaderDepth) {
        fail(cat("brackets nested deeper than ", kMaxNpyHeaderDepth, " levels"));
      }
      ++pos_;
      if (c == '{') return dict(depth);
      return sequence(c == '(' ? ')' : ']', depth);
    }
    if (c == '\'' || c == '"') return string();
    if (c == '-' || c == '+' || (c >= '0' && c <= '9') || c == '.') return number();
    if (ident_char(c)) {
      const size_t start = pos_;
      while (pos_ < s_.size() && ident_char(s_[pos_])) ++pos_;
      const std::string_view word = s_.substr(start, pos_ - start);
      PyLit v;
      if (word == "True" || word == "False") {
        v.kind = PyLit::Kind::kBool;
        v.b = word == "True";
        return v;
      }
      if (word == "None") return v;
      pos_ = start;
      fail(cat("unknown name ", printable(word)));
    }
    fail(cat("expected a value, found ", next_desc()));
  }

  PyLit dict(int depth) {
    PyLit d;
    d.kind = PyLit::Kind::kDict;
    while (true) {
      if (consume('}')) return d;
      d.keys.push_back(value(depth + 1));
      if (!consume(':')) fail(cat("expected ':' after a dict key, found ", next_desc()));
      d.items.push_back(value(depth + 1));
      if (consume(',')) continue;
      if (consume('}')) return d;
      fail(cat("expected ',' or '}' in a dict, found ", next_desc()));
    }
  }

  // Python semantics: "()" is an empty tuple, "(x,)" a 1-tuple, "(x)" just x in parentheses.
  PyLit sequence(char close, int depth) {
    PyLit t;
    t.kind = close == ')' ? PyLit::Kind::kTuple : PyLit::Kind::kList;
    bool saw_comma = false;
    while (true) {
      if (consume(close)) break;
      t.items.push_back(value(depth + 1));
      if (consume(',')) {
        saw_comma = true;
        continue;
      }
      if (consume(close)) break;
      fail(cat("expected ',' or '", close, "', found ", next_desc()));
    }
    if (close == ')' && t.items.size() == 1 && !saw_comma) return std::move(t.items[0]);
    return t;
  }

  PyLit string() {
    const char quote = s_[pos_++];
    PyLit v;
    v.kind = PyLit::Kind::kStr;
    while (true) {
      if (pos_ >= s_.size()) fail("unterminated string");
      const char c = s_[pos_];
      if (c == quote) {
        ++pos_;
        return v;
      }
      if (c == '\n' || c == '\r') fail("newline inside a string");
      if (c == '\\') {
        ++pos_;
        if (pos_ >= s_.size()) fail("unterminated string");
        const char e = s_[pos_];
        if (e == '\\' || e == '\'' || e == '"') {
          v.text += e;
        } else if (e == 'n') {
          v.text += '\n';
        } else if (e == 't') {
          v.text += '\t';
        } else {
          fail(cat("unsupported escape \\", printable(std::string_view(&e, 1))));
        }
        ++pos_;
        continue;
      }
      v.text += c;
      ++pos_;
    }
  }

  // An int ("12", "-3", Python 2's "12L") or something float-like ("2.5", "1e3"), which is
  // kept as text so that the caller can say *which* field held a non-integer.
  PyLit number() {
    const size_t start = pos_;
    PyLit v;
    bool neg = false;
    if (s_[pos_] == '-' || s_[pos_] == '+') neg = s_[pos_++] == '-';
    const size_t digits_start = pos_;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
    const size_t ndigits = pos_ - digits_start;
    const bool floaty = pos_ < s_.size() && (s_[pos_] == '.' || s_[pos_] == 'e' || s_[pos_] == 'E');
    if (floaty) {
      bool any_digit = ndigits > 0;
      if (s_[pos_] == '.') {
        ++pos_;
        while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_, any_digit = true;
      }
      if (!any_digit) fail("malformed number");
      if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
        ++pos_;
        if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
        const size_t e0 = pos_;
        while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
        if (pos_ == e0) fail("malformed exponent");
      }
      v.kind = PyLit::Kind::kFloat;
      v.text = std::string(s_.substr(start, pos_ - start));
    } else {
      if (ndigits == 0) {
        pos_ = start;
        fail(cat("malformed number ", next_desc()));
      }
      if (ndigits > 1 && s_[digits_start] == '0') {
        pos_ = start;
        fail(cat("integer with a leading zero ", next_desc()));
      }
      // Accumulate negatively so that the full int64 range parses.
      int64_t acc = 0;
      for (size_t k = digits_start; k < digits_start + ndigits; ++k) {
        const int d = s_[k] - '0';
        if (acc < (std::numeric_limits<int64_t>::min() + d) / 10) {
          pos_ = start;
          fail(cat("integer ", printable(s_.substr(start, digits_start + ndigits - start)),
                   " does not fit in int64"));
        }
        acc = acc * 10 - d;
      }
      if (!neg) {
        if (acc == std::numeric_limits<int64_t>::min()) {
          pos_ = start;
          fail("integer does not fit in int64");
        }
        acc = -acc;
      }
      if (pos_ < s_.size() && (s_[pos_] == 'L' || s_[pos_] == 'l')) ++pos_;  // Python 2 long
      v.kind = PyLit::Kind::kInt;
      v.i = acc;
      v.text = std::string(s_.substr(start, pos_ - start));
    }
    if (pos_ < s_.size() && ident_char(s_[pos_])) {
      fail(cat("malformed number ", printable(s_.substr(start, pos_ - start + 1))));
    }
    return v;
  }

  std::string_view s_;
  const std::string& source_;
  size_t pos_ = 0;
};

/// Fields of a validated .npy header.
struct NpyHeader {
  DType dtype = DType::kF32;
  bool fortran_order = false;
  std::vector<int64_t> shape;
};

/// Maps a descr string to a dtype, or throws naming the descr and what would be accepted.
inline DType npy_descr_dtype(const std::string& d, const NpyReadOptions& opt,
                             const std::string& source) {
  if (d == "<f4") return DType::kF32;
  if (d == "<f2") return DType::kF16;
  if (d == "<V2" || d == "|V2" || d == "bfloat16") return DType::kBF16;
  if ((d == "<u2" || d == "<i2") && opt.raw_u16_as_bf16) return DType::kBF16;
  if (d == "<u2" || d == "<i2") {
    fail(ErrorKind::kIo, source, ": descr ", printable(d),
         " is a 16-bit integer array; if it holds raw bfloat16 bits, read it with "
         "NpyReadOptions::raw_u16_as_bf16 = true");
  }
  if (d == ">f4" || d == ">f2" || d == ">u2" || d == ">i2" || d == ">V2") {
    fail(ErrorKind::kIo, source, ": descr ", printable(d),
         " is big-endian; kvq reads little-endian data only (save with "
         "arr.astype(arr.dtype.newbyteorder('<')))");
  }
  fail(ErrorKind::kIo, source, ": unsupported descr ", printable(d),
       "; kvq reads '<f4' (float32), '<f2' (float16) and bfloat16 as '<V2'/'|V2'/'bfloat16'");
}

/// Checks the parsed header dict against numpy's rules and kvq's supported types.
inline NpyHeader npy_check_header(const PyLit& h, const NpyReadOptions& opt,
                                  const std::string& source) {
  KVQ_REQUIRE(h.kind == PyLit::Kind::kDict, kIo, source, ": .npy header is a ",
              PyLit::kind_name(h.kind), ", not a dict");
  const PyLit* descr = nullptr;
  const PyLit* fortran = nullptr;
  const PyLit* shape = nullptr;
  for (size_t i = 0; i < h.keys.size(); ++i) {
    const PyLit& k = h.keys[i];
    KVQ_REQUIRE(k.kind == PyLit::Kind::kStr, kIo, source, ": .npy header key ", k.repr(),
                " is not a string");
    const PyLit** slot = k.text == "descr"           ? &descr
                         : k.text == "fortran_order" ? &fortran
                         : k.text == "shape"         ? &shape
                                                     : nullptr;
    KVQ_REQUIRE(slot != nullptr, kIo, source, ": unexpected .npy header key ", printable(k.text),
                " (the header has exactly 'descr', 'fortran_order' and 'shape')");
    KVQ_REQUIRE(*slot == nullptr, kIo, source, ": duplicate .npy header key ", printable(k.text));
    *slot = &h.items[i];
  }
  KVQ_REQUIRE(descr, kIo, source, ": .npy header lacks the key 'descr'");
  KVQ_REQUIRE(fortran, kIo, source, ": .npy header lacks the key 'fortran_order'");
  KVQ_REQUIRE(shape, kIo, source, ": .npy header lacks the key 'shape'");

  NpyHeader out;
  KVQ_REQUIRE(descr->kind == PyLit::Kind::kStr, kIo, source, ": 'descr' is ", descr->repr(),
              "; structured dtypes are not supported");
  out.dtype = npy_descr_dtype(descr->text, opt, source);
  KVQ_REQUIRE(fortran->kind == PyLit::Kind::kBool, kIo, source, ": 'fortran_order' is ",
              fortran->repr(), ", not True or False");
  out.fortran_order = fortran->b;
  KVQ_REQUIRE(shape->kind == PyLit::Kind::kTuple, kIo, source, ": 'shape' is ", shape->repr(),
              ", not a tuple (write (n,) for one dimension)");
  KVQ_REQUIRE(shape->items.size() <= static_cast<size_t>(kMaxRank), kIo, source, ": 'shape' has ",
              shape->items.size(), " dimensions, more than the limit of ", kMaxRank);
  for (size_t i = 0; i < shape->items.size(); ++i) {
    const PyLit& e = shape->items[i];
    KVQ_REQUIRE(e.kind == PyLit::Kind::kInt, kIo, source, ": 'shape' entry ", i, " is ", e.repr(),
                ", not an integer");
    KVQ_REQUIRE(e.i >= 0, kIo, source, ": 'shape' entry ", i, " is ", e.i, ", must be >= 0");
    out.shape.push_back(e.i);
  }
  return out;
}

/// Column-major (Fortran) element order -> row-major, for any rank: dst[c] = src[f(c)].
inline void fortran_to_c(const uint8_t* src, const std::vector<int64_t>& shape, size_t itemsize,
                         uint8_t* dst, size_t nbytes) {
  const size_t rank = shape.size();
  if (nbytes == 0) return;
  if (rank <= 1) {
    std::memcpy(dst, src, nbytes);
    return;
  }
  // Fortran strides in elements: dim 0 is fastest. All products fit: they are bounded by
  // numel, which was checked.
  std::vector<int64_t> fstride(rank);
  int64_t s = 1;
  for (size_t k = 0; k < rank; ++k) {
    fstride[k] = s;
    s *= shape[k];
  }
  // Odometer over the C-order index (last dim fastest), tracking the Fortran offset.
  std::vector<int64_t> idx(rank, 0);
  int64_t foff = 0;
  const size_t n = nbytes / itemsize;
  for (size_t c = 0; c < n; ++c) {
    std::memcpy(dst + c * itemsize, src + static_cast<size_t>(foff) * itemsize, itemsize);
    for (size_t k = rank; k-- > 0;) {
      if (++idx[k] < shape[k]) {
        foff += fstride[k];
        break;
      }
      foff -= fstride[k] * (shape[k] - 1);
      idx[k] = 0;
    }
  }
}

/// Where the parts of a .npy file lie, from its validated header.
struct NpyLayout {
  NpyHeader header;
  size_t data_start = 0;  ///< file offset of the data
  size_t nbytes = 0;      ///< data bytes the shape implies (== file size - data_start)
};

/// Validates preamble and header from the first `avail` bytes of a file of `total` bytes and
/// checks that the data exactly fills the rest. `avail` must cover at least the preamble and
/// kMaxNpyHeaderBytes of header, or the whole file when it is shorter.
inline NpyLayout npy_layout(const uint8_t* data, size_t avail, uint64_t total,
                            const NpyReadOptions& opt, const std::string& source) {
  constexpr size_t kMagicLen = 6;
  static const uint8_t kMagic[kMagicLen] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
  KVQ_REQUIRE(total >= kMagicLen + 2 && avail >= kMagicLen + 2, kIo, source, ": ", total,
              " bytes is too short for a .npy file (magic and version need 8)");
  KVQ_REQUIRE(std::memcmp(data, kMagic, kMagicLen) == 0, kIo, source,
              ": not a .npy file: magic is [", hex_bytes(data, kMagicLen),
              "], expected [93 4e 55 4d 50 59] (\"\\x93NUMPY\")");
  const int major = data[6];
  const int minor = data[7];
  KVQ_REQUIRE(major >= 1 && major <= 3 && minor == 0, kIo, source,
              ": unsupported .npy format version ", major, ".", minor,
              " (kvq reads 1.0, 2.0 and 3.0)");
  const size_t len_bytes = major == 1 ? 2 : 4;
  const size_t header_start = kMagicLen + 2 + len_bytes;
  KVQ_REQUIRE(avail >= header_start, kIo, source,
              ": truncated in the header length field (file is ", total, " bytes)");
  const size_t header_len = major == 1 ? load_u16le(data + 8) : load_u32le(data + 8);
  KVQ_REQUIRE(header_len <= kMaxNpyHeaderBytes, kIo, source, ": header length ", header_len,
              " exceeds the limit of ", kMaxNpyHeaderBytes, " bytes");
  KVQ_REQUIRE(header_len <= total - header_start && header_len <= avail - header_start, kIo, source,
              ": header length ", header_len, " runs past the end of the file (",
              total - header_start, " bytes follow the length field)");
  const std::string_view text(reinterpret_cast<const char*>(data + header_start), header_len);
  if (major == 3) {
    size_t bad = 0;
    KVQ_REQUIRE(valid_utf8(text, &bad), kIo, source,
                ": version 3.0 header is not valid UTF-8 (header byte ", bad, ")");
  }
  NpyLayout l;
  l.header = npy_check_header(PyLitParser(text, source).parse_document(), opt, source);
  const int64_t numel = checked_numel(l.header.shape, source + ": 'shape'");
  l.nbytes = checked_nbytes(numel, dtype_size(l.header.dtype), source + ": data");
  l.data_start = header_start + header_len;
  const uint64_t have = total - l.data_start;
  const std::string what =
      cat("shape ", shape_str(l.header.shape), " of ", to_string(l.header.dtype));
  KVQ_REQUIRE(have >= l.nbytes, kIo, source, ": truncated: ", what, " needs ", l.nbytes,
              " data bytes, the file has ", have);
  KVQ_REQUIRE(have == l.nbytes, kIo, source, ": ", have - l.nbytes,
              " unexpected bytes after the data of ", what);
  return l;
}

/// The Array of a validated layout whose data bytes are at `src`.
inline Array npy_array(const NpyLayout& l, const uint8_t* src, const std::string& source) {
  Array a;
  a.dtype = l.header.dtype;
  a.shape = l.header.shape;
  a.bytes = alloc_bytes(l.nbytes, source);
  if (l.header.fortran_order) {
    fortran_to_c(src, a.shape, static_cast<size_t>(dtype_size(a.dtype)), a.bytes.data(), l.nbytes);
  } else if (l.nbytes) {
    std::memcpy(a.bytes.data(), src, l.nbytes);
  }
  return a;
}

}  // namespace detail

/// Parses a complete .npy file held in memory. `source` names it in error messages.
/// Throws kvq::Error(kIo) on anything malformed, truncated, oversized or unsupported.
inline Array read_npy_bytes(const uint8_t* data, size_t size, const NpyReadOptions& opt = {},
                            const std::string& source = "<memory>") {
  KVQ_REQUIRE(data != nullptr || size == 0, kInvalidArgument, source, ": null buffer");
  const detail::NpyLayout l = detail::npy_layout(data, size, size, opt, source);
  return detail::npy_array(l, data + l.data_start, source);
}

/// Reads a .npy file. The header is read and validated first, so memory is allocated only
/// for the data a valid header implies and the file actually holds. Throws kvq::Error(kIo)
/// naming the path.
inline Array read_npy(const std::filesystem::path& path, const NpyReadOptions& opt = {}) {
  const std::string source = path.string();
  detail::FileReader f(path);
  const std::vector<uint8_t> head = f.read_prefix(12 + kMaxNpyHeaderBytes);
  const detail::NpyLayout l = detail::npy_layout(head.data(), head.size(), f.size(), opt, source);
  if (!l.header.fortran_order) {
    Array a;
    a.dtype = l.header.dtype;
    a.shape = l.header.shape;
    a.bytes = detail::alloc_bytes(l.nbytes, source);
    f.read(l.data_start, l.nbytes, a.bytes.data());
    return a;
  }
  std::vector<uint8_t> raw = detail::alloc_bytes(l.nbytes, source);
  f.read(l.data_start, l.nbytes, raw.data());
  return detail::npy_array(l, raw.data(), source);
}

/// The .npy encoding of `a`. version 0 picks 1.0 when the header fits its 16-bit length and
/// 2.0 otherwise (as numpy does); 1, 2 or 3 force that version. bf16 is written as '<V2'.
inline std::vector<uint8_t> encode_npy(const Array& a, int version = 0) {
  KVQ_REQUIRE(version >= 0 && version <= 3, kInvalidArgument, "encode_npy: version ", version,
              " is not 0 (auto), 1, 2 or 3");
  a.validate("encode_npy");
  const char* descr = a.dtype == DType::kF32 ? "<f4" : a.dtype == DType::kF16 ? "<f2" : "<V2";
  std::string dict = detail::cat("{'descr': '", descr, "', 'fortran_order': False, 'shape': (");
  for (size_t i = 0; i < a.shape.size(); ++i) {
    dict += std::to_string(a.shape[i]);
    dict += a.shape.size() == 1 ? "," : i + 1 < a.shape.size() ? ", " : "";
  }
  dict += "), }";
  // Pad with spaces and a final '\n' so that the data starts on a 64-byte boundary.
  auto padded = [&](size_t len_bytes) {
    const size_t pre = 8 + len_bytes;
    const size_t total = (pre + dict.size() + 1 + 63) / 64 * 64;
    return total - pre;  // header length including padding and '\n'
  };
  int v = version;
  if (v == 0) v = padded(2) <= 0xffff ? 1 : 2;
  const size_t len_bytes = v == 1 ? 2 : 4;
  const size_t header_len = padded(len_bytes);
  KVQ_REQUIRE(v != 1 || header_len <= 0xffff, kInvalidArgument, "encode_npy: header of ",
              header_len, " bytes does not fit format 1.0");
  // Sized once and filled in place (GCC 12 misreports appends to a reserved vector as
  // overflows under -Wstringop-overflow).
  std::vector<uint8_t> out(8 + len_bytes + header_len + a.bytes.size(), ' ');
  const uint8_t pre[8] = {0x93, 'N', 'U', 'M', 'P', 'Y', static_cast<uint8_t>(v), 0};
  std::copy(pre, pre + 8, out.begin());
  if (v == 1) {
    detail::store_u16le(out.data() + 8, static_cast<uint16_t>(header_len));
  } else {
    detail::store_u32le(out.data() + 8, static_cast<uint32_t>(header_len));
  }
  const size_t h0 = 8 + len_bytes;  // header: dict, space padding (already ' '), '\n'
  std::copy(dict.begin(), dict.end(), out.begin() + static_cast<std::ptrdiff_t>(h0));
  out[h0 + header_len - 1] = '\n';
  std::copy(a.bytes.begin(), a.bytes.end(),
            out.begin() + static_cast<std::ptrdiff_t>(h0 + header_len));
  return out;
}

/// Writes `a` as a .npy file (see encode_npy for version and bf16 conventions).
inline void write_npy(const std::filesystem::path& path, const Array& a, int version = 0) {
  const std::vector<uint8_t> buf = encode_npy(a, version);
  detail::FileWriter w(path);
  w.write(buf.data(), buf.size());
  w.close();
}

/// Writes data[0 .. prod(shape)) as a .npy file, rounded to store_as (f32, f16 or bf16).
inline void write_npy(const std::filesystem::path& path, const float* data,
                      const std::vector<int64_t>& shape, DType store_as = DType::kF32) {
  write_npy(path, Array::from_float(data, shape, store_as));
}

}  // namespace kvq::io

#pragma once
/// \file json.hpp
/// A small, strict JSON (RFC 8259) parser and string quoter, written for the .safetensors
/// header and for any other JSON kvq reads from a file.
///
/// Strict on purpose: the input is hostile. Rejected: trailing commas, comments, NaN/Infinity,
/// leading zeros, unescaped control characters, invalid UTF-8, unpaired UTF-16 surrogates in
/// \\u escapes, duplicate object keys (RFC 8259 leaves their meaning open; two readers could
/// disagree on which value wins), nesting deeper than JsonLimits::max_depth (bounds recursion),
/// and more than JsonLimits::max_values values (bounds memory: a 100 MB header of "[0,0,0..."
/// would otherwise become gigabytes of nodes).
///
/// Numbers keep their source text; as_int64() converts exactly or refuses, so "1e3", "2.0" or
/// 2^64 never silently become shape entries.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvq/core/error.hpp"
#include "kvq/io/array.hpp"

namespace kvq::io {

/// Resource limits for one parse.
struct JsonLimits {
  int max_depth = 64;                   ///< deepest array/object nesting accepted
  size_t max_values = size_t{1} << 20;  ///< most values (of any type) in one parsed value
};

namespace detail {
class JsonParser;
}

/// A parsed JSON value (immutable once parsed).
class Json {
 public:
  enum class Type : uint8_t { kNull, kBool, kNumber, kString, kArray, kObject };

  static const char* type_name(Type t) {
    switch (t) {
      case Type::kNull:
        return "null";
      case Type::kBool:
        return "boolean";
      case Type::kNumber:
        return "number";
      case Type::kString:
        return "string";
      case Type::kArray:
        return "array";
      case Type::kObject:
        return "object";
    }
    return "?";
  }

  Type type() const { return type_; }
  const char* type_name() const { return type_name(type_); }
  /// The type with its article ("an array", "a number", "null"), for error messages.
  const char* described_type() const {
    switch (type_) {
      case Type::kNull:
        return "null";
      case Type::kBool:
        return "a boolean";
      case Type::kNumber:
        return "a number";
      case Type::kString:
        return "a string";
      case Type::kArray:
        return "an array";
      case Type::kObject:
        return "an object";
    }
    return "?";
  }
  bool is_null() const { return type_ == Type::kNull; }
  bool is_bool() const { return type_ == Type::kBool; }
  bool is_number() const { return type_ == Type::kNumber; }
  bool is_string() const { return type_ == Type::kString; }
  bool is_array() const { return type_ == Type::kArray; }
  bool is_object() const { return type_ == Type::kObject; }

  bool as_bool() const {
    require(Type::kBool);
    return bool_;
  }
  /// String contents (decoded, UTF-8).
  const std::string& as_string() const {
    require(Type::kString);
    return text_;
  }
  /// A number's source text, exactly as written in the document.
  const std::string& number_text() const {
    require(Type::kNumber);
    return text_;
  }
  /// The number as int64 when it is written as an integer (no fraction, no exponent) and fits;
  /// nullopt for any other number and for non-numbers.
  std::optional<int64_t> as_int64() const {
    if (type_ != Type::kNumber) return std::nullopt;
    const std::string& t = text_;
    size_t i = 0;
    const bool neg = !t.empty() && t[0] == '-';
    if (neg) ++i;
    if (i == t.size()) return std::nullopt;
    // |value| accumulated as negative so that INT64_MIN is representable.
    int64_t v = 0;
    for (; i < t.size(); ++i) {
      const char c = t[i];
      if (c < '0' || c > '9') return std::nullopt;
      const int d = c - '0';
      if (v < (std::numeric_limits<int64_t>::min() + d) / 10) return std::nullopt;
      v = v * 10 - d;
    }
    if (!neg) {
      if (v == std::numeric_limits<int64_t>::min()) return std::nullopt;
      v = -v;
    }
    return v;
  }
  /// Array elements, or object values (parallel to keys()).
  const std::vector<Json>& items() const {
    if (type_ != Type::kArray) require(Type::kObject);
    return items_;
  }
  /// Object keys in document order.
  const std::vector<std::string>& keys() const {
    require(Type::kObject);
    return keys_;
  }
  size_t size() const { return items_.size(); }
  /// The value of `key` in an object, or nullptr when absent (or when this is not an object).
  const Json* find(std::string_view key) const {
    if (type_ != Type::kObject) return nullptr;
    for (size_t i = 0; i < keys_.size(); ++i) {
      if (keys_[i] == key) return &items_[i];
    }
    return nullptr;
  }

 private:
  friend class detail::JsonParser;
  void require(Type t) const {
    KVQ_REQUIRE(type_ == t, kInvalidArgument, "JSON value is ", described_type(), ", not ",
                t == Type::kArray || t == Type::kObject ? "an " : "a ", type_name(t));
  }

  Type type_ = Type::kNull;
  bool bool_ = false;
  std::string text_;               // string contents or number text
  std::vector<std::string> keys_;  // object keys
  std::vector<Json> items_;        // array elements or object values
};

namespace detail {

/// Recursive-descent parser over a byte range. Exposes its primitives so that a caller can
/// walk a large top-level object entry by entry (the .safetensors reader does), with the
/// value budget applied per entry instead of building one huge tree.
class JsonParser {
 public:
  JsonParser(std::string_view text, std::string source, ErrorKind kind = ErrorKind::kParse,
             JsonLimits limits = {})
      : s_(text), source_(std::move(source)), kind_(kind), limits_(limits) {}

  /// Byte offset of the next unread character.
  size_t offset() const { return pos_; }

  void skip_ws() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) {
      ++pos_;
    }
  }
  /// True when only whitespace is left.
  bool at_end() {
    skip_ws();
    return pos_ == s_.size();
  }
  /// Skips whitespace, then consumes c if it is next.
  bool consume(char c) {
    skip_ws();
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  void expect(char c, const char* context) {
    if (!consume(c)) fail(detail::cat("expected '", c, "' ", context, ", found ", next_desc()));
  }
  /// Skips whitespace and parses one string.
  std::string parse_string() {
    skip_ws();
    if (pos_ >= s_.size() || s_[pos_] != '"') {
      fail(detail::cat("expected a string, found ", next_desc()));
    }
    ++pos_;
    return string_body();
  }
  /// Parses one complete value; the value budget and depth count start afresh.
  Json parse_value() {
    values_left_ = limits_.max_values;
    return value(0);
  }

  [[noreturn]] void fail(const std::string& msg) const {
    ::kvq::fail(kind_, source_, ": invalid JSON at byte ", pos_, ": ", msg);
  }

 private:
  std::string next_desc() const {
    if (pos_ >= s_.size()) return "end of input";
    return detail::printable(s_.substr(pos_, 1));
  }

  Json value(int depth) {
    if (values_left_ == 0) fail(detail::cat("more than ", limits_.max_values, " values"));
    --values_left_;
    skip_ws();
    if (pos_ >= s_.size()) fail("expected a value, found end of input");
    Json j;
    const char c = s_[pos_];
    if (c == '{' || c == '[') {
      if (depth >= limits_.max_depth) {
        fail(detail::cat("nesting deeper than ", limits_.max_depth, " levels"));
      }
      ++pos_;
      if (c == '{') {
        j.type_ = Json::Type::kObject;
        if (consume('}')) return j;
        while (true) {
          j.keys_.push_back(parse_string());
          expect(':', "after an object key");
          j.items_.push_back(value(depth + 1));
          if (consume(',')) continue;
          expect('}', "after an object member");
          break;
        }
        check_unique_keys(j.keys_);
      } else {
        j.type_ = Json::Type::kArray;
        if (consume(']')) return j;
        while (true) {
          j.items_.push_back(value(depth + 1));
          if (consume(',')) continue;
          expect(']', "after an array element");
          break;
        }
      }
      return j;
    }
    if (c == '"') {
      ++pos_;
      j.type_ = Json::Type::kString;
      j.text_ = string_body();
      return j;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
      j.type_ = Json::Type::kNumber;
      j.text_ = number();
      return j;
    }
    if (literal("true")) {
      j.type_ = Json::Type::kBool;
      j.bool_ = true;
      return j;
    }
    if (literal("false")) {
      j.type_ = Json::Type::kBool;
      return j;
    }
    if (literal("null")) return j;
    fail(detail::cat("expected a value, found ", next_desc()));
  }

  bool literal(std::string_view word) {
    if (s_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  void check_unique_keys(const std::vector<std::string>& keys) const {
    if (keys.size() < 2) return;
    std::vector<const std::string*> sorted;
    sorted.reserve(keys.size());
    for (const auto& k : keys) sorted.push_back(&k);
    std::sort(sorted.begin(), sorted.end(),
              [](const std::string* a, const std::string* b) { return *a < *b; });
    for (size_t i = 1; i < sorted.size(); ++i) {
      if (*sorted[i] == *sorted[i - 1]) {
        fail(detail::cat("duplicate object key ", detail::printable(*sorted[i])));
      }
    }
  }

  // -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
  std::string number() {
    const size_t start = pos_;
    auto digit = [&] { return pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9'; };
    auto digits = [&](const char* what) {
      if (!digit()) fail(detail::cat("expected a digit ", what, ", found ", next_desc()));
      while (digit()) ++pos_;
    };
    if (s_[pos_] == '-') ++pos_;
    if (pos_ < s_.size() && s_[pos_] == '0') {
      ++pos_;
      if (digit()) fail("number with a leading zero");
    } else {
      digits("in a number");
    }
    if (pos_ < s_.size() && s_[pos_] == '.') {
      ++pos_;
      digits("after a decimal point");
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      digits("in an exponent");
    }
    return std::string(s_.substr(start, pos_ - start));
  }

  static int hex_val(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }
  uint32_t hex4() {
    if (s_.size() - pos_ < 4) fail("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const int h = hex_val(s_[pos_ + i]);
      if (h < 0)
        fail(detail::cat("bad hex digit in \\u escape: ", detail::printable(s_.substr(pos_, 4))));
      v = v * 16 + static_cast<uint32_t>(h);
    }
    pos_ += 4;
    return v;
  }
  static void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xc0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xe0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else {
      out += static_cast<char>(0xf0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    }
  }

  // After the opening quote; consumes the closing quote.
  std::string string_body() {
    std::string out;
    while (true) {
      if (pos_ >= s_.size()) fail("unterminated string");
      const auto c = static_cast<unsigned char>(s_[pos_]);
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (c < 0x20)
        fail(detail::cat("unescaped control character 0x", detail::hex_bytes(&c, 1),
                         " in a string"));
      if (c == '\\') {
        ++pos_;
        if (pos_ >= s_.size()) fail("unterminated escape");
        const char e = s_[pos_++];
        switch (e) {
          case '"':
            out += '"';
            break;
          case '\\':
            out += '\\';
            break;
          case '/':
            out += '/';
            break;
          case 'b':
            out += '\b';
            break;
          case 'f':
            out += '\f';
            break;
          case 'n':
            out += '\n';
            break;
          case 'r':
            out += '\r';
            break;
          case 't':
            out += '\t';
            break;
          case 'u': {
            uint32_t cp = hex4();
            if (cp >= 0xdc00 && cp <= 0xdfff) fail("unpaired low surrogate in \\u escape");
            if (cp >= 0xd800 && cp <= 0xdbff) {
              if (s_.substr(pos_, 2) != "\\u") fail("unpaired high surrogate in \\u escape");
              pos_ += 2;
              const uint32_t lo = hex4();
              if (lo < 0xdc00 || lo > 0xdfff) fail("high surrogate not followed by a low one");
              cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
            }
            append_utf8(out, cp);
            break;
          }
          default:
            --pos_;
            fail(detail::cat("invalid escape \\", detail::printable(s_.substr(pos_, 1))));
        }
        continue;
      }
      if (c < 0x80) {
        out += static_cast<char>(c);
        ++pos_;
        continue;
      }
      // Multi-byte UTF-8 sequence: validate it as one unit, copy it through.
      const size_t len = (c & 0xe0) == 0xc0   ? 2
                         : (c & 0xf0) == 0xe0 ? 3
                         : (c & 0xf8) == 0xf0 ? 4
                                              : 0;
      if (len == 0 || s_.size() - pos_ < len || !detail::valid_utf8(s_.substr(pos_, len))) {
        fail("invalid UTF-8 in a string");
      }
      out.append(s_.data() + pos_, len);
      pos_ += len;
    }
  }

  std::string_view s_;
  std::string source_;
  ErrorKind kind_;
  JsonLimits limits_;
  size_t pos_ = 0;
  size_t values_left_ = 0;
};

}  // namespace detail

/// Parses a complete JSON document (one value, optional surrounding whitespace). Errors throw
/// kvq::Error of `kind`, with `source` and the byte offset in the message.
inline Json parse_json(std::string_view text, const std::string& source = "JSON text",
                       ErrorKind kind = ErrorKind::kParse, JsonLimits limits = {}) {
  detail::JsonParser p(text, source, kind, limits);
  Json j = p.parse_value();
  if (!p.at_end()) p.fail("unexpected content after the document");
  return j;
}

/// s as a JSON string literal (with quotes). Escapes '"', '\\' and control characters; other
/// characters pass through, so s must be valid UTF-8 (kInvalidArgument otherwise).
inline std::string json_quote(std::string_view s) {
  size_t bad = 0;
  KVQ_REQUIRE(detail::valid_utf8(s, &bad), kInvalidArgument, "string ", detail::printable(s),
              " is not valid UTF-8 (byte ", bad, "); JSON text must be UTF-8");
  static const char kHex[] = "0123456789abcdef";
  std::string out = "\"";
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20) {
          out += "\\u00";
          out += kHex[c >> 4];
          out += kHex[c & 15];
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

}  // namespace kvq::io

#pragma once
/// \file error.hpp
/// kvq reports bad input by throwing kvq::Error. Messages name the problem: which shape,
/// which dtype, which value, which token of a spec, which byte offset of a file.
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace kvq {

/// Category of an error, so callers can react without parsing messages.
enum class ErrorKind {
  kInvalidArgument,  ///< a parameter is out of its domain (bits, group size, head_dim, ...)
  kShapeMismatch,    ///< tensor shapes/strides do not fit together
  kNonFinite,        ///< NaN or Inf where a finite value is required
  kOutOfRange,       ///< a value cannot be represented (e.g. exceeds fp16 metadata range)
  kParse,            ///< malformed spec string
  kIo,               ///< file missing, truncated, or hostile
  kUnsupported,      ///< valid request that this build does not support
};

inline const char* to_string(ErrorKind k) {
  switch (k) {
    case ErrorKind::kInvalidArgument: return "invalid argument";
    case ErrorKind::kShapeMismatch: return "shape mismatch";
    case ErrorKind::kNonFinite: return "non-finite value";
    case ErrorKind::kOutOfRange: return "out of range";
    case ErrorKind::kParse: return "parse error";
    case ErrorKind::kIo: return "I/O error";
    case ErrorKind::kUnsupported: return "unsupported";
  }
  return "error";
}

/// The one exception type kvq throws for bad input.
class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& msg)
      : std::runtime_error(std::string("kvq: ") + to_string(kind) + ": " + msg), kind_(kind) {}
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

namespace detail {
inline void cat_into(std::ostringstream&) {}
template <class T, class... R>
void cat_into(std::ostringstream& os, const T& v, const R&... rest) {
  os << v;
  cat_into(os, rest...);
}
/// Concatenates its arguments with operator<< (message building for errors).
template <class... A>
std::string cat(const A&... a) {
  std::ostringstream os;
  os.precision(9);
  cat_into(os, a...);
  return os.str();
}
}  // namespace detail

/// Throws kvq::Error(kind, message built from the remaining arguments).
template <class... A>
[[noreturn]] void fail(ErrorKind kind, const A&... a) {
  throw Error(kind, detail::cat(a...));
}

}  // namespace kvq

/// KVQ_REQUIRE(cond, kind, parts...): throw kvq::Error when cond is false.
#define KVQ_REQUIRE(cond, kind, ...)                  \
  do {                                                \
    if (!(cond)) ::kvq::fail(::kvq::ErrorKind::kind, __VA_ARGS__); \
  } while (0)

/// \file fuzz_json.cpp
/// Fuzz target: kvq::io::parse_json (the strict RFC 8259 parser behind .safetensors headers).
/// Properties on success: writing the value back out (strings through json_quote, numbers as
/// their source text) and parsing that gives a structurally identical value; the parse under
/// tight limits (depth 4, 64 values) either fails with kvq::Error or agrees with the default.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz_util.hpp"
#include "kvq/io/json.hpp"

namespace {

using kvq::io::Json;

void write(const Json& j, std::string& out) {
  switch (j.type()) {
    case Json::Type::kNull:
      out += "null";
      return;
    case Json::Type::kBool:
      out += j.as_bool() ? "true" : "false";
      return;
    case Json::Type::kNumber:
      out += j.number_text();
      return;
    case Json::Type::kString:
      out += kvq::io::json_quote(j.as_string());
      return;
    case Json::Type::kArray:
      out += '[';
      for (size_t i = 0; i < j.size(); ++i) {
        if (i) out += ',';
        write(j.items()[i], out);
      }
      out += ']';
      return;
    case Json::Type::kObject:
      out += '{';
      for (size_t i = 0; i < j.size(); ++i) {
        if (i) out += ',';
        out += kvq::io::json_quote(j.keys()[i]);
        out += ':';
        write(j.items()[i], out);
      }
      out += '}';
      return;
  }
}

bool same(const Json& a, const Json& b) {
  if (a.type() != b.type()) return false;
  switch (a.type()) {
    case Json::Type::kNull:
      return true;
    case Json::Type::kBool:
      return a.as_bool() == b.as_bool();
    case Json::Type::kNumber:
      return a.number_text() == b.number_text() && a.as_int64() == b.as_int64();
    case Json::Type::kString:
      return a.as_string() == b.as_string();
    case Json::Type::kArray:
    case Json::Type::kObject:
      if (a.size() != b.size()) return false;
      if (a.is_object() && a.keys() != b.keys()) return false;
      for (size_t i = 0; i < a.size(); ++i) {
        if (!same(a.items()[i], b.items()[i])) return false;
      }
      return true;
  }
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  Json j;
  try {
    j = kvq::io::parse_json(text, "fuzz.json");
  } catch (const kvq::Error&) {
    // Valid JSON must never be rejected only because tight limits were lifted; the converse
    // (tight limits accepting what the default refuses) is checked below.
    try {
      kvq::io::JsonLimits tight;
      tight.max_depth = 4;
      tight.max_values = 64;
      (void)kvq::io::parse_json(text, "fuzz.json", kvq::ErrorKind::kParse, tight);
    } catch (const kvq::Error&) {
      return 0;
    }
    KVQ_FUZZ_CHECK(!"tight limits accepted a document the default limits refused");
  }
  std::string out;
  write(j, out);
  const Json back = kvq::io::parse_json(out, "re-written");
  KVQ_FUZZ_CHECK(same(j, back));
  return 0;
}

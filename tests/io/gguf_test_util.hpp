#pragma once
// Builds GGUF files in memory for tests (a writer for the subset of the format the tests need:
// every metadata kind, arrays, tensor infos, alignment padding). Fields are written exactly as
// the format lays them out, so a test can also corrupt any of them afterwards.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace kvq_test {

class GgufBuilder {
 public:
  explicit GgufBuilder(uint32_t version = 3, uint32_t alignment = 32)
      : version_(version), alignment_(alignment) {}

  // Metadata (value type codes of the format).
  void u8(const std::string& k, uint8_t v) { kv(k, 0), pod(&meta_, v); }
  void i8(const std::string& k, int8_t v) { kv(k, 1), pod(&meta_, v); }
  void u16(const std::string& k, uint16_t v) { kv(k, 2), pod(&meta_, v); }
  void i16(const std::string& k, int16_t v) { kv(k, 3), pod(&meta_, v); }
  void u32(const std::string& k, uint32_t v) { kv(k, 4), pod(&meta_, v); }
  void i32(const std::string& k, int32_t v) { kv(k, 5), pod(&meta_, v); }
  void f32(const std::string& k, float v) { kv(k, 6), pod(&meta_, v); }
  void boolean(const std::string& k, bool v) { kv(k, 7), pod(&meta_, static_cast<uint8_t>(v)); }
  void str(const std::string& k, const std::string& v) { kv(k, 8), string(&meta_, v); }
  void u64(const std::string& k, uint64_t v) { kv(k, 10), pod(&meta_, v); }
  void i64(const std::string& k, int64_t v) { kv(k, 11), pod(&meta_, v); }
  void f64(const std::string& k, double v) { kv(k, 12), pod(&meta_, v); }
  void strings(const std::string& k, const std::vector<std::string>& v) {
    kv(k, 9);
    pod(&meta_, uint32_t{8});
    pod(&meta_, static_cast<uint64_t>(v.size()));
    for (const auto& s : v) string(&meta_, s);
  }
  void i32s(const std::string& k, const std::vector<int32_t>& v) {
    kv(k, 9);
    pod(&meta_, uint32_t{5});
    pod(&meta_, static_cast<uint64_t>(v.size()));
    for (int32_t x : v) pod(&meta_, x);
  }
  void f32s(const std::string& k, const std::vector<float>& v) {
    kv(k, 9);
    pod(&meta_, uint32_t{6});
    pod(&meta_, static_cast<uint64_t>(v.size()));
    for (float x : v) pod(&meta_, x);
  }
  /// An array of arrays of u16: [[...], [...]].
  void nested_u16(const std::string& k, const std::vector<std::vector<uint16_t>>& v) {
    kv(k, 9);
    pod(&meta_, uint32_t{9});
    pod(&meta_, static_cast<uint64_t>(v.size()));
    for (const auto& inner : v) {
      // Each element is an array without a type code of its own (gguf-py's layout): its
      // element type, count and elements.
      pod(&meta_, uint32_t{2});
      pod(&meta_, static_cast<uint64_t>(inner.size()));
      for (uint16_t x : inner) pod(&meta_, x);
    }
  }
  /// Raw bytes appended to the metadata section (for hand-made corrupt entries); counts as
  /// `entries` metadata entries.
  void raw_meta(const std::vector<uint8_t>& bytes, uint64_t entries = 1) {
    meta_.insert(meta_.end(), bytes.begin(), bytes.end());
    n_kv_ += entries;
  }

  /// A tensor with extents ne (fastest first), ggml type code, and its raw bytes; placed at
  /// the next aligned offset of the data section.
  void tensor(const std::string& name, const std::vector<uint64_t>& ne, uint32_t type,
              const std::vector<uint8_t>& bytes) {
    string(&infos_, name);
    pod(&infos_, static_cast<uint32_t>(ne.size()));
    for (uint64_t e : ne) pod(&infos_, e);
    pod(&infos_, type);
    while (data_.size() % alignment_ != 0) data_.push_back(0);
    pod(&infos_, static_cast<uint64_t>(data_.size()));
    data_.insert(data_.end(), bytes.begin(), bytes.end());
    ++n_tensors_;
  }
  void tensor_f32(const std::string& name, const std::vector<uint64_t>& ne,
                  const std::vector<float>& v) {
    std::vector<uint8_t> b(v.size() * 4);
    if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
    tensor(name, ne, 0, b);
  }

  std::vector<uint8_t> build() const {
    std::vector<uint8_t> out = {'G', 'G', 'U', 'F'};
    pod(&out, version_);
    pod(&out, n_tensors_);
    pod(&out, n_kv_);
    out.insert(out.end(), meta_.begin(), meta_.end());
    out.insert(out.end(), infos_.begin(), infos_.end());
    while (out.size() % alignment_ != 0) out.push_back(0);
    out.insert(out.end(), data_.begin(), data_.end());
    return out;
  }

  template <class T>
  static void pod(std::vector<uint8_t>* out, T v) {
    uint8_t b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    out->insert(out->end(), b, b + sizeof(T));
  }
  static void string(std::vector<uint8_t>* out, const std::string& s) {
    pod(out, static_cast<uint64_t>(s.size()));
    out->insert(out->end(), s.begin(), s.end());
  }

 private:
  void kv(const std::string& k, uint32_t type) {
    string(&meta_, k);
    pod(&meta_, type);
    ++n_kv_;
  }

  uint32_t version_;
  uint32_t alignment_;
  uint64_t n_tensors_ = 0;
  uint64_t n_kv_ = 0;
  std::vector<uint8_t> meta_, infos_, data_;
};

}  // namespace kvq_test

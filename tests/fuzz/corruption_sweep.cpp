// Corruption sweep over the seed corpora (docs/reliability.md): every truncation and every
// single-bit flip of each seed that loads; prints refused / accepted counts per format.
// Build: see tests/fuzz/CMakeLists.txt (target fuzz_corruption_sweep, not a test).
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include "kvq/io/gguf.hpp"
#include "kvq/io/kv_dump.hpp"
#include "kvq/io/npy.hpp"
#include "kvq/io/safetensors.hpp"
namespace fs = std::filesystem;
int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_corruption_sweep CORPUS_DIR (tests/fuzz/corpus)\n");
    return 2;
  }
  const std::string root = argv[1];
  struct T {
    const char* dir;
    std::function<void(const std::vector<uint8_t>&)> read;
  };
  std::vector<T> ts = {
      {"npy", [](const std::vector<uint8_t>& b) { kvq::io::read_npy_bytes(b.data(), b.size()); }},
      {"safetensors",
       [](const std::vector<uint8_t>& b) { kvq::io::read_safetensors_bytes(b.data(), b.size()); }},
      {"kv_dump",
       [](const std::vector<uint8_t>& b) { kvq::io::load_kv_dump_bytes(b.data(), b.size()); }},
      {"gguf",
       [](const std::vector<uint8_t>& b) {
         auto f = kvq::io::GgufFile::parse(b.data(), b.size());
         for (auto& t : f.tensors())
           if (t.n_elements) try {
               f.dequantize_tensor(t.name);
             } catch (const kvq::Error&) {
             }
       }},
  };
  for (auto& t : ts) {
    long files = 0, trunc = 0, trunc_ref = 0, flips = 0, flip_ref = 0;
    for (auto& e : fs::directory_iterator(root + "/" + t.dir)) {
      std::ifstream in(e.path(), std::ios::binary);
      std::vector<uint8_t> b((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
      try {
        t.read(b);
      } catch (const kvq::Error&) {
        continue;
      }  // only seeds that load
      ++files;
      for (size_t n = 0; n < b.size(); ++n) {
        std::vector<uint8_t> c(b.begin(), b.begin() + n);
        ++trunc;
        try {
          t.read(c);
        } catch (const kvq::Error&) {
          ++trunc_ref;
        }
      }
      for (size_t i = 0; i < b.size() * 8; ++i) {
        std::vector<uint8_t> c = b;
        c[i / 8] ^= static_cast<uint8_t>(1u << (i % 8));
        ++flips;
        try {
          t.read(c);
        } catch (const kvq::Error&) {
          ++flip_ref;
        }
      }
    }
    std::printf(
        "%s: %ld seeds; truncations %ld, refused %ld; single-bit flips %ld, refused %ld (the rest "
        "load: payload/padding bits, no checksum)\n",
        t.dir, files, trunc, trunc_ref, flips, flip_ref);
  }
}

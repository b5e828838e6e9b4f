/// \file replay_main.cpp
/// The regression driver linked into every fuzz target when it is built without libFuzzer:
/// runs LLVMFuzzerTestOneInput once on every file named on the command line (directories are
/// walked, sorted, recursively). ctest runs each target over its seed corpus
/// (tests/fuzz/corpus/<target>/, including every crash input ever found), under the normal
/// build and the ASan/UBSan build, so a fixed bug stays fixed without clang or libFuzzer.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

int run_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "replay: cannot open %s\n", p.string().c_str());
    return 1;
  }
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                std::istreambuf_iterator<char>());
  // A copy of exactly the file's size, so ASan sees a read one past the end as an overflow.
  std::vector<uint8_t> buf(bytes.begin(), bytes.end());
  LLVMFuzzerTestOneInput(buf.empty() ? nullptr : buf.data(), buf.size());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::filesystem::path> files;
  for (int i = 1; i < argc; ++i) {
    const std::filesystem::path arg(argv[i]);
    if (std::filesystem::is_directory(arg)) {
      for (const auto& e : std::filesystem::recursive_directory_iterator(arg)) {
        if (e.is_regular_file()) files.push_back(e.path());
      }
    } else if (std::filesystem::exists(arg)) {
      files.push_back(arg);
    } else {
      std::fprintf(stderr, "replay: %s does not exist\n", argv[i]);
      return 1;
    }
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) {
    std::fprintf(stderr, "replay: no inputs (give corpus files or directories)\n");
    return 1;
  }
  // The empty input is always worth a run: it is the shortest file every reader must refuse.
  LLVMFuzzerTestOneInput(nullptr, 0);
  int bad = 0;
  for (const auto& f : files) bad += run_file(f);
  std::printf("replay: %zu inputs, %s\n", files.size(), bad ? "errors" : "all passed");
  return bad ? 1 : 0;
}

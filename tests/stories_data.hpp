#pragma once
// Locating the real model shipped in ../shared/data/stories260K for tests that use it.
// On CI (CI=true) missing data is a failure, elsewhere a skip: the suite must never pass on CI
// while silently testing nothing.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <string>

// True in sanitizer builds (they run the model ~10x slower: tests evaluate less text there).
#if defined(__SANITIZE_ADDRESS__)
#define KVQ_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVQ_TEST_SANITIZED 1
#endif
#endif
#ifndef KVQ_TEST_SANITIZED
#define KVQ_TEST_SANITIZED 0
#endif

namespace kvq_test {

/// The compiled-in default of the shared data directory: the CMake cache variable
/// KVQ_SHARED_DIR (defaults to <source>/../shared), else "../shared".
inline std::string compiled_shared_dir() {
#ifdef KVQ_SHARED_DIR
  return KVQ_SHARED_DIR;
#else
  return "../shared";
#endif
}

/// The shared data directory: the KVQ_SHARED_DIR environment variable when set and non-empty
/// (a run-time override, e.g. for an installed test binary or data kept elsewhere), else the
/// compiled-in default.
inline std::string shared_dir() {
  const char* e = std::getenv("KVQ_SHARED_DIR");
  if (e != nullptr && *e != '\0') return e;
  return compiled_shared_dir();
}

inline std::string stories_dir() { return shared_dir() + "/data/stories260K"; }
inline std::string model_path() { return stories_dir() + "/stories260K.bin"; }
inline std::string tokenizer_path() { return stories_dir() + "/tok512.bin"; }
inline std::string text_path() { return stories_dir() + "/tinystories-dev.txt"; }

inline bool file_exists(const std::string& p) { return std::ifstream(p, std::ios::binary).good(); }

/// Empty when the stories260K files are present, else a message naming the missing path.
inline std::string missing_data() {
  for (const std::string& p : {model_path(), tokenizer_path(), text_path()}) {
    if (!file_exists(p)) {
      const char* e = std::getenv("KVQ_SHARED_DIR");
      const bool from_env = e != nullptr && *e != '\0';
      return "shared data file '" + p + "' not found (shared data directory '" + shared_dir() +
             "', from " +
             (from_env ? "the KVQ_SHARED_DIR environment variable"
                       : "the compiled-in default, CMake option KVQ_SHARED_DIR") +
             "; set the KVQ_SHARED_DIR environment variable at run time, or configure with "
             "-DKVQ_SHARED_DIR=<dir>, to the directory holding data/stories260K)";
    }
  }
  return "";
}

inline bool on_ci() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::string(ci) == "true";
}

}  // namespace kvq_test

// Fails on CI, skips elsewhere, when the stories260K files are missing.
#define KVQ_REQUIRE_STORIES()                               \
  do {                                                      \
    const std::string why_ = ::kvq_test::missing_data();    \
    if (!why_.empty()) {                                    \
      if (::kvq_test::on_ci()) FAIL() << why_;              \
      GTEST_SKIP() << why_;                                 \
    }                                                       \
  } while (0)

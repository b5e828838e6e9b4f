#pragma once
// Locating SmolLM2-135M-Instruct (GGUF) for the tests that run it. The model is not in the
// repository: `./kvq.sh model smollm2` fetches it into the model cache ($KVQ_MODEL_DIR, default
// ~/.cache/kvq/models); KVQ_SMOLLM2_GGUF overrides the path. On CI (CI=true) a missing model
// is a failure (.ci/run fetches it first), elsewhere a skip naming the command.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <string>

// True in sanitizer builds (several times slower: the SmolLM2 tests evaluate less text there).
#if defined(__SANITIZE_ADDRESS__)
#define KVQ_SMOLLM2_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVQ_SMOLLM2_SANITIZED 1
#endif
#endif
#ifndef KVQ_SMOLLM2_SANITIZED
#define KVQ_SMOLLM2_SANITIZED 0
#endif

namespace kvq_test {

inline std::string smollm2_gguf_path() {
  if (const char* p = std::getenv("KVQ_SMOLLM2_GGUF")) {
    if (*p) return p;
  }
  std::string dir;
  if (const char* d = std::getenv("KVQ_MODEL_DIR"); d && *d) {
    dir = d;
  } else {
    const char* home = std::getenv("HOME");
    dir = std::string(home && *home ? home : ".") + "/.cache/kvq/models";
  }
  return dir + "/SmolLM2-135M-Instruct.Q4_1.gguf";
}

/// tinystories-dev.txt from the shared data (the text of reference.md's SmolLM2 figures).
inline std::string smollm2_text_path() {
#ifdef KVQ_SHARED_DIR
  std::string shared = KVQ_SHARED_DIR;
#else
  std::string shared = "../shared";
#endif
  if (const char* e = std::getenv("KVQ_SHARED_DIR"); e && *e) shared = e;
  return shared + "/data/stories260K/tinystories-dev.txt";
}

/// Empty when the model and the text are present, else why not (naming the fetch command).
inline std::string missing_smollm2() {
  const std::string m = smollm2_gguf_path();
  if (!std::ifstream(m, std::ios::binary).good()) {
    return "SmolLM2 GGUF '" + m +
           "' not found: fetch it with `./kvq.sh model smollm2` (or set KVQ_SMOLLM2_GGUF)";
  }
  const std::string t = smollm2_text_path();
  if (!std::ifstream(t, std::ios::binary).good()) {
    return "text '" + t + "' not found (set KVQ_SHARED_DIR to the directory holding data/)";
  }
  return "";
}

inline bool smollm2_on_ci() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::string(ci) == "true";
}

}  // namespace kvq_test

// Fails on CI, skips elsewhere, when SmolLM2 or the dev text is missing.
#define KVQ_REQUIRE_SMOLLM2()                                \
  do {                                                       \
    const std::string why_ = ::kvq_test::missing_smollm2();  \
    if (!why_.empty()) {                                     \
      if (::kvq_test::smollm2_on_ci()) FAIL() << why_;       \
      GTEST_SKIP() << why_;                                  \
    }                                                        \
  } while (0)

#pragma once
// Locating Gemma 3 270M (GGUF, Q4_K_M) for the tests that run it. Not in the repository:
// `./kvq.sh model gemma3` fetches it into the model cache ($KVQ_MODEL_DIR, default
// ~/.cache/kvq/models); KVQ_GEMMA3_GGUF overrides the path. On CI (CI=true) a missing model is a
// failure (`./kvq.sh test` fetches it first), elsewhere a skip naming the command.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "smollm2_data.hpp"

namespace kvq_test {

inline std::string gemma3_gguf_path() {
  if (const char* p = std::getenv("KVQ_GEMMA3_GGUF")) {
    if (*p) return p;
  }
  std::string dir;
  if (const char* d = std::getenv("KVQ_MODEL_DIR"); d && *d) {
    dir = d;
  } else {
    const char* home = std::getenv("HOME");
    dir = std::string(home && *home ? home : ".") + "/.cache/kvq/models";
  }
  return dir + "/gemma-3-270m-q4_k_m.gguf";
}

/// Empty when the model and the dev text are present, else why not (naming the fetch command).
inline std::string missing_gemma3() {
  const std::string m = gemma3_gguf_path();
  if (!std::ifstream(m, std::ios::binary).good()) {
    return "Gemma 3 GGUF '" + m +
           "' not found: fetch it with `./kvq.sh model gemma3` (or set KVQ_GEMMA3_GGUF)";
  }
  const std::string t = smollm2_text_path();
  if (!std::ifstream(t, std::ios::binary).good()) {
    return "text '" + t + "' not found (set KVQ_SHARED_DIR to the directory holding data/)";
  }
  return "";
}

}  // namespace kvq_test

// Fails on CI, skips elsewhere, when Gemma 3 or the dev text is missing.
#define KVQ_REQUIRE_GEMMA3()                                 \
  do {                                                       \
    const std::string why_ = ::kvq_test::missing_gemma3();   \
    if (!why_.empty()) {                                     \
      if (::kvq_test::smollm2_on_ci()) FAIL() << why_;       \
      GTEST_SKIP() << why_;                                  \
    }                                                        \
  } while (0)

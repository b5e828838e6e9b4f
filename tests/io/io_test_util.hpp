#pragma once
// Helpers shared by the io/ tests: per-test temporary directories, error expectations, and a
// seeded byte mutator for the fuzz loops.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <random>
#include <string>
#include <system_error>
#include <vector>

#include "kvq/core/error.hpp"

#if defined(_WIN32)
#include <process.h>
#define KVQ_TEST_GETPID _getpid
#else
#include <unistd.h>
#define KVQ_TEST_GETPID getpid
#endif

namespace kvq_test {

/// A fresh directory per test (name of the test + pid + counter), removed afterwards.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "kvq";
    for (char& c : name) {
      if (c == '/') c = '_';
    }
    path_ = std::filesystem::temp_directory_path() /
            ("kvq_io_" + name + "_" + std::to_string(KVQ_TEST_GETPID()) + "_" +
             std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

inline void write_bytes(const std::filesystem::path& p, const std::vector<uint8_t>& b) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

inline std::vector<uint8_t> to_bytes(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

/// Runs fn and checks that it throws kvq::Error of `kind` whose message contains every one of
/// `parts` (so tests pin down that messages name the field and the value).
inline ::testing::AssertionResult throws_error(const std::function<void()>& fn, kvq::ErrorKind kind,
                                               std::initializer_list<std::string> parts) {
  try {
    fn();
  } catch (const kvq::Error& e) {
    if (e.kind() != kind) {
      return ::testing::AssertionFailure()
             << "wrong kind " << kvq::to_string(e.kind()) << ": " << e.what();
    }
    const std::string msg = e.what();
    for (const auto& p : parts) {
      if (msg.find(p) == std::string::npos) {
        return ::testing::AssertionFailure() << "message lacks \"" << p << "\": " << msg;
      }
    }
    return ::testing::AssertionSuccess() << msg;
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-kvq exception: " << e.what();
  } catch (...) {
    return ::testing::AssertionFailure() << "threw a non-exception";
  }
  return ::testing::AssertionFailure() << "did not throw";
}

#define EXPECT_IO_ERROR(stmt, ...) \
  EXPECT_TRUE(::kvq_test::throws_error([&] { stmt; }, ::kvq::ErrorKind::kIo, {__VA_ARGS__}))

/// One seeded random mutation of `in`: flip bits, overwrite with interesting bytes, insert,
/// delete, duplicate a slice, or truncate.
inline std::vector<uint8_t> mutate(const std::vector<uint8_t>& in, std::mt19937& rng) {
  std::vector<uint8_t> b = in;
  auto pick = [&](size_t n) { return n == 0 ? size_t{0} : static_cast<size_t>(rng() % n); };
  static const uint8_t kInteresting[] = {0x00, 0xff, 0x7f, 0x80, '0',  '9',  '-',  '.', ',',
                                         ':',  '[',  ']',  '{',  '}',  '(',  ')',  '"', '\'',
                                         '\\', 'e',  'L',  ' ',  '\n', 0xc3, 0xed, 0xf4};
  const int nmut = 1 + static_cast<int>(rng() % 4);
  for (int m = 0; m < nmut; ++m) {
    switch (rng() % 7) {
      case 0:
        if (!b.empty()) b[pick(b.size())] ^= static_cast<uint8_t>(1u << (rng() % 8));
        break;
      case 1:
        if (!b.empty()) b[pick(b.size())] = kInteresting[pick(sizeof kInteresting)];
        break;
      case 2:
        b.insert(b.begin() + static_cast<std::ptrdiff_t>(pick(b.size() + 1)),
                 kInteresting[pick(sizeof kInteresting)]);
        break;
      case 3:
        if (!b.empty()) b.erase(b.begin() + static_cast<std::ptrdiff_t>(pick(b.size())));
        break;
      case 4:
        b.resize(pick(b.size() + 1));
        break;
      case 5: {  // duplicate a short slice somewhere else
        if (b.size() < 2) break;
        const size_t a = pick(b.size());
        const size_t len = 1 + pick(std::min<size_t>(16, b.size() - a));
        std::vector<uint8_t> s(b.begin() + static_cast<std::ptrdiff_t>(a),
                               b.begin() + static_cast<std::ptrdiff_t>(a + len));
        b.insert(b.begin() + static_cast<std::ptrdiff_t>(pick(b.size() + 1)), s.begin(), s.end());
        break;
      }
      default:  // random byte
        if (!b.empty()) b[pick(b.size())] = static_cast<uint8_t>(rng());
        break;
    }
  }
  return b;
}

/// Feeds `iterations` mutants of each seed to parse(); every call must either return or throw
/// kvq::Error. Returns how many parsed successfully (so tests can check the loop is not
/// trivially rejecting everything).
inline int fuzz(const std::vector<std::vector<uint8_t>>& seeds, int iterations, uint32_t seed,
                const std::function<void(const std::vector<uint8_t>&)>& parse) {
  std::mt19937 rng(seed);
  int ok = 0;
  for (const auto& s : seeds) {
    for (int i = 0; i < iterations; ++i) {
      const std::vector<uint8_t> b = mutate(s, rng);
      try {
        parse(b);
        ++ok;
      } catch (const kvq::Error&) {
      } catch (const std::exception& e) {
        ADD_FAILURE() << "mutant " << i << " threw a non-kvq exception: " << e.what();
        return ok;
      }
    }
  }
  return ok;
}

}  // namespace kvq_test

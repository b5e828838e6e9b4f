// Byte-level BPE tokenizer: the GPT-2 pre-tokenizer pattern and the smollm digit split on
// hand-worked examples, merge order, user-defined/control tokens, byte-exact round trips; and
// SmolLM2's tokenizer against llama.cpp's token ids from shared/docs/reference.md.
#include "kvq/eval/bpe_tokenizer.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "smollm2_data.hpp"

namespace {

using kvq::eval::BpeTokenizer;
using Words = std::vector<std::string>;

/// The byte-level symbol of byte b (GPT-2's byte -> printable character map).
std::string sym(unsigned char b) {
  std::string s;
  kvq::eval::detail::append_utf8(kvq::eval::detail::byte_to_codepoint()[b], &s);
  return s;
}

/// A vocabulary of the 256 byte symbols (ids 0..255, id = byte) plus `extra` tokens from 256.
BpeTokenizer tiny(const std::vector<std::string>& merges, const std::vector<std::string>& extra,
                  const std::string& pre = "smollm", std::vector<int> extra_types = {},
                  bool add_bos = false) {
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.push_back(sym(static_cast<unsigned char>(b)));
  tokens.insert(tokens.end(), extra.begin(), extra.end());
  std::vector<int> types(tokens.size(), BpeTokenizer::kNormal);
  for (size_t i = 0; i < extra_types.size(); ++i) types[256 + i] = extra_types[i];
  return BpeTokenizer(tokens, types, merges, pre, add_bos, /*bos=*/add_bos ? 256 : -1, -1);
}

TEST(BpeTokenizer, ByteMapIsGpt2s) {
  EXPECT_EQ(sym(' '), "\xC4\xA0");   // U+0120 'Ġ'
  EXPECT_EQ(sym('\n'), "\xC4\x8A");  // U+010A 'Ċ'
  EXPECT_EQ(sym('A'), "A");
  EXPECT_EQ(sym(0xA1), "\xC2\xA1");  // printable Latin-1 maps to itself
  EXPECT_EQ(sym(0xAD), "\xC5\x83");  // soft hyphen: the 68th non-printable byte, U+0143
  EXPECT_EQ(sym(0), "\xC4\x80");     // U+0100
}

TEST(BpeTokenizer, Gpt2PatternWords) {
  const auto t = tiny({}, {}, "gpt2");
  EXPECT_EQ(t.pretokenize("Hello world"), (Words{"Hello", " world"}));
  EXPECT_EQ(t.pretokenize("It's 12345 o'clock; don't!"),
            (Words{"It", "'s", " 12345", " o", "'", "clock", ";", " don", "'t", "!"}));
  EXPECT_EQ(t.pretokenize("we're they'll I've I'm he'd"),
            (Words{"we", "'re", " they", "'ll", " I", "'ve", " I", "'m", " he", "'d"}));
  EXPECT_EQ(t.pretokenize("I'M"), (Words{"I", "'", "M"}));  // contractions are lower case only
  EXPECT_EQ(t.pretokenize("a  b"), (Words{"a", " ", " b"}));
  EXPECT_EQ(t.pretokenize("x \n\n y"), (Words{"x", " \n\n", " y"}));
  EXPECT_EQ(t.pretokenize("x\n\ny"), (Words{"x", "\n", "\n", "y"}));
  EXPECT_EQ(t.pretokenize("end   "), (Words{"end", "   "}));
  EXPECT_EQ(t.pretokenize("a ... b"), (Words{"a", " ...", " b"}));
  EXPECT_EQ(t.pretokenize("h\xC3\xA9llo w\xC3\xB6rld"), (Words{"h\xC3\xA9llo", " w\xC3\xB6rld"}));
  // CJK ideographs and kana are letters (Lo): one word.
  EXPECT_EQ(t.pretokenize("\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E"), (Words{"\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E"}));
  // NBSP (U+00A0) is whitespace; '½' (U+00BD, No) a number.
  EXPECT_EQ(t.pretokenize("a\xC2\xA0\xC2\xBD"), (Words{"a", "\xC2\xA0", "\xC2\xBD"}));
}

TEST(BpeTokenizer, SmollmSplitsEveryDigit) {
  const auto t = tiny({}, {}, "smollm");
  EXPECT_EQ(t.pretokenize("It's 12345 o'clock"),
            (Words{"It", "'s", " ", "1", "2", "3", "4", "5", " o", "'", "clock"}));
  EXPECT_EQ(t.pretokenize("In 2007, 29 June"),
            (Words{"In", " ", "2", "0", "0", "7", ",", " ", "2", "9", " June"}));
  EXPECT_EQ(t.pretokenize("x\xC2\xB2"), (Words{"x", "\xC2\xB2"}));  // '²' (No) alone
}

TEST(BpeTokenizer, InvalidUtf8IsKeptByteExact) {
  const auto t = tiny({}, {});
  const std::string s = "a\xFF" "b\xC3(\xE2\x82";
  EXPECT_EQ(t.pretokenize(s), (Words{"a", "\xFF", "b", "\xC3(\xE2\x82"}));
  const auto ids = t.encode(s);
  EXPECT_EQ(ids, (std::vector<int>{'a', 0xFF, 'b', 0xC3, '(', 0xE2, 0x82}));
  EXPECT_EQ(t.decode(ids), s);
}

TEST(BpeTokenizer, MergesLowestRankFirstLeftmostOnTies) {
  // "abc" with a+b ranked before b+c: (ab)c -> abc.
  const auto t1 = tiny({"a b", "b c", "ab c"}, {"ab", "bc", "abc"});
  EXPECT_EQ(t1.encode("abc"), (std::vector<int>{258}));
  // b+c ranked first: a(bc), and no merge joins a with bc.
  const auto t2 = tiny({"b c", "a b", "ab c"}, {"ab", "bc", "abc"});
  EXPECT_EQ(t2.encode("abc"), (std::vector<int>{'a', 257}));
  // Ties: "aaa" merges its leftmost pair.
  const auto t3 = tiny({"a a"}, {"aa"});
  EXPECT_EQ(t3.encode("aaa"), (std::vector<int>{256, 'a'}));
  EXPECT_EQ(t3.encode("aaaa"), (std::vector<int>{256, 256}));
  // Space symbols: " a" is one merge of 'Ġ' and 'a'.
  const auto t4 = tiny({sym(' ') + " a"}, {sym(' ') + "a"});
  EXPECT_EQ(t4.encode("a a"), (std::vector<int>{'a', 256}));
  EXPECT_EQ(t4.decode(t4.encode("a a")), "a a");
}

/// The textbook BPE of one word, written independently of the tokenizer: rescan every
/// adjacent pair, merge the one of lowest rank (leftmost on ties), repeat. Quadratic; for short
/// words only. Returns the final symbols.
std::vector<std::string> reference_bpe(const std::string& word,
                                       const std::vector<std::string>& merges) {
  std::vector<std::string> s;
  for (unsigned char c : word) s.push_back(sym(c));
  for (;;) {
    size_t best_rank = merges.size(), at = 0;
    for (size_t k = 0; k + 1 < s.size(); ++k) {
      const std::string pair = s[k] + " " + s[k + 1];
      for (size_t r = 0; r < best_rank; ++r)
        if (merges[r] == pair) {
          best_rank = r;
          at = k;
          break;
        }
    }
    if (best_rank == merges.size()) return s;
    s[at] += s[at + 1];
    s.erase(s.begin() + static_cast<std::ptrdiff_t>(at) + 1);
  }
}

TEST(BpeTokenizer, MergesEqualTheTextbookRescanOnRandomWords) {
  // Random merge lists over {a, b, c} (every merge result in the vocabulary) and random words:
  // the tokenizer's heap-ordered merges give exactly the rescan's symbols.
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<std::string> pool = {"a", "b", "c"}, merges, extra;
    const int n_merges = 1 + static_cast<int>(rng() % 12);
    for (int m = 0; m < n_merges; ++m) {
      const std::string x = pool[rng() % pool.size()];
      const std::string y = pool[rng() % pool.size()];
      const std::string mg = x + " " + y;
      if (std::find(merges.begin(), merges.end(), mg) != merges.end()) continue;
      merges.push_back(mg);
      if (std::find(pool.begin(), pool.end(), x + y) == pool.end()) {
        pool.push_back(x + y);
        extra.push_back(x + y);
      }
    }
    const auto t = tiny(merges, extra, "gpt2");
    for (int w = 0; w < 10; ++w) {
      std::string word;
      const int len = 1 + static_cast<int>(rng() % 40);
      for (int k = 0; k < len; ++k) word.push_back(static_cast<char>('a' + rng() % 3));
      std::vector<int> want;
      for (const std::string& piece : reference_bpe(word, merges)) {
        const auto it = std::find(extra.begin(), extra.end(), piece);
        want.push_back(piece.size() == 1 ? static_cast<unsigned char>(piece[0])
                                         : 256 + static_cast<int>(it - extra.begin()));
      }
      ASSERT_EQ(t.encode(word), want) << "word " << word << ", trial " << trial;
    }
  }
}

TEST(BpeTokenizer, LongRepeatedLetterWordIsMergedExactly) {
  // One 65537-letter word (the quadratic rescan took 5.6 s on it; the heap merges it in
  // O(n log n)). Merges a+a, aa+aa, aaaa+aaaa pair up leftmost first: 8192 "a"x8 tokens and
  // the odd trailing "a".
  const auto t = tiny({"a a", "aa aa", "aaaa aaaa"}, {"aa", "aaaa", "aaaaaaaa"}, "gpt2");
  std::vector<int> want(8192, 258);
  want.push_back('a');
  EXPECT_EQ(t.encode(std::string(65537, 'a')), want);
  // "ab" repeated: no merge applies to a+b, so every byte stays its own symbol.
  std::string ab;
  for (int k = 0; k < 32768; ++k) ab += "ab";
  const auto ids = t.encode(ab);
  ASSERT_EQ(ids.size(), ab.size());
  for (size_t k = 0; k < ids.size(); ++k) ASSERT_EQ(ids[k], static_cast<unsigned char>(ab[k]));
}

TEST(BpeTokenizer, UserDefinedTokensMatchControlTokensDoNot) {
  const auto t = tiny({}, {"<ctl>", "<usr>"}, "smollm",
                      {BpeTokenizer::kControl, BpeTokenizer::kUserDefined});
  const auto ids = t.encode("x<usr>y<ctl>");
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids[0], 'x');
  EXPECT_EQ(ids[1], 257);  // <usr> as one token
  EXPECT_EQ(ids[2], 'y');
  EXPECT_EQ(ids.size(), 3u + 5u);  // "<ctl>" spelled out byte by byte
  EXPECT_EQ(t.decode(ids), "x<usr>y<ctl>");
}

TEST(BpeTokenizer, BosAndErrors) {
  const auto t = tiny({}, {"<s>"}, "smollm", {BpeTokenizer::kControl}, /*add_bos=*/true);
  EXPECT_EQ(t.encode("a"), (std::vector<int>{256, 'a'}));
  EXPECT_EQ(t.encode("a", false), (std::vector<int>{'a'}));
  EXPECT_THROW(tiny({}, {}, "llama-bpe"), kvq::Error);  // pre-tokenizer not implemented
  EXPECT_THROW(tiny({"ab"}, {}), kvq::Error);           // a merge without its space
  EXPECT_THROW(t.token(100000), kvq::Error);
}

// ---------------------------------------------------------------------------------------------
// SmolLM2 against llama.cpp's ids (shared/docs/reference.md)
// ---------------------------------------------------------------------------------------------

class SmolLM2Tokenizer : public ::testing::Test {
 protected:
  void SetUp() override {
    KVQ_REQUIRE_SMOLLM2();
    const auto f = kvq::io::GgufFile::open(kvq_test::smollm2_gguf_path());
    tok_ = std::make_unique<BpeTokenizer>(BpeTokenizer::from_gguf(f));
  }
  std::unique_ptr<BpeTokenizer> tok_;
};

TEST_F(SmolLM2Tokenizer, ReferenceIds) {
  const BpeTokenizer& t = *tok_;
  EXPECT_EQ(t.vocab_size(), 49152);
  EXPECT_EQ(t.pre(), "smollm");
  EXPECT_FALSE(t.add_bos());
  EXPECT_EQ(t.encode("Hello world"), (std::vector<int>{19556, 905}));
  EXPECT_EQ(t.encode("In 2007, 29 June"),
            (std::vector<int>{788, 216, 34, 32, 32, 39, 28, 216, 34, 41, 4019}));
  EXPECT_EQ(t.encode("It's 12345 o'clock; don't!"),
            (std::vector<int>{1589, 506, 216, 33, 34, 35, 36, 37, 263, 23, 17466, 43, 1326, 982, 17}));
  EXPECT_EQ(t.encode("x\n\ny"), (std::vector<int>{104, 198, 198, 105}));
  EXPECT_EQ(t.encode("3.14159e-10 + 1,000,000"),
            (std::vector<int>{35, 30, 33, 36, 33, 37, 41, 85, 29, 33, 32, 1232, 216, 33, 28, 32,
                              32, 32, 28, 32, 32, 32}));
  for (const char* s : {"Hello world", "It's 12345 o'clock; don't!", "x\n\ny"}) {
    EXPECT_EQ(t.decode(t.encode(s)), s);
  }
}

TEST_F(SmolLM2Tokenizer, DevTextLines) {
  std::ifstream in(kvq_test::smollm2_text_path(), std::ios::binary);
  std::vector<size_t> counts;
  std::vector<int> first;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();  // the protocol reads text lines
    if (line.empty()) continue;
    const auto ids = tok_->encode(line);
    if (counts.empty()) first.assign(ids.begin(), ids.begin() + 20);
    counts.push_back(ids.size());
    EXPECT_EQ(tok_->decode(ids), line);
  }
  EXPECT_EQ(first, (std::vector<int>{22459, 1980, 253, 655, 665, 436, 253, 1838, 8180, 617, 4146,
                                     288, 2217, 260, 905, 30, 2306, 3413, 874, 2652}));
  EXPECT_EQ(counts, (std::vector<size_t>{186, 186, 208, 633, 158, 209, 236, 220, 250}));
}

}  // namespace

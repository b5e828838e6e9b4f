// SentencePiece-style tokenizer (eval/spm_tokenizer.hpp): merge order by score, leftmost on
// ties, byte fallback and the unknown token, user-defined pieces cut out of the raw text,
// control tokens as plain text, the space prefix, decoding; GgufTokenizer's choice between BPE
// and SPM; and Gemma 3's tokenizer against ids from the `sentencepiece` package itself (a
// SentencePiece BPE model rebuilt from the GGUF's pieces, scores and types by
// tests/eval/gemma3_reference.py: an implementation independent of kvq's) on tricky text
// (Unicode, whitespace runs, digits, emoji, HTML tags, control characters) and the dev text.
#include "kvq/eval/spm_tokenizer.hpp"

#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "gemma3_data.hpp"
#include "io/gguf_test_util.hpp"
#include "kvq/eval/gguf_tokenizer.hpp"

namespace {

using kvq::eval::SpmTokenizer;
using Ids = std::vector<int>;

const char* const kSp = "\xE2\x96\x81";  // U+2581

/// A vocabulary: <unk> <s> </s>, optional byte tokens <0x00>..<0xFF> (ids 3..258), then
/// `pieces` with scores `scores` and types (normal unless given).
SpmTokenizer tiny(const std::vector<std::string>& pieces, const std::vector<float>& scores,
                  bool bytes = true, std::vector<int> types = {}, bool space_prefix = false) {
  std::vector<std::string> tok = {"<unk>", "<s>", "</s>"};
  std::vector<float> sc = {0, 0, 0};
  std::vector<int> ty = {SpmTokenizer::kUnknown, SpmTokenizer::kControl, SpmTokenizer::kControl};
  if (bytes) {
    for (int b = 0; b < 256; ++b) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "<0x%02X>", b);
      tok.push_back(buf);
      sc.push_back(0);
      ty.push_back(SpmTokenizer::kByte);
    }
  }
  for (size_t i = 0; i < pieces.size(); ++i) {
    tok.push_back(pieces[i]);
    sc.push_back(scores[i]);
    ty.push_back(i < types.size() ? types[i] : SpmTokenizer::kNormal);
  }
  SpmTokenizer::Options o;
  o.unk = 0;
  o.bos = 1;
  o.eos = 2;
  o.add_bos = false;
  o.add_space_prefix = space_prefix;
  return SpmTokenizer(tok, sc, ty, o);
}

int base(bool bytes = true) { return bytes ? 259 : 3; }

TEST(SpmTokenizer, MergesHighestScoreFirst) {
  // pieces: a b c ab bc abc; "bc" outscores "ab", so "abc" comes from a + bc.
  const auto t = tiny({"a", "b", "c", "ab", "bc", "abc"}, {-1, -1, -1, -5, -2, -3});
  const int B = base();
  EXPECT_EQ(t.encode("abc"), (Ids{B + 5}));
  EXPECT_EQ(t.encode("ab"), (Ids{B + 3}));
  EXPECT_EQ(t.encode("cab"), (Ids{B + 2, B + 3}));
  // Without "abc", "bc" wins over "ab": a + bc.
  const auto u = tiny({"a", "b", "c", "ab", "bc"}, {-1, -1, -1, -5, -2});
  EXPECT_EQ(u.encode("abc"), (Ids{base(), base() + 4}));
}

TEST(SpmTokenizer, LeftmostOnEqualScores) {
  const auto t = tiny({"a", "aa"}, {-1, -2});
  const int B = base();
  EXPECT_EQ(t.encode("aaa"), (Ids{B + 1, B}));  // (aa)(a), not (a)(aa)
  EXPECT_EQ(t.encode("aaaa"), (Ids{B + 1, B + 1}));
}

TEST(SpmTokenizer, SpacesBecomeU2581AndDecodeBack) {
  const std::string sp = kSp;
  const auto t = tiny({sp, "a", sp + "a", "b"}, {-1, -1, -2, -1});
  const int B = base();
  EXPECT_EQ(t.encode("a a"), (Ids{B + 1, B + 2}));
  EXPECT_EQ(t.encode(" a"), (Ids{B + 2}));
  EXPECT_EQ(t.encode("  b"), (Ids{B, B, B + 3}));
  EXPECT_EQ(t.decode(t.encode("a a  b ")), "a a  b ");
  // The space prefix (add_space_prefix): one U+2581 before the text.
  const auto p = tiny({sp, "a", sp + "a"}, {-1, -1, -2}, true, {}, true);
  EXPECT_EQ(p.encode("a"), (Ids{B + 2}));
  EXPECT_EQ(p.encode(""), (Ids{}));
}

TEST(SpmTokenizer, ByteFallbackAndUnknown) {
  const auto t = tiny({"a"}, {-1});
  // "é" (C3 A9) is not a piece: its two bytes.
  EXPECT_EQ(t.encode("a\xC3\xA9"), (Ids{base(), 3 + 0xC3, 3 + 0xA9}));
  EXPECT_EQ(t.decode(t.encode("a\xC3\xA9")), "a\xC3\xA9");
  // Invalid UTF-8 is kept byte by byte.
  EXPECT_EQ(t.encode("\xFF" "a"), (Ids{3 + 0xFF, base()}));
  // No byte tokens: the unknown token for the whole character.
  const auto u = tiny({"a"}, {-1}, false);
  EXPECT_EQ(u.encode("a\xC3\xA9" "a"), (Ids{base(false), 0, base(false)}));
}

TEST(SpmTokenizer, UserDefinedCutFirstControlIsText) {
  const int U = SpmTokenizer::kUserDefined, N = SpmTokenizer::kNormal;
  // user-defined "\n\n", "  " (raw spaces), "<b>"; normal "<", "b", ">", "x", "\n"
  const auto t = tiny({"\n\n", "  ", "<b>", "<", "b", ">", "x", "\n"}, {0, 0, 0, -1, -1, -1, -1, -1},
                      true, {U, U, U, N, N, N, N, N});
  const int B = base();
  EXPECT_EQ(t.encode("x\n\n\nx"), (Ids{B + 6, B, B + 7, B + 6}));  // leftmost-longest
  EXPECT_EQ(t.encode("x  x"), (Ids{B + 6, B + 1, B + 6}));
  EXPECT_EQ(t.encode("<b>x"), (Ids{B + 2, B + 6}));
  // "<s>" is a control token: in text it is three characters.
  const Ids ids = t.encode("<s>");
  EXPECT_EQ(ids.size(), 3u);
  EXPECT_EQ(ids[0], B + 3);
  EXPECT_EQ(t.decode(t.encode("x  <b>\n\nx")), "x  <b>\n\nx");
  EXPECT_EQ(t.decode({1, B + 6, 2}), "x");  // control tokens decode to nothing
}

TEST(SpmTokenizer, BosAndErrors) {
  const auto t = tiny({"a"}, {-1});
  EXPECT_EQ(t.encode("a", true), (Ids{1, base()}));
  EXPECT_THROW(t.token(-1), kvq::Error);
  EXPECT_THROW(t.piece_bytes(1 << 20), kvq::Error);
  SpmTokenizer::Options o;
  o.add_bos = true;  // but no bos id
  EXPECT_THROW(SpmTokenizer({"a"}, {0.f}, {1}, o), kvq::Error);
  EXPECT_THROW(SpmTokenizer({"a", "b"}, {0.f}, {1, 1}, SpmTokenizer::Options{}), kvq::Error);
}

TEST(GgufTokenizer, PicksTheKindFromTheMetadata) {
  {
    kvq_test::GgufBuilder b;
    b.str("general.architecture", "gemma3");
    b.str("tokenizer.ggml.model", "llama");
    b.strings("tokenizer.ggml.tokens", {"<pad>", "<eos>", "<bos>", "a", "b", "ab", "\n\n"});
    b.f32s("tokenizer.ggml.scores", {0, 0, 0, -1, -1, -2, 0});
    b.i32s("tokenizer.ggml.token_type", {3, 3, 3, 1, 1, 1, 4});
    b.u32("tokenizer.ggml.bos_token_id", 2);
    b.u32("tokenizer.ggml.eos_token_id", 1);
    b.boolean("tokenizer.ggml.add_space_prefix", false);
    const auto bytes = b.build();
    const auto f = kvq::io::GgufFile::parse(bytes.data(), bytes.size());
    const auto t = kvq::eval::GgufTokenizer::from_gguf(f);
    EXPECT_STREQ(t.kind(), "spm");
    EXPECT_TRUE(t.add_bos());  // llama.cpp's default for SentencePiece vocabularies
    EXPECT_EQ(t.encode("ab\n\nb"), (Ids{2, 5, 6, 4}));
    EXPECT_TRUE(t.is_end(1));
    EXPECT_FALSE(t.is_end(2));
    EXPECT_EQ(t.piece_bytes(5), "ab");
  }
  kvq_test::GgufBuilder b;
  b.str("general.architecture", "llama");
  b.str("tokenizer.ggml.model", "t5");
  b.strings("tokenizer.ggml.tokens", {"a"});
  const auto bytes = b.build();
  const auto f = kvq::io::GgufFile::parse(bytes.data(), bytes.size());
  try {
    kvq::eval::GgufTokenizer::from_gguf(f);
    FAIL() << "a t5 tokenizer was accepted";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'t5' is not implemented"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// Gemma 3 270M against the sentencepiece package (ids recorded by gemma3_reference.py)
// ---------------------------------------------------------------------------------------------

class Gemma3Tokenizer : public ::testing::Test {
 protected:
  void SetUp() override {
    KVQ_REQUIRE_GEMMA3();
    const auto f = kvq::io::GgufFile::open(kvq_test::gemma3_gguf_path());
    tok_ = std::make_unique<kvq::eval::GgufTokenizer>(kvq::eval::GgufTokenizer::from_gguf(f));
  }
  std::unique_ptr<kvq::eval::GgufTokenizer> tok_;
};

TEST_F(Gemma3Tokenizer, SentencepieceIds) {
  const auto& t = *tok_;
  ASSERT_STREQ(t.kind(), "spm");
  EXPECT_EQ(t.vocab_size(), 262144);
  EXPECT_TRUE(t.add_bos());
  EXPECT_EQ(t.bos_id(), 2);
  EXPECT_EQ(t.eos_id(), 1);
  struct Case {
    const char* text;
    Ids ids;
  };
  const std::vector<Case> cases = {
      {"Hello world", {9259, 1902}},
      {"In 2007, 29 June", {902, 236743, 236778, 236771, 236771, 236832, 236764, 236743, 236778, 236819, 5142}},
      {"It's 12345 o'clock; don't!",
       {1509, 236789, 236751, 236743, 236770, 236778, 236800, 236812, 236810, 512, 236789, 15868,
        236793, 1537, 236789, 236745, 236888}},
      {"x\n\ny", {236781, 108, 236762}},
      {"  two  spaces\tand\ttabs\t\t", {138, 13498, 138, 35220, 255968, 624, 255968, 39218, 255969}},
      {"h\xC3\xA9llo w\xC3\xB6rld \xE2\x80\x94 \xE2\x98\x83 \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E \xF0\x9F\x8E\x89",
       {236754, 7869, 844, 515, 4010, 671, 2192, 236743, 246690, 33375, 238582, 204906}},
      {"e\xCC\x81 \xC7\x85", {236744, 238288, 236743, 437, 371}},  // combining accent; byte fallback
      {"a\xE2\x80\x8B" "b", {236746, 237141, 236763}},                 // zero-width space
      {"3.14159e-10 + 1,000,000",
       {236800, 236761, 236770, 236812, 236770, 236810, 236819, 236744, 236772, 236770, 236771,
        900, 236743, 236770, 236764, 236771, 236771, 236771, 236764, 236771, 236771, 236771}},
      {" leading space", {5830, 2557}},
      {"trailing spaces   ", {136697, 9952, 139}},
      {"<bos> is text, <b>bold</b> and <table>",
       {236820, 46757, 236813, 563, 1816, 236764, 236743, 200, 15640, 209, 532, 236743, 168}},
      {"line1\r\nline2\n\n\n\nend", {1257, 236770, 251, 107, 1257, 236778, 110, 643}},
      {"    indented\n        more", {140, 724, 16764, 107, 144, 5576}},
      {"\xC3\x9Cn\xC3\xAF" "c\xC3\xB6" "d\xC3\xA9 \xC3\x85\xC3\x84\xC3\x96 \xC3\xB1 \xC3\x9F \xEF\xAC\x81",
       {238194, 236749, 238527, 236755, 55515, 236859, 44667, 239122, 238255, 131079, 114881, 97940}},
      {"\xF0\x9F\x98\x80\xF0\x9F\x98\x83\xF0\x9F\x98\x84 \xF0\x9F\x87\xA9\xF0\x9F\x87\xAA",
       {242398, 243065, 242850, 236743, 246841, 245562}},
      {"\x01\x7f control", {249732, 251541, 2256}},
      {"", {}},
      {"a", {236746}},
      {"\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E\xE3\x81\xAE\xE3\x83\x86\xE3\x82\xAD\xE3\x82\xB9\xE3\x83\x88"
       "\xE3\x81\xA7\xE3\x81\x99\xE3\x80\x82",
       {94951, 236945, 95830, 3652, 236924}},
      {"\xD0\x9F\xD1\x80\xD0\xB8\xD0\xB2\xD0\xB5\xD1\x82, \xD0\xBC\xD0\xB8\xD1\x80!",
       {116130, 236764, 58562, 236888}},
      {"\xD9\x85\xD8\xB1\xD8\xAD\xD8\xA8\xD8\xA7 \xD8\xA8\xD8\xA7\xD9\x84\xD8\xB9\xD8\xA7\xD9\x84\xD9\x85",
       {236873, 150345, 107602, 17193}},
      {"1234567890", {236770, 236778, 236800, 236812, 236810, 236825, 236832, 236828, 236819, 236771}},
      {"   ", {139}},
      {"\t", {255968}},
      {"The quick brown fox jumps over the lazy dog.",
       {818, 3823, 8864, 37423, 38167, 1024, 506, 31770, 4799, 236761}},
  };
  for (const Case& c : cases) {
    Ids want = {2};
    want.insert(want.end(), c.ids.begin(), c.ids.end());
    EXPECT_EQ(t.encode(c.text), want) << "text: " << c.text;
    EXPECT_EQ(t.encode(c.text, false), c.ids) << "text: " << c.text;
    EXPECT_EQ(t.decode(t.encode(c.text)), c.text);  // BOS decodes to nothing
  }
}

TEST_F(Gemma3Tokenizer, DevTextLines) {
  std::ifstream in(kvq_test::smollm2_text_path(), std::ios::binary);
  std::vector<size_t> counts;
  Ids first;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    const auto ids = tok_->encode(line);
    if (counts.empty()) first.assign(ids.begin(), ids.begin() + 20);
    counts.push_back(ids.size());
    EXPECT_EQ(tok_->decode(ids), line);
  }
  EXPECT_EQ(first, (Ids{2, 20073, 3324, 496, 990, 993, 691, 496, 2268, 3953, 1015, 5048, 531,
                        11327, 506, 1902, 236761, 2625, 4733, 1116}));
  // BOS included; the 630 is cut to 512 by the protocol: 2179 predictions in all.
  EXPECT_EQ(counts, (std::vector<size_t>{189, 189, 209, 630, 160, 212, 236, 225, 256}));
  size_t predictions = 0;
  for (size_t c : counts) predictions += std::min<size_t>(c, 512) - 1;
  EXPECT_EQ(predictions, 2179u);
}

}  // namespace

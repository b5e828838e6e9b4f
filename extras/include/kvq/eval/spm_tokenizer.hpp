#pragma once
/// \file spm_tokenizer.hpp
/// SentencePiece-style tokenizer as GGUF stores it (tokenizer.ggml.model "llama": Llama 1/2,
/// Gemma, ...): a vocabulary of pieces with scores and types, no merge list.
///
/// Encoding, as SentencePiece's BPE model does it:
///  1. user-defined pieces (type 4: Gemma's runs of newlines, tabs and spaces, HTML tags) are
///     cut out of the raw text first, leftmost-longest, and become their own tokens;
///  2. in every other stretch, spaces become U+2581 ("▁"), with one prepended to the text when
///     tokenizer.ggml.add_space_prefix says so;
///  3. the stretch starts as one symbol per UTF-8 character; the adjacent pair whose
///     concatenation is a piece (normal, user-defined or unused) with the highest score is
///     merged, leftmost first on ties, until no pair is a piece;
///  4. each final symbol is its piece's id, or (byte fallback) one <0xXX> token per byte, or
///     the unknown token when the vocabulary has no byte tokens.
/// Control tokens (<bos>, <eos>, ...) in the text are plain text, never their ids.
///
/// Decoding maps "▁" back to a space and byte tokens back to their byte; control tokens give
/// nothing, user-defined ones their text.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <queue>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvq/core/error.hpp"
#include "kvq/io/gguf.hpp"

namespace kvq::eval {

class SpmTokenizer {
 public:
  /// Token types of tokenizer.ggml.token_type (as BpeTokenizer's).
  enum TokenType { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };

  /// Reads the tokenizer of a GGUF file; kUnsupported unless tokenizer.ggml.model is "llama",
  /// kIo when the metadata is inconsistent (names the key).
  static SpmTokenizer from_gguf(const io::GgufFile& f) {
    const std::string model = f.get_string("tokenizer.ggml.model");
    KVQ_REQUIRE(model == "llama", kUnsupported, f.source(), ": tokenizer.ggml.model is '", model,
                "'; SpmTokenizer implements 'llama' (SentencePiece)");
    const std::vector<std::string>& tokens = f.get_strings("tokenizer.ggml.tokens");
    const int64_t n = static_cast<int64_t>(tokens.size());
    std::vector<float> scores(tokens.size(), 0.0f);
    if (f.has("tokenizer.ggml.scores")) {
      const io::GgufValue* v = f.find("tokenizer.ggml.scores");
      KVQ_REQUIRE(v->type == io::GgufValueType::kArray &&
                      (v->elem_type == io::GgufValueType::kF32 ||
                       v->elem_type == io::GgufValueType::kF64) &&
                      v->count == tokens.size(),
                  kIo, f.source(), ": tokenizer.ggml.scores is not an array of ", tokens.size(),
                  " floats");
      for (size_t i = 0; i < scores.size(); ++i) scores[i] = static_cast<float>(v->float_at(i));
    }
    std::vector<int> types(tokens.size(), kNormal);
    if (f.has("tokenizer.ggml.token_type")) {
      const std::vector<int64_t> t = f.get_ints("tokenizer.ggml.token_type");
      KVQ_REQUIRE(t.size() == tokens.size(), kIo, f.source(), ": tokenizer.ggml.token_type has ",
                  t.size(), " entries, tokenizer.ggml.tokens ", tokens.size());
      for (size_t i = 0; i < t.size(); ++i)
        types[i] = static_cast<int>(std::max<int64_t>(std::min<int64_t>(t[i], 99), -1));
    }
    Options o;
    o.bos = static_cast<int>(f.get_int_or("tokenizer.ggml.bos_token_id", -1, -1, n - 1));
    o.eos = static_cast<int>(f.get_int_or("tokenizer.ggml.eos_token_id", -1, -1, n - 1));
    o.unk = static_cast<int>(f.get_int_or("tokenizer.ggml.unknown_token_id", -1, -1, n - 1));
    // llama.cpp's defaults for SentencePiece vocabularies: BOS added, space prefix added.
    o.add_bos = f.get_bool_or("tokenizer.ggml.add_bos_token", true);
    o.add_eos = f.get_bool_or("tokenizer.ggml.add_eos_token", false);
    o.add_space_prefix = f.get_bool_or("tokenizer.ggml.add_space_prefix", true);
    return SpmTokenizer(tokens, std::move(scores), std::move(types), o);
  }

  struct Options {
    int bos = -1, eos = -1, unk = -1;
    bool add_bos = true, add_eos = false, add_space_prefix = true;
  };

  SpmTokenizer(std::vector<std::string> tokens, std::vector<float> scores, std::vector<int> types,
               const Options& o)
      : tokens_(std::move(tokens)), scores_(std::move(scores)), types_(std::move(types)), o_(o) {
    KVQ_REQUIRE(!tokens_.empty(), kIo, "SPM tokenizer: empty vocabulary");
    KVQ_REQUIRE(tokens_.size() < static_cast<size_t>(std::numeric_limits<int>::max()), kIo,
                "SPM tokenizer: vocabulary too large");
    KVQ_REQUIRE(scores_.size() == tokens_.size() && types_.size() == tokens_.size(), kIo,
                "SPM tokenizer: ", tokens_.size(), " tokens but ", scores_.size(), " scores and ",
                types_.size(), " types");
    for (const int id : {o_.bos, o_.eos, o_.unk})
      KVQ_REQUIRE(id >= -1 && id < vocab_size(), kIo, "SPM tokenizer: special token id ", id,
                  " is not a token");
    KVQ_REQUIRE(!o_.add_bos || o_.bos >= 0, kIo,
                "SPM tokenizer: add_bos_token is set but there is no bos_token_id");
    byte_id_.fill(-1);
    piece_.reserve(tokens_.size());
    for (size_t i = 0; i < tokens_.size(); ++i) {
      const int id = static_cast<int>(i);
      const std::string& t = tokens_[i];
      const int ty = types_[i];
      if (ty == kNormal || ty == kUserDefined || ty == kUnused) piece_.emplace(t, id);  // first wins
      if (ty == kUserDefined && !t.empty()) {
        user_[static_cast<uint8_t>(t[0])].push_back(id);
      }
      if (ty == kByte) {
        unsigned b = 0;
        if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' &&
            std::sscanf(t.c_str() + 3, "%2x", &b) == 1 && byte_id_[b] < 0) {
          byte_id_[b] = id;
        }
      }
    }
    for (auto& u : user_) {  // longest first: the first match is the longest
      std::stable_sort(u.begin(), u.end(), [&](int a, int b) {
        return tokens_[static_cast<size_t>(a)].size() > tokens_[static_cast<size_t>(b)].size();
      });
    }
  }

  int vocab_size() const { return static_cast<int>(tokens_.size()); }
  bool add_bos() const { return o_.add_bos; }
  int bos_id() const { return o_.bos; }
  int eos_id() const { return o_.eos; }
  int unk_id() const { return o_.unk; }
  const std::string& token(int id) const {
    check_id(id);
    return tokens_[static_cast<size_t>(id)];
  }
  float score(int id) const {
    check_id(id);
    return scores_[static_cast<size_t>(id)];
  }
  int type(int id) const {
    check_id(id);
    return types_[static_cast<size_t>(id)];
  }

  /// Token ids of `text`; BOS first (EOS last) when the metadata says so.
  std::vector<int> encode(const std::string& text) const { return encode(text, o_.add_bos); }
  /// Token ids of `text`, with BOS first when `bos`.
  std::vector<int> encode(const std::string& text, bool bos) const {
    std::vector<int> ids;
    if (bos) {
      KVQ_REQUIRE(o_.bos >= 0, kInvalidArgument, "SPM tokenizer: BOS requested but the "
                  "vocabulary has no bos_token_id");
      ids.push_back(o_.bos);
    }
    std::string stretch;  // text between user-defined pieces, spaces escaped
    const auto flush = [&]() {
      if (!stretch.empty()) bpe(stretch, &ids);
      stretch.clear();
    };
    size_t i = 0;
    if (o_.add_space_prefix && !text.empty()) stretch = kSpace;
    while (i < text.size()) {
      const int u = match_user(text, i);
      if (u >= 0) {
        flush();
        ids.push_back(u);
        i += tokens_[static_cast<size_t>(u)].size();
      } else {
        if (text[i] == ' ') {
          stretch += kSpace;
        } else {
          stretch += text[i];
        }
        ++i;
      }
    }
    flush();
    if (o_.add_eos && o_.eos >= 0) ids.push_back(o_.eos);
    return ids;
  }

  /// The bytes of one token as text: "▁" as a space, a byte token as its byte, a control token
  /// as nothing (a piece of a UTF-8 character may end mid-character: concatenate).
  std::string piece_bytes(int id) const {
    check_id(id);
    const std::string& t = tokens_[static_cast<size_t>(id)];
    switch (types_[static_cast<size_t>(id)]) {
      case kControl: return std::string();
      case kUserDefined: return t;
      case kByte:
        for (int b = 0; b < 256; ++b)
          if (byte_id_[static_cast<size_t>(b)] == id) return std::string(1, static_cast<char>(b));
        return t;
      default: break;
    }
    std::string out;
    for (size_t i = 0; i < t.size();) {
      if (t.compare(i, 3, kSpace) == 0) {
        out += ' ';
        i += 3;
      } else {
        out += t[i++];
      }
    }
    return out;
  }

  /// The text of `ids` (concatenated piece_bytes()).
  std::string decode(const std::vector<int>& ids) const {
    std::string out;
    for (int id : ids) out += piece_bytes(id);
    return out;
  }

 private:
  static constexpr const char* kSpace = "\xE2\x96\x81";  // U+2581

  void check_id(int id) const {
    KVQ_REQUIRE(id >= 0 && id < vocab_size(), kInvalidArgument, "SPM tokenizer: token id ", id,
                " out of range [0, ", vocab_size(), ")");
  }

  /// The longest user-defined piece starting at text[i], or -1.
  int match_user(const std::string& text, size_t i) const {
    for (int id : user_[static_cast<uint8_t>(text[i])]) {
      const std::string& t = tokens_[static_cast<size_t>(id)];
      if (text.compare(i, t.size(), t) == 0) return id;
    }
    return -1;
  }

  /// Length of the UTF-8 character starting at s[i] (1 for an invalid or truncated one).
  static size_t char_len(const std::string& s, size_t i) {
    const auto c = static_cast<uint8_t>(s[i]);
    size_t n = 1;
    if (c >= 0xF0 && c < 0xF8) {
      n = 4;
    } else if (c >= 0xE0) {
      n = c < 0xF0 ? 3 : 1;
    } else if (c >= 0xC0) {
      n = 2;
    }
    if (n == 1 || i + n > s.size()) return 1;
    for (size_t k = 1; k < n; ++k)
      if ((static_cast<uint8_t>(s[i + k]) & 0xC0) != 0x80) return 1;
    return n;
  }

  /// SentencePiece BPE over one stretch (spaces already escaped).
  void bpe(const std::string& s, std::vector<int>* ids) const {
    struct Sym {
      size_t off, len;
      int prev, next;
    };
    std::vector<Sym> sym;
    for (size_t i = 0; i < s.size();) {
      const size_t n = char_len(s, i);
      const int k = static_cast<int>(sym.size());
      sym.push_back(Sym{i, n, k - 1, k + 1});
      i += n;
    }
    if (sym.empty()) return;
    sym.back().next = -1;
    struct Pair {
      float score;
      int left, right;
      size_t len;  // merged length when queued (stale entries are skipped)
    };
    const auto worse = [](const Pair& a, const Pair& b) {  // priority: high score, then left
      if (a.score != b.score) return a.score < b.score;
      return a.left > b.left;
    };
    std::priority_queue<Pair, std::vector<Pair>, decltype(worse)> queue(worse);
    std::string scratch;
    const auto consider = [&](int l, int r) {
      if (l < 0 || r < 0) return;
      scratch.assign(s, sym[static_cast<size_t>(l)].off,
                     sym[static_cast<size_t>(l)].len + sym[static_cast<size_t>(r)].len);
      const auto it = piece_.find(scratch);
      if (it == piece_.end()) return;
      queue.push(Pair{scores_[static_cast<size_t>(it->second)], l, r, scratch.size()});
    };
    for (int k = 0; k + 1 < static_cast<int>(sym.size()); ++k) consider(k, k + 1);
    while (!queue.empty()) {
      const Pair p = queue.top();
      queue.pop();
      Sym& L = sym[static_cast<size_t>(p.left)];
      Sym& R = sym[static_cast<size_t>(p.right)];
      // Stale: either side already merged away or grown since this pair was queued.
      if (L.len == 0 || R.len == 0 || L.next != p.right || L.len + R.len != p.len) continue;
      L.len += R.len;
      R.len = 0;
      L.next = R.next;
      if (R.next >= 0) sym[static_cast<size_t>(R.next)].prev = p.left;
      consider(L.prev, p.left);
      consider(p.left, L.next);
    }
    for (int k = 0; k >= 0; k = sym[static_cast<size_t>(k)].next) {
      const Sym& x = sym[static_cast<size_t>(k)];
      scratch.assign(s, x.off, x.len);
      const auto it = piece_.find(scratch);
      if (it != piece_.end()) {
        ids->push_back(it->second);
        continue;
      }
      for (size_t b = 0; b < x.len; ++b) {  // byte fallback
        const int id = byte_id_[static_cast<uint8_t>(s[x.off + b])];
        if (id >= 0) {
          ids->push_back(id);
        } else {
          KVQ_REQUIRE(o_.unk >= 0, kInvalidArgument, "SPM tokenizer: '", scratch,
                      "' is not in the vocabulary, which has neither byte tokens nor an "
                      "unknown token");
          ids->push_back(o_.unk);
          break;  // one unknown token for the whole symbol
        }
      }
    }
  }

  std::vector<std::string> tokens_;
  std::vector<float> scores_;
  std::vector<int> types_;
  Options o_;
  std::unordered_map<std::string, int> piece_;  // normal / user-defined / unused pieces
  std::vector<int> user_[256];                  // user-defined ids by first byte, longest first
  std::array<int, 256> byte_id_{};
};

}  // namespace kvq::eval

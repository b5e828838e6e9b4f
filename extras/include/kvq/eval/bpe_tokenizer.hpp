#pragma once
/// \file bpe_tokenizer.hpp
/// GPT-2 style byte-level BPE tokenizer built from a GGUF file's metadata
/// (tokenizer.ggml.tokens / token_type / merges / pre / add_bos_token), as llama.cpp runs it,
/// so that perplexities measured here are on the same token ids as llama.cpp's.
///
/// Pipeline: (1) user-defined tokens (token type 4) are cut out of the text verbatim, control
/// tokens (type 3) are not matched (llama.cpp's behaviour without "parse special"); (2) the
/// pre-tokenizer named by tokenizer.ggml.pre splits each remaining fragment into words —
/// "smollm" first isolates every \p{N} code point, then applies the GPT-2 pattern
///   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
/// (hand-written matcher below, Unicode classes from eval/unicode_categories.hpp; "gpt2" and
/// "default" skip the digit split); (3) each word's bytes become the printable characters of
/// GPT-2's byte-to-unicode map and are merged by BPE, lowest merge rank first (leftmost on
/// ties); (4) each final symbol is looked up in the vocabulary.
///
/// Invalid UTF-8 bytes are classed as punctuation (neither letter, number nor space) and kept
/// byte-exact, so every input round-trips through decode().
#include <cstdint>
#include <limits>
#include <functional>
#include <queue>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvq/core/error.hpp"
#include "kvq/eval/unicode_categories.hpp"
#include "kvq/io/gguf.hpp"

namespace kvq::eval {

namespace detail {

/// GPT-2's byte -> code point map: the printable bytes '!'..'~', 0xA1..0xAC and 0xAE..0xFF
/// map to themselves, the other 68 bytes to 256, 257, ... in increasing byte order (so every
/// byte has a visible, non-space character: ' ' is U+0120 'Ġ', '\n' is U+010A 'Ċ').
inline const std::vector<uint32_t>& byte_to_codepoint() {
  static const std::vector<uint32_t> table = [] {
    std::vector<uint32_t> t(256);
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      t[b] = printable ? b : next++;
    }
    return t;
  }();
  return table;
}

inline void append_utf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

/// One decoded code point and the bytes of the text it came from.
struct CodePoint {
  uint32_t cp;
  uint32_t offset;  ///< byte offset in the text
  uint32_t len;     ///< bytes (1 for an invalid byte)
};

/// Marks an invalid UTF-8 byte: classed as punctuation, kept byte-exact.
inline constexpr uint32_t kInvalidCodePoint = 0xFFFFFFFFu;

/// Decodes UTF-8 strictly (no overlongs, no surrogates, <= U+10FFFF); each invalid byte becomes
/// its own kInvalidCodePoint entry.
inline std::vector<CodePoint> decode_utf8(const std::string& s, size_t b, size_t e) {
  std::vector<CodePoint> out;
  out.reserve(e - b);
  size_t i = b;
  while (i < e) {
    const auto c0 = static_cast<unsigned char>(s[i]);
    uint32_t cp = kInvalidCodePoint;
    uint32_t len = 1;
    auto cont = [&](size_t k) {
      return i + k < e && (static_cast<unsigned char>(s[i + k]) & 0xC0) == 0x80;
    };
    auto cb = [&](size_t k) { return static_cast<uint32_t>(static_cast<unsigned char>(s[i + k]) & 0x3F); };
    if (c0 < 0x80) {
      cp = c0;
    } else if (c0 >= 0xC2 && c0 <= 0xDF && cont(1)) {
      cp = ((c0 & 0x1Fu) << 6) | cb(1);
      len = 2;
    } else if (c0 >= 0xE0 && c0 <= 0xEF && cont(1) && cont(2)) {
      const uint32_t v = ((c0 & 0x0Fu) << 12) | (cb(1) << 6) | cb(2);
      if (v >= 0x800 && (v < 0xD800 || v > 0xDFFF)) {
        cp = v;
        len = 3;
      }
    } else if (c0 >= 0xF0 && c0 <= 0xF4 && cont(1) && cont(2) && cont(3)) {
      const uint32_t v = ((c0 & 0x07u) << 18) | (cb(1) << 12) | (cb(2) << 6) | cb(3);
      if (v >= 0x10000 && v <= 0x10FFFF) {
        cp = v;
        len = 4;
      }
    }
    out.push_back(CodePoint{cp, static_cast<uint32_t>(i), len});
    i += len;
  }
  return out;
}

inline bool cp_letter(uint32_t c) { return c != kInvalidCodePoint && unicode::is_letter(c); }
inline bool cp_number(uint32_t c) { return c != kInvalidCodePoint && unicode::is_number(c); }
inline bool cp_space(uint32_t c) { return c != kInvalidCodePoint && unicode::is_space(c); }
inline bool cp_other(uint32_t c) { return !cp_letter(c) && !cp_number(c) && !cp_space(c); }

/// The GPT-2 pattern over code points [b, e) of `cps`; appends [begin, end) index ranges.
inline void gpt2_split(const std::vector<CodePoint>& cps, size_t b, size_t e,
                       std::vector<std::pair<size_t, size_t>>* words) {
  size_t pos = b;
  while (pos < e) {
    const uint32_t c = cps[pos].cp;
    // 's 't 're 've 'm 'll 'd (lower case only, as GPT-2's pattern)
    if (c == '\'' && pos + 1 < e) {
      const uint32_t n1 = cps[pos + 1].cp;
      if (n1 == 's' || n1 == 't' || n1 == 'm' || n1 == 'd') {
        words->emplace_back(pos, pos + 2);
        pos += 2;
        continue;
      }
      if (pos + 2 < e) {
        const uint32_t n2 = cps[pos + 2].cp;
        if ((n1 == 'r' && n2 == 'e') || (n1 == 'v' && n2 == 'e') || (n1 == 'l' && n2 == 'l')) {
          words->emplace_back(pos, pos + 3);
          pos += 3;
          continue;
        }
      }
    }
    // ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+'
    const size_t p0 = (c == ' ' && pos + 1 < e) ? pos + 1 : pos;
    const uint32_t c0 = cps[p0].cp;
    bool (*cls)(uint32_t) = nullptr;
    if (cp_letter(c0)) {
      cls = cp_letter;
    } else if (cp_number(c0)) {
      cls = cp_number;
    } else if (cp_other(c0)) {
      cls = cp_other;
    }
    if (cls != nullptr) {
      size_t p = p0;
      while (p < e && cls(cps[p].cp)) ++p;
      words->emplace_back(pos, p);
      pos = p;
      continue;
    }
    // '\s+(?!\S)': a whitespace run not followed by a non-space, i.e. all of it at the end of
    // the fragment, else all but its last character (which then prefixes the next word);
    // '\s+': a single whitespace character before a non-space.
    size_t q = pos;
    while (q < e && cp_space(cps[q].cp)) ++q;
    if (q - pos > 1 && q < e) q -= 1;
    words->emplace_back(pos, q);
    pos = q;
  }
}

}  // namespace detail

/// Byte-level BPE tokenizer (GPT-2 family) from GGUF metadata.
class BpeTokenizer {
 public:
  /// Token types of tokenizer.ggml.token_type.
  enum TokenType { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };

  /// Reads the tokenizer of a GGUF file; throws kUnsupported when tokenizer.ggml.model is not
  /// "gpt2" or the pre-tokenizer is not one implemented here, kIo when the metadata is
  /// inconsistent (names the key).
  static BpeTokenizer from_gguf(const io::GgufFile& f) {
    const std::string model = f.get_string("tokenizer.ggml.model");
    KVQ_REQUIRE(model == "gpt2", kUnsupported, f.source(), ": tokenizer.ggml.model is '", model,
                "'; only 'gpt2' (byte-level BPE) is implemented");
    const std::vector<std::string>& tokens = f.get_strings("tokenizer.ggml.tokens");
    std::vector<int> types;
    if (f.has("tokenizer.ggml.token_type")) {
      const auto& t = f.get_ints("tokenizer.ggml.token_type");
      KVQ_REQUIRE(t.size() == tokens.size(), kIo, f.source(), ": tokenizer.ggml.token_type has ",
                  t.size(), " entries, tokenizer.ggml.tokens ", tokens.size());
      types.reserve(t.size());
      for (int64_t v : t) types.push_back(static_cast<int>(std::max<int64_t>(std::min<int64_t>(v, 99), -1)));
    }
    const int64_t n = static_cast<int64_t>(tokens.size());
    const int64_t bos = f.get_int_or("tokenizer.ggml.bos_token_id", -1, -1, n - 1);
    const int64_t eos = f.get_int_or("tokenizer.ggml.eos_token_id", -1, -1, n - 1);
    return BpeTokenizer(tokens, types, f.get_strings("tokenizer.ggml.merges"),
                        f.get_string_or("tokenizer.ggml.pre", "default"),
                        f.get_bool_or("tokenizer.ggml.add_bos_token", false),
                        static_cast<int>(bos), static_cast<int>(eos));
  }

  BpeTokenizer(std::vector<std::string> tokens, std::vector<int> types,
               const std::vector<std::string>& merges, std::string pre, bool add_bos, int bos_id,
               int eos_id)
      : tokens_(std::move(tokens)),
        types_(std::move(types)),
        pre_(std::move(pre)),
        add_bos_(add_bos),
        bos_(bos_id),
        eos_(eos_id) {
    KVQ_REQUIRE(!tokens_.empty(), kIo, "BPE tokenizer: empty vocabulary");
    KVQ_REQUIRE(tokens_.size() < static_cast<size_t>(std::numeric_limits<int>::max()), kIo,
                "BPE tokenizer: vocabulary too large");
    KVQ_REQUIRE(pre_ == "smollm" || pre_ == "gpt2" || pre_ == "default", kUnsupported,
                "BPE tokenizer: pre-tokenizer '", pre_,
                "' is not implemented (implemented: smollm, gpt2, default)");
    split_digits_ = pre_ == "smollm";
    KVQ_REQUIRE(!add_bos_ || (bos_ >= 0 && bos_ < vocab_size()), kIo,
                "BPE tokenizer: add_bos_token is set but bos_token_id ", bos_, " is not a token");
    if (types_.empty()) types_.assign(tokens_.size(), kNormal);
    id_.reserve(tokens_.size());
    for (size_t i = 0; i < tokens_.size(); ++i) {
      id_.emplace(tokens_[i], static_cast<int>(i));  // first of duplicates wins
      if (types_[i] == kUserDefined && !tokens_[i].empty()) user_defined_.push_back(static_cast<int>(i));
    }
    rank_.reserve(merges.size());
    for (size_t r = 0; r < merges.size(); ++r) {
      const std::string& m = merges[r];
      const size_t sp = m.find(' ', 1);
      KVQ_REQUIRE(sp != std::string::npos && sp + 1 < m.size() && m.find(' ', sp + 1) == std::string::npos,
                  kIo, "BPE tokenizer: merge ", r, " ", io::detail::printable(m),
                  " is not two symbols separated by one space");
      rank_.emplace(m, static_cast<int>(r));  // first of duplicates wins
    }
    const auto& b2c = detail::byte_to_codepoint();
    for (int b = 0; b < 256; ++b) {
      std::string s;
      detail::append_utf8(b2c[static_cast<size_t>(b)], &s);
      byte_sym_[b] = s;
      char_to_byte_.emplace(b2c[static_cast<size_t>(b)], static_cast<uint8_t>(b));
    }
  }

  int vocab_size() const { return static_cast<int>(tokens_.size()); }
  bool add_bos() const { return add_bos_; }
  int bos_id() const { return bos_; }
  int eos_id() const { return eos_; }
  const std::string& pre() const { return pre_; }
  const std::string& token(int id) const {
    KVQ_REQUIRE(id >= 0 && id < vocab_size(), kInvalidArgument, "BPE tokenizer: token id ", id,
                " out of range [0, ", vocab_size(), ")");
    return tokens_[static_cast<size_t>(id)];
  }

  /// Token ids of `text`; BOS first when the metadata's add_bos_token says so.
  std::vector<int> encode(const std::string& text) const { return encode(text, add_bos_); }
  /// Token ids of `text`, with BOS first when `bos` (and a BOS id exists).
  std::vector<int> encode(const std::string& text, bool bos) const {
    std::vector<int> ids;
    if (bos) {
      KVQ_REQUIRE(bos_ >= 0, kInvalidArgument, "BPE tokenizer: BOS requested but the vocabulary "
                  "has no bos_token_id");
      ids.push_back(bos_);
    }
    for (const auto& w : words(text)) {
      if (w.second >= 0) {
        ids.push_back(w.second);
      } else {
        bpe_word(w.first, &ids);
      }
    }
    return ids;
  }

  /// The pre-tokenizer's words (byte strings of the text; user-defined tokens as their own
  /// words). Exposed for tests.
  std::vector<std::string> pretokenize(const std::string& text) const {
    std::vector<std::string> out;
    for (const auto& w : words(text)) out.push_back(w.first);
    return out;
  }

  /// The text of `ids` (byte-level symbols mapped back to bytes; control tokens as their text).
  std::string decode(const std::vector<int>& ids) const {
    std::string out;
    for (int id : ids) {
      const std::string& t = token(id);
      const int ty = types_[static_cast<size_t>(id)];
      if (ty == kControl || ty == kUserDefined) {
        out += t;
        continue;
      }
      const auto cps = detail::decode_utf8(t, 0, t.size());
      for (const auto& c : cps) {
        const auto it = char_to_byte_.find(c.cp);
        if (it != char_to_byte_.end()) {
          out.push_back(static_cast<char>(it->second));
        } else {
          out.append(t, c.offset, c.len);
        }
      }
    }
    return out;
  }

 private:
  /// (word bytes, -1) for text to run BPE on, ("", id) for a user-defined token.
  std::vector<std::pair<std::string, int>> words(const std::string& text) const {
    std::vector<std::pair<std::string, int>> out;
    size_t frag = 0;
    size_t i = 0;
    while (i < text.size()) {
      int hit = -1;
      size_t hit_len = 0;
      for (int id : user_defined_) {
        const std::string& t = tokens_[static_cast<size_t>(id)];
        if (t.size() > hit_len && text.compare(i, t.size(), t) == 0) {
          hit = id;
          hit_len = t.size();
        }
      }
      if (hit < 0) {
        ++i;
        continue;
      }
      split_fragment(text, frag, i, &out);
      out.emplace_back(std::string(), hit);
      i += hit_len;
      frag = i;
    }
    split_fragment(text, frag, text.size(), &out);
    return out;
  }

  void split_fragment(const std::string& text, size_t b, size_t e,
                      std::vector<std::pair<std::string, int>>* out) const {
    if (b >= e) return;
    const auto cps = detail::decode_utf8(text, b, e);
    std::vector<std::pair<size_t, size_t>> w;
    if (split_digits_) {
      size_t run = 0;
      for (size_t k = 0; k < cps.size(); ++k) {
        if (!detail::cp_number(cps[k].cp)) continue;
        detail::gpt2_split(cps, run, k, &w);
        w.emplace_back(k, k + 1);
        run = k + 1;
      }
      detail::gpt2_split(cps, run, cps.size(), &w);
    } else {
      detail::gpt2_split(cps, 0, cps.size(), &w);
    }
    for (const auto& r : w) {
      const size_t ob = cps[r.first].offset;
      const size_t oe = cps[r.second - 1].offset + cps[r.second - 1].len;
      out->emplace_back(text.substr(ob, oe - ob), -1);
    }
  }

  int rank(const std::string& a, const std::string& b, std::string* scratch) const {
    scratch->assign(a);
    scratch->push_back(' ');
    scratch->append(b);
    const auto it = rank_.find(*scratch);
    return it == rank_.end() ? -1 : it->second;
  }

  /// BPE over one word: start from one symbol per byte, repeatedly merge the adjacent pair of
  /// lowest rank (leftmost among equal ranks) until no pair has a rank.
  ///
  /// O(n log n) in the word's bytes n: the symbols form a doubly linked list over their byte
  /// offsets, and every adjacent pair with a rank sits in a min-heap keyed (rank, offset of its
  /// left symbol). Merging never reorders symbols, so the left symbol's first byte offset
  /// orders pairs left to right and the heap's top is exactly the pair the plain rescan would
  /// choose (lowest rank, leftmost on ties). A pair made stale by an earlier merge (either side
  /// merged away or grown) is recognized by the symbols' versions and dropped when popped. At
  /// most n - 1 merges happen and each pushes at most two pairs, so the heap sees < 3n pushes.
  void bpe_word(const std::string& word, std::vector<int>* ids) const {
    KVQ_REQUIRE(word.size() < static_cast<size_t>(std::numeric_limits<int>::max()),
                kInvalidArgument, "BPE tokenizer: a word of ", word.size(), " bytes is too long");
    const int n = static_cast<int>(word.size());
    std::vector<std::string> sym(static_cast<size_t>(n));
    for (int k = 0; k < n; ++k) sym[static_cast<size_t>(k)] = byte_sym_[static_cast<unsigned char>(word[static_cast<size_t>(k)])];
    std::vector<int> prev(static_cast<size_t>(n)), next(static_cast<size_t>(n));
    std::vector<uint32_t> version(static_cast<size_t>(n), 0);  // bumped when a symbol changes
    for (int k = 0; k < n; ++k) {
      prev[static_cast<size_t>(k)] = k - 1;
      next[static_cast<size_t>(k)] = k + 1 < n ? k + 1 : -1;
    }
    struct Pair {
      int rank, left, right;
      uint32_t left_version, right_version;
      bool operator>(const Pair& o) const {
        return rank != o.rank ? rank > o.rank : left > o.left;
      }
    };
    std::priority_queue<Pair, std::vector<Pair>, std::greater<Pair>> heap;
    std::string scratch;
    auto push = [&](int l, int r) {
      if (l < 0 || r < 0) return;
      const int rk = rank(sym[static_cast<size_t>(l)], sym[static_cast<size_t>(r)], &scratch);
      if (rk >= 0)
        heap.push(Pair{rk, l, r, version[static_cast<size_t>(l)], version[static_cast<size_t>(r)]});
    };
    for (int k = 0; k + 1 < n; ++k) push(k, k + 1);
    while (!heap.empty()) {
      const Pair p = heap.top();
      heap.pop();
      const auto l = static_cast<size_t>(p.left), r = static_cast<size_t>(p.right);
      // Stale: the right symbol was merged into another, or either side changed since the push
      // (a merged-away symbol is unlinked, so next[l] no longer names it).
      if (next[l] != p.right || version[l] != p.left_version || version[r] != p.right_version)
        continue;
      sym[l] += sym[r];
      sym[r].clear();
      ++version[l];
      ++version[r];
      next[l] = next[r];
      if (next[r] >= 0) prev[static_cast<size_t>(next[r])] = p.left;
      next[r] = -1;
      prev[r] = -1;
      push(prev[l], p.left);
      push(p.left, next[l]);
    }
    for (int k = n > 0 ? 0 : -1; k >= 0; k = next[static_cast<size_t>(k)]) {
      const std::string& s = sym[static_cast<size_t>(k)];
      const auto it = id_.find(s);
      if (it != id_.end()) {
        ids->push_back(it->second);
        continue;
      }
      // A merged symbol missing from the vocabulary: fall back to its single-byte symbols.
      const auto cps = detail::decode_utf8(s, 0, s.size());
      for (const auto& c : cps) {
        const std::string one = s.substr(c.offset, c.len);
        const auto jt = id_.find(one);
        KVQ_REQUIRE(jt != id_.end(), kInvalidArgument, "BPE tokenizer: byte symbol ",
                    io::detail::printable(one), " is not in the vocabulary");
        ids->push_back(jt->second);
      }
    }
  }

  std::vector<std::string> tokens_;
  std::vector<int> types_;
  std::string pre_;
  bool add_bos_ = false;
  int bos_ = -1;
  int eos_ = -1;
  bool split_digits_ = false;
  std::unordered_map<std::string, int> id_;
  std::unordered_map<std::string, int> rank_;
  std::vector<int> user_defined_;
  std::string byte_sym_[256];
  std::unordered_map<uint32_t, uint8_t> char_to_byte_;
};

}  // namespace kvq::eval

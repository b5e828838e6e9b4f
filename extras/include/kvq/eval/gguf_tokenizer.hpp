#pragma once
/// \file gguf_tokenizer.hpp
/// The tokenizer a GGUF file carries, whichever kind it is: byte-level BPE
/// (tokenizer.ggml.model "gpt2": SmolLM2, Qwen2, ...; eval/bpe_tokenizer.hpp) or SentencePiece
/// (model "llama": Gemma, Llama 1/2; eval/spm_tokenizer.hpp). Anything else is refused by name.
#include <memory>
#include <string>
#include <vector>

#include "kvq/core/error.hpp"
#include "kvq/eval/bpe_tokenizer.hpp"
#include "kvq/eval/spm_tokenizer.hpp"
#include "kvq/io/gguf.hpp"

namespace kvq::eval {

class GgufTokenizer {
 public:
  static GgufTokenizer from_gguf(const io::GgufFile& f) {
    const std::string model = f.get_string("tokenizer.ggml.model");
    GgufTokenizer t;
    if (model == "gpt2") {
      t.bpe_ = std::make_shared<BpeTokenizer>(BpeTokenizer::from_gguf(f));
    } else if (model == "llama") {
      t.spm_ = std::make_shared<SpmTokenizer>(SpmTokenizer::from_gguf(f));
    } else {
      fail(ErrorKind::kUnsupported, f.source(), ": tokenizer.ggml.model '", model,
           "' is not implemented (implemented: gpt2 byte-level BPE, llama SentencePiece)");
    }
    if (f.has("tokenizer.ggml.eot_token_id")) {
      t.eot_ = static_cast<int>(f.get_int("tokenizer.ggml.eot_token_id", -1, t.vocab_size() - 1));
    }
    return t;
  }
  explicit GgufTokenizer(BpeTokenizer b) : bpe_(std::make_shared<BpeTokenizer>(std::move(b))) {}
  explicit GgufTokenizer(SpmTokenizer s) : spm_(std::make_shared<SpmTokenizer>(std::move(s))) {}

  /// "bpe" or "spm".
  const char* kind() const { return bpe_ ? "bpe" : "spm"; }
  const BpeTokenizer* bpe() const { return bpe_.get(); }
  const SpmTokenizer* spm() const { return spm_.get(); }

  int vocab_size() const { return bpe_ ? bpe_->vocab_size() : spm_->vocab_size(); }
  bool add_bos() const { return bpe_ ? bpe_->add_bos() : spm_->add_bos(); }
  int bos_id() const { return bpe_ ? bpe_->bos_id() : spm_->bos_id(); }
  int eos_id() const { return bpe_ ? bpe_->eos_id() : spm_->eos_id(); }
  /// True for the ids that end a generation (EOS, and EOT when the file names one).
  bool is_end(int id) const { return id >= 0 && (id == eos_id() || id == eot_); }
  const std::string& token(int id) const { return bpe_ ? bpe_->token(id) : spm_->token(id); }

  /// Token ids of `text`, BOS first when the metadata says so.
  std::vector<int> encode(const std::string& text) const {
    return bpe_ ? bpe_->encode(text) : spm_->encode(text);
  }
  std::vector<int> encode(const std::string& text, bool bos) const {
    return bpe_ ? bpe_->encode(text, bos) : spm_->encode(text, bos);
  }
  std::string decode(const std::vector<int>& ids) const {
    return bpe_ ? bpe_->decode(ids) : spm_->decode(ids);
  }
  /// The bytes one token adds to the text (streaming output; may end mid-character).
  std::string piece_bytes(int id) const {
    return bpe_ ? bpe_->decode(std::vector<int>{id}) : spm_->piece_bytes(id);
  }

 private:
  GgufTokenizer() = default;
  std::shared_ptr<const BpeTokenizer> bpe_;
  std::shared_ptr<const SpmTokenizer> spm_;
  int eot_ = -1;
};

}  // namespace kvq::eval

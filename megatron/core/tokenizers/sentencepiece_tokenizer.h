// SentencePieceTokenizer, GPTSentencePieceTokenizer and Llama2Tokenizer (--tokenizer-model x.model).
// At the reference commit all three go through Megatron's 'sentencepiece' library with legacy=False
// and no extra special tokens, so they behave the same: ids = the model's encode_as_ids, vocab =
// piece count, bos / eos / pad = the model's own ids (absent when -1), eod = eos.
#pragma once

#include <memory>
#include <string>

#include "megatron/core/tokenizers/tokenizer.h"

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace megatron {

class SentencePieceTokenizer : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& model_file);
  ~SentencePieceTokenizer() override;

  std::vector<int64_t> tokenize(std::string_view text) const override;
  std::string detokenize(const std::vector<int64_t>& ids) const override;
  std::string token_text(int64_t id) const override;  // a leading "\u2581" reads as a space
  int64_t vocab_size() const override;
  int64_t eod() const override;
  std::optional<int64_t> bos() const override;
  std::optional<int64_t> eos() const override;
  std::optional<int64_t> pad() const override;
  nlohmann::ordered_json unique_identifiers() const override;

 private:
  std::string model_file_;
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
};

}  // namespace megatron

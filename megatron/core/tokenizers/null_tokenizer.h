// NullTokenizer (--vocab-size V): text is space-separated integer ids. At the reference commit it is
// megatron/core/tokenizers' null-text library: vocab_size = V, eod = V - 1, pad_id = -1 (no pad);
// build_tokenizer passes vocab_size and pad_id, which is what unique_identifiers records.
#pragma once

#include "megatron/core/tokenizers/tokenizer.h"

namespace megatron {

class NullTokenizer : public Tokenizer {
 public:
  explicit NullTokenizer(int64_t vocab_size);

  std::vector<int64_t> tokenize(std::string_view text) const override;
  std::string detokenize(const std::vector<int64_t>& ids) const override;
  int64_t vocab_size() const override { return vocab_size_; }
  int64_t eod() const override { return vocab_size_ - 1; }
  std::optional<int64_t> eos() const override { return eod(); }
  nlohmann::ordered_json unique_identifiers() const override;

 private:
  int64_t vocab_size_;
};

}  // namespace megatron

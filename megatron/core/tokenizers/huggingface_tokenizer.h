// HuggingFaceTokenizer (--tokenizer-model): a local HuggingFace tokenizer, as Megatron's
// HuggingFaceTokenizer library runs AutoTokenizer on it. The folder holds tokenizer.json (plus
// tokenizer_config.json for the special-token roles), or GPT-2 style vocab.json + merges.txt; a
// tokenizer.json path works too. Megatron encodes with self.tokenizer(text).input_ids, so the
// post-processor's special tokens (e.g. Llama-3's <|begin_of_text|>) are included; eod = the
// eos_token's id, bos = bos_token (or cls_token), pad = pad_token if any.
#pragma once

#include <memory>
#include <string>

#include "megatron/core/tokenizers/hf_pipeline.h"
#include "megatron/core/tokenizers/tokenizer.h"

namespace megatron {

class HuggingFaceTokenizer : public Tokenizer {
 public:
  /// path: --tokenizer-model; vocab_file / merge_file: --vocab-file / --merge-file, which Megatron
  /// passes on to AutoTokenizer (used instead of a folder's vocab.json / merges.txt; a tokenizer.json
  /// takes precedence, as in a fast tokenizer).
  explicit HuggingFaceTokenizer(const std::string& path, const std::string& vocab_file = "",
                                const std::string& merge_file = "");

  std::vector<int64_t> tokenize(std::string_view text) const override { return pipeline_->encode(text); }
  std::string detokenize(const std::vector<int64_t>& ids) const override { return pipeline_->decode(ids); }
  int64_t vocab_size() const override { return pipeline_->vocab_size(); }
  int64_t eod() const override;
  std::optional<int64_t> bos() const override { return pipeline_->bos_id(); }
  std::optional<int64_t> eos() const override { return pipeline_->eos_id(); }
  std::optional<int64_t> pad() const override { return pipeline_->pad_id(); }
  nlohmann::ordered_json unique_identifiers() const override;

  std::optional<int64_t> token_to_id(std::string_view token) const { return pipeline_->token_to_id(token); }

 private:
  std::string path_, vocab_file_, merge_file_;
  std::unique_ptr<HfPipeline> pipeline_;
};

}  // namespace megatron

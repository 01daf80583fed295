// GPT2BPETokenizer (--vocab-file vocab.json --merge-file merges.txt). At the reference commit
// Megatron builds it through the 'megatron' library: HuggingFace's GPT-2 tokenizer over these files,
// so it runs the same byte-level BPE pipeline as HuggingFaceTokenizer on a GPT-2 folder:
// <|endoftext|> is eod (and bos/eos, as GPT-2's config says) and is matched in the text as a special
// token; the vocab is 50257; there is no pad.
#pragma once

#include <memory>
#include <string>

#include "megatron/core/tokenizers/hf_pipeline.h"
#include "megatron/core/tokenizers/tokenizer.h"

namespace megatron {

class GPT2BPETokenizer : public Tokenizer {
 public:
  GPT2BPETokenizer(const std::string& vocab_file, const std::string& merge_file);

  std::vector<int64_t> tokenize(std::string_view text) const override { return pipeline_->encode(text); }
  std::string detokenize(const std::vector<int64_t>& ids) const override { return pipeline_->decode(ids); }
  int64_t vocab_size() const override { return pipeline_->vocab_size(); }
  int64_t eod() const override { return *pipeline_->eos_id(); }
  std::optional<int64_t> bos() const override { return pipeline_->bos_id(); }
  std::optional<int64_t> eos() const override { return pipeline_->eos_id(); }
  nlohmann::ordered_json unique_identifiers() const override;

 private:
  std::string vocab_file_, merge_file_;
  std::unique_ptr<HfPipeline> pipeline_;
};

}  // namespace megatron

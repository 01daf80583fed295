// GPT2BPETokenizer: GPT-2's vocab.json + merges.txt with GPT-2's tokenizer config.
#include "megatron/core/tokenizers/gpt2_bpe.h"

#include "megatron/core/tokenizers/identifiers.h"
#include "megatron/runtime/check.h"

namespace megatron {

GPT2BPETokenizer::GPT2BPETokenizer(const std::string& vocab_file, const std::string& merge_file)
    : vocab_file_(vocab_file), merge_file_(merge_file) {
  MG_CHECK(!vocab_file.empty(), "GPT2BPETokenizer needs --vocab-file (GPT-2's vocab.json)");
  MG_CHECK(!merge_file.empty(), "GPT2BPETokenizer needs --merge-file (GPT-2's merges.txt)");
  // GPT-2's tokenizer_config: bos = eos = unk = <|endoftext|>, no prefix space.
  pipeline_ = HfPipeline::from_gpt2_files(vocab_file, merge_file, nlohmann::json::object());
}

nlohmann::ordered_json GPT2BPETokenizer::unique_identifiers() const {
  // build_tokenizer passes the type name as the path of the 'megatron' library.
  return text_tokenizer_identifiers("GPT2BPETokenizer", {{"additional_special_tokens", "[]"},
                                                         {"vocab_file", vocab_file_},
                                                         {"merges_file", merge_file_},
                                                         {"use_fast", "True"},
                                                         {"trust_remote_code", "False"},
                                                         {"include_special_tokens", "True"}});
}

}  // namespace megatron

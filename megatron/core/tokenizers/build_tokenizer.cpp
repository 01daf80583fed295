// build_tokenizer: --tokenizer-type -> a tokenizer, each flag it needs checked with a clear message.
#include <filesystem>

#include "megatron/core/tokenizers/gpt2_bpe.h"
#include "megatron/core/tokenizers/huggingface_tokenizer.h"
#include "megatron/core/tokenizers/null_tokenizer.h"
#include "megatron/core/tokenizers/sentencepiece_tokenizer.h"
#include "megatron/core/tokenizers/tiktokenizer.h"
#include "megatron/core/tokenizers/tokenizer.h"
#include "megatron/runtime/check.h"

namespace megatron {

namespace {

void require_file(const std::string& path, const char* flag, const std::string& type, const char* what) {
  MG_CHECK(!path.empty(), "--tokenizer-type {} needs {} ({})", type, flag, what);
  MG_CHECK(std::filesystem::exists(path), "{} '{}' does not exist: pass {}", flag, path, what);
}

}  // namespace

std::unique_ptr<Tokenizer> build_tokenizer(const TokenizerArgs& args) {
  const std::string& type = args.tokenizer_type;
  if (type == "GPT2BPETokenizer") {
    require_file(args.vocab_file, "--vocab-file", type, "GPT-2's vocab.json");
    require_file(args.merge_file, "--merge-file", type, "GPT-2's merges.txt");
    return std::make_unique<GPT2BPETokenizer>(args.vocab_file, args.merge_file);
  }
  if (type == "HuggingFaceTokenizer") {
    require_file(args.tokenizer_model, "--tokenizer-model", type,
                 "a local HuggingFace tokenizer folder or tokenizer.json");
    return std::make_unique<HuggingFaceTokenizer>(args.tokenizer_model, args.vocab_file, args.merge_file);
  }
  if (type == "SentencePieceTokenizer" || type == "GPTSentencePieceTokenizer" || type == "Llama2Tokenizer") {
    require_file(args.tokenizer_model, "--tokenizer-model", type, "a SentencePiece .model file");
    return std::make_unique<SentencePieceTokenizer>(args.tokenizer_model);
  }
  if (type == "TikTokenizer") {
    require_file(args.tokenizer_model, "--tokenizer-model", type, "a tiktoken ranks file");
    TikTokenizer::Options options;
    options.pattern = args.tiktoken_pattern;
    if (args.vocab_size && *args.vocab_size != 0) options.vocab_size = args.vocab_size;
    options.num_special_tokens = args.tiktoken_num_special_tokens;
    return std::make_unique<TikTokenizer>(args.tokenizer_model, options);
  }
  if (type == "NullTokenizer") {
    MG_CHECK(args.vocab_size.has_value() && *args.vocab_size > 0,
             "--tokenizer-type NullTokenizer needs --vocab-size (the number of token ids)");
    return std::make_unique<NullTokenizer>(*args.vocab_size);
  }
  MG_CHECK(!type.empty(),
           "--tokenizer-type is required (GPT2BPETokenizer, HuggingFaceTokenizer, "
           "SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer, TikTokenizer, "
           "NullTokenizer)");
  MG_CHECK(false,
           "unknown --tokenizer-type '{}': use GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer, "
           "GPTSentencePieceTokenizer, Llama2Tokenizer, TikTokenizer or NullTokenizer",
           type);
  return nullptr;
}

}  // namespace megatron

// The tokenizer interface (Megatron's MegatronTokenizer) and the factory for --tokenizer-type.
//
// Every tokenizer encodes text to ids as Megatron's does (preprocess_data appends the EOD itself with
// --append-eod): no special tokens, except that a HuggingFaceTokenizer whose tokenizer.json has a
// post-processor adds its tokens (Llama-3's <|begin_of_text|>), as `tokenizer(text).input_ids`
// does. It decodes ids back to text and reports its special ids as Megatron defines them.
// unique_identifiers() is the JSON object Megatron writes into a dataset's description (and so
// into the md5 that names the index cache): key order and value spelling matter and follow
// Megatron-LM's megatron/core/tokenizers.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace megatron {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  /// Text -> ids (see above for special tokens).
  virtual std::vector<int64_t> tokenize(std::string_view text) const = 0;
  /// Ids -> text.
  virtual std::string detokenize(const std::vector<int64_t>& ids) const = 0;
  /// One token's text as it reads inside a sequence (the token strings of the server's logprobs,
  /// which join to the text): detokenize({id}), except where decoding drops what a token carries at
  /// the start of a text (SentencePiece's "\u2581the" reads " the", not "the").
  virtual std::string token_text(int64_t id) const { return detokenize({id}); }
  /// The tokenizer's own vocabulary size (unpadded; the model pads it).
  virtual int64_t vocab_size() const = 0;
  /// Megatron's eod id (the id --append-eod appends and --eod-mask-loss masks).
  virtual int64_t eod() const = 0;
  virtual std::optional<int64_t> bos() const { return std::nullopt; }
  virtual std::optional<int64_t> eos() const { return std::nullopt; }
  /// The pad id, if the tokenizer has one (GPTDataset pads with it, else with -1).
  virtual std::optional<int64_t> pad() const { return std::nullopt; }
  /// Megatron's unique_identifiers, in Megatron's key order and spelling.
  virtual nlohmann::ordered_json unique_identifiers() const = 0;
};

/// The tokenizer flags of pretrain_gpt / preprocess_data (Megatron's names).
struct TokenizerArgs {
  std::string tokenizer_type;   // GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer,
                                // GPTSentencePieceTokenizer, Llama2Tokenizer, TikTokenizer, NullTokenizer
  std::string vocab_file;       // --vocab-file
  std::string merge_file;       // --merge-file
  std::string tokenizer_model;  // --tokenizer-model (a file or a HuggingFace folder)
  std::optional<int64_t> vocab_size;  // --vocab-size (NullTokenizer)
  std::string tiktoken_pattern;       // --tiktoken-pattern (v1 | v2)
  int64_t tiktoken_num_special_tokens = 1000;  // --tiktoken-num-special-tokens
};

/// Builds the tokenizer --tokenizer-type names; a missing file or flag is a clear error.
std::unique_ptr<Tokenizer> build_tokenizer(const TokenizerArgs& args);

}  // namespace megatron

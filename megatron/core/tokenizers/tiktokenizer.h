// TikTokenizer (--tokenizer-model ranks, --tiktoken-pattern v1|v2, --tiktoken-num-special-tokens N,
// --vocab-size V), as Megatron's TikTokenTokenizer: ids 0..N-1 are special tokens (<unk> <s> </s>
// <mask> <pad> <cls> <sep>, then <SPECIAL_7>...), the BPE ranks follow shifted by N, the vocab is cut
// to V (default 131072) and must fill N..V-1 exactly. Special tokens in the text are encoded as such
// (allowed_special="all"). eod = eos = </s> = 2, bos = <s> = 1, pad = <pad> = 4.
// The ranks file is Megatron's JSON list of {"rank", "token_bytes" (base64), "token_str"}, or a
// tiktoken .tiktoken file ("<base64 token> <rank>" per line).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "megatron/core/tokenizers/bpe.h"
#include "megatron/core/tokenizers/text_split.h"
#include "megatron/core/tokenizers/tokenizer.h"

namespace megatron {

class TikTokenizer : public Tokenizer {
 public:
  struct Options {
    std::string pattern;                // "v1" | "v2"; empty = not given (the library's default v2)
    std::optional<int64_t> vocab_size;  // --vocab-size, if given
    int64_t num_special_tokens = 1000;
  };
  TikTokenizer(const std::string& path, const Options& options);

  std::vector<int64_t> tokenize(std::string_view text) const override;
  std::string detokenize(const std::vector<int64_t>& ids) const override;
  int64_t vocab_size() const override { return vocab_size_; }
  int64_t eod() const override { return 2; }
  std::optional<int64_t> bos() const override { return 1; }
  std::optional<int64_t> eos() const override { return 2; }
  std::optional<int64_t> pad() const override { return 4; }
  nlohmann::ordered_json unique_identifiers() const override;

 private:
  void encode_piece(std::string_view piece, std::vector<int64_t>& out) const;
  std::optional<int64_t> rank_of(std::string_view bytes) const;

  std::string path_;
  Options options_;
  int64_t vocab_size_;
  std::unordered_map<std::string, int64_t> token_to_id_;  // BPE bytes -> id (rank + N)
  std::vector<std::string> id_to_bytes_;                  // index id - N
  std::vector<std::string> special_tokens_;
  std::unique_ptr<Regex> regex_;
  SpecialTokenMatcher specials_;
  WordCache cache_;
};

}  // namespace megatron

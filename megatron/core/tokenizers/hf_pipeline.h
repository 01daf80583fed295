// The HuggingFace `tokenizers` pipeline for byte-level BPE tokenizers, as AutoTokenizer runs it:
// added tokens cut out of the text first (never split), then normalizer, pre-tokenizer (Sequence of
// Split(regex, behavior, invert) and ByteLevel(add_prefix_space, use_regex)), the BPE model, the
// post-processor's template (e.g. Llama-3's leading <|begin_of_text|>), and the ByteLevel decoder.
// Built either from a tokenizer.json or from GPT-2 style vocab.json + merges.txt (what AutoTokenizer
// converts a GPT2Tokenizer folder into). GPT2BPETokenizer and HuggingFaceTokenizer both run on it.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "megatron/core/tokenizers/bpe.h"
#include "megatron/core/tokenizers/text_split.h"

namespace megatron {

class HfPipeline {
 public:
  /// tokenizer.json (path) with its tokenizer_config.json contents (null when absent).
  static std::unique_ptr<HfPipeline> from_tokenizer_json(const std::string& path, const nlohmann::json& config);
  /// GPT-2 style vocab.json + merges.txt with a tokenizer_config.json's contents (null when absent).
  static std::unique_ptr<HfPipeline> from_gpt2_files(const std::string& vocab_file, const std::string& merges_file,
                                                     const nlohmann::json& config);

  std::vector<int64_t> encode(std::string_view text) const;
  std::string decode(const std::vector<int64_t>& ids) const;
  /// len(tokenizer): the model vocab plus added tokens not in it.
  int64_t vocab_size() const { return vocab_size_; }
  std::optional<int64_t> token_to_id(std::string_view token) const;

  /// Ids of the special-token roles of tokenizer_config.json (Megatron: bos falls back to cls).
  std::optional<int64_t> bos_id() const { return bos_; }
  std::optional<int64_t> eos_id() const { return eos_; }
  std::optional<int64_t> pad_id() const { return pad_; }

 private:
  enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };
  struct Step {
    bool byte_level = false;
    std::shared_ptr<const Regex> regex;  // Split pattern, or ByteLevel's GPT-2 regex when use_regex
    Behavior behavior = Behavior::Isolated;
    bool invert = false;
    bool add_prefix_space = false;
  };

  HfPipeline() = default;
  void parse_pre_tokenizer(const nlohmann::json& j);
  void parse_post_processor(const nlohmann::json& j);
  void add_token(const std::string& content, std::optional<int64_t> id, bool lstrip, bool rstrip, bool single_word);
  void resolve_roles(const nlohmann::json& config, bool gpt2_defaults);
  void apply_step(const Step& step, std::vector<std::string>& pieces) const;
  void encode_plain(std::string_view text, std::vector<int64_t>& out) const;

  std::unique_ptr<BpeModel> model_;
  std::vector<Step> steps_;
  bool byte_level_decoder_ = false;
  SpecialTokenMatcher matcher_;
  std::unordered_map<std::string, int64_t> added_by_content_;
  std::unordered_map<int64_t, std::string> added_by_id_;
  std::vector<int64_t> prefix_, suffix_;
  int64_t vocab_size_ = 0;
  std::string source_;    // the file, for messages
  int64_t id_limit_ = 0;  // explicit added-token ids must be below it (the file's token count)
  std::optional<int64_t> bos_, eos_, pad_;
};

/// The GPT-2 pre-tokenizer regex (HuggingFace ByteLevel's, Megatron's GPT2BPETokenizer's).
extern const char* const kGpt2SplitPattern;

/// Reads and parses a JSON file; a missing or malformed file is a megatron::Error naming what.
nlohmann::json read_json_file(const std::string& path, const std::string& what);

}  // namespace megatron

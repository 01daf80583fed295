// Splitting text before BPE: the pre-tokenizer regexes (PCRE2 in UTF mode with Unicode properties,
// compiled once and JIT-compiled when available) and the matcher that cuts special / added tokens
// out of the text first so that they are never split.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace megatron {

/// A compiled regex; find_all is const and safe to call from several threads at once.
class Regex {
 public:
  explicit Regex(const std::string& pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  /// The [begin, end) byte ranges of the successive non-empty leftmost matches in text.
  void find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& matches) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Text cut at its special tokens: either a plain span of the text, or a special token's id.
struct TextSegment {
  std::string_view text;  // empty for a special token
  int64_t token_id = -1;  // >= 0 for a special token
};

/// HuggingFace added-token semantics: leftmost-longest match; lstrip / rstrip swallow whitespace
/// beside the token; single_word only matches a token not glued to word characters.
class SpecialTokenMatcher {
 public:
  struct Token {
    std::string content;
    int64_t id = -1;
    bool lstrip = false;
    bool rstrip = false;
    bool single_word = false;
  };
  void add(Token token);
  bool empty() const { return tokens_.empty(); }
  /// Cuts text into plain spans and special tokens (empty spans dropped).
  std::vector<TextSegment> split(std::string_view text) const;

 private:
  std::vector<Token> tokens_;
  std::vector<std::vector<size_t>> by_first_byte_ = std::vector<std::vector<size_t>>(256);
};

}  // namespace megatron

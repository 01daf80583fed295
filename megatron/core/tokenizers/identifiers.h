// unique_identifiers as Megatron's MegatronTokenizerText writes them (megatron/core/tokenizers at the
// reference commit): {"class": DefaultTokenizerText's module.qualname, "tokenizer_path": the path
// given to the library (null for NullTokenizer), then every keyword argument build_tokenizer passed,
// in its order, as Python's str() of the value ("None", "True", "[]", "50257")}.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace megatron {

inline constexpr const char* kDefaultTokenizerTextClass =
    "megatron.core.tokenizers.text.models.default_tokenizer.DefaultTokenizerText";

inline nlohmann::ordered_json text_tokenizer_identifiers(
    nlohmann::ordered_json tokenizer_path, const std::vector<std::pair<std::string, std::string>>& kwargs) {
  nlohmann::ordered_json j;
  j["class"] = kDefaultTokenizerTextClass;
  j["tokenizer_path"] = std::move(tokenizer_path);
  for (const auto& [key, value] : kwargs) j[key] = value;
  return j;
}

/// Python's str() of an optional path argument: the path, or "None" when the flag was not given.
inline std::string py_str_or_none(const std::string& s) { return s.empty() ? "None" : s; }

}  // namespace megatron

// NullTokenizer: ids written out as text and read back (Python's int() of each ' '-separated field).
#include "megatron/core/tokenizers/null_tokenizer.h"

#include <charconv>

#include "megatron/core/tokenizers/identifiers.h"
#include "megatron/runtime/check.h"

namespace megatron {

NullTokenizer::NullTokenizer(int64_t vocab_size) : vocab_size_(vocab_size) {
  MG_CHECK(vocab_size > 0, "NullTokenizer needs --vocab-size > 0 (got {})", vocab_size);
}

std::vector<int64_t> NullTokenizer::tokenize(std::string_view text) const {
  std::vector<int64_t> ids;
  size_t pos = 0;
  while (true) {
    size_t end = text.find(' ', pos);
    std::string_view field = text.substr(pos, end == std::string_view::npos ? std::string_view::npos : end - pos);
    std::string_view f = field;
    while (!f.empty() && std::isspace(static_cast<unsigned char>(f.front()))) f.remove_prefix(1);
    while (!f.empty() && std::isspace(static_cast<unsigned char>(f.back()))) f.remove_suffix(1);
    if (!f.empty() && f.front() == '+') f.remove_prefix(1);
    int64_t v = 0;
    auto [ptr, ec] = std::from_chars(f.data(), f.data() + f.size(), v);
    MG_CHECK(!f.empty() && ec == std::errc() && ptr == f.data() + f.size(),
             "NullTokenizer reads text as space-separated integer ids, but got '{}'", field);
    ids.push_back(v);
    if (end == std::string_view::npos) break;
    pos = end + 1;
  }
  return ids;
}

std::string NullTokenizer::detokenize(const std::vector<int64_t>& ids) const {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) out.push_back(' ');
    out += std::to_string(ids[i]);
  }
  return out;
}

nlohmann::ordered_json NullTokenizer::unique_identifiers() const {
  return text_tokenizer_identifiers(nullptr, {{"vocab_size", std::to_string(vocab_size_)}, {"pad_id", "-1"}});
}

}  // namespace megatron

// PCRE2-backed pre-tokenizer regexes and the special-token matcher.
#include "megatron/core/tokenizers/text_split.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>

#include "megatron/core/tokenizers/bpe.h"
#include "megatron/runtime/check.h"

namespace megatron {

struct Regex::Impl {
  pcre2_code* code = nullptr;
  bool jit = false;
};

Regex::Regex(const std::string& pattern) : impl_(std::make_unique<Impl>()) {
  uint32_t options = PCRE2_UTF | PCRE2_UCP;
#ifdef PCRE2_MATCH_INVALID_UTF
  options |= PCRE2_MATCH_INVALID_UTF;
#endif
  int err = 0;
  PCRE2_SIZE offset = 0;
  impl_->code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &err, &offset, nullptr);
  if (!impl_->code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof(msg));
    MG_CHECK(false, "tokenizer regex does not compile at offset {}: {} (pattern: {})", offset,
             reinterpret_cast<const char*>(msg), pattern);
  }
  impl_->jit = pcre2_jit_compile(impl_->code, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() {
  if (impl_ && impl_->code) pcre2_code_free(impl_->code);
}

void Regex::find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& matches) const {
  matches.clear();
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(impl_->code, nullptr);
  MG_ASSERT(md != nullptr, "pcre2_match_data_create failed");
  auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0;
  while (pos <= text.size()) {
    int rc = impl_->jit ? pcre2_jit_match(impl_->code, subject, text.size(), pos, 0, md, nullptr)
                        : pcre2_match(impl_->code, subject, text.size(), pos, 0, md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      pcre2_match_data_free(md);
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof(msg));
      MG_CHECK(false, "tokenizer regex match failed: {}", reinterpret_cast<const char*>(msg));
    }
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    size_t b = ov[0], e = ov[1];
    if (e > b) {
      matches.emplace_back(b, e);
      pos = e;
    } else {  // an empty match: step over one character
      if (b >= text.size()) break;
      pos = b + std::min(utf8_char_len(static_cast<unsigned char>(text[b])), text.size() - b);
    }
  }
  pcre2_match_data_free(md);
}

void SpecialTokenMatcher::add(Token token) {
  MG_CHECK(!token.content.empty(), "a special token cannot be empty");
  for (const auto& t : tokens_) {
    if (t.content == token.content) return;
  }
  by_first_byte_[static_cast<unsigned char>(token.content[0])].push_back(tokens_.size());
  tokens_.push_back(std::move(token));
  for (auto& list : by_first_byte_) {
    std::stable_sort(list.begin(), list.end(),
                     [&](size_t a, size_t b) { return tokens_[a].content.size() > tokens_[b].content.size(); });
  }
}

namespace {

bool is_space(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }
bool is_word_byte(unsigned char c) { return std::isalnum(c) || c == '_' || c >= 0x80; }

}  // namespace

std::vector<TextSegment> SpecialTokenMatcher::split(std::string_view text) const {
  std::vector<TextSegment> out;
  if (tokens_.empty()) {
    if (!text.empty()) out.push_back({text, -1});
    return out;
  }
  size_t emitted = 0;  // text[0, emitted) is already in out
  for (size_t pos = 0; pos < text.size(); ++pos) {
    const auto& candidates = by_first_byte_[static_cast<unsigned char>(text[pos])];
    const Token* hit = nullptr;
    for (size_t idx : candidates) {
      const Token& t = tokens_[idx];
      if (text.compare(pos, t.content.size(), t.content) != 0) continue;
      if (t.single_word) {
        size_t end = pos + t.content.size();
        bool glued_left = pos > 0 && is_word_byte(static_cast<unsigned char>(text[pos - 1]));
        bool glued_right = end < text.size() && is_word_byte(static_cast<unsigned char>(text[end]));
        if (glued_left || glued_right) continue;
      }
      hit = &t;
      break;
    }
    if (!hit) continue;
    size_t begin = pos, end = pos + hit->content.size();
    if (hit->lstrip) {
      while (begin > emitted && is_space(static_cast<unsigned char>(text[begin - 1]))) --begin;
    }
    if (hit->rstrip) {
      while (end < text.size() && is_space(static_cast<unsigned char>(text[end]))) ++end;
    }
    if (begin > emitted) out.push_back({text.substr(emitted, begin - emitted), -1});
    out.push_back({std::string_view(), hit->id});
    emitted = end;
    pos = end - 1;
  }
  if (emitted < text.size()) out.push_back({text.substr(emitted), -1});
  return out;
}

}  // namespace megatron

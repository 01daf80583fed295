// The text generation API's request parsing: one prompt cap for PUT /api and POST /v1/completions,
// the 400 naming it (NullTokenizer: prompts are space-separated ids).
#include "megatron/core/inference/text_generation_api.h"

#include <gtest/gtest.h>

#include "megatron/core/tokenizers/null_tokenizer.h"

namespace megatron {
namespace {

using nlohmann::json;

json prompts(size_t n) {
  json p = json::array();
  for (size_t i = 0; i < n; ++i) p.push_back("1 2");
  return p;
}

template <typename F>
std::string api_error(F&& f) {
  try {
    f();
  } catch (const ApiError& e) {
    return e.what();
  }
  return "";
}

TEST(TextGenerationApi, OnePromptCapForBothEndpoints) {
  NullTokenizer tok(64);
  const json api = {{"prompts", prompts(kDefaultMaxPrompts + 1)}, {"tokens_to_generate", 1}};
  const json cmpl = {{"prompt", prompts(kDefaultMaxPrompts + 1)}, {"max_tokens", 1}};
  for (const std::string& e : {api_error([&] { parse_megatron_api_request(api, tok); }),
                               api_error([&] { parse_completion_request(cmpl, tok); })}) {
    EXPECT_NE(e.find("at most 128 prompts per request (got 129"), std::string::npos) << e;
    EXPECT_NE(e.find("--max-prompts-per-request"), std::string::npos) << e;
  }
  EXPECT_EQ(parse_megatron_api_request({{"prompts", prompts(128)}, {"tokens_to_generate", 1}}, tok).requests.size(),
            128u);
  EXPECT_EQ(parse_completion_request({{"prompt", prompts(128)}}, tok).requests.size(), 128u);
  // A smaller cap, and one prompt of token ids counts as one.
  EXPECT_NE(api_error([&] { parse_completion_request({{"prompt", prompts(3)}}, tok, 2); }).find("at most 2 prompts"),
            std::string::npos);
  EXPECT_EQ(parse_completion_request({{"prompt", {1, 2, 3}}}, tok, 1).requests.size(), 1u);
}

}  // namespace
}  // namespace megatron

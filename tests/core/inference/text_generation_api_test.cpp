// The text generation API's request parsing and response pieces: one prompt cap for every
// endpoint, Megatron's /api fields and wording, OpenAI's n / best_of / suffix / stream_options /
// echo + logprobs, chat messages through a template (NullTokenizer: prompts are space-separated
// ids; the GPT-2 tokenizer fixture for the newline rules).
#include "megatron/core/inference/text_generation_api.h"

#include <gtest/gtest.h>

#include "megatron/core/tokenizers/huggingface_tokenizer.h"
#include "megatron/core/tokenizers/null_tokenizer.h"
#include "tests/test_util.h"

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
  const std::string api_e = api_error([&] { parse_megatron_api_request(api, tok); });
  EXPECT_NE(api_e.find("Maximum number of prompts is 128 (got 129"), std::string::npos) << api_e;
  const std::string cmpl_e = api_error([&] { parse_completion_request(cmpl, tok); });
  EXPECT_NE(cmpl_e.find("at most 128 prompts per request (got 129"), std::string::npos) << cmpl_e;
  for (const std::string& e : {api_e, cmpl_e}) EXPECT_NE(e.find("--max-prompts-per-request"), std::string::npos) << e;
  // best_of samples count against the cap.
  EXPECT_NE(api_error([&] { parse_completion_request({{"prompt", prompts(3)}, {"best_of", 2}}, tok, 5); })
                .find("at most 5 prompts per request (got 6"),
            std::string::npos);
  EXPECT_EQ(parse_megatron_api_request({{"prompts", prompts(128)}, {"tokens_to_generate", 1}}, tok).requests.size(),
            128u);
  EXPECT_EQ(parse_completion_request({{"prompt", prompts(128)}}, tok).requests.size(), 128u);
  // A smaller cap, and one prompt of token ids counts as one.
  EXPECT_NE(api_error([&] { parse_completion_request({{"prompt", prompts(3)}}, tok, 2); }).find("at most 2 prompts"),
            std::string::npos);
  EXPECT_EQ(parse_completion_request({{"prompt", {1, 2, 3}}}, tok, 1).requests.size(), 1u);
}

TEST(TextGenerationApi, MegatronApiSpeaksMegatronsWords) {
  NullTokenizer tok(64);
  const std::vector<std::pair<json, std::string>> cases = {
      {{{"tokens_to_generate", 1}}, "prompts argument required"},
      {{{"prompts", {"1"}}, {"max_len", 4}}, "max_len is no longer used.  Replace with tokens_to_generate"},
      {{{"prompts", {"1"}}, {"sentences", {"1"}}}, "sentences is no longer used.  Replace with prompts"},
      {{{"prompts", {"1", "2"}}, {"beam_width", 2}}, "When doing beam_search, batch size must be 1"},
      {{{"prompts", {"1"}}, {"beam_width", 0}}, "beam_width must be an integer > 1"},
      {{{"prompts", {"1"}}, {"beam_width", "2"}}, "beam_width must be integer"},
      {{{"prompts", {"1"}}, {"beam_width", 2}, {"top_k", 2}}, "top_k does not apply to beam search (beam_width)"},
      {{{"prompts", {"1"}}, {"beam_width", 2}, {"tokens_to_generate", 0}, {"logprobs", true}},
       "logprobs does not apply to beam search"},
      {{{"prompts", "1 2"}}, "prompts is not a list of strings"},
      {{{"prompts", {1, 2}}}, "prompts is not a list of strings"},
      {{{"prompts", json::array()}}, "prompts is empty"},
      {{{"prompts", {"1"}}, {"tokens_to_generate", -1}}, "tokens_to_generate must be an integer greater than or equal to 0"},
      {{{"prompts", {"1"}}, {"tokens_to_generate", 0}}, "tokens_to_generate=0 implies logprobs should be True"},
      {{{"prompts", {"1"}}, {"logprobs", "yes"}}, "logprobs must be a boolean value"},
      {{{"prompts", {"1"}}, {"top_k", 1001}}, "top_k must be an integer equal to or greater than 0 and less than or equal to 1000"},
      {{{"prompts", {"1"}}, {"top_k", 5}, {"top_p", 0.5}}, "cannot set both top-k and top-p samplings."},
      {{{"prompts", {"1"}}, {"top_p_decay", 0.5}}, "top_p_decay cannot be set without top_p"},
      {{{"prompts", {"1"}}, {"top_p", 0.5}, {"top_p_bound", 0.7}}, "top_p_bound must be greater than 0 and less than top_p"},
      {{{"prompts", {""}}}, "Empty prompts require add_BOS=true"},
      {{{"prompts", {"1"}}, {"add_BOS", 1}}, "add_BOS must be a boolean value"},
      {{{"prompts", {"1"}}, {"stop_on_eol", "no"}}, "stop_on_eol must be a boolean value"},
      {{{"prompts", {"1"}}, {"random_seed", -3}}, "random_seed must be a positive integer"},
      {{{"prompts", {"1"}}, {"stop_token", "eod"}}, "stop_token must be an integer"},
      {{{"prompts", {"1"}}, {"length_penalty", "long"}}, "length_penalty must be a float"},
      {{{"prompts", {"1"}}, {"length_penalty", 1.5}}, "length_penalty only scores beam search: give beam_width"},
      {{{"prompts", {"1"}}, {"stop_on_eol", true}}, "stop_on_eol needs a tokenizer that encodes \"\\n\" as one token"},
      {{{"prompts", {"1"}}, {"prevent_newline_after_colon", true}}, "prevent_newline_after_colon needs a tokenizer"},
      {{{"prompts", {"1"}}, {"colour", "red"}}, "unknown field 'colour'"},
  };
  for (const auto& [body, message] : cases) {
    const std::string e = api_error([&] { parse_megatron_api_request(body, tok); });
    EXPECT_EQ(e.rfind(message, 0), 0u) << body.dump() << " -> '" << e << "'";
  }
  // An empty prompt with add_BOS is the BOS alone (Megatron's BOS: the eod token).
  auto r = parse_megatron_api_request({{"prompts", {"", "5 6"}}, {"add_BOS", true}, {"tokens_to_generate", 2}}, tok);
  EXPECT_EQ(r.requests[0].prompt, std::vector<int64_t>{tok.eod()});
  EXPECT_EQ(r.requests[1].prompt, (std::vector<int64_t>{tok.eod(), 5, 6}));
  r = parse_megatron_api_request(
      {{"prompts", {"1"}}, {"top_p", 0.9}, {"top_p_decay", 0.5}, {"top_p_bound", 0.2}, {"length_penalty", 1.0},
       {"no_log", true}},
      tok);
  EXPECT_FLOAT_EQ(r.requests[0].sampling.top_p_decay, 0.5f);
  EXPECT_FLOAT_EQ(r.requests[0].sampling.top_p_bound, 0.2f);
  EXPECT_TRUE(r.no_log);
  EXPECT_FALSE(r.beam.has_value());
  r = parse_megatron_api_request({{"prompts", {"4 5"}}, {"beam_width", 3}, {"length_penalty", 0.5},
                                  {"tokens_to_generate", 7}, {"stop_token", 9}, {"add_BOS", true}},
                                 tok);
  ASSERT_TRUE(r.beam.has_value());
  EXPECT_EQ(r.beam->prompt, (std::vector<int64_t>{tok.eod(), 4, 5}));
  EXPECT_EQ(r.beam->beam_size, 3);
  EXPECT_EQ(r.beam->max_new_tokens, 7);
  EXPECT_EQ(r.beam->stop_token, 9);
  EXPECT_DOUBLE_EQ(r.beam->length_penalty, 0.5);
}

// The server's --temperature / --top_k / --top_p fill what a request leaves out; a request that
// sets top_k or top_p replaces both.
TEST(TextGenerationApi, ServerSamplingDefaults) {
  NullTokenizer tok(64);
  const SamplingDefaults d{.temperature = 0.5, .top_k = 7, .top_p = 0.0};
  auto api = parse_megatron_api_request({{"prompts", {"1"}}}, tok, 128, d).requests[0].sampling;
  EXPECT_FLOAT_EQ(api.temperature, 0.5f);
  EXPECT_EQ(api.top_k, 7);
  api = parse_megatron_api_request({{"prompts", {"1"}}, {"top_p", 0.9}, {"temperature", 1.0}}, tok, 128, d)
            .requests[0]
            .sampling;
  EXPECT_EQ(api.top_k, 0);
  EXPECT_FLOAT_EQ(api.top_p, 0.9f);
  EXPECT_FLOAT_EQ(api.temperature, 1.0f);
  auto v1 = parse_completion_request({{"prompt", "1"}}, tok, 128, {.temperature = 0.0, .top_k = 0, .top_p = 0.8})
                .requests[0]
                .sampling;
  EXPECT_TRUE(v1.greedy);
  EXPECT_FLOAT_EQ(v1.top_p, 0.8f);
  v1 = parse_completion_request({{"prompt", "1"}, {"top_k", 3}}, tok, 128, {.top_p = 0.8}).requests[0].sampling;
  EXPECT_EQ(v1.top_k, 3);
  EXPECT_FLOAT_EQ(v1.top_p, 0.0f) << "top_p 1 (off) once the request sets a filter";
}

TEST(TextGenerationApi, MegatronNewlineRulesUseTheTokenizersNewlines) {
  HuggingFaceTokenizer tok(testing::data_fixtures_dir() + "/tok-gpt2");  // "\n" 198, "\n\n" 628, ":" 25
  auto r = parse_megatron_api_request({{"prompts", {"a"}}, {"stop_on_eol", true}}, tok);
  EXPECT_EQ(r.requests[0].stop_sequences, (std::vector<std::vector<int64_t>>{{628}, {198}}));
  r = parse_megatron_api_request({{"prompts", {"a"}}, {"stop_on_double_eol", true}, {"stop_on_eol", true}}, tok);
  EXPECT_EQ(r.requests[0].stop_sequences, (std::vector<std::vector<int64_t>>{{628}, {198, 198}}));
  r = parse_megatron_api_request({{"prompts", {"a"}}, {"prevent_newline_after_colon", true}}, tok);
  EXPECT_EQ(r.requests[0].banned_after, (std::vector<std::pair<int64_t, int64_t>>{{25, 198}}));
  EXPECT_TRUE(parse_megatron_api_request({{"prompts", {"a"}}}, tok).requests[0].stop_sequences.empty());
}

TEST(TextGenerationApi, OpenAIFields) {
  NullTokenizer tok(64);
  auto c = parse_completion_request(
      {{"prompt", {"1 2", "3"}}, {"n", 2}, {"best_of", 3}, {"seed", 10}, {"frequency_penalty", 0.5},
       {"presence_penalty", -1}, {"logprobs", 2}, {"echo", true}, {"max_tokens", 0}, {"suffix", ""}},
      tok);
  ASSERT_EQ(c.requests.size(), 6u);  // 2 prompts x best_of 3, prompt-major
  EXPECT_EQ(c.n, 2u);
  EXPECT_EQ(c.best_of, 3u);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(c.requests[i].prompt, i < 3 ? (std::vector<int64_t>{1, 2}) : std::vector<int64_t>{3});
    EXPECT_EQ(c.requests[i].sampling.seed, 10u + i % 3);
    EXPECT_FLOAT_EQ(c.requests[i].sampling.frequency_penalty, 0.5f);
    EXPECT_FLOAT_EQ(c.requests[i].sampling.presence_penalty, -1.0f);
    EXPECT_EQ(c.requests[i].top_logprobs, 2);
    EXPECT_TRUE(c.requests[i].prompt_logprobs) << "echo with logprobs scores the prompt";
    EXPECT_EQ(c.requests[i].max_new_tokens, 0);
  }
  EXPECT_TRUE(parse_completion_request({{"prompt", "1"}, {"stream", true}, {"stream_options", {{"include_usage", true}}}},
                                       tok)
                  .include_usage);
  const std::vector<std::pair<json, std::string>> bad = {
      {{{"prompt", "1"}, {"suffix", "2 3"}}, "'suffix' is not supported: this server has no fill-in-the-middle model"},
      {{{"prompt", "1"}, {"n", 3}, {"best_of", 2}}, "best_of (2) must be at least n (3)"},
      {{{"prompt", "1"}, {"stream_options", {{"include_usage", true}}}}, "stream_options is only allowed when stream"},
      {{{"prompt", "1"}, {"stream", true}, {"stream_options", {{"extra", 1}}}}, "unknown field 'extra'"},
      {{{"prompt", "1"}, {"stream", true}, {"best_of", 2}}, "best_of greater than n cannot be streamed"},
      {{{"prompt", "1"}, {"stream", true}, {"echo", true}, {"logprobs", 1}}, "echo with logprobs cannot be streamed"},
      {{{"prompt", "1"}, {"presence_penalty", 2.5}}, "'presence_penalty' must be in [-2, 2]"},
      {{{"prompt", "1"}, {"logprobs", 21}}, "'logprobs' must be in [0, 20]"},
      {{{"prompt", "1"}, {"logit_bias", json::object()}}, "unknown field 'logit_bias'"},
  };
  for (const auto& [body, message] : bad) {
    const std::string e = api_error([&] { parse_completion_request(body, tok); });
    EXPECT_EQ(e.rfind(message, 0), 0u) << body.dump() << " -> '" << e << "'";
  }
}

TEST(TextGenerationApi, ChatMessagesGoThroughTheTemplate) {
  NullTokenizer tok(64);
  const json body = {{"messages", {{{"role", "system"}, {"content", "9"}}, {{"role", "user"}, {"content", "1 2"}}}},
                     {"max_completion_tokens", 3},
                     {"logprobs", true},
                     {"top_logprobs", 4}};
  EXPECT_EQ(api_error([&] { parse_chat_request(body, tok, nullptr); })
                .rfind("this model's tokenizer has no chat template (tokenizer_config.json \"chat_template\")", 0),
            0u);
  ChatTemplate t("{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}7{% endif %}",
                 "", "");
  CompletionRequest c = parse_chat_request(body, tok, &t);
  EXPECT_TRUE(c.chat);
  ASSERT_EQ(c.requests.size(), 1u);
  EXPECT_EQ(c.prompt_texts[0], "9 1 2 7");
  EXPECT_EQ(c.requests[0].prompt, (std::vector<int64_t>{9, 1, 2, 7}));
  EXPECT_EQ(c.requests[0].max_new_tokens, 3);
  EXPECT_EQ(c.requests[0].top_logprobs, 4);
  const std::vector<std::pair<json, std::string>> bad = {
      {{{"messages", json::array()}}, "'messages' must be a non-empty list"},
      {{{"messages", {{{"role", "tool"}, {"content", "1"}}}}}, "message 0: role 'tool' is not one of system, user, assistant"},
      {{{"messages", {{{"role", "user"}}}}}, "message 0: 'content' must be a string"},
      {{{"messages", {{{"role", "user"}, {"content", "1"}, {"tool_calls", 1}}}}}, "message 0: unknown field 'tool_calls'"},
      {{{"messages", {{{"role", "user"}, {"content", "1"}}}}, {"top_logprobs", 2}}, "top_logprobs needs logprobs: true"},
      {{{"messages", {{{"role", "user"}, {"content", "1"}}}}, {"echo", true}}, "unknown field 'echo'"},
  };
  for (const auto& [b, message] : bad) {
    const std::string e = api_error([&] { parse_chat_request(b, tok, &t); });
    EXPECT_EQ(e.rfind(message, 0), 0u) << b.dump() << " -> '" << e << "'";
  }
}

TEST(TextGenerationApi, EchoedLogprobsStartWithNull) {
  NullTokenizer tok(64);
  GenerationRequest r;
  r.prompt = {5, 6, 7};
  r.top_logprobs = 1;
  GenerationResult g;
  g.tokens = {8, 9};
  g.logprobs = {-0.5, -0.25};
  g.prompt_logprobs = {-1.0, -2.0};
  g.prompt_top_logprobs = {{{6, -1.0}}, {{3, -0.1}}};
  g.top_logprobs = {{{8, -0.5}}, {{9, -0.25}}};
  json lp = completion_logprobs(choice_logprobs(r, g, 1, /*echo=*/true), tok);
  EXPECT_EQ(lp["tokens"], json({"5", "6", "7", "8"}));
  EXPECT_EQ(lp["token_logprobs"], json({nullptr, -1.0, -2.0, -0.5}));
  EXPECT_EQ(lp["top_logprobs"], json({nullptr, {{"6", -1.0}}, {{"3", -0.1}}, {{"8", -0.5}}}));
  EXPECT_EQ(lp["text_offset"], json({0, 1, 2, 3}));
  json chat = chat_logprobs(choice_logprobs(r, g, 2, false), tok);
  ASSERT_EQ(chat["content"].size(), 2u);
  EXPECT_EQ(chat["content"][1]["token"], "9");
  EXPECT_EQ(chat["content"][1]["bytes"], json({57}));
  EXPECT_EQ(chat["content"][1]["top_logprobs"][0]["logprob"], -0.25);
}

}  // namespace
}  // namespace megatron

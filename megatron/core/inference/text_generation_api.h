// The text generation server's request and response formats, apart from HTTP so they can be
// tested alone:
//   PUT /api              Megatron's text_generation_server fields (prompts, tokens_to_generate,
//                         temperature, top_k, top_p, logprobs, add_BOS, random_seed, stop_token)
//                         -> {"text": [...], "segments": [...], "logprobs": [...] | null}
//   POST /v1/completions  OpenAI's completion request (model, prompt, max_tokens, temperature,
//                         top_p, top_k (extension), logprobs, stream, stop, seed, n = 1, echo, user)
//                         -> a text_completion object, or server-sent chunks of one.
// Every problem with a request (malformed JSON, a wrong type, an unknown field, a value out of
// range, an empty prompt, more prompts than the server's cap) throws ApiError with a one-line
// message: the server answers 400. Both endpoints share one prompt cap (Megatron's /api: 128).
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "megatron/core/inference/generation.h"
#include "megatron/core/tokenizers/tokenizer.h"

namespace megatron {

struct ApiError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// PUT /api, parsed: one GenerationRequest per prompt.
struct MegatronApiRequest {
  std::vector<GenerationRequest> requests;
  bool logprobs = false;
};
/// The default cap on prompts per request (--max-prompts-per-request), Megatron's /api limit.
inline constexpr size_t kDefaultMaxPrompts = 128;

MegatronApiRequest parse_megatron_api_request(const nlohmann::json& body, const Tokenizer& tokenizer,
                                              size_t max_prompts = kDefaultMaxPrompts);
/// {"text": prompt + generation per prompt, "segments": per-token strings, "logprobs": per-token
/// log-probabilities after the first token (prompt and generation), or null}.
nlohmann::json megatron_api_response(const MegatronApiRequest& request, const std::vector<GenerationResult>& results,
                                     const Tokenizer& tokenizer);

/// POST /v1/completions, parsed: one GenerationRequest per prompt (choice).
struct CompletionRequest {
  std::string model;
  std::vector<GenerationRequest> requests;
  std::vector<std::string> prompt_texts;
  std::vector<std::string> stop;  // stop strings (not included in the text)
  bool stream = false;
  bool logprobs = false;
  bool echo = false;
};
CompletionRequest parse_completion_request(const nlohmann::json& body, const Tokenizer& tokenizer,
                                           size_t max_prompts = kDefaultMaxPrompts);

/// The text of one completion as tokens arrive: the generated ids detokenized (a final stop
/// token left out), cut at the first stop string. add() releases only text that can no longer
/// turn out to be part of a stop string (or an incomplete UTF-8 character), so the streamed pieces
/// concatenate to exactly the final text.
class CompletionText {
 public:
  CompletionText(const Tokenizer& tokenizer, std::vector<int64_t> stop_tokens, std::vector<std::string> stop);
  /// Adds a generated token; returns the newly released text (possibly empty).
  std::string add(int64_t token);
  /// Releases whatever was held back; returns it.
  std::string finish();
  bool stopped() const { return stopped_; }  // a stop string appeared (or a stop token)
  const std::string& text() const { return released_; }
  const std::vector<int64_t>& tokens() const { return ids_; }

 private:
  std::string release(size_t end);

  const Tokenizer& tokenizer_;
  std::vector<int64_t> stop_tokens_;
  std::vector<std::string> stop_;
  std::vector<int64_t> ids_;
  std::string full_, released_;
  bool stopped_ = false;
};

/// OpenAI's finish_reason for an engine result ("stop" also when a stop string ended it).
std::string completion_finish_reason(const GenerationResult& result, bool stopped_by_text);
/// One choice of a completion object. logprobs: the generated tokens' strings and values or null.
nlohmann::json completion_choice(size_t index, const std::string& text, const std::optional<std::string>& finish_reason,
                                 const nlohmann::json& logprobs);
/// {"tokens": [...], "token_logprobs": [...], "top_logprobs": null, "text_offset": [...]}.
nlohmann::json completion_logprobs(const std::vector<int64_t>& tokens, const std::vector<double>& logprobs,
                                   const Tokenizer& tokenizer);
/// The completion object around its choices ("object": "text_completion"; usage when given).
nlohmann::json completion_object(const std::string& id, const std::string& model, nlohmann::json choices,
                                 const nlohmann::json& usage = nullptr);

}  // namespace megatron

// The text generation server's request and response formats, apart from HTTP so they can be
// tested alone:
//   PUT /api                   Megatron's text_generation_server fields (prompts, tokens_to_generate,
//                              temperature, top_k, top_p, top_p_decay, top_p_bound, logprobs,
//                              add_BOS, random_seed, stop_token, stop_on_eol, stop_on_double_eol,
//                              prevent_newline_after_colon, no_log, beam_width with length_penalty)
//                              -> {"text": [...], "segments": [...], "logprobs": [...] | null}, or
//                              with beam_width {"text", "segments", "scores"}: the beams, best first
//   POST /v1/completions       OpenAI's completion request (model, prompt, max_tokens, temperature,
//                              top_p, top_k (extension), frequency_penalty, presence_penalty,
//                              logprobs, echo, stream, stream_options, stop, seed, n, best_of,
//                              suffix (only empty: no fill-in-the-middle), user)
//   POST /v1/chat/completions  OpenAI's chat request: messages rendered with the tokenizer's chat
//                              template, then generated as a completion.
// Every problem with a request (malformed JSON, a wrong type, an unknown field, a value out of
// range, an empty prompt, more prompts than the server's cap) throws ApiError with a one-line
// message: the server answers 400 (Megatron's wording on /api). Every endpoint shares one prompt
// cap (Megatron's /api: 128); on /v1 a prompt counts best_of times.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "megatron/core/inference/chat_template.h"
#include "megatron/core/inference/generation.h"
#include "megatron/core/tokenizers/tokenizer.h"

namespace megatron {

struct ApiError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// The server's sampling defaults for requests that leave a field out (Megatron's text generation
/// flags --temperature, --top_k, --top_p; 0 means off for top_k and top_p). A request that sets
/// top_k or top_p replaces both defaults (Megatron: not both at once).
struct SamplingDefaults {
  double temperature = 1.0;
  int64_t top_k = 0;
  double top_p = 0.0;
};

/// PUT /api, parsed: one GenerationRequest per prompt.
struct MegatronApiRequest {
  std::vector<GenerationRequest> requests;
  bool logprobs = false;
  bool no_log = false;  // the request asks not to be logged (--inference-flask-server-logging)
  std::optional<BeamSearchRequest> beam;  // beam_width given: one prompt, searched instead of sampled
};
/// The default cap on prompts per request (--max-prompts-per-request), Megatron's /api limit.
inline constexpr size_t kDefaultMaxPrompts = 128;

MegatronApiRequest parse_megatron_api_request(const nlohmann::json& body, const Tokenizer& tokenizer,
                                              size_t max_prompts = kDefaultMaxPrompts,
                                              const SamplingDefaults& defaults = {});
/// {"text": prompt + generation per prompt, "segments": per-token strings, "logprobs": per-token
/// log-probabilities after the first token (prompt and generation), or null}.
nlohmann::json megatron_api_response(const MegatronApiRequest& request, const std::vector<GenerationResult>& results,
                                     const Tokenizer& tokenizer);

/// Megatron's beam search answer: {"text": prompt + generation per beam, "segments", "scores"}.
nlohmann::json megatron_beam_response(const std::vector<BeamHypothesis>& beams, const Tokenizer& tokenizer);

/// POST /v1/completions or /v1/chat/completions, parsed: best_of GenerationRequests per prompt,
/// prompt-major; sample j of a prompt draws with seed + j. A prompt's answer is its n samples
/// (best_of == n) or the n of highest total logprob (best_of > n); choice index = prompt * n + k.
struct CompletionRequest {
  std::string model;
  std::vector<GenerationRequest> requests;
  std::vector<std::string> prompt_texts;  // one per prompt
  std::vector<std::string> stop;          // stop strings (not included in the text)
  size_t n = 1, best_of = 1;
  bool chat = false;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage: a last chunk with the usage
  bool logprobs = false;
  int top_logprobs = 0;  // the most likely tokens listed at each position
  bool echo = false;     // completions: the prompt (and with logprobs its tokens) precede the text
};
CompletionRequest parse_completion_request(const nlohmann::json& body, const Tokenizer& tokenizer,
                                           size_t max_prompts = kDefaultMaxPrompts, const SamplingDefaults& defaults = {});
/// `chat_template` null: the tokenizer has none, and the request is refused saying so.
CompletionRequest parse_chat_request(const nlohmann::json& body, const Tokenizer& tokenizer,
                                     const ChatTemplate* chat_template, size_t max_prompts = kDefaultMaxPrompts,
                                     const SamplingDefaults& defaults = {});

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
/// One choice of a completion object (chat: {"message"} or, streaming, {"delta"}; else {"text"}).
/// logprobs: from completion_logprobs / chat_logprobs, or null.
nlohmann::json completion_choice(size_t index, const std::string& text, const std::optional<std::string>& finish_reason,
                                 const nlohmann::json& logprobs);
nlohmann::json chat_choice(size_t index, const std::string& content, const std::optional<std::string>& finish_reason,
                           const nlohmann::json& logprobs);
/// A chat stream delta: {"role": "assistant", "content": ""} first, then {"content": piece}; none at the end.
nlohmann::json chat_delta_choice(size_t index, const std::optional<std::string>& role,
                                 const std::optional<std::string>& content,
                                 const std::optional<std::string>& finish_reason, const nlohmann::json& logprobs);

/// The log-probabilities of a token run; a value may be absent (null: the first prompt token).
struct TokenLogprobs {
  std::vector<int64_t> tokens;
  std::vector<std::optional<double>> logprobs;
  std::vector<std::optional<std::vector<std::pair<int64_t, double>>>> top;  // empty: not asked
};
/// A choice's tokens: with echo the prompt's first (its first token null), then the generated ones.
TokenLogprobs choice_logprobs(const GenerationRequest& request, const GenerationResult& result, size_t kept,
                              bool echo);
/// OpenAI completions' {"tokens", "token_logprobs", "top_logprobs" (a {token: logprob} per position,
/// or null), "text_offset"}; token strings are Tokenizer::token_text, so they join to the text.
nlohmann::json completion_logprobs(const TokenLogprobs& lp, const Tokenizer& tokenizer, size_t text_offset = 0);
/// OpenAI chat's {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}.
nlohmann::json chat_logprobs(const TokenLogprobs& lp, const Tokenizer& tokenizer);
/// The completion object around its choices ("text_completion", "chat.completion" or
/// "chat.completion.chunk"; usage when given).
nlohmann::json completion_object(const std::string& id, const std::string& object, const std::string& model,
                                 nlohmann::json choices, const nlohmann::json& usage = nullptr);

}  // namespace megatron

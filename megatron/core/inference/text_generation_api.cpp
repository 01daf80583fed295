#include "megatron/core/inference/text_generation_api.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <set>

namespace megatron {

namespace {

using nlohmann::json;

// A client's string in a message: JSON-escaped, so the message stays one line.
std::string quoted(const std::string& s) {
  const std::string j = json(s).dump(-1, ' ', false, json::error_handler_t::replace);
  return "'" + j.substr(1, j.size() - 2) + "'";
}

void check_fields(const json& body, const std::set<std::string>& known) {
  if (!body.is_object()) throw ApiError("the request body must be a JSON object");
  for (const auto& [key, value] : body.items()) {
    if (!known.count(key)) throw ApiError(fmt::format("unknown field {}", quoted(key)));
  }
}

bool has(const json& body, const char* key) { return body.contains(key) && !body.at(key).is_null(); }

int64_t get_int(const json& body, const char* key, int64_t fallback, int64_t lo, int64_t hi) {
  if (!has(body, key)) return fallback;
  const json& v = body.at(key);
  if (!v.is_number_integer()) throw ApiError(fmt::format("'{}' must be an integer", key));
  const int64_t x = v.get<int64_t>();
  if (x < lo || x > hi) throw ApiError(fmt::format("'{}' must be in [{}, {}] (got {})", key, lo, hi, x));
  return x;
}

double get_number(const json& body, const char* key, double fallback, double lo, double hi) {
  if (!has(body, key)) return fallback;
  const json& v = body.at(key);
  if (!v.is_number()) throw ApiError(fmt::format("'{}' must be a number", key));
  const double x = v.get<double>();
  if (!(x >= lo && x <= hi)) throw ApiError(fmt::format("'{}' must be in [{}, {}] (got {})", key, lo, hi, x));
  return x;
}

bool get_bool(const json& body, const char* key, bool fallback) {
  if (!has(body, key)) return fallback;
  if (!body.at(key).is_boolean()) throw ApiError(fmt::format("'{}' must be true or false", key));
  return body.at(key).get<bool>();
}

std::vector<int64_t> tokenize_prompt(const Tokenizer& tokenizer, const std::string& text, size_t index) {
  if (text.empty()) throw ApiError(fmt::format("prompt {} is empty", index));
  std::vector<int64_t> ids;
  try {
    ids = tokenizer.tokenize(text);
  } catch (const std::exception& e) {
    throw ApiError(fmt::format("prompt {} cannot be tokenized: {}", index, e.what()));
  }
  if (ids.empty()) throw ApiError(fmt::format("prompt {} tokenizes to nothing", index));
  return ids;
}

void check_prompt_count(size_t n, size_t max_prompts) {
  if (n > max_prompts)
    throw ApiError(fmt::format("at most {} prompts per request (got {}; the server's --max-prompts-per-request)",
                               max_prompts, n));
}

// temperature 0 means greedy; top_p 1 means no nucleus filter.
SamplingParams sampling_params(double temperature, int64_t top_k, double top_p, uint64_t seed) {
  SamplingParams s;
  s.greedy = temperature == 0.0;
  s.temperature = s.greedy ? 1.0f : float(temperature);
  s.top_k = int(top_k);
  s.top_p = top_p >= 1.0 ? 0.0f : float(top_p);
  s.seed = seed;
  return s;
}

}  // namespace

// ---- PUT /api ------------------------------------------------------------------------------------

namespace {

// Megatron's checks are on JSON types: a field's value must be of the type it names.
bool api_bool(const json& body, const char* key, bool fallback) {
  if (!body.contains(key)) return fallback;
  if (!body.at(key).is_boolean()) throw ApiError(fmt::format("{} must be a boolean value", key));
  return body.at(key).get<bool>();
}

// The id of `text` when the tokenizer encodes it as exactly one token.
std::optional<int64_t> single_token(const Tokenizer& tokenizer, const std::string& text) {
  try {
    std::vector<int64_t> ids = tokenizer.tokenize(text);
    if (ids.size() == 1) return ids[0];
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

}  // namespace

MegatronApiRequest parse_megatron_api_request(const json& body, const Tokenizer& tokenizer, size_t max_prompts,
                                              const SamplingDefaults& defaults) {
  if (!body.is_object()) throw ApiError("the request body must be a JSON object");
  if (!body.contains("prompts")) throw ApiError("prompts argument required");
  if (body.contains("max_len")) throw ApiError("max_len is no longer used.  Replace with tokens_to_generate");
  if (body.contains("sentences")) throw ApiError("sentences is no longer used.  Replace with prompts");
  check_fields(body, {"prompts", "tokens_to_generate", "temperature", "top_k", "top_p", "top_p_decay", "top_p_bound",
                      "logprobs", "add_BOS", "random_seed", "stop_token", "stop_on_eol", "stop_on_double_eol",
                      "prevent_newline_after_colon", "length_penalty", "no_log", "beam_width"});
  const json& prompts = body.at("prompts");
  if (!prompts.is_array()) throw ApiError("prompts is not a list of strings");
  if (prompts.empty()) throw ApiError("prompts is empty");
  if (prompts.size() > max_prompts)
    throw ApiError(fmt::format("Maximum number of prompts is {} (got {}; the server's --max-prompts-per-request)",
                               max_prompts, prompts.size()));
  for (const json& p : prompts)
    if (!p.is_string()) throw ApiError("prompts is not a list of strings");
  MegatronApiRequest out;
  std::optional<int> beam_width;
  if (body.contains("beam_width")) {
    const json& v = body.at("beam_width");
    if (!v.is_number_integer()) throw ApiError("beam_width must be integer");
    if (v.get<int64_t>() < 1) throw ApiError("beam_width must be an integer > 1");
    if (v.get<int64_t>() > int64_t(max_prompts))
      throw ApiError(fmt::format("beam_width must be at most {} (the server's --max-prompts-per-request)", max_prompts));
    if (prompts.size() > 1) throw ApiError("When doing beam_search, batch size must be 1");
    // Megatron's beam search reads none of the sampling fields: refused rather than ignored.
    for (const char* field : {"temperature", "top_k", "top_p", "top_p_decay", "top_p_bound", "logprobs", "random_seed",
                              "stop_on_eol", "stop_on_double_eol"})
      if (body.contains(field)) throw ApiError(fmt::format("{} does not apply to beam search (beam_width): drop it", field));
    beam_width = int(v.get<int64_t>());
  }
  int64_t tokens_to_generate = 64;
  if (body.contains("tokens_to_generate")) {
    const json& v = body.at("tokens_to_generate");
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > (1 << 30))
      throw ApiError("tokens_to_generate must be an integer greater than or equal to 0 (and at most 2^30)");
    tokens_to_generate = v.get<int64_t>();
  }
  out.logprobs = api_bool(body, "logprobs", false);
  if (tokens_to_generate == 0 && !out.logprobs) throw ApiError("tokens_to_generate=0 implies logprobs should be True");
  double temperature = defaults.temperature;
  if (body.contains("temperature")) {
    const json& v = body.at("temperature");
    if (!v.is_number() || !(v.get<double>() >= 0.0 && v.get<double>() <= 100.0))
      throw ApiError("temperature must be a number in [0, 100] (0: greedy)");
    temperature = v.get<double>();
  }
  const bool sets_filter = body.contains("top_k") || body.contains("top_p");
  int64_t top_k = sets_filter ? 0 : defaults.top_k;
  if (body.contains("top_k")) {
    const json& v = body.at("top_k");
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > 1000)
      throw ApiError("top_k must be an integer equal to or greater than 0 and less than or equal to 1000");
    top_k = v.get<int64_t>();
  }
  auto unit_float = [&](const char* key, const char* message) {
    const json& v = body.at(key);
    if (!v.is_number() || !(v.get<double>() >= 0.0 && v.get<double>() <= 1.0)) throw ApiError(message);
    return v.get<double>();
  };
  double top_p = sets_filter ? 0.0 : defaults.top_p, top_p_decay = 0.0, top_p_bound = 0.0;
  if (body.contains("top_p")) {
    top_p = unit_float("top_p", "top_p must be a positive float less than or equal to 1.0");
    if (top_p > 0.0 && top_k > 0) throw ApiError("cannot set both top-k and top-p samplings.");
  }
  if (body.contains("top_p_decay")) {
    top_p_decay = unit_float("top_p_decay", "top_p_decay must be a positive float less than or equal to 1.0");
    if (top_p == 0.0) throw ApiError("top_p_decay cannot be set without top_p");
  }
  if (body.contains("top_p_bound")) {
    top_p_bound = unit_float("top_p_bound", "top_p_bound must be a positive float less than or equal to top_p");
    if (top_p == 0.0) throw ApiError("top_p_bound cannot be set without top_p");
    if (!(top_p_bound > 0.0 && top_p_bound <= top_p))
      throw ApiError("top_p_bound must be greater than 0 and less than top_p");
  }
  const bool add_bos = api_bool(body, "add_BOS", false);
  const bool stop_on_double_eol = api_bool(body, "stop_on_double_eol", false);
  const bool stop_on_eol = api_bool(body, "stop_on_eol", false);
  const bool prevent_newline_after_colon = api_bool(body, "prevent_newline_after_colon", false);
  out.no_log = api_bool(body, "no_log", false);
  uint64_t seed = 1234;
  if (body.contains("random_seed")) {
    const json& v = body.at("random_seed");
    if (!v.is_number_integer()) throw ApiError("random_seed must be integer");
    if (v.get<int64_t>() < 0) throw ApiError("random_seed must be a positive integer");
    seed = v.get<uint64_t>();
  }
  int64_t stop_token = tokenizer.eod();
  if (body.contains("stop_token")) {
    const json& v = body.at("stop_token");
    if (!v.is_number_integer()) throw ApiError("stop_token must be an integer");
    stop_token = v.get<int64_t>();
  }
  double length_penalty = 1.0;
  if (body.contains("length_penalty")) {
    const json& v = body.at("length_penalty");
    if (!v.is_number()) throw ApiError("length_penalty must be a float");
    length_penalty = v.get<double>();
    if (length_penalty != 1.0 && !beam_width) throw ApiError("length_penalty only scores beam search: give beam_width");
  }
  // Megatron's end-of-line rules, on the tokenizer's newline tokens ("\n", and "\n\n" if it is one).
  const std::optional<int64_t> eol = single_token(tokenizer, "\n"), double_eol = single_token(tokenizer, "\n\n");
  std::vector<std::vector<int64_t>> stop_sequences;
  if (stop_on_eol || stop_on_double_eol) {
    if (!eol)
      throw ApiError(fmt::format("{} needs a tokenizer that encodes \"\\n\" as one token, and this one does not",
                                 stop_on_double_eol ? "stop_on_double_eol" : "stop_on_eol"));
    if (double_eol) stop_sequences.push_back({*double_eol});
    // Megatron: stop_on_double_eol takes precedence (two newline tokens in a row, or "\n\n").
    stop_sequences.push_back(stop_on_double_eol ? std::vector<int64_t>{*eol, *eol} : std::vector<int64_t>{*eol});
  }
  std::vector<std::pair<int64_t, int64_t>> banned_after;
  if (prevent_newline_after_colon) {
    const std::optional<int64_t> colon = single_token(tokenizer, ":");
    if (!eol || !colon)
      throw ApiError("prevent_newline_after_colon needs a tokenizer that encodes \":\" and \"\\n\" as one token each, "
                     "and this one does not");
    banned_after.emplace_back(*colon, *eol);
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    const std::string text = prompts[i].get<std::string>();
    if (text.empty() && !add_bos) throw ApiError("Empty prompts require add_BOS=true");
    GenerationRequest r;
    if (!text.empty()) r.prompt = tokenize_prompt(tokenizer, text, i);
    if (add_bos) r.prompt.insert(r.prompt.begin(), tokenizer.eod());  // Megatron's BOS is the eod token
    r.max_new_tokens = tokens_to_generate;
    r.sampling = sampling_params(temperature, top_k, top_p, seed);
    r.sampling.top_p_decay = float(top_p_decay);
    r.sampling.top_p_bound = float(top_p_bound);
    r.stop_tokens = {stop_token};
    r.stop_sequences = stop_sequences;
    r.banned_after = banned_after;
    r.prompt_logprobs = out.logprobs;
    out.requests.push_back(std::move(r));
  }
  if (beam_width) {
    if (tokens_to_generate == 0) throw ApiError("beam search needs tokens_to_generate > 0");
    BeamSearchRequest b;
    b.prompt = out.requests[0].prompt;
    b.max_new_tokens = tokens_to_generate;
    b.beam_size = *beam_width;
    b.stop_token = stop_token;
    b.length_penalty = length_penalty;
    b.banned_after = banned_after;
    out.beam = std::move(b);
  }
  return out;
}

json megatron_beam_response(const std::vector<BeamHypothesis>& beams, const Tokenizer& tokenizer) {
  json text = json::array(), segments = json::array(), scores = json::array();
  for (const BeamHypothesis& b : beams) {
    text.push_back(tokenizer.detokenize(b.tokens));
    json seg = json::array();
    for (int64_t id : b.tokens) seg.push_back(tokenizer.token_text(id));
    segments.push_back(std::move(seg));
    scores.push_back(b.score);
  }
  return {{"text", text}, {"segments", segments}, {"scores", scores}};
}

json megatron_api_response(const MegatronApiRequest& request, const std::vector<GenerationResult>& results,
                           const Tokenizer& tokenizer) {
  json text = json::array(), segments = json::array(), logprobs = json::array();
  for (size_t i = 0; i < results.size(); ++i) {
    std::vector<int64_t> ids = request.requests[i].prompt;
    ids.insert(ids.end(), results[i].tokens.begin(), results[i].tokens.end());
    text.push_back(tokenizer.detokenize(ids));
    json seg = json::array();
    for (int64_t id : ids) seg.push_back(tokenizer.token_text(id));
    segments.push_back(std::move(seg));
    std::vector<double> lp = results[i].prompt_logprobs;
    lp.insert(lp.end(), results[i].logprobs.begin(), results[i].logprobs.end());
    logprobs.push_back(lp);
  }
  return {{"text", text}, {"segments", segments}, {"logprobs", request.logprobs ? logprobs : json(nullptr)}};
}

// ---- POST /v1/completions and /v1/chat/completions ----------------------------------------------------

namespace {

// The fields both OpenAI endpoints share: sampling, n / best_of, streaming, stop strings. Builds
// best_of requests per prompt of `ids`.
void parse_openai_common(const json& body, const Tokenizer& tokenizer, size_t max_prompts,
                         const SamplingDefaults& defaults, int64_t max_tokens, std::vector<std::vector<int64_t>> ids,
                         CompletionRequest& out) {
  if (has(body, "model")) {
    if (!body.at("model").is_string()) throw ApiError("'model' must be a string");
    out.model = body.at("model").get<std::string>();
  }
  out.n = size_t(get_int(body, "n", 1, 1, int64_t(max_prompts)));
  out.best_of = size_t(get_int(body, "best_of", int64_t(out.n), 1, int64_t(max_prompts)));
  if (out.best_of < out.n)
    throw ApiError(fmt::format("best_of ({}) must be at least n ({})", out.best_of, out.n));
  check_prompt_count(ids.size() * out.best_of, max_prompts);
  const bool sets_filter = has(body, "top_k") || has(body, "top_p");
  const double temperature = get_number(body, "temperature", defaults.temperature, 0.0, 100.0);
  const double top_p =
      get_number(body, "top_p", !sets_filter && defaults.top_p > 0.0 ? defaults.top_p : 1.0, 0.0, 1.0);
  const int64_t top_k = get_int(body, "top_k", sets_filter ? 0 : defaults.top_k, 0, 1 << 30);
  const uint64_t seed = uint64_t(get_int(body, "seed", 1234, 0, INT64_MAX));
  const double frequency_penalty = get_number(body, "frequency_penalty", 0.0, -2.0, 2.0);
  const double presence_penalty = get_number(body, "presence_penalty", 0.0, -2.0, 2.0);
  out.stream = get_bool(body, "stream", false);
  if (has(body, "stream_options")) {
    const json& so = body.at("stream_options");
    if (!out.stream) throw ApiError("stream_options is only allowed when stream is true");
    check_fields(so, {"include_usage"});
    out.include_usage = get_bool(so, "include_usage", false);
  }
  if (out.stream && out.best_of > out.n) throw ApiError("best_of greater than n cannot be streamed");
  if (has(body, "user") && !body.at("user").is_string()) throw ApiError("'user' must be a string");
  if (has(body, "stop")) {
    const json& stop = body.at("stop");
    if (stop.is_string()) {
      out.stop.push_back(stop.get<std::string>());
    } else if (stop.is_array() && std::all_of(stop.begin(), stop.end(), [](const json& s) { return s.is_string(); })) {
      out.stop = stop.get<std::vector<std::string>>();
    } else {
      throw ApiError("'stop' must be a string or a list of strings");
    }
    if (std::any_of(out.stop.begin(), out.stop.end(), [](const std::string& s) { return s.empty(); }))
      throw ApiError("a stop string is empty");
  }
  for (auto& p : ids) {
    for (size_t j = 0; j < out.best_of; ++j) {
      GenerationRequest r;
      r.prompt = p;
      r.max_new_tokens = max_tokens;
      r.sampling = sampling_params(temperature, top_k, top_p, seed + j);
      r.sampling.frequency_penalty = float(frequency_penalty);
      r.sampling.presence_penalty = float(presence_penalty);
      r.stop_tokens = {tokenizer.eod()};
      r.top_logprobs = out.top_logprobs;
      out.requests.push_back(std::move(r));
    }
  }
}

}  // namespace

CompletionRequest parse_completion_request(const json& body, const Tokenizer& tokenizer, size_t max_prompts,
                                           const SamplingDefaults& defaults) {
  check_fields(body, {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "logprobs", "stream",
                      "stream_options", "stop", "seed", "n", "best_of", "echo", "user", "frequency_penalty",
                      "presence_penalty", "suffix"});
  CompletionRequest out;
  if (!body.contains("prompt")) throw ApiError("'prompt' is required");
  const json& prompt = body.at("prompt");
  std::vector<std::vector<int64_t>> ids;  // in request order
  auto add_text = [&](const std::string& text) {
    ids.push_back(tokenize_prompt(tokenizer, text, ids.size()));
    out.prompt_texts.push_back(text);
  };
  auto add_ids = [&](std::vector<int64_t> t) {
    if (t.empty()) throw ApiError(fmt::format("prompt {} is empty", ids.size()));
    out.prompt_texts.push_back(tokenizer.detokenize(t));
    ids.push_back(std::move(t));
  };
  if (prompt.is_string()) {
    add_text(prompt.get<std::string>());
  } else if (prompt.is_array() && !prompt.empty() && prompt[0].is_number_integer()) {
    if (!std::all_of(prompt.begin(), prompt.end(), [](const json& x) { return x.is_number_integer(); }))
      throw ApiError("'prompt' must be a string, a list of strings, or token ids");
    add_ids(prompt.get<std::vector<int64_t>>());  // one prompt of token ids
  } else if (prompt.is_array() && !prompt.empty()) {
    check_prompt_count(prompt.size(), max_prompts);
    for (const json& p : prompt) {
      if (p.is_string()) {
        add_text(p.get<std::string>());
      } else if (p.is_array() && std::all_of(p.begin(), p.end(), [](const json& x) { return x.is_number_integer(); })) {
        add_ids(p.get<std::vector<int64_t>>());
      } else {
        throw ApiError("'prompt' must be a string, a list of strings, or token ids");
      }
    }
  } else {
    throw ApiError("'prompt' must be a non-empty string or list");
  }
  if (has(body, "suffix")) {
    if (!body.at("suffix").is_string()) throw ApiError("'suffix' must be a string");
    if (!body.at("suffix").get<std::string>().empty())
      throw ApiError("'suffix' is not supported: this server has no fill-in-the-middle model");
  }
  const int64_t max_tokens = get_int(body, "max_tokens", 16, 0, 1 << 30);
  if (has(body, "logprobs")) {
    out.top_logprobs = int(get_int(body, "logprobs", 0, 0, 20));
    out.logprobs = true;
  }
  out.echo = get_bool(body, "echo", false);
  if (out.echo && out.logprobs && get_bool(body, "stream", false))
    throw ApiError("echo with logprobs cannot be streamed; ask without \"stream\"");
  parse_openai_common(body, tokenizer, max_prompts, defaults, max_tokens, std::move(ids), out);
  for (GenerationRequest& r : out.requests) r.prompt_logprobs = out.echo && out.logprobs;
  return out;
}

CompletionRequest parse_chat_request(const json& body, const Tokenizer& tokenizer, const ChatTemplate* chat_template,
                                     size_t max_prompts, const SamplingDefaults& defaults) {
  check_fields(body, {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
                      "logprobs", "top_logprobs", "stream", "stream_options", "stop", "seed", "n", "user",
                      "frequency_penalty", "presence_penalty"});
  if (!chat_template)
    throw ApiError("this model's tokenizer has no chat template (tokenizer_config.json \"chat_template\"), so "
                   "/v1/chat/completions cannot format messages; use /v1/completions");
  CompletionRequest out;
  out.chat = true;
  if (!body.contains("messages")) throw ApiError("'messages' is required");
  const json& messages = body.at("messages");
  if (!messages.is_array() || messages.empty()) throw ApiError("'messages' must be a non-empty list");
  nlohmann::ordered_json conversation = nlohmann::ordered_json::array();
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    if (!m.is_object()) throw ApiError(fmt::format("message {} must be an object", i));
    for (const auto& [key, value] : m.items())
      if (key != "role" && key != "content" && key != "name")
        throw ApiError(fmt::format("message {}: unknown field {}", i, quoted(key)));
    if (!m.contains("role") || !m.at("role").is_string()) throw ApiError(fmt::format("message {} needs a role", i));
    const std::string role = m.at("role").get<std::string>();
    if (role != "system" && role != "user" && role != "assistant")
      throw ApiError(fmt::format("message {}: role {} is not one of system, user, assistant", i, quoted(role)));
    if (!m.contains("content") || !m.at("content").is_string())
      throw ApiError(fmt::format("message {}: 'content' must be a string", i));
    nlohmann::ordered_json msg = {{"role", role}, {"content", m.at("content").get<std::string>()}};
    if (m.contains("name")) {
      if (!m.at("name").is_string()) throw ApiError(fmt::format("message {}: 'name' must be a string", i));
      msg["name"] = m.at("name").get<std::string>();
    }
    conversation.push_back(std::move(msg));
  }
  std::string prompt;
  try {
    prompt = chat_template->render(conversation, /*add_generation_prompt=*/true);
  } catch (const std::exception& e) {
    throw ApiError(e.what());
  }
  std::vector<int64_t> ids = tokenize_prompt(tokenizer, prompt, 0);
  // A template that writes bos_token itself, tokenized by a tokenizer that adds it too (transformers
  // tokenizes the rendered chat without special tokens): keep one.
  if (auto bos = tokenizer.bos(); bos && ids.size() >= 2 && ids[0] == *bos && ids[1] == *bos) ids.erase(ids.begin());
  out.prompt_texts.push_back(prompt);
  if (has(body, "max_tokens") && has(body, "max_completion_tokens"))
    throw ApiError("give max_tokens or max_completion_tokens, not both");
  const int64_t max_tokens = has(body, "max_completion_tokens")
                                 ? get_int(body, "max_completion_tokens", 16, 0, 1 << 30)
                                 : get_int(body, "max_tokens", 16, 0, 1 << 30);
  out.logprobs = get_bool(body, "logprobs", false);
  if (has(body, "top_logprobs")) {
    if (!out.logprobs) throw ApiError("top_logprobs needs logprobs: true");
    out.top_logprobs = int(get_int(body, "top_logprobs", 0, 0, 20));
  }
  parse_openai_common(body, tokenizer, max_prompts, defaults, max_tokens, {std::move(ids)}, out);
  return out;
}

CompletionText::CompletionText(const Tokenizer& tokenizer, std::vector<int64_t> stop_tokens,
                               std::vector<std::string> stop)
    : tokenizer_(tokenizer), stop_tokens_(std::move(stop_tokens)), stop_(std::move(stop)) {}

std::string CompletionText::release(size_t end) {
  if (end <= released_.size()) return "";
  std::string piece = full_.substr(released_.size(), end - released_.size());
  released_ += piece;
  return piece;
}

std::string CompletionText::add(int64_t token) {
  if (stopped_) return "";
  if (std::find(stop_tokens_.begin(), stop_tokens_.end(), token) != stop_tokens_.end()) {
    stopped_ = true;
    return finish();
  }
  ids_.push_back(token);
  full_ = tokenizer_.detokenize(ids_);
  size_t cut = std::string::npos;
  for (const std::string& s : stop_) cut = std::min(cut, full_.find(s));
  if (cut != std::string::npos) {
    full_.resize(cut);
    stopped_ = true;
    return finish();
  }
  // Hold back a suffix that may grow into a stop string, or an unfinished UTF-8 character (U+FFFD).
  size_t hold = 0;
  for (const std::string& s : stop_)
    for (size_t n = std::min(s.size() - 1, full_.size()); n > hold; --n)
      if (full_.compare(full_.size() - n, n, s, 0, n) == 0) hold = n;
  static const std::string kReplacement = "\xEF\xBF\xBD";
  if (full_.size() >= 3 && full_.compare(full_.size() - 3, 3, kReplacement) == 0) hold = std::max<size_t>(hold, 3);
  return release(full_.size() - hold);
}

std::string CompletionText::finish() { return release(full_.size()); }

std::string completion_finish_reason(const GenerationResult& result, bool stopped_by_text) {
  if (stopped_by_text || result.finish_reason == "stop") return "stop";
  return result.finish_reason == "length" ? "length" : result.finish_reason;
}

json completion_choice(size_t index, const std::string& text, const std::optional<std::string>& finish_reason,
                       const json& logprobs) {
  return {{"index", index},
          {"text", text},
          {"logprobs", logprobs},
          {"finish_reason", finish_reason ? json(*finish_reason) : json(nullptr)}};
}

json chat_choice(size_t index, const std::string& content, const std::optional<std::string>& finish_reason,
                 const json& logprobs) {
  return {{"index", index},
          {"message", {{"role", "assistant"}, {"content", content}}},
          {"logprobs", logprobs},
          {"finish_reason", finish_reason ? json(*finish_reason) : json(nullptr)}};
}

json chat_delta_choice(size_t index, const std::optional<std::string>& role, const std::optional<std::string>& content,
                       const std::optional<std::string>& finish_reason, const json& logprobs) {
  json delta = json::object();
  if (role) delta["role"] = *role;
  if (content) delta["content"] = *content;
  return {{"index", index},
          {"delta", delta},
          {"logprobs", logprobs},
          {"finish_reason", finish_reason ? json(*finish_reason) : json(nullptr)}};
}

TokenLogprobs choice_logprobs(const GenerationRequest& request, const GenerationResult& result, size_t kept,
                              bool echo) {
  TokenLogprobs lp;
  const bool top = request.top_logprobs > 0;
  if (echo) {
    lp.tokens = request.prompt;
    lp.logprobs.push_back(std::nullopt);
    for (double x : result.prompt_logprobs) lp.logprobs.push_back(x);
    if (top) {
      lp.top.push_back(std::nullopt);
      for (const auto& t : result.prompt_top_logprobs) lp.top.push_back(t);
    }
  }
  for (size_t i = 0; i < kept; ++i) {
    lp.tokens.push_back(result.tokens[i]);
    lp.logprobs.push_back(result.logprobs[i]);
    if (top) lp.top.push_back(result.top_logprobs[i]);
  }
  return lp;
}

namespace {
json optional_number(const std::optional<double>& x) { return x ? json(*x) : json(nullptr); }

json utf8_bytes(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(int(c));
  return b;
}
}  // namespace

json completion_logprobs(const TokenLogprobs& lp, const Tokenizer& tokenizer, size_t text_offset) {
  json strings = json::array(), values = json::array(), tops = json::array(), offsets = json::array();
  for (size_t i = 0; i < lp.tokens.size(); ++i) {
    std::string s = tokenizer.token_text(lp.tokens[i]);
    offsets.push_back(text_offset);
    text_offset += s.size();
    strings.push_back(std::move(s));
    values.push_back(optional_number(lp.logprobs[i]));
    if (!lp.top.empty()) {
      if (!lp.top[i]) {
        tops.push_back(nullptr);
        continue;
      }
      json d = json::object();
      for (const auto& [t, v] : *lp.top[i]) {
        const std::string key = tokenizer.token_text(t);
        if (!d.contains(key)) d[key] = v;  // two ids with one text: the likelier one
      }
      tops.push_back(std::move(d));
    }
  }
  return {{"tokens", strings},
          {"token_logprobs", values},
          {"top_logprobs", lp.top.empty() ? json(nullptr) : tops},
          {"text_offset", offsets}};
}

json chat_logprobs(const TokenLogprobs& lp, const Tokenizer& tokenizer) {
  json content = json::array();
  for (size_t i = 0; i < lp.tokens.size(); ++i) {
    const std::string s = tokenizer.token_text(lp.tokens[i]);
    json top = json::array();
    if (!lp.top.empty() && lp.top[i]) {
      for (const auto& [t, v] : *lp.top[i]) {
        const std::string ts = tokenizer.token_text(t);
        top.push_back({{"token", ts}, {"logprob", v}, {"bytes", utf8_bytes(ts)}});
      }
    }
    content.push_back(
        {{"token", s}, {"logprob", optional_number(lp.logprobs[i])}, {"bytes", utf8_bytes(s)}, {"top_logprobs", top}});
  }
  return {{"content", content}};
}

json completion_object(const std::string& id, const std::string& object, const std::string& model, json choices,
                       const json& usage) {
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  json out = {{"id", id},
              {"object", object},
              {"created", std::chrono::duration_cast<std::chrono::seconds>(now).count()},
              {"model", model},
              {"choices", std::move(choices)}};
  if (!usage.is_null()) out["usage"] = usage;
  return out;
}

}  // namespace megatron

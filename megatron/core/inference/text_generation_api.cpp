#include "megatron/core/inference/text_generation_api.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <set>

namespace megatron {

namespace {

using nlohmann::json;

void check_fields(const json& body, const std::set<std::string>& known) {
  if (!body.is_object()) throw ApiError("the request body must be a JSON object");
  for (const auto& [key, value] : body.items()) {
    if (!known.count(key)) throw ApiError(fmt::format("unknown field '{}'", key));
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

MegatronApiRequest parse_megatron_api_request(const json& body, const Tokenizer& tokenizer, size_t max_prompts) {
  check_fields(body, {"prompts", "tokens_to_generate", "temperature", "top_k", "top_p", "logprobs", "add_BOS",
                      "random_seed", "stop_token"});
  if (!body.contains("prompts")) throw ApiError("'prompts' is required");
  const json& prompts = body.at("prompts");
  if (!prompts.is_array()) throw ApiError("'prompts' must be a list of strings");
  if (prompts.empty()) throw ApiError("'prompts' is empty");
  check_prompt_count(prompts.size(), max_prompts);
  MegatronApiRequest out;
  out.logprobs = get_bool(body, "logprobs", false);
  const int64_t tokens_to_generate = get_int(body, "tokens_to_generate", 64, 0, 1 << 30);
  if (tokens_to_generate == 0 && !out.logprobs) throw ApiError("tokens_to_generate=0 implies logprobs should be true");
  const double temperature = get_number(body, "temperature", 1.0, 0.0, 100.0);
  const int64_t top_k = get_int(body, "top_k", 0, 0, 1000);
  const double top_p = get_number(body, "top_p", 0.0, 0.0, 1.0);
  if (top_k > 0 && top_p > 0.0) throw ApiError("cannot set both top_k and top_p");
  const bool add_bos = get_bool(body, "add_BOS", false);
  const uint64_t seed = uint64_t(get_int(body, "random_seed", 1234, 0, INT64_MAX));
  const int64_t stop_token = get_int(body, "stop_token", tokenizer.eod(), 0, INT64_MAX);
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (!prompts[i].is_string()) throw ApiError(fmt::format("prompt {} must be a string", i));
    GenerationRequest r;
    r.prompt = tokenize_prompt(tokenizer, prompts[i].get<std::string>(), i);
    if (add_bos) r.prompt.insert(r.prompt.begin(), tokenizer.bos().value_or(tokenizer.eod()));
    r.max_new_tokens = tokens_to_generate;
    r.sampling = sampling_params(temperature, top_k, top_p, seed);
    r.stop_tokens = {stop_token};
    r.prompt_logprobs = out.logprobs;
    out.requests.push_back(std::move(r));
  }
  return out;
}

json megatron_api_response(const MegatronApiRequest& request, const std::vector<GenerationResult>& results,
                           const Tokenizer& tokenizer) {
  json text = json::array(), segments = json::array(), logprobs = json::array();
  for (size_t i = 0; i < results.size(); ++i) {
    std::vector<int64_t> ids = request.requests[i].prompt;
    ids.insert(ids.end(), results[i].tokens.begin(), results[i].tokens.end());
    text.push_back(tokenizer.detokenize(ids));
    json seg = json::array();
    for (int64_t id : ids) seg.push_back(tokenizer.detokenize({id}));
    segments.push_back(std::move(seg));
    std::vector<double> lp = results[i].prompt_logprobs;
    lp.insert(lp.end(), results[i].logprobs.begin(), results[i].logprobs.end());
    logprobs.push_back(lp);
  }
  return {{"text", text}, {"segments", segments}, {"logprobs", request.logprobs ? logprobs : json(nullptr)}};
}

// ---- POST /v1/completions ----------------------------------------------------------------------------

CompletionRequest parse_completion_request(const json& body, const Tokenizer& tokenizer, size_t max_prompts) {
  check_fields(body, {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "logprobs", "stream", "stop",
                      "seed", "n", "echo", "user"});
  CompletionRequest out;
  if (has(body, "model")) {
    if (!body.at("model").is_string()) throw ApiError("'model' must be a string");
    out.model = body.at("model").get<std::string>();
  }
  if (!body.contains("prompt")) throw ApiError("'prompt' is required");
  const json& prompt = body.at("prompt");
  std::vector<std::vector<int64_t>> token_prompts;
  if (prompt.is_string()) {
    out.prompt_texts.push_back(prompt.get<std::string>());
  } else if (prompt.is_array() && !prompt.empty() && prompt[0].is_number_integer()) {
    token_prompts.push_back(prompt.get<std::vector<int64_t>>());  // one prompt of token ids
  } else if (prompt.is_array() && !prompt.empty()) {
    check_prompt_count(prompt.size(), max_prompts);
    for (const json& p : prompt) {
      if (p.is_string()) {
        out.prompt_texts.push_back(p.get<std::string>());
      } else if (p.is_array() && std::all_of(p.begin(), p.end(), [](const json& x) { return x.is_number_integer(); })) {
        token_prompts.push_back(p.get<std::vector<int64_t>>());
      } else {
        throw ApiError("'prompt' must be a string, a list of strings, or token ids");
      }
    }
  } else {
    throw ApiError("'prompt' must be a non-empty string or list");
  }
  if (get_int(body, "n", 1, 1, 1) != 1) throw ApiError("only n = 1 is supported");
  const int64_t max_tokens = get_int(body, "max_tokens", 16, 0, 1 << 30);
  const double temperature = get_number(body, "temperature", 1.0, 0.0, 100.0);
  const double top_p = get_number(body, "top_p", 1.0, 0.0, 1.0);
  const int64_t top_k = get_int(body, "top_k", 0, 0, 1 << 30);
  const uint64_t seed = uint64_t(get_int(body, "seed", 1234, 0, INT64_MAX));
  if (has(body, "logprobs")) out.logprobs = get_int(body, "logprobs", 0, 0, 20) >= 0;
  out.stream = get_bool(body, "stream", false);
  out.echo = get_bool(body, "echo", false);
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
  std::vector<std::vector<int64_t>> ids;
  for (size_t i = 0; i < out.prompt_texts.size(); ++i)
    ids.push_back(tokenize_prompt(tokenizer, out.prompt_texts[i], i));
  for (auto& t : token_prompts) {
    if (t.empty()) throw ApiError(fmt::format("prompt {} is empty", ids.size()));
    out.prompt_texts.push_back(tokenizer.detokenize(t));
    ids.push_back(std::move(t));
  }
  for (auto& p : ids) {
    GenerationRequest r;
    r.prompt = std::move(p);
    r.max_new_tokens = max_tokens;
    r.sampling = sampling_params(temperature, top_k, top_p, seed);
    r.stop_tokens = {tokenizer.eod()};
    out.requests.push_back(std::move(r));
  }
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

json completion_logprobs(const std::vector<int64_t>& tokens, const std::vector<double>& logprobs,
                         const Tokenizer& tokenizer) {
  json strings = json::array(), offsets = json::array();
  size_t offset = 0;
  for (int64_t t : tokens) {
    std::string s = tokenizer.detokenize({t});
    offsets.push_back(offset);
    offset += s.size();
    strings.push_back(std::move(s));
  }
  return {{"tokens", strings}, {"token_logprobs", logprobs}, {"top_logprobs", nullptr}, {"text_offset", offsets}};
}

json completion_object(const std::string& id, const std::string& model, json choices, const json& usage) {
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  json out = {{"id", id},
              {"object", "text_completion"},
              {"created", std::chrono::duration_cast<std::chrono::seconds>(now).count()},
              {"model", model},
              {"choices", std::move(choices)}};
  if (!usage.is_null()) out["usage"] = usage;
  return out;
}

}  // namespace megatron

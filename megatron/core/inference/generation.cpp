#include "megatron/core/inference/generation.h"

#include <algorithm>
#include <limits>

#include "megatron/runtime/check.h"

namespace megatron {

int64_t model_max_sequence_length(const TransformerConfig& config) {
  if (config.use_learned_positions() || config.max_position_embeddings > 0) return config.max_position_embeddings;
  return config.seq_length;
}

namespace {
int64_t resolve_max_length(const TransformerConfig& config, const EngineOptions& options) {
  const int64_t model_max = model_max_sequence_length(config);
  int64_t len = options.max_sequence_length > 0 ? options.max_sequence_length : model_max;
  MG_CHECK(len > 0, "the inference engine needs a maximum sequence length (the model has none; set one)");
  if (config.use_learned_positions()) {
    MG_CHECK(len <= model_max, "maximum sequence length {} exceeds the model's {} learned positions", len, model_max);
  }
  return len;
}
}  // namespace

InferenceEngine::InferenceEngine(const GPTModel& model, Context& ctx, int64_t vocab_size, EngineOptions options)
    : model_(model),
      ctx_(ctx),
      vocab_size_(vocab_size),
      max_length_(resolve_max_length(model.config(), options)),
      group_(options.group),
      cache_(model.config(), options.max_batch_size, max_length_, ctx.device()),
      slots_(size_t(options.max_batch_size)) {
  MG_CHECK(!group_ || group_->leader(), "the inference engine runs on rank 0 of its tensor-parallel group");
  MG_CHECK(vocab_size > 0 && vocab_size <= model.config().padded_vocab_size,
           "tokenizer vocabulary {} does not fit the model's {} output rows", vocab_size,
           model.config().padded_vocab_size);
}

void InferenceEngine::validate(const GenerationRequest& r) const {
  MG_CHECK(!r.prompt.empty(), "the prompt is empty");
  for (int64_t id : r.prompt)
    MG_CHECK(id >= 0 && id < vocab_size_, "prompt token {} is outside [0, {})", id, vocab_size_);
  MG_CHECK(r.max_new_tokens >= 0, "the number of tokens to generate must be non-negative (got {})", r.max_new_tokens);
  MG_CHECK(int64_t(r.prompt.size()) + r.max_new_tokens <= max_length_,
           "too many tokens: a prompt of {} tokens plus {} to generate exceeds the maximum sequence length {}",
           r.prompt.size(), r.max_new_tokens, max_length_);
  check_sampling_params(r.sampling);
  MG_CHECK(r.top_logprobs >= 0 && r.top_logprobs <= vocab_size_, "top_logprobs must be in [0, {}] (got {})",
           vocab_size_, r.top_logprobs);
  for (const auto& s : r.stop_sequences) MG_CHECK(!s.empty(), "a stop sequence is empty");
}

void InferenceEngine::submit(GenerationRequest request, TokenCallback on_token, DoneCallback on_done) {
  validate(request);
  Sequence seq{std::move(request), std::move(on_token), std::move(on_done), {}, {}};
  seq.ids = seq.request.prompt;
  const uint64_t group = seq.request.group;
  auto it = std::find_if(waiting_.rbegin(), waiting_.rend(), [&](const Group& g) { return g.id == group; });
  if (it != waiting_.rend()) {
    it->sequences.push_back(std::move(seq));
  } else {
    waiting_.push_back({group, {}});
    waiting_.back().sequences.push_back(std::move(seq));
  }
}

int64_t InferenceEngine::active_count() const {
  return std::count_if(slots_.begin(), slots_.end(), [](const auto& s) { return s.has_value(); });
}

int64_t InferenceEngine::waiting_count() const {
  int64_t n = 0;
  for (const Group& g : waiting_) n += int64_t(g.sequences.size());
  return n;
}

namespace {
bool is_cancelled(const GenerationRequest& r) { return r.cancelled && r.cancelled->load(); }
}  // namespace

void InferenceEngine::drop_cancelled() {
  for (size_t k = 0; k < slots_.size(); ++k)
    if (slots_[k] && is_cancelled(slots_[k]->request)) finish(int64_t(k), "cancelled");
  std::vector<Sequence> dropped;
  for (Group& g : waiting_) {
    auto keep = std::stable_partition(g.sequences.begin(), g.sequences.end(),
                                      [](const Sequence& s) { return !is_cancelled(s.request); });
    for (auto it = keep; it != g.sequences.end(); ++it) dropped.push_back(std::move(*it));
    g.sequences.erase(keep, g.sequences.end());
  }
  std::erase_if(waiting_, [](const Group& g) { return g.sequences.empty(); });
  for (Sequence& seq : dropped) {
    seq.result.finish_reason = "cancelled";
    if (seq.on_done) seq.on_done(seq.result);
  }
}

// Note [Fair admission]: a free slot goes to the group at the front of the turn order, which then
// moves to the back. One HTTP request's prompts share a group, so a request of 128 prompts takes
// every other slot that frees up while a one-prompt request waits, instead of all of them first:
// the small one waits for one sequence to end, not for the whole big request. Within a group the
// order is submission order; requests with the default group 0 are plain FIFO.
InferenceEngine::Sequence InferenceEngine::next_waiting() {
  Group& g = waiting_.front();
  Sequence seq = std::move(g.sequences.front());
  g.sequences.pop_front();
  if (g.sequences.empty()) {
    waiting_.pop_front();
  } else if (waiting_.size() > 1) {
    Group turn_over = std::move(g);
    waiting_.pop_front();
    waiting_.push_back(std::move(turn_over));
  }
  return seq;
}

bool InferenceEngine::step() {
  drop_cancelled();
  std::vector<int64_t> admitted;
  for (size_t k = 0; k < slots_.size() && !waiting_.empty(); ++k) {
    if (slots_[k]) continue;
    slots_[k] = next_waiting();
    admitted.push_back(int64_t(k));
  }
  if (!admitted.empty()) prefill(admitted);
  const bool decoding = active_count() > 0;
  if (decoding) decode();
  return !admitted.empty() || decoding;
}

Tensor InferenceEngine::forward(const Tensor& tokens, const std::vector<int64_t>& slots,
                                const std::vector<int64_t>& starts, const std::vector<int64_t>& output_rows) {
  if (group_) group_->announce_forward(ctx_, InferenceGroup::kEngineCache, cache_, tokens, slots, starts, output_rows);
  return model_.forward_inference(ctx_, tokens, slots, starts, cache_, output_rows);
}

// Right-padded prefill of the admitted prompts (all from position 0), then each sequence's first token.
void InferenceEngine::prefill(const std::vector<int64_t>& slots) {
  const int64_t b = int64_t(slots.size());
  int64_t len = 0;
  for (int64_t k : slots) len = std::max<int64_t>(len, int64_t(slots_[size_t(k)]->ids.size()));
  std::vector<int64_t> tokens(size_t(b * len), 0);
  for (int64_t i = 0; i < b; ++i) {
    const std::vector<int64_t>& ids = slots_[size_t(slots[size_t(i)])]->ids;
    std::copy(ids.begin(), ids.end(), tokens.begin() + i * len);
  }
  // Note [Prefill output rows]: the output layer runs only on the rows whose logits are used: each
  // sequence's last prompt token, and every prompt token of a sequence that asks for prompt
  // log-probabilities. Row j·b + i is sequence i's token j; sorted, so runs of rows copy at once.
  std::vector<int64_t> wanted;
  for (int64_t i = 0; i < b; ++i) {
    const Sequence& seq = *slots_[size_t(slots[size_t(i)])];
    const int64_t n = int64_t(seq.request.prompt.size());
    for (int64_t j = seq.request.prompt_logprobs ? 0 : n - 1; j < n; ++j) wanted.push_back(j * b + i);
  }
  std::sort(wanted.begin(), wanted.end());
  Tensor t = Tensor::from_ints(tokens, {b, len}, DType::Int64, ctx_.device());
  const std::vector<int64_t> starts(size_t(b), 0);
  std::vector<float> logits = forward(t, slots, starts, wanted).to_floats();  // [wanted, V]
  const int64_t v = model_.config().padded_vocab_size;
  auto row = [&](int64_t j, int64_t i) {
    const auto at = std::lower_bound(wanted.begin(), wanted.end(), j * b + i);
    return logits.data() + (at - wanted.begin()) * v;
  };
  for (int64_t i = 0; i < b; ++i) {
    Sequence& seq = *slots_[size_t(slots[size_t(i)])];
    const int64_t n = int64_t(seq.request.prompt.size());
    if (seq.request.prompt_logprobs) {
      for (int64_t j = 0; j + 1 < n; ++j) {
        seq.result.prompt_logprobs.push_back(token_logprob(row(j, i), vocab_size_, seq.request.prompt[size_t(j + 1)]));
        if (seq.request.top_logprobs > 0)
          seq.result.prompt_top_logprobs.push_back(top_logprobs(row(j, i), vocab_size_, seq.request.top_logprobs));
      }
    }
    if (seq.request.max_new_tokens == 0) {
      finish(slots[size_t(i)], "length");
      continue;
    }
    emit(slots[size_t(i)], row(n - 1, i));
  }
}

// One token for every active sequence, each at its own position.
void InferenceEngine::decode() {
  std::vector<int64_t> slots, starts, tokens;
  for (size_t k = 0; k < slots_.size(); ++k) {
    if (!slots_[k]) continue;
    slots.push_back(int64_t(k));
    starts.push_back(int64_t(slots_[k]->ids.size()) - 1);
    tokens.push_back(slots_[k]->ids.back());
  }
  const int64_t b = int64_t(slots.size()), v = model_.config().padded_vocab_size;
  Tensor t = Tensor::from_ints(tokens, {b, 1}, DType::Int64, ctx_.device());
  std::vector<float> logits = forward(t, slots, starts).to_floats();  // [1, b, V]
  for (int64_t i = 0; i < b; ++i) emit(slots[size_t(i)], logits.data() + i * v);
}

namespace {
bool ends_with_any(const std::vector<int64_t>& ids, const std::vector<std::vector<int64_t>>& sequences) {
  for (const std::vector<int64_t>& s : sequences)
    if (s.size() <= ids.size() && std::equal(s.rbegin(), s.rend(), ids.rbegin())) return true;
  return false;
}
}  // namespace

void InferenceEngine::emit(int64_t slot, const float* logits) {
  Sequence& seq = *slots_[size_t(slot)];
  const GenerationRequest& r = seq.request;
  const float* sampled = logits;
  std::vector<float> adjusted;
  if (r.sampling.frequency_penalty != 0.0f || r.sampling.presence_penalty != 0.0f || !r.banned_after.empty()) {
    adjusted.assign(logits, logits + vocab_size_);
    apply_penalties(adjusted.data(), vocab_size_, seq.result.tokens, r.sampling);
    for (const auto& [after, banned] : r.banned_after)
      if (seq.ids.back() == after && banned >= 0 && banned < vocab_size_)
        adjusted[size_t(banned)] = -std::numeric_limits<float>::infinity();
    sampled = adjusted.data();
  }
  const int64_t token = sample_token(sampled, vocab_size_, r.sampling, uint64_t(seq.result.tokens.size()));
  const double logprob = token_logprob(logits, vocab_size_, token);
  seq.ids.push_back(token);
  seq.result.tokens.push_back(token);
  seq.result.logprobs.push_back(logprob);
  static const TopLogprobs kNone;
  if (r.top_logprobs > 0) seq.result.top_logprobs.push_back(top_logprobs(logits, vocab_size_, r.top_logprobs));
  if (seq.on_token && !seq.on_token(token, logprob, r.top_logprobs > 0 ? seq.result.top_logprobs.back() : kNone)) {
    finish(slot, "cancelled");
  } else if (std::find(r.stop_tokens.begin(), r.stop_tokens.end(), token) != r.stop_tokens.end() ||
             ends_with_any(seq.ids, r.stop_sequences)) {
    finish(slot, "stop");
  } else if (int64_t(seq.result.tokens.size()) >= r.max_new_tokens) {
    finish(slot, "length");
  }
}

void InferenceEngine::finish(int64_t slot, const std::string& reason) {
  Sequence seq = std::move(*slots_[size_t(slot)]);
  slots_[size_t(slot)].reset();
  seq.result.finish_reason = reason;
  if (seq.on_done) seq.on_done(seq.result);
}

void InferenceEngine::abort_all(const std::string& message) {
  for (size_t k = 0; k < slots_.size(); ++k)
    if (slots_[k]) finish(int64_t(k), "error: " + message);
  while (!waiting_.empty()) {
    Sequence seq = next_waiting();
    seq.result.finish_reason = "error: " + message;
    if (seq.on_done) seq.on_done(seq.result);
  }
}

std::vector<GenerationResult> InferenceEngine::generate(const std::vector<GenerationRequest>& requests) {
  std::vector<GenerationResult> results(requests.size());
  for (const GenerationRequest& r : requests) validate(r);
  for (size_t i = 0; i < requests.size(); ++i) {
    submit(requests[i], nullptr, [&results, i](const GenerationResult& r) { results[i] = r; });
  }
  while (step()) {
  }
  return results;
}

}  // namespace megatron

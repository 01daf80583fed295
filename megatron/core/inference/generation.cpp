#include "megatron/core/inference/generation.h"

#include <algorithm>
#include <bit>
#include <limits>

#include "megatron/kernels/ops.h"
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
  // Tensor-parallel steps announce every forward to the other ranks and run collectives: eager.
  use_graphs_ = options.cuda_graphs && ctx.device().is_cuda() && model.inference_capturable() && !group_;
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

// Note [Greedy rows on the device]: a greedy request with no penalty, no banned token and no top
// log-probabilities needs of its logits row only the argmax and the log-softmax there; those come
// from ops::logits_summary (three numbers a row) instead of copying [rows, vocab] fp32 to the host
// and taking an fp64 log-softmax there. Same values: the CPU op sums in token_logprob's order, the
// GPU's fp64 sum differs only in its last bits.
bool needs_full_row(const GenerationRequest& r) {
  return !(r.sampling.greedy || r.sampling.top_k == 1) || r.sampling.frequency_penalty != 0.0f ||
         r.sampling.presence_penalty != 0.0f || !r.banned_after.empty() || r.top_logprobs > 0 || r.prompt_logprobs;
}

struct RowChoice {
  int64_t token;
  double logprob;
};

// logits_summary's argmax and log_norm -> each row's token and its log-probability (-log_norm).
std::vector<RowChoice> read_choices(const Tensor& argmax, const Tensor& log_norm) {
  const std::vector<int64_t> ids = argmax.to_ints(), norms = log_norm.to_ints();
  std::vector<RowChoice> out;
  for (size_t r = 0; r < ids.size(); ++r) out.push_back({ids[r], -std::bit_cast<double>(norms[r])});
  return out;
}

// rows [n, V'] on the model's device -> each row's argmax and its log-probability over [0, vocab).
std::vector<RowChoice> greedy_choices(Context& ctx, const Tensor& rows, int64_t vocab) {
  const int64_t n = rows.size(0);
  Tensor argmax = Tensor::empty({n}, DType::Int64, rows.device()), max_logit = Tensor::empty({n}, DType::Float32, rows.device());
  Tensor log_norm = Tensor::empty({n}, DType::Int64, rows.device());
  ops::logits_summary(ctx, rows, vocab, argmax, max_logit, log_norm);
  return read_choices(argmax, log_norm);
}
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
  const Tensor out = forward(t, slots, starts, wanted);  // [wanted, V]
  if (std::none_of(slots.begin(), slots.end(), [&](int64_t k) { return needs_full_row(slots_[size_t(k)]->request); })) {
    const std::vector<RowChoice> choice = greedy_choices(ctx_, out, vocab_size_);  // one wanted row per sequence
    for (int64_t i = 0; i < b; ++i) {
      const int64_t n = int64_t(slots_[size_t(slots[size_t(i)])]->request.prompt.size());
      const size_t at = size_t(std::lower_bound(wanted.begin(), wanted.end(), (n - 1) * b + i) - wanted.begin());
      if (slots_[size_t(slots[size_t(i)])]->request.max_new_tokens == 0) {
        finish(slots[size_t(i)], "length");
      } else {
        accept(slots[size_t(i)], choice[at].token, choice[at].logprob);
      }
    }
    return;
  }
  std::vector<float> logits = out.to_floats();
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
  const bool greedy = std::none_of(slots.begin(), slots.end(),
                                   [&](int64_t k) { return needs_full_row(slots_[size_t(k)]->request); });
  std::vector<RowChoice> choice;
  std::vector<float> logits;
  if (use_graphs_) {
    const DecodeGraph& g = decode_through_graph(model_.inference_inputs(ctx_, t, slots, starts, cache_));
    if (greedy) {
      choice = read_choices(g.argmax, g.log_norm);
    } else {
      logits = g.logits.to_floats();
    }
  } else {
    const Tensor out = forward(t, slots, starts).view({b, v});
    if (greedy) {
      choice = greedy_choices(ctx_, out, vocab_size_);  // Note [Greedy rows on the device]
    } else {
      logits = out.to_floats();
    }
  }
  for (int64_t i = 0; i < b; ++i) {
    if (greedy) {
      accept(slots[size_t(i)], choice[size_t(i)].token, choice[size_t(i)].logprob);
    } else {
      emit(slots[size_t(i)], logits.data() + i * v);
    }
  }
}

// Note [Decode graphs]: on a GPU a decode step of b sequences is a few hundred small kernels (24
// layers x ~14), each launched from the host: a batch-1 step of a 1.3B model spends more time
// launching than computing. So each batch size's step is recorded once as a CUDA graph
// (runtime/cuda_graph.h) and then launched as one: the step's inputs — token ids, positions,
// rotary rows, cache slots and starts, all checked on the host by GPTModel::inference_inputs —
// are copied into the graph's own input tensors, and the graph writes the logits and their
// logits_summary into its output tensors. The first step of a batch size runs eagerly (it builds
// the cuBLASLt plans and grows the workspaces the recording must find in place); the second is
// recorded, then launched like every later one. What the device half of the forward reads on the
// host makes a model not capturable (GPTModel::inference_capturable: MoE, MLA, sinks, windows,
// FP8): those decode eagerly. Prefill stays eager (its shapes change with every admission).
InferenceEngine::DecodeGraph& InferenceEngine::decode_through_graph(const InferenceInputs& fresh) {
  const int64_t b = fresh.tokens.size(0), v = model_.config().padded_vocab_size;
  std::unique_ptr<DecodeGraph>& slot = graphs_[b];
  const Device dev = ctx_.device();
  if (!slot) {
    slot = std::make_unique<DecodeGraph>();
    auto like = [&](const Tensor& t) { return t.defined() ? Tensor::empty(t.shape(), t.dtype(), dev) : Tensor(); };
    slot->in.tokens = like(fresh.tokens);
    slot->in.position_ids = like(fresh.position_ids);
    slot->in.freqs = like(fresh.freqs);
    slot->in.rows.slots = like(fresh.rows.slots);
    slot->in.rows.starts = like(fresh.rows.starts);
    slot->argmax = Tensor::empty({b}, DType::Int64, dev);
    slot->max_logit = Tensor::empty({b}, DType::Float32, dev);
    slot->log_norm = Tensor::empty({b}, DType::Int64, dev);
  }
  DecodeGraph& g = *slot;
  auto put = [&](const Tensor& src, Tensor& dst) {
    if (src.defined()) ops::copy_rows(ctx_, src, 0, dst, 0, src.size(0));
  };
  put(fresh.tokens, g.in.tokens);
  put(fresh.position_ids, g.in.position_ids);
  put(fresh.freqs, g.in.freqs);
  put(fresh.rows.slots, g.in.rows.slots);
  put(fresh.rows.starts, g.in.rows.starts);
  g.in.rows.slot_ids = fresh.rows.slot_ids;  // host copies: a one-token forward does not read them
  g.in.rows.start_ids = fresh.rows.start_ids;
  auto body = [&] {
    const Tensor out = model_.forward_inference(ctx_, g.in, cache_).view({b, v});
    if (!g.logits.defined()) g.logits = Tensor::empty(out.shape(), out.dtype(), dev);  // in the eager step
    ops::logits_summary(ctx_, out, vocab_size_, g.argmax, g.max_logit, g.log_norm);
    ops::copy_rows(ctx_, out, 0, g.logits, 0, b);
  };
  if (!g.warmed_up) {
    body();
    g.warmed_up = true;
    return g;
  }
  if (!g.graph.captured()) g.graph.capture(ctx_, body);
  g.graph.replay(ctx_);
  return g;
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
  if (r.top_logprobs > 0) seq.result.top_logprobs.push_back(top_logprobs(logits, vocab_size_, r.top_logprobs));
  accept(slot, token, token_logprob(logits, vocab_size_, token));
}

void InferenceEngine::accept(int64_t slot, int64_t token, double logprob) {
  Sequence& seq = *slots_[size_t(slot)];
  const GenerationRequest& r = seq.request;
  seq.ids.push_back(token);
  seq.result.tokens.push_back(token);
  seq.result.logprobs.push_back(logprob);
  static const TopLogprobs kNone;
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

// InferenceEngine: batched generation with a KV cache and continuous batching (Megatron-Core's
// inference engine, simplified to one process).
//
// Requests queue up; each step() first admits waiting requests into free cache slots and runs
// their prompts through the model in one right-padded prefill forward, then runs one decode
// forward for every active sequence, each at its own position. A sequence ends on a stop token
// or stop sequence (emitted, then "stop"), after max_new_tokens ("length"), or when its token callback returns
// false or its cancellation flag is set ("cancelled"); its slot is free for the next step at once.
// Waiting requests are admitted round-robin over their groups (Note [Fair admission]).
//
// Sampling draws for token t of a request come from Philox(seed, t), so a seeded request gives
// the same tokens whatever it was batched with. Penalties and banned tokens change the logits that
// are sampled from; log-probabilities are always the model's: fp64 log-softmax over the unpadded
// vocabulary of the model's logits.
//
// Not thread-safe: one thread owns the engine (the text generation server's engine thread). Under
// tensor parallelism the engine lives on the group's leader and announces each forward to the
// other ranks, which run it with their shards (Note [Tensor-parallel inference], inference_group.h).
#pragma once

#include <atomic>
#include <deque>
#include <memory>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "megatron/core/transformer/kv_cache.h"
#include "megatron/core/inference/beam_search.h"
#include "megatron/core/inference/inference_group.h"
#include "megatron/core/inference/sampling.h"
#include "megatron/core/models/gpt/gpt_model.h"
#include "megatron/runtime/cuda_graph.h"

namespace megatron {

struct GenerationRequest {
  std::vector<int64_t> prompt;  // token ids, non-empty
  int64_t max_new_tokens = 16;  // prompt + max_new_tokens <= the engine's max_sequence_length
  SamplingParams sampling;
  std::vector<int64_t> stop_tokens;  // end the sequence after emitting one (e.g. the eod id)
  // End the sequence ("stop") once prompt + generated ids end with one of these after a generated
  // token (Megatron's stop_on_eol / stop_on_double_eol: the newline tokens).
  std::vector<std::vector<int64_t>> stop_sequences;
  // {a, b}: right after token a (prompt or generated), token b is never sampled (Megatron's
  // prevent_newline_after_colon).
  std::vector<std::pair<int64_t, int64_t>> banned_after;
  bool prompt_logprobs = false;      // also the log-probability of every prompt token after the first
  int top_logprobs = 0;              // also the k most likely tokens at every logprob position
  uint64_t group = 0;                // requests of one group (one HTTP request) take turns with other groups'
  std::shared_ptr<const std::atomic<bool>> cancelled;  // once set, the request ends "cancelled" at the next step
};

struct GenerationResult {
  std::vector<int64_t> tokens;          // generated ids (a final stop token included)
  std::vector<double> logprobs;         // one per generated id
  std::vector<double> prompt_logprobs;  // prompt.size() - 1 values when requested
  // With top_logprobs = k: the k most likely (token, logprob) at each generated / prompt position.
  std::vector<std::vector<std::pair<int64_t, double>>> top_logprobs, prompt_top_logprobs;
  std::string finish_reason;            // "stop" | "length" | "cancelled" | "error: ..."
};

/// Called (on the engine's thread) for every generated token, with its top_logprobs (empty unless
/// asked for); returning false cancels the request.
using TopLogprobs = std::vector<std::pair<int64_t, double>>;
using TokenCallback = std::function<bool(int64_t token, double logprob, const TopLogprobs& top)>;
/// Called once when a request ends, with everything it generated.
using DoneCallback = std::function<void(const GenerationResult&)>;

struct EngineOptions {
  int64_t max_batch_size = 8;       // cache slots: sequences decoded together
  int64_t max_sequence_length = 0;  // 0: max_position_embeddings (learned positions) or seq_length
  InferenceGroup* group = nullptr;  // tensor-parallel ranks (this one their leader); null: one process
  bool cuda_graphs = true;          // decode steps through CUDA graphs on a GPU (Note [Decode graphs])
};

class InferenceEngine {
 public:
  /// vocab_size: the tokenizer's (unpadded) vocabulary; sampling and log-softmax range over it.
  InferenceEngine(const GPTModel& model, Context& ctx, int64_t vocab_size, EngineOptions options = {});

  /// Throws megatron::Error (one line) if the request cannot run: empty prompt, an id outside the
  /// vocabulary, too many tokens, invalid sampling parameters.
  void validate(const GenerationRequest& request) const;
  /// Queues a request (validated first); callbacks run inside step().
  void submit(GenerationRequest request, TokenCallback on_token = nullptr, DoneCallback on_done = nullptr);
  /// One engine iteration (admit + prefill, then one decode step). Returns false if there was nothing to do.
  bool step();
  bool idle() const { return waiting_.empty() && active_count() == 0; }
  int64_t waiting_count() const;
  /// Ends every queued and active request with finish_reason "error: <message>" (after a failed step).
  void abort_all(const std::string& message);

  /// Runs the requests to completion; results in request order.
  std::vector<GenerationResult> generate(const std::vector<GenerationRequest>& requests);
  /// Beam search for one prompt (beam_search.h), run at once in a cache of its own; the queued and
  /// active requests wait meanwhile.
  std::vector<BeamHypothesis> beam_search(const BeamSearchRequest& request) {
    return megatron::beam_search(model_, ctx_, vocab_size_, max_length_, request, group_);
  }

  int64_t max_sequence_length() const { return max_length_; }
  int64_t max_batch_size() const { return cache_.num_slots(); }

 private:
  struct Sequence {
    GenerationRequest request;
    TokenCallback on_token;
    DoneCallback on_done;
    std::vector<int64_t> ids;  // prompt + generated; all but the last are in the cache
    GenerationResult result;
  };

  struct Group {
    uint64_t id;
    std::deque<Sequence> sequences;
  };

  int64_t active_count() const;
  // Ends every cancelled sequence, waiting or active, without computing it further.
  void drop_cancelled();
  // The next waiting sequence, round-robin over the groups.
  Sequence next_waiting();
  // GPTModel::forward_inference through the engine's cache, announced to the group's other ranks first.
  Tensor forward(const Tensor& tokens, const std::vector<int64_t>& slots, const std::vector<int64_t>& starts,
                 const std::vector<int64_t>& output_rows = {});
  void prefill(const std::vector<int64_t>& slots);
  void decode();
  // Samples the next token of `slot` from its logits row; ends the sequence if it is done.
  void emit(int64_t slot, const float* logits);
  // Appends the chosen token of `slot` and its log-probability; ends the sequence if it is done.
  void accept(int64_t slot, int64_t token, double logprob);
  void finish(int64_t slot, const std::string& reason);

  // Note [Decode graphs]: one recorded decode step per batch size.
  struct DecodeGraph {
    CudaGraph graph;
    InferenceInputs in;                        // the graph's inputs: each step's are copied in
    Tensor logits, argmax, max_logit, log_norm;  // its outputs: [b, V'] and logits_summary's
    bool warmed_up = false;
  };
  // The decode forward of `fresh` inputs through the batch size's graph; returns its DecodeGraph.
  DecodeGraph& decode_through_graph(const InferenceInputs& fresh);

  const GPTModel& model_;
  Context& ctx_;
  bool use_graphs_ = false;
  std::map<int64_t, std::unique_ptr<DecodeGraph>> graphs_;
  int64_t vocab_size_;
  int64_t max_length_;
  InferenceGroup* group_;
  KVCache cache_;
  std::deque<Group> waiting_;  // non-empty groups, in turn order
  std::vector<std::optional<Sequence>> slots_;
};

/// The longest sequence a model can run: max_position_embeddings with learned positions, else
/// seq_length (or max_position_embeddings when set).
int64_t model_max_sequence_length(const TransformerConfig& config);

}  // namespace megatron

// InferenceGroup: the ranks of a tensor-parallel model running generation in lockstep, as
// Megatron's text generation server does (tools/run_text_generation_server.py: every rank launched
// as for training, rank 0 serves HTTP and broadcasts each piece of work to the others).
//
// Note [Tensor-parallel inference]: rank 0 of the tensor-parallel group leads. It alone owns the
// InferenceEngine: the queue, admission, sampling and every other decision. Each model forward the
// engine or beam search makes is announced first — a fixed header (command, cache, shape) and
// one Int64 payload (tokens, slots, starts, output rows) broadcast over the group — and then run by
// every rank together: the followers run the same GPTModel::forward_inference on their shards
// (taking part in its all-reduces and in the all-gather of the vocabulary-parallel logits) and drop
// the logits; the leader samples from them. The followers only mirror the leader's KV caches (each
// holding its rank's query groups), keyed by the cache ids the leader announces: 0 the engine's,
// 1 beam search's; a cache is (re)made when a forward names it with other dimensions (a follower
// keeps the last beam-search cache, which the leader frees: at most the leader's peak memory).
// Beam search's slot copies are announced the same way. A forward writes every cache position it
// later reads, so a reused cache needs no clearing.
// Waiting for the next announcement is a collective like any other and times out after
// --distributed-timeout-minutes, so an idle leader sends a heartbeat (an empty command) every
// quarter of that; stop() ends the followers' loop. Sequence parallelism is off for inference (as
// in Megatron): every rank holds every token.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <utility>
#include <vector>

#include "megatron/core/comm/communicator.h"
#include "megatron/core/models/gpt/gpt_model.h"
#include "megatron/core/transformer/kv_cache.h"

namespace megatron {

class InferenceGroup {
 public:
  /// The KV caches a leader names in its announcements.
  static constexpr int64_t kEngineCache = 0, kBeamCache = 1;

  /// `group`: the tensor-parallel group, every rank of which constructs one; its rank 0 leads.
  explicit InferenceGroup(Communicator& group) : group_(group) {}

  bool leader() const { return group_.rank() == 0; }
  int size() const { return group_.size(); }
  /// How long an idle leader may wait before it sends a heartbeat.
  std::chrono::milliseconds heartbeat_interval() const { return group_.timeout() / 4; }

  // ---- the leader ----
  /// Announces a forward of `tokens` [b, s] through cache `cache_id` (as GPTModel::forward_inference's arguments).
  void announce_forward(Context& ctx, int64_t cache_id, const KVCache& cache, const Tensor& tokens,
                        const std::vector<int64_t>& slots, const std::vector<int64_t>& starts,
                        const std::vector<int64_t>& output_rows);
  /// Announces KVCache::copy_slots(pairs) on cache `cache_id`.
  void announce_copy_slots(Context& ctx, int64_t cache_id, const KVCache& cache,
                           const std::vector<std::pair<int64_t, int64_t>>& pairs);
  /// Keeps the followers' wait from timing out.
  void heartbeat(Context& ctx);
  /// Ends the followers' loop (follow() returns).
  void stop(Context& ctx);

  // ---- a follower ----
  /// Runs what the leader announces until it stops. An error here is fatal to the job (the ranks
  /// can no longer run in lockstep): the caller reports it and exits.
  void follow(const GPTModel& model, Context& ctx);

 private:
  enum Command : int64_t { kHeartbeat = 0, kForward = 1, kCopySlots = 2, kStop = 3 };
  static constexpr int64_t kHeaderSize = 7;  // command, cache id, cache slots, cache length, b, s, payload size

  void announce(Context& ctx, const std::array<int64_t, kHeaderSize - 1>& fields, const std::vector<int64_t>& payload);

  Communicator& group_;
};

}  // namespace megatron

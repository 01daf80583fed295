// Beam search for one prompt, as Megatron's beam_search_and_return_on_first_stage
// (text_generation/generation.py before the MCore engine) with its BeamHypotheses (beam_utils.py):
//
//   each step extends every beam by every token: candidate score = beam score + log_softmax(logits);
//   the first step extends beam 0 alone (the beams start equal). Of the best 2 * beam_size
//   candidates in order, one ending in stop_token finishes a hypothesis (prompt + its tokens, the
//   stop token left out; length = generated tokens counting the stop) if it ranks within the
//   first beam_size, else is skipped; the others become the next beams until there are beam_size.
//   A hypothesis scores sum_logprobs / length ** length_penalty; the kept set holds the beam_size
//   best. The search ends when beam_size hypotheses are kept and none can be beaten (the best
//   candidate's score, length-normalised at the current length, is no better than the worst kept),
//   or after max_new_tokens steps, when the open beams join as hypotheses of that length.
//   Returned: the hypotheses, best first.
//
// banned_after (Megatron's prevent_newline_after_colon) sets the banned token's logit to -1e10 before
// the log_softmax, as Megatron does. Two differences from Megatron: the log_softmax runs over the
// tokenizer's vocabulary (not the padded rows), and when skipped stop tokens leave fewer than
// beam_size other candidates in the first 2 * beam_size, the next ones are taken (Megatron's beam
// count would shrink). The beams' KV caches live in 2 * beam_size slots of a cache of their own,
// each step copying every new beam's parent rows into the other half.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "megatron/core/inference/inference_group.h"
#include "megatron/core/models/gpt/gpt_model.h"

namespace megatron {

struct BeamSearchRequest {
  std::vector<int64_t> prompt;  // non-empty
  int64_t max_new_tokens = 16;  // > 0
  int beam_size = 1;            // >= 1
  int64_t stop_token = -1;      // -1: none
  double length_penalty = 1.0;
  std::vector<std::pair<int64_t, int64_t>> banned_after;  // {a, b}: no b right after a
  std::shared_ptr<const std::atomic<bool>> cancelled;     // set: the search stops with an error
};

struct BeamHypothesis {
  std::vector<int64_t> tokens;  // prompt + generated (no stop token)
  double score = 0;             // sum of logprobs / length ** length_penalty
};

/// Runs the search on `model` (dropout off) over the tokens [0, vocab); max_length bounds prompt +
/// generation. Throws megatron::Error (one line) for an invalid request, or when cancelled. With
/// `group` (its leader), every forward and cache copy is announced to the followers first (Note
/// [Tensor-parallel inference]).
std::vector<BeamHypothesis> beam_search(const GPTModel& model, Context& ctx, int64_t vocab, int64_t max_length,
                                        const BeamSearchRequest& request, InferenceGroup* group = nullptr);

}  // namespace megatron

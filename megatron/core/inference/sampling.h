// Token sampling from one row of logits (Megatron's inference sampling): greedy, temperature,
// top-k, top-p (nucleus) with Megatron's top_p decay, and OpenAI's frequency and presence
// penalties. Random draws come from Philox (seed, step), so a seed reproduces a generation exactly.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace megatron {

struct SamplingParams {
  bool greedy = false;  // argmax (also when top_k == 1)
  float temperature = 1.0f;
  int top_k = 0;       // 0: no top-k filter
  float top_p = 0.0f;  // 0: no nucleus filter
  uint64_t seed = 1234;
  // Megatron's --top-p-decay / --top-p-bound: after each generated token top_p *= top_p_decay, but
  // not below top_p_bound (0: no bound); 0: no decay.
  float top_p_decay = 0.0f;
  float top_p_bound = 0.0f;
  // OpenAI's penalties, in [-2, 2]: logit[j] -= count[j] * frequency + (count[j] > 0) * presence,
  // count[j] = how often token j was generated so far (the prompt does not count).
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;
};

/// Throws megatron::Error (one line naming the field) unless the parameters are valid: temperature
/// > 0 unless greedy, top_k >= 0, top_p, top_p_decay and top_p_bound in [0, 1], penalties in [-2, 2].
void check_sampling_params(const SamplingParams& params);

/// The nucleus size for generated token `step` (0-based): top_p decayed step times, bounded.
float top_p_at(const SamplingParams& params, uint64_t step);

/// Picks the next token from logits[0, vocab) (the unpadded vocabulary). `step` selects the
/// random draw and the decayed top_p. Invalid parameters are a user error.
int64_t sample_token(const float* logits, int64_t vocab, const SamplingParams& params, uint64_t step);

/// Subtracts the frequency and presence penalties of `generated` from logits[0, vocab).
void apply_penalties(float* logits, int64_t vocab, const std::vector<int64_t>& generated, const SamplingParams& params);

/// log-softmax of logits[token] over [0, vocab), in fp64.
double token_logprob(const float* logits, int64_t vocab, int64_t token);

/// The k most likely tokens of logits[0, vocab) with their log-probabilities, most likely first
/// (ties: the lower id first).
std::vector<std::pair<int64_t, double>> top_logprobs(const float* logits, int64_t vocab, int k);

}  // namespace megatron

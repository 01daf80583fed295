// Token sampling from one row of logits (Megatron's inference sampling): greedy, temperature,
// top-k, top-p (nucleus). Random draws come from Philox (seed, step), so a seed reproduces a
// generation exactly.
#pragma once

#include <cstdint>

namespace megatron {

struct SamplingParams {
  bool greedy = false;  // argmax (also when top_k == 1)
  float temperature = 1.0f;
  int top_k = 0;       // 0: no top-k filter
  float top_p = 0.0f;  // 0: no nucleus filter
  uint64_t seed = 1234;
};

/// Throws megatron::Error (one line naming the field) unless the parameters are valid: temperature
/// > 0 unless greedy, top_k >= 0, top_p in [0, 1].
void check_sampling_params(const SamplingParams& params);

/// Picks the next token from logits[0, vocab) (the unpadded vocabulary). `step` selects the
/// random draw. Invalid parameters (temperature <= 0, top_p outside [0, 1]) are a user error.
int64_t sample_token(const float* logits, int64_t vocab, const SamplingParams& params, uint64_t step);

/// log-softmax of logits[token] over [0, vocab), in fp64.
double token_logprob(const float* logits, int64_t vocab, int64_t token);

}  // namespace megatron

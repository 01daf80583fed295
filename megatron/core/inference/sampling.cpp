#include "megatron/core/inference/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "megatron/runtime/check.h"
#include "megatron/runtime/philox.h"

namespace megatron {

void check_sampling_params(const SamplingParams& p) {
  MG_CHECK(p.top_k >= 0, "top_k must be non-negative (got {})", p.top_k);
  MG_CHECK(p.frequency_penalty >= -2.0f && p.frequency_penalty <= 2.0f, "frequency_penalty must be in [-2, 2] (got {})",
           p.frequency_penalty);
  MG_CHECK(p.presence_penalty >= -2.0f && p.presence_penalty <= 2.0f, "presence_penalty must be in [-2, 2] (got {})",
           p.presence_penalty);
  MG_CHECK(p.top_p_decay >= 0.0f && p.top_p_decay <= 1.0f, "top_p_decay must be in [0, 1] (got {})", p.top_p_decay);
  MG_CHECK(p.top_p_bound >= 0.0f && p.top_p_bound <= 1.0f, "top_p_bound must be in [0, 1] (got {})", p.top_p_bound);
  if (p.greedy || p.top_k == 1) return;
  MG_CHECK(p.temperature > 0.0f && std::isfinite(p.temperature),
           "temperature must be positive (got {}); use greedy decoding for 0", p.temperature);
  MG_CHECK(p.top_p >= 0.0f && p.top_p <= 1.0f, "top_p must be in [0, 1] (got {})", p.top_p);
}

float top_p_at(const SamplingParams& p, uint64_t step) {
  if (p.top_p <= 0.0f || p.top_p_decay <= 0.0f) return p.top_p;
  const double decayed = double(p.top_p) * std::pow(double(p.top_p_decay), double(step));
  return float(std::max(decayed, double(p.top_p_bound)));
}

int64_t sample_token(const float* logits, int64_t vocab, const SamplingParams& p, uint64_t step) {
  MG_CHECK(vocab > 0, "sampling from an empty vocabulary");
  check_sampling_params(p);
  if (p.greedy || p.top_k == 1) return int64_t(std::max_element(logits, logits + vocab) - logits);
  std::vector<int64_t> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return logits[a] > logits[b]; });
  size_t keep = p.top_k > 0 ? std::min<size_t>(size_t(p.top_k), order.size()) : order.size();
  std::vector<double> probs(keep);
  const double max = logits[order[0]] / p.temperature;
  double sum = 0;
  for (size_t i = 0; i < keep; ++i) sum += probs[i] = std::exp(logits[order[i]] / p.temperature - max);
  for (double& x : probs) x /= sum;
  if (const float top_p = top_p_at(p, step); top_p > 0.0f) {  // the smallest prefix whose mass reaches top_p
    double cum = 0;
    size_t n = 0;
    while (n < keep && cum < top_p) cum += probs[n++];
    keep = std::max<size_t>(n, 1);
    probs.resize(keep);
    for (double& x : probs) x /= cum;
  }
  double u = philox_uniform(p.seed, step, 0), cum = 0;
  for (size_t i = 0; i < keep; ++i) {
    cum += probs[i];
    if (u < cum) return order[i];
  }
  return order[keep - 1];
}

void apply_penalties(float* logits, int64_t vocab, const std::vector<int64_t>& generated, const SamplingParams& p) {
  if (p.frequency_penalty == 0.0f && p.presence_penalty == 0.0f) return;
  std::vector<int64_t> count(size_t(vocab), 0);
  for (int64_t t : generated)
    if (t >= 0 && t < vocab) ++count[size_t(t)];
  for (int64_t j = 0; j < vocab; ++j) {
    if (count[size_t(j)] == 0) continue;
    logits[j] -= float(count[size_t(j)]) * p.frequency_penalty + p.presence_penalty;
  }
}

double token_logprob(const float* logits, int64_t vocab, int64_t token) {
  double max = *std::max_element(logits, logits + vocab), sum = 0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(double(logits[i]) - max);
  return double(logits[token]) - max - std::log(sum);
}

}  // namespace megatron

namespace megatron {

std::vector<std::pair<int64_t, double>> top_logprobs(const float* logits, int64_t vocab, int k) {
  k = int(std::min<int64_t>(k, vocab));
  if (k <= 0) return {};
  double max = *std::max_element(logits, logits + vocab), sum = 0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(double(logits[i]) - max);
  const double log_z = max + std::log(sum);
  std::vector<int64_t> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int64_t a, int64_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
  std::vector<std::pair<int64_t, double>> out;
  for (int i = 0; i < k; ++i) out.emplace_back(order[size_t(i)], double(logits[order[size_t(i)]]) - log_z);
  return out;
}

}  // namespace megatron

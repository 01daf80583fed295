#include "megatron/core/inference/beam_search.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "megatron/core/transformer/kv_cache.h"
#include "megatron/runtime/check.h"

namespace megatron {

namespace {

// Megatron's BeamHypotheses: the num_beams best finished hypotheses.
class Hypotheses {
 public:
  Hypotheses(int num_beams, double length_penalty) : num_beams_(num_beams), length_penalty_(length_penalty) {}

  void add(std::vector<int64_t> tokens, double sum_logprobs, int64_t length) {
    const double score = sum_logprobs / std::pow(double(length), length_penalty_);
    if (int(beams_.size()) < num_beams_ || score > worst_) {
      beams_.push_back({std::move(tokens), score});
      if (int(beams_.size()) > num_beams_) {
        auto worst = std::min_element(beams_.begin(), beams_.end(),
                                      [](const auto& a, const auto& b) { return a.score < b.score; });
        beams_.erase(worst);
        worst_ = std::min_element(beams_.begin(), beams_.end(), [](const auto& a, const auto& b) {
                   return a.score < b.score;
                 })->score;
      } else {
        worst_ = std::min(score, worst_);
      }
    }
  }

  bool done(double best_sum_logprobs, int64_t length) const {
    if (int(beams_.size()) < num_beams_) return false;
    return worst_ >= best_sum_logprobs / std::pow(double(length), length_penalty_);
  }

  std::vector<BeamHypothesis> sorted() const {
    std::vector<BeamHypothesis> out = beams_;
    std::stable_sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.score > b.score; });
    return out;
  }

 private:
  int num_beams_;
  double length_penalty_;
  std::vector<BeamHypothesis> beams_;
  double worst_ = 1e9;
};

void log_softmax_inplace(std::vector<double>& row) {
  const double max = *std::max_element(row.begin(), row.end());
  double sum = 0;
  for (double x : row) sum += std::exp(x - max);
  const double log_z = max + std::log(sum);
  for (double& x : row) x -= log_z;
}

}  // namespace

std::vector<BeamHypothesis> beam_search(const GPTModel& model, Context& ctx, int64_t vocab, int64_t max_length,
                                        const BeamSearchRequest& r, InferenceGroup* group) {
  MG_CHECK(!r.prompt.empty(), "beam search needs a non-empty prompt");
  MG_CHECK(r.beam_size >= 1, "beam_width must be at least 1 (got {})", r.beam_size);
  MG_CHECK(r.max_new_tokens > 0, "beam search needs tokens_to_generate > 0");
  MG_CHECK(int64_t(r.prompt.size()) + r.max_new_tokens <= max_length,
           "too many tokens: a prompt of {} tokens plus {} to generate exceeds the maximum sequence length {}",
           r.prompt.size(), r.max_new_tokens, max_length);
  for (int64_t id : r.prompt) MG_CHECK(id >= 0 && id < vocab, "prompt token {} is outside [0, {})", id, vocab);
  const int64_t beams = r.beam_size, padded = model.config().padded_vocab_size;
  const int64_t length = int64_t(r.prompt.size()) + r.max_new_tokens;
  KVCache cache(model.config(), 2 * beams, length, ctx.device());
  Hypotheses hyps(r.beam_size, r.length_penalty);
  auto forward = [&](const Tensor& tokens, const std::vector<int64_t>& slots, const std::vector<int64_t>& starts,
                     const std::vector<int64_t>& rows) {
    if (group) group->announce_forward(ctx, InferenceGroup::kBeamCache, cache, tokens, slots, starts, rows);
    return model.forward_inference(ctx, tokens, slots, starts, cache, rows).to_floats();
  };

  // Beam k lives in slot half * beams + k; its ids are all in the cache but the last.
  std::vector<std::vector<int64_t>> ids = {r.prompt};
  std::vector<double> scores = {0.0};
  int64_t half = 0;
  Tensor prompt = Tensor::from_ints(r.prompt, {1, int64_t(r.prompt.size())}, DType::Int64, ctx.device());
  const int64_t last_row = int64_t(r.prompt.size()) - 1;  // only the last prompt token's logits count
  std::vector<float> last = forward(prompt, {0}, {0}, {last_row});  // [1, V]
  bool done = false;
  for (int64_t step = 0; step < r.max_new_tokens && !done; ++step) {
    MG_CHECK(!(r.cancelled && r.cancelled->load()), "cancelled");
    const int64_t live = int64_t(ids.size());
    // Candidates: (score, beam, token), best first.
    std::vector<double> cand(size_t(live * vocab));
    for (int64_t b = 0; b < live; ++b) {
      std::vector<double> row(last.begin() + b * padded, last.begin() + b * padded + vocab);
      for (const auto& [after, banned] : r.banned_after)
        if (ids[size_t(b)].back() == after && banned >= 0 && banned < vocab) row[size_t(banned)] = -1e10;
      log_softmax_inplace(row);
      for (int64_t v = 0; v < vocab; ++v) cand[size_t(b * vocab + v)] = scores[size_t(b)] + row[size_t(v)];
    }
    std::vector<int64_t> order(cand.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cand[size_t(a)] > cand[size_t(b)]; });
    std::vector<std::pair<int64_t, int64_t>> next;  // (parent beam, token)
    std::vector<double> next_scores;
    for (size_t rank = 0; rank < order.size() && int64_t(next.size()) < beams; ++rank) {
      const int64_t beam = order[rank] / vocab, token = order[rank] % vocab;
      if (token == r.stop_token) {
        if (int64_t(rank) < beams) hyps.add(ids[size_t(beam)], cand[size_t(order[rank])], step + 1);
        continue;
      }
      next.emplace_back(beam, token);
      next_scores.push_back(cand[size_t(order[rank])]);
    }
    done = hyps.done(cand[size_t(order[0])], step + 1);
    // Reorder: each new beam copies its parent's cache rows into the other half.
    const int64_t other = 1 - half;
    std::vector<std::pair<int64_t, int64_t>> copies;
    for (size_t k = 0; k < next.size(); ++k) copies.emplace_back(half * beams + next[k].first, other * beams + int64_t(k));
    if (group) group->announce_copy_slots(ctx, InferenceGroup::kBeamCache, cache, copies);
    cache.copy_slots(copies);
    std::vector<std::vector<int64_t>> next_ids;
    for (const auto& [beam, token] : next) {
      next_ids.push_back(ids[size_t(beam)]);
      next_ids.back().push_back(token);
    }
    ids = std::move(next_ids);
    scores = std::move(next_scores);
    half = other;
    if (done || step + 1 == r.max_new_tokens) break;
    std::vector<int64_t> tokens, slots, starts;
    for (size_t k = 0; k < ids.size(); ++k) {
      tokens.push_back(ids[k].back());
      slots.push_back(half * beams + int64_t(k));
      starts.push_back(int64_t(ids[k].size()) - 1);
    }
    Tensor t = Tensor::from_ints(tokens, {int64_t(ids.size()), 1}, DType::Int64, ctx.device());
    last = forward(t, slots, starts, {});  // [1, live, V]
  }
  if (!done) {
    for (size_t k = 0; k < ids.size(); ++k)
      hyps.add(ids[k], scores[k], int64_t(ids[k].size()) - int64_t(r.prompt.size()));
  }
  return hyps.sorted();
}

}  // namespace megatron

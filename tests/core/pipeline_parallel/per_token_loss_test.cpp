// Megatron's --calculate-per-token-loss (Note [Per-token loss] in schedules.h) on a small GPT with
// very uneven loss masks (2 and 7 of 8 tokens): the reported loss is Σ loss·mask / Σ mask computed
// here from the model's own per-token losses, and the gradient after finalize_model_grads is that
// of the masked mean over the whole global batch — the default mode's gradient with both rows in one
// microbatch — whether the rows are two microbatches of one rank or one microbatch on each of two
// data-parallel thread-ranks. The default mode's two-microbatch gradient (the mean of the
// microbatches' means) differs, which shows the comparison can fail.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "megatron/core/distributed/distributed_data_parallel.h"
#include "megatron/core/models/gpt/gpt_model.h"
#include "megatron/core/pipeline_parallel/schedules.h"
#include "tests/core/thread_ranks.h"

namespace megatron {
namespace {

constexpr int64_t kSeq = 8;

TransformerConfig tiny_config(bool per_token) {
  TransformerConfig c;
  c.num_layers = 2;
  c.hidden_size = 16;
  c.num_attention_heads = 2;
  c.vocab_size = 10;
  c.make_vocab_size_divisible_by = 8;
  c.max_position_embeddings = kSeq;
  c.hidden_dropout = c.attention_dropout = 0.0f;
  c.padded_vocab_size = padded_vocab_size(c.vocab_size, c.make_vocab_size_divisible_by, 1);
  c.calculate_per_token_loss = per_token;
  return c;
}

// Row r of the global batch: tokens, next-token labels, and a mask of 2 (row 0) or 7 (row 1) tokens.
MicroBatch rows(const std::vector<int>& which) {
  const std::vector<std::vector<int64_t>> tokens = {{1, 4, 2, 8, 5, 7, 3, 9}, {6, 0, 3, 3, 8, 2, 4, 1}};
  const std::vector<std::vector<float>> masks = {{0, 1, 0, 0, 0, 1, 0, 0}, {1, 1, 1, 0, 1, 1, 1, 1}};
  std::vector<int64_t> t, l, p;
  std::vector<float> m;
  for (int r : which) {
    for (int64_t i = 0; i < kSeq; ++i) {
      t.push_back(tokens[size_t(r)][size_t(i)]);
      l.push_back(tokens[size_t(r)][size_t((i + 1) % kSeq)]);
      p.push_back(i);
      m.push_back(masks[size_t(r)][size_t(i)]);
    }
  }
  const int64_t b = int64_t(which.size());
  MicroBatch mb;
  mb.tokens = Tensor::from_ints(t, {b, kSeq});
  mb.labels = Tensor::from_ints(l, {b, kSeq});
  mb.position_ids = Tensor::from_ints(p, {b, kSeq});
  mb.loss_mask = Tensor::from_floats(m, {b, kSeq});
  return mb;
}

ForwardStepFunc gpt_step() {
  return typed_forward_step<GPTModel>(
      [](Context& cx, const MicroBatch& b, const GPTModel& m, const Tensor& input, GPTModel::Stash& stash) {
        Tensor losses = m.forward_step(cx, b.tokens, b.position_ids, b.labels, input, stash);
        return ForwardOutput{losses, Tensor(),
                             masked_token_loss(b.loss_mask, nullptr, m.config().calculate_per_token_loss)};
      });
}

std::map<std::string, std::vector<float>> grads_of(const GPTModel& m) {
  std::map<std::string, std::vector<float>> out;
  for (const Parameter* p : m.params().parameters()) out[p->name] = p->main_grad.to_floats();
  return out;
}

// max |a - b| over max |b|, over every parameter.
double relative_difference(const std::map<std::string, std::vector<float>>& a,
                           const std::map<std::string, std::vector<float>>& b) {
  double diff = 0, scale = 0;
  for (const auto& [name, vb] : b) {
    const std::vector<float>& va = a.at(name);
    for (size_t i = 0; i < vb.size(); ++i) {
      diff = std::max(diff, std::fabs(double(va[i]) - double(vb[i])));
      scale = std::max(scale, std::fabs(double(vb[i])));
    }
  }
  return diff / scale;
}

// One step over `batches` (this rank's microbatches) with a DDP over `ps`, finalized; the grads.
std::map<std::string, std::vector<float>> step_grads(ParallelState& ps, bool per_token,
                                                     const std::vector<MicroBatch>& batches, LossSums* sums) {
  GPTModel model(tiny_config(per_token));
  model.init_weights(7);
  DDPConfig cfg;
  cfg.calculate_per_token_loss = per_token;
  DistributedDataParallel ddp(ps, {&model.params()}, cfg);
  Context ctx;
  ddp.zero_grad(ctx);
  ForwardBackwardArgs args;
  args.num_microbatches = int(batches.size());
  args.micro_batch_size = batches[0].tokens.size(0);
  args.seq_length = kSeq;
  args.calculate_per_token_loss = per_token;
  const LossSums s = forward_backward(ctx, &ps, {&model}, gpt_step(), batches, args, &ddp);
  finalize_model_grads(ctx, ddp, per_token ? std::optional<double>(s.num_tokens) : std::nullopt);
  if (sums) *sums = s;
  return grads_of(model);
}

TEST(PerTokenLoss, LossAndGradientAreThoseOfTheGlobalBatchMaskedMean) {
  // The reference loss: the model's per-token losses of both rows, Σ loss·mask / Σ mask, here.
  double want_loss = 0, want_tokens = 0;
  {
    GPTModel model(tiny_config(false));
    model.init_weights(7);
    Context ctx;
    GPTModel::Stash stash;
    const MicroBatch b = rows({0, 1});
    const std::vector<float> losses = model.forward(ctx, b.tokens, b.position_ids, b.labels, stash).to_floats();
    const std::vector<float> mask = b.loss_mask.to_floats();
    for (size_t i = 0; i < losses.size(); ++i) want_loss += double(losses[i]) * mask[i], want_tokens += mask[i];
  }
  ASSERT_EQ(want_tokens, 9.0);

  std::map<std::string, std::vector<float>> reference, per_token, mean_of_means, per_token_dp2;
  LossSums sums;
  testing::run_thread_ranks(1, [&](ParallelState& ps) {
    // The masked mean over the global batch: both rows in one microbatch (default mode).
    reference = step_grads(ps, false, {rows({0, 1})}, nullptr);
    per_token = step_grads(ps, true, {rows({0}), rows({1})}, &sums);
    mean_of_means = step_grads(ps, false, {rows({0}), rows({1})}, nullptr);
  });
  EXPECT_EQ(sums.num_tokens, want_tokens);
  EXPECT_NEAR(sums.loss_sum / sums.num_tokens, want_loss / want_tokens, 1e-6 * want_loss / want_tokens);
  EXPECT_LT(relative_difference(per_token, reference), 1e-5);
  EXPECT_GT(relative_difference(mean_of_means, reference), 1e-2);  // the default mode weighs row 0's tokens more

  // Two data-parallel ranks, one row each: the token count is summed over them, the gradients too.
  testing::run_thread_ranks(2, [&](ParallelState& ps) {
    LossSums s;
    auto g = step_grads(ps, true, {rows({ps.dp_rank()})}, &s);
    EXPECT_EQ(s.num_tokens, want_tokens) << "rank " << ps.dp_rank();
    if (ps.dp_rank() == 0) per_token_dp2 = std::move(g);
  });
  EXPECT_LT(relative_difference(per_token_dp2, reference), 1e-5);
}

}  // namespace
}  // namespace megatron

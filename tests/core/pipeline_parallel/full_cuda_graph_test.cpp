// The host side of the full-iteration CUDA graph (core/full_cuda_graph.h): the id checks that stand
// in for the kernels' own while a graph is captured (Note [Host checks under capture]), and its
// eager warmup steps, which must be the plain step. Capture and replay themselves: tests/gpu.
#include "megatron/core/full_cuda_graph.h"

#include <gtest/gtest.h>

#include "megatron/core/models/gpt/gpt_model.h"
#include "megatron/runtime/check.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

using testing::error_of;

MicroBatch batch(std::vector<int64_t> tokens, std::vector<int64_t> labels, std::vector<int64_t> positions) {
  MicroBatch b;
  b.tokens = Tensor::from_ints(tokens, {2, 2});
  b.labels = Tensor::from_ints(labels, {2, 2});
  b.position_ids = Tensor::from_ints(positions, {2, 2});
  b.loss_mask = Tensor::from_floats({1, 1, 1, 1}, {2, 2});
  return b;
}

TEST(FullCudaGraph, HostIdChecksSayWhatTheKernelsSay) {
  EXPECT_EQ(error_of([] { check_batch_ids(batch({0, 5, 9, 1}, {1, 2, 3, 4}, {0, 1, 0, 1}), 10, 4); }), "");
  std::string e = error_of([] { check_batch_ids(batch({0, 5, 10, 1}, {1, 2, 3, 4}, {0, 1, 0, 1}), 10, 4); });
  EXPECT_NE(e.find("token id 10 at [1, 0] is outside the embedding table of 10 rows"), std::string::npos) << e;
  e = error_of([] { check_batch_ids(batch({0, 5, 9, 1}, {1, 2, 3, 4}, {0, 1, 0, 4}), 10, 4); });
  EXPECT_NE(e.find("position id 4 at [1, 1] is outside the embedding table of 4 rows"), std::string::npos) << e;
  // RoPE models have no position table: position ids are not checked.
  EXPECT_EQ(error_of([] { check_batch_ids(batch({0, 5, 9, 1}, {1, 2, 3, 4}, {0, 1, 0, 400}), 10, 0); }), "");
  e = error_of([] { check_batch_ids(batch({0, 5, 9, 1}, {1, -1, 3, 4}, {0, 1, 0, 1}), 10, 4); });
  EXPECT_NE(e.find("label -1 at position 1 is outside the vocabulary [0, 10)"), std::string::npos) << e;
}

// Warmup steps are the plain step (same losses); the capture after them needs a GPU and says so.
TEST(FullCudaGraph, WarmupIsThePlainStepAndCaptureNeedsAGpu) {
  TransformerConfig c;
  c.num_layers = 2;
  c.hidden_size = 16;
  c.num_attention_heads = 2;
  c.vocab_size = 10;
  c.make_vocab_size_divisible_by = 8;
  c.max_position_embeddings = 2;
  c.hidden_dropout = c.attention_dropout = 0.0f;
  c.padded_vocab_size = padded_vocab_size(c.vocab_size, c.make_vocab_size_divisible_by, 1);
  GPTModel model(c);
  model.init_weights(5);
  Context ctx;
  ForwardStepFunc forward_step = typed_forward_step<GPTModel>(
      [](Context& cx, const MicroBatch& b, const GPTModel& m, const Tensor& input, GPTModel::Stash& stash) {
        return ForwardOutput{m.forward_step(cx, b.tokens, b.position_ids, b.labels, input, stash), b.loss_mask};
      });
  BatchIterator data = [] { return batch({0, 5, 9, 1}, {5, 9, 1, 2}, {0, 1, 0, 1}); };
  ForwardBackwardArgs args;
  args.num_microbatches = 2;
  args.micro_batch_size = 2;
  args.seq_length = 2;
  FullCudaGraph graph(1);
  const LossSums eager = forward_backward(ctx, nullptr, {&model}, forward_step, data, args);
  const LossSums warm = graph.forward_backward(ctx, nullptr, {&model}, forward_step, data, args);
  EXPECT_EQ(warm.loss_sum, eager.loss_sum);
  EXPECT_EQ(warm.num_tokens, 8.0);
  const std::string e = error_of([&] { graph.forward_backward(ctx, nullptr, {&model}, forward_step, data, args); });
  EXPECT_NE(e.find("CUDA graphs need a CUDA device"), std::string::npos) << e;
}

}  // namespace
}  // namespace megatron

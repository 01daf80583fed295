// InferenceEngine on a GPU: the decode steps through CUDA graphs (Note [Decode graphs]) give what
// the eager steps give, to the bit, for greedy rows (summarised on the device) and sampled rows
// (whole logits rows), with sequences finishing at different steps (the batch size changes, so
// several graphs); and the CUDA engine's greedy tokens equal the CPU engine's (fp32).
#include <gtest/gtest.h>

#include "megatron/core/inference/generation.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

std::unique_ptr<GPTModel> tiny_llama(Device device) {
  TransformerConfig c;
  c.num_layers = 2;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;
  c.vocab_size = 100;
  c.make_vocab_size_divisible_by = 16;
  c.max_position_embeddings = 200;
  c.normalization = "RMSNorm";
  c.activation = "swiglu";
  c.add_bias_linear = false;
  c.position_embedding_type = "rope";
  c.share_embeddings_and_output_weights = false;
  c.hidden_dropout = c.attention_dropout = 0.0f;
  auto model = std::make_unique<GPTModel>(c, device);
  model->init_weights(3);
  return model;
}

std::vector<GenerationRequest> requests() {
  std::vector<GenerationRequest> rs;
  for (int i = 0; i < 5; ++i) {
    GenerationRequest r;
    for (int t = 0; t < 7 + 13 * i; ++t) r.prompt.push_back((t * 31 + i * 7) % 100);
    r.max_new_tokens = 20 + 9 * i;  // different lengths: the batch shrinks as they end
    r.sampling.greedy = i % 2 == 0;
    r.sampling.temperature = 0.8f;
    r.sampling.seed = uint64_t(i);
    rs.push_back(r);
  }
  return rs;
}

TEST(CudaInferenceEngine, DecodeGraphsEqualEagerSteps) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU";
  Context ctx(Device::cuda(0));
  auto model = tiny_llama(ctx.device());
  ASSERT_TRUE(model->inference_capturable());
  for (bool all_greedy : {true, false}) {
    std::vector<GenerationRequest> rs = requests();
    if (all_greedy)
      for (GenerationRequest& r : rs) r.sampling.greedy = true;
    InferenceEngine eager(*model, ctx, 100, {.max_batch_size = 4, .cuda_graphs = false});
    InferenceEngine graphed(*model, ctx, 100, {.max_batch_size = 4, .cuda_graphs = true});
    const std::vector<GenerationResult> a = eager.generate(rs), b = graphed.generate(rs);
    for (size_t i = 0; i < rs.size(); ++i) {
      EXPECT_EQ(a[i].tokens, b[i].tokens) << "request " << i << (all_greedy ? " (greedy)" : "");
      EXPECT_EQ(a[i].logprobs, b[i].logprobs) << "request " << i;
      EXPECT_EQ(a[i].finish_reason, b[i].finish_reason);
    }
  }
}

TEST(CudaInferenceEngine, GreedyTokensEqualTheCpuEngine) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU";
  Context cpu_ctx, gpu_ctx(Device::cuda(0));
  auto cpu_model = tiny_llama(Device::cpu());
  auto gpu_model = tiny_llama(gpu_ctx.device());
  std::vector<GenerationRequest> rs = requests();
  for (GenerationRequest& r : rs) r.sampling.greedy = true;
  const std::vector<GenerationResult> want = InferenceEngine(*cpu_model, cpu_ctx, 100, {.max_batch_size = 4}).generate(rs);
  const std::vector<GenerationResult> got = InferenceEngine(*gpu_model, gpu_ctx, 100, {.max_batch_size = 4}).generate(rs);
  double worst = 0;
  for (size_t i = 0; i < rs.size(); ++i) {
    EXPECT_EQ(got[i].tokens, want[i].tokens) << "request " << i;
    for (size_t t = 0; t < std::min(got[i].logprobs.size(), want[i].logprobs.size()); ++t)
      worst = std::max(worst, std::fabs(got[i].logprobs[t] - want[i].logprobs[t]));
  }
  std::printf("max |logprob CUDA - CPU| = %.3g\n", worst);
  EXPECT_LE(worst, 1e-4);
}

}  // namespace
}  // namespace megatron

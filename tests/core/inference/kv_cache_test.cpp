// The KV-cache inference path equals the training forward: the attention_kv_cache op against
// attention_forward, and GPTModel::forward_inference (right-padded prefill of prompts of different
// lengths, then decode steps at different positions) against forward_logits on each full sequence.
#include "megatron/core/transformer/kv_cache.h"

#include <gtest/gtest.h>

#include "megatron/core/models/gpt/gpt_model.h"
#include "megatron/kernels/ops.h"
#include "tests/core/model_test_util.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

TransformerConfig tiny_config(bool llama) {
  TransformerConfig c;
  c.num_layers = 3;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.vocab_size = 100;
  c.make_vocab_size_divisible_by = 16;
  c.max_position_embeddings = 32;
  c.hidden_dropout = c.attention_dropout = 0.0f;
  if (llama) {
    c.num_query_groups = 2;
    testing::use_llama_layers(c);
    c.ffn_hidden_size = 96;
  }
  return c;
}

TEST(AttentionKVCache, FromEmptyCacheEqualsCausalAttention) {
  Context ctx;
  const int64_t s = 7, b = 3, nq = 4, ng = 2, d = 8;
  Tensor q = testing::random_tensor({s, b, nq, d}, 1), k = testing::random_tensor({s, b, ng, d}, 2),
         v = testing::random_tensor({s, b, ng, d}, 3);
  Tensor ref = Tensor::empty({s, b, nq, d}, DType::Float32), lse = Tensor::empty({b, nq, s}, DType::Float32);
  ops::attention_forward(ctx, q, k, v, AttnMask::causal(), 0.3f, 0.0f, 0, 0, ref, lse);
  // Slots in reverse order, a cache longer than the sequence.
  Tensor kc = Tensor::zeros({4, 10, ng, d}, DType::Float32), vc = Tensor::zeros({4, 10, ng, d}, DType::Float32);
  Tensor out = Tensor::empty({s, b, nq, d}, DType::Float32);
  ops::attention_kv_cache_forward(ctx, q, k, v, Tensor::from_ints({3, 2, 1}, {b}), Tensor::from_ints({0, 0, 0}, {b}),
                                  0.3f, kc, vc, out);
  EXPECT_LE(testing::max_abs_error(out.to_floats(), ref.to_floats()), 1e-6);
  // The keys landed in slot 3 - i at positions 0..s-1.
  std::vector<float> kcache = kc.to_floats(), knew = k.to_floats();
  for (int64_t j = 0; j < s; ++j)
    for (int64_t i = 0; i < b; ++i)
      for (int64_t e = 0; e < ng * d; ++e)
        ASSERT_EQ(kcache[size_t(((3 - i) * 10 + j) * ng * d + e)], knew[size_t((j * b + i) * ng * d + e)]);
}

class CachedForward : public ::testing::TestWithParam<bool> {};

// Cached logits of every new token equal forward_logits on the full unpadded sequence.
TEST_P(CachedForward, EqualsFullForwardAtEveryStep) {
  GPTModel model(tiny_config(GetParam()));
  model.init_weights(7);
  Context ctx;
  const int64_t v = model.config().padded_vocab_size;
  std::vector<std::vector<int64_t>> seqs = {{5, 17, 3, 99, 42, 8, 1}, {11, 2}, {60, 61, 62, 63}};
  const int64_t b = int64_t(seqs.size());
  const std::vector<int64_t> slots = {2, 0, 1};
  KVCache cache(model.config(), 3, 24, ctx.device());
  double worst = 0;
  auto check = [&](const std::vector<int64_t>& seq, const float* cached_row) {
    Tensor full = model.forward_logits(ctx, Tensor::from_ints(seq, {1, int64_t(seq.size())}), Tensor());
    std::vector<float> last = full.slice(int64_t(seq.size()) - 1, int64_t(seq.size())).to_floats();
    std::vector<float> ours(cached_row, cached_row + v);
    worst = std::max(worst, testing::max_abs_error(ours, last));
    return int64_t(std::max_element(ours.begin(), ours.end() - (v - 100)) - ours.begin());
  };
  // Right-padded prefill (pad id 0); each sequence's last real token.
  int64_t len = 0;
  for (const auto& s : seqs) len = std::max<int64_t>(len, int64_t(s.size()));
  std::vector<int64_t> padded(size_t(b * len), 0);
  for (int64_t i = 0; i < b; ++i) std::copy(seqs[size_t(i)].begin(), seqs[size_t(i)].end(), padded.begin() + i * len);
  std::vector<float> logits =
      model.forward_inference(ctx, Tensor::from_ints(padded, {b, len}), slots, {0, 0, 0}, cache).to_floats();
  std::vector<int64_t> next(static_cast<size_t>(b));
  for (int64_t i = 0; i < b; ++i) {
    const int64_t n = int64_t(seqs[size_t(i)].size());
    next[size_t(i)] = check(seqs[size_t(i)], logits.data() + ((n - 1) * b + i) * v);
  }
  for (int step = 0; step < 10; ++step) {
    std::vector<int64_t> starts;
    for (int64_t i = 0; i < b; ++i) {
      starts.push_back(int64_t(seqs[size_t(i)].size()));
      seqs[size_t(i)].push_back(next[size_t(i)]);
    }
    logits = model.forward_inference(ctx, Tensor::from_ints(next, {b, 1}), slots, starts, cache).to_floats();
    for (int64_t i = 0; i < b; ++i) next[size_t(i)] = check(seqs[size_t(i)], logits.data() + i * v);
  }
  std::printf("max |cached - full| logits: %.3g\n", worst);
  EXPECT_LE(worst, 1e-5);
}

// Note [Prefill output rows]: the output layer on picked rows gives those rows of the full output
// (within rounding: BLAS may round a row differently in a GEMM with another number of rows).
TEST_P(CachedForward, OutputRowsAreRowsOfTheFullOutput) {
  GPTModel model(tiny_config(GetParam()));
  model.init_weights(7);
  Context ctx;
  const int64_t v = model.config().padded_vocab_size, b = 3, s = 5;
  const Tensor tokens = Tensor::from_ints({5, 17, 3, 99, 42, 11, 2, 0, 0, 0, 60, 61, 62, 63, 0}, {b, s});
  KVCache all_cache(model.config(), 3, 8, ctx.device()), picked_cache(model.config(), 3, 8, ctx.device());
  std::vector<float> all = model.forward_inference(ctx, tokens, {0, 1, 2}, {0, 0, 0}, all_cache).to_floats();
  const std::vector<int64_t> rows = {0, 1, 2, 4, 9, 10, 11, 12, 14};  // runs and single rows
  Tensor picked = model.forward_inference(ctx, tokens, {0, 1, 2}, {0, 0, 0}, picked_cache, rows);
  ASSERT_EQ(picked.shape(), (Shape{int64_t(rows.size()), v}));
  std::vector<float> got = picked.to_floats();
  for (size_t r = 0; r < rows.size(); ++r)
    for (int64_t c = 0; c < v; ++c) ASSERT_NEAR(got[r * size_t(v) + size_t(c)], all[size_t(rows[r] * v + c)], 1e-6) << r;
  EXPECT_EQ(picked_cache.keys[0].to_floats(), all_cache.keys[0].to_floats()) << "the cache is written the same";
  EXPECT_THROW(model.forward_inference(ctx, tokens, {0, 1, 2}, {0, 0, 0}, picked_cache, {s * b}), Error);
}

TEST_P(CachedForward, CacheOverflowIsAClearError) {
  GPTModel model(tiny_config(GetParam()));
  model.init_weights(7);
  Context ctx;
  KVCache cache(model.config(), 1, 4, ctx.device());
  EXPECT_THROW(model.forward_inference(ctx, Tensor::from_ints({1, 2, 3, 4, 5}, {1, 5}), {0}, {0}, cache), Error);
}

INSTANTIATE_TEST_SUITE_P(Styles, CachedForward, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "llama" : "gpt2"; });

}  // namespace
}  // namespace megatron

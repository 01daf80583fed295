// GPT-OSS's pieces in a model: attention sinks (--softmax-type learnable / off-by-one), sliding-window
// attention on alternate layers (--window-size, --window-attn-skip-freq), the clamped quick-GeGLU
// experts with biases (sequential and grouped GEMMs) and the router's bias. Finite-difference
// gradients of the new parameters and of the layers they feed, grouped = sequential experts,
// selective recomputation giving the same gradients, the sinks under tensor parallelism, the
// parameters' names and shapes, and the configurations refused with one line.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "megatron/core/comm/communicator.h"
#include "megatron/core/distributed/distributed_data_parallel.h"
#include "megatron/core/models/gpt/gpt_layer_specs.h"
#include "megatron/core/parallel_state.h"
#include "megatron/core/transformer/kv_cache.h"
#include "megatron/core/models/gpt/gpt_model.h"
#include "megatron/runtime/philox.h"
#include "megatron/training/arguments.h"
#include "tests/kernels/gradcheck.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

TransformerConfig gpt_oss_config(bool grouped = false, const std::string& softmax_type = "learnable") {
  TransformerConfig c;
  c.num_layers = 2;
  c.hidden_size = 16;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;
  c.kv_channels = 8;
  c.ffn_hidden_size = 12;
  c.vocab_size = 40;
  c.make_vocab_size_divisible_by = 32;
  c.max_position_embeddings = 32;
  c.hidden_dropout = c.attention_dropout = 0.0f;
  c.normalization = "RMSNorm";
  c.position_embedding_type = "rope";
  c.share_embeddings_and_output_weights = false;
  c.add_bias_linear = true;
  c.activation = "quick_geglu";
  c.glu_linear_offset = 1.0f;
  c.activation_func_clamp_value = 1.5f;  // small, so that some inputs are clamped
  c.softmax_type = softmax_type;
  c.window_size_left = 2;
  c.window_attn_skip_freq = "2";  // layer 0 windowed, layer 1 full
  c.num_moe_experts = 4;
  c.moe_router_topk = 2;
  c.moe_grouped_gemm = grouped;
  return c;
}

// Megatron's initialisation, then the biases and sinks away from zero (as trained ones are).
void init(GPTModel& model) {
  model.init_weights(1234);
  for (Parameter* p : model.params().parameters()) {
    if (p->name.find("bias") == std::string::npos && p->name.find("softmax_offset") == std::string::npos) continue;
    std::vector<float> v(size_t(p->data.numel()));
    const uint64_t key = std::hash<std::string>{}(p->name);
    for (size_t i = 0; i < v.size(); ++i) v[i] = 0.02f * float(int(philox_element(key, 0, i) % 100) - 50);
    p->data.copy_from(Tensor::from_floats(v, p->data.shape()));
  }
}

TEST(GptOssConfig, LayerWindowsFollowMegatron) {
  TransformerConfig c = gpt_oss_config();
  c.num_layers = 4;
  c.finalize();
  EXPECT_EQ(c.window_attn_pattern, std::vector<int>({1, 0, 1, 0}));  // layer_number % 2 != 0 is windowed
  const TransformerBlockSpec spec = get_gpt_decoder_block_spec(c);
  EXPECT_EQ(spec.layers[0].mixer.window_left, 2);
  EXPECT_EQ(spec.layers[1].mixer.window_left, -1);
  EXPECT_EQ(window_attn_pattern("([1]*3+[0]*1)*2", 8), std::vector<int>({1, 1, 1, 0, 1, 1, 1, 0}));
  EXPECT_EQ(window_attn_pattern("", 3), std::vector<int>({1, 1, 1}));
  EXPECT_EQ(window_attn_pattern("3", 6), std::vector<int>({1, 1, 0, 1, 1, 0}));
  EXPECT_THROW(window_attn_pattern("[1,0]", 3), Error);
}

TEST(GptOssConfig, UnsupportedCombinationsAreRefused) {
  auto refused = [](auto edit) {
    TransformerConfig c = gpt_oss_config();
    edit(c);
    EXPECT_THROW(c.finalize(), Error);
  };
  refused([](TransformerConfig& c) { c.softmax_type = "sigmoid"; });
  refused([](TransformerConfig& c) { c.window_size_left = -1; });                     // skip freq without a window
  refused([](TransformerConfig& c) { c.activation = "swiglu"; });                     // offset/clamp need quick-GeGLU
  refused([](TransformerConfig& c) { c.activation_func_clamp_value = -1.0f; });
  refused([](TransformerConfig& c) { c.window_attn_skip_freq = "[1,0,1]"; });         // 3 entries for 2 layers
  for (const char* type : {"p2p", "all_gather", "a2a", "a2a+p2p"}) {  // sinks with every CP comm type
    TransformerConfig c = gpt_oss_config();
    c.window_attn_skip_freq.clear();
    c.window_size_left = -1;
    c.context_parallel_size = 2;
    c.cp_comm_type = type;
    EXPECT_NO_THROW(c.finalize()) << type;
  }
}

TEST(GptOssConfig, FlagsMapToTheConfig) {
  const char* argv[] = {"pretrain_gpt",  "--num-layers",  "4",    "--hidden-size", "16",   "--num-attention-heads",
                        "4",             "--seq-length",  "8",    "--max-position-embeddings", "8", "--quick-geglu",
                        "--glu-linear-offset", "1.0", "--activation-func-clamp-value", "7.0", "--softmax-type",
                        "learnable", "--window-size", "127,0", "--window-attn-skip-freq", "2", "--micro-batch-size",
                        "1", "--vocab-size", "64", "--tokenizer-type", "NullTokenizer"};
  const Arguments a = *parse_args(int(std::size(argv)), argv, "test");
  const TransformerConfig c = transformer_config_from_args(a, 64);
  EXPECT_EQ(c.activation, "quick_geglu");
  EXPECT_TRUE(c.gated_linear_unit);
  EXPECT_EQ(c.glu_linear_offset, 1.0f);
  EXPECT_EQ(c.activation_func_clamp_value, 7.0f);
  EXPECT_EQ(c.softmax_type, "learnable");
  EXPECT_EQ(c.window_size_left, 127);
  EXPECT_EQ(c.window_attn_pattern, std::vector<int>({1, 0, 1, 0}));
  const Arguments back = model_arguments_from_config(c);
  EXPECT_EQ(back.window_size, "127,0");
  EXPECT_TRUE(back.quick_geglu);
  EXPECT_FALSE(back.swiglu);
  std::vector<const char*> bad(std::begin(argv), std::end(argv));
  bad[19] = "127,3";  // a right window
  const Arguments b = *parse_args(int(bad.size()), bad.data(), "test");
  EXPECT_THROW(transformer_config_from_args(b, 64), Error);
}

TEST(GptOssModel, ParametersFollowMegatronCore) {
  GPTModel model(gpt_oss_config());
  for (int i = 0; i < 2; ++i) {
    const Parameter* sinks =
        model.params().find(fmt::format("decoder.layers.{}.self_attention.core_attention.softmax_offset", i));
    ASSERT_NE(sinks, nullptr);
    EXPECT_EQ(sinks->data.shape(), Shape({4}));
    EXPECT_TRUE(sinks->no_weight_decay);
    const Parameter* router_bias = model.params().find(fmt::format("decoder.layers.{}.mlp.router.bias", i));
    ASSERT_NE(router_bias, nullptr);
    EXPECT_EQ(router_bias->data.shape(), Shape({4}));
    EXPECT_NE(model.params().find(fmt::format("decoder.layers.{}.mlp.experts.local_experts.3.linear_fc1.bias", i)),
              nullptr);
  }
  GPTModel off_by_one(gpt_oss_config(false, "off-by-one"));
  EXPECT_EQ(off_by_one.params().find("decoder.layers.0.self_attention.core_attention.softmax_offset"), nullptr);
}

class GptOssGradients : public ::testing::TestWithParam<bool> {};

// d(Σ losses · R)/dθ by finite differences against backward: the sinks, the router's bias, the
// experts' biases and a few rows of each linear layer that the new pieces feed.
TEST_P(GptOssGradients, MatchFiniteDifferences) {
  GPTModel model(gpt_oss_config(GetParam()));
  init(model);
  Context ctx;
  const Tensor tokens = testing::random_ids(2, 8, 40, 1), labels = testing::random_ids(2, 8, 40, 2);
  testing::GradCheck gc([&] {
    GPTModel::Stash stash;
    return std::vector<Tensor>{model.forward(ctx, tokens, Tensor(), labels, stash)};
  });
  model.params().zero_grad();
  GPTModel::Stash stash;
  model.forward(ctx, tokens, Tensor(), labels, stash);
  model.backward(ctx, gc.upstream(0), stash);
  const testing::GradTolerance tol{.eps = 1e-3, .rtol = 1e-2, .atol = 3e-3};
  int checked = 0;
  for (Parameter* p : model.params().parameters()) {
    const bool whole = p->name.find("softmax_offset") != std::string::npos ||
                       p->name.find("router.bias") != std::string::npos ||
                       p->name.find("experts.local_experts.1.linear_fc") != std::string::npos;
    if (whole && p->data.numel() <= 64) {
      gc.check(p->name, p->data, p->main_grad.clone(), tol);
      ++checked;
    } else if (p->name.find("linear_qkv.weight") != std::string::npos ||
               p->name.find("local_experts.0.linear_fc1.weight") != std::string::npos) {
      Tensor rows = p->data.slice(0, 2);
      gc.check(p->name + " rows 0..1", rows, p->main_grad.clone().slice(0, 2), tol);
      ++checked;
    }
  }
  EXPECT_GE(checked, 12);
}

INSTANTIATE_TEST_SUITE_P(Experts, GptOssGradients, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "grouped" : "sequential"; });

// The grouped GEMMs with their rank-1 bias terms compute what the expert-by-expert GEMMs do.
TEST(GptOssModel, GroupedExpertsEqualSequential) {
  std::vector<float> losses[2], grads[2];
  for (int grouped = 0; grouped < 2; ++grouped) {
    GPTModel model(gpt_oss_config(grouped != 0));
    init(model);
    Context ctx;
    model.params().zero_grad();
    GPTModel::Stash stash;
    Tensor l = model.forward(ctx, testing::random_ids(2, 8, 40, 1), Tensor(), testing::random_ids(2, 8, 40, 2), stash);
    model.backward(ctx, testing::random_tensor(l.shape(), 5, 1.0f, DType::Float32), stash);
    losses[grouped] = l.to_floats();
    grads[grouped] = model.params().grad_buffer().to_floats();
  }
  EXPECT_LT(testing::max_abs_error(losses[1], losses[0]), 1e-5);
  EXPECT_LT(testing::max_abs_error(grads[1], grads[0]), 1e-5);
}

// The sinks are part of the core attention that selective recomputation recomputes.
TEST(GptOssModel, SelectiveRecomputationGivesTheSameGradients) {
  std::vector<float> grads[2];
  for (int recompute = 0; recompute < 2; ++recompute) {
    TransformerConfig c = gpt_oss_config();
    if (recompute) c.recompute_granularity = "selective";
    GPTModel model(c);
    init(model);
    Context ctx;
    model.params().zero_grad();
    GPTModel::Stash stash;
    Tensor l = model.forward(ctx, testing::random_ids(2, 8, 40, 1), Tensor(), testing::random_ids(2, 8, 40, 2), stash);
    model.backward(ctx, testing::random_tensor(l.shape(), 5, 1.0f, DType::Float32), stash);
    grads[recompute] = model.params().grad_buffer().to_floats();
  }
  EXPECT_EQ(grads[0], grads[1]);
}

// Off-by-one: a fixed 0 logit per head, no parameter; a model with it differs from the vanilla one.
TEST(GptOssModel, OffByOneChangesTheSoftmax) {
  std::vector<float> losses[2];
  const char* types[] = {"off-by-one", "vanilla"};
  for (int t = 0; t < 2; ++t) {
    GPTModel model(gpt_oss_config(false, types[t]));
    model.init_weights(1234);
    Context ctx;
    GPTModel::Stash stash;
    losses[t] = model.forward(ctx, testing::random_ids(2, 8, 40, 1), Tensor(), testing::random_ids(2, 8, 40, 2), stash).to_floats();
  }
  EXPECT_GT(testing::max_abs_error(losses[0], losses[1]), 1e-4);
}

// Generation over the KV cache (Note [KV-cache attention with sinks or windows]): two sequences of
// different lengths prefilled into their slots, then decoded together, each step's logits equal to
// the full forward of each sequence, past the window (2) and with the sinks; learnable and off-by-one.
TEST(GptOssModel, KVCacheEqualsFullForward) {
  for (const char* type : {"learnable", "off-by-one"}) {
    SCOPED_TRACE(type);
    GPTModel model(gpt_oss_config(false, type));
    init(model);
    Context ctx;
    std::vector<std::vector<int64_t>> seqs = {{5, 17, 3, 9, 12}, {7, 1, 30}};
    KVCache cache(model.config(), 2, 16, ctx.device());
    Tensor last[2];
    for (int64_t i = 0; i < 2; ++i) {
      const int64_t n = int64_t(seqs[size_t(i)].size());
      const Tensor logits = model.forward_inference(ctx, Tensor::from_ints(seqs[size_t(i)], {1, n}), {i}, {0}, cache);
      last[i] = logits.slice(n - 1, n);  // [1, 1, vp]
    }
    double worst = 0;
    for (int step = 0; step < 4; ++step) {
      std::vector<int64_t> next, starts;
      for (int64_t i = 0; i < 2; ++i) {
        std::vector<int64_t>& seq = seqs[size_t(i)];
        const int64_t n = int64_t(seq.size());
        const Tensor full = model.forward_logits(ctx, Tensor::from_ints(seq, {1, n}), Tensor());
        const std::vector<float> want = full.slice(n - 1, n).to_floats();
        worst = std::max(worst, testing::max_abs_error(last[i].to_floats(), want));
        seq.push_back(int64_t(std::max_element(want.begin(), want.begin() + 40) - want.begin()));
        next.push_back(seq.back());
        starts.push_back(n);
      }
      const Tensor logits = model.forward_inference(ctx, Tensor::from_ints(next, {2, 1}), {0, 1}, starts, cache);
      for (int64_t i = 0; i < 2; ++i) {  // logits [1, 2, vp]: sequence i's row
        const int64_t vp = logits.size(2);
        std::vector<float> all = logits.to_floats();
        last[i] = Tensor::from_floats(std::vector<float>(all.begin() + i * vp, all.begin() + (i + 1) * vp), {1, 1, vp});
      }
    }
    EXPECT_LE(worst, 1e-5) << "logits differ by " << worst;
  }
}

// Under tensor parallelism each rank holds the sinks of its heads: the gathered gradients (and the
// losses) equal the single-process ones, with and without sequence parallelism. A dense model (the
// quick-GeGLU fc1 split as [gate; up] blocks) with sinks on every layer and a window on the first.
struct TpRun {
  std::vector<float> losses, sinks_grad;  // sinks of layer 0, gathered in rank order
};

TpRun tp_run(int tp, bool sp) {
  std::vector<TpRun> per_rank(static_cast<size_t>(tp));
  std::vector<std::string> errors(static_cast<size_t>(tp));
  auto comms = make_local_group(tp);
  std::vector<std::thread> threads;
  for (int r = 0; r < tp; ++r) {
    threads.emplace_back([&, r] {
      try {
        ParallelConfig pc;
        pc.tensor_model_parallel_size = tp;
        pc.sequence_parallel = sp;
        ParallelState ps(std::move(comms[size_t(r)]), pc);
        TransformerConfig c = gpt_oss_config();
        c.num_moe_experts = 0;
        c.tensor_model_parallel_size = tp;
        c.sequence_parallel = sp;
        GPTModel model(c, Device::cpu(), &ps);
        model.init_weights(1234);  // shard-aware: each rank gets its piece of the same full tensors
        Context ctx(Device::cpu(), 1234);
        DistributedDataParallel ddp(ps, {&model.params()}, DDPConfig{});
        ddp.zero_grad(ctx);
        GPTModel::Stash stash;
        Tensor losses = model.forward(ctx, testing::random_ids(2, 8, 40, 1), Tensor(), testing::random_ids(2, 8, 40, 2), stash);
        model.backward(ctx, testing::random_tensor(losses.shape(), 5, 1.0f, DType::Float32), stash);
        finalize_model_grads(ctx, ddp);
        Parameter* sinks = model.params().find("decoder.layers.0.self_attention.core_attention.softmax_offset");
        MG_CHECK(sinks && sinks->data.numel() == 4 / tp, "rank {} holds no shard of the sinks", r);
        per_rank[size_t(r)] = {losses.to_floats(), sinks->main_grad.to_floats()};
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  TpRun all;
  for (int r = 0; r < tp; ++r) {
    EXPECT_TRUE(errors[size_t(r)].empty()) << "rank " << r << ": " << errors[size_t(r)];
    all.sinks_grad.insert(all.sinks_grad.end(), per_rank[size_t(r)].sinks_grad.begin(),
                          per_rank[size_t(r)].sinks_grad.end());
  }
  all.losses = per_rank[0].losses;
  return all;
}

TEST(GptOssTensorParallel, SinksAreShardedWithTheirHeads) {
  const TpRun single = tp_run(1, false);
  ASSERT_EQ(single.sinks_grad.size(), 4u);
  for (bool sp : {false, true}) {
    const TpRun tp2 = tp_run(2, sp);
    ASSERT_EQ(tp2.sinks_grad.size(), 4u);
    EXPECT_LT(testing::max_abs_error(tp2.losses, single.losses), 1e-5) << (sp ? "sp" : "");
    EXPECT_LT(testing::max_abs_error(tp2.sinks_grad, single.sinks_grad), 1e-5) << (sp ? "sp" : "");
  }
}

}  // namespace
}  // namespace megatron

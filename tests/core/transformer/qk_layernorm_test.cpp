// --qk-layernorm (Note [QK layernorm] in attention.h): finite-difference gradients of a model with
// per-head q/k norms (RMSNorm with RoPE and GQA; LayerNorm with MHA and no RoPE, where the fused
// QKV path must give way to the split one; zero-centred gamma), selective recomputation giving the
// same gradients, the KV-cache path equal to the full forward, and tensor parallelism (with and
// without sequence parallelism) giving the single-process gradients of the norm weights, which
// are partial sums over each rank's heads before the all-reduce.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <thread>

#include "megatron/core/comm/communicator.h"
#include "megatron/core/distributed/distributed_data_parallel.h"
#include "megatron/core/parallel_state.h"
#include "megatron/core/transformer/kv_cache.h"
#include "megatron/core/models/gpt/gpt_model.h"
#include "megatron/runtime/philox.h"
#include "tests/kernels/gradcheck.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

struct Style {
  std::string name;
  bool rms = true, rope = true, gqa = true, zero_centered_gamma = false;
};

void PrintTo(const Style& st, std::ostream* os) { *os << st.name; }

TransformerConfig tiny_config(const Style& st, int layers = 1) {
  TransformerConfig c;
  c.num_layers = layers;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.num_query_groups = st.gqa ? 2 : 4;
  c.kv_channels = 12;  // not hidden / heads: the norms run over kv_channels
  c.ffn_hidden_size = 48;
  c.vocab_size = 40;
  c.make_vocab_size_divisible_by = 32;  // 64 rows at TP 1 and 2 alike
  c.max_position_embeddings = 16;
  c.hidden_dropout = c.attention_dropout = 0.0f;
  c.qk_layernorm = true;
  c.normalization = st.rms ? "RMSNorm" : "LayerNorm";
  c.layernorm_zero_centered_gamma = st.zero_centered_gamma;
  c.position_embedding_type = st.rope ? "rope" : "learned_absolute";
  if (st.rope) {
    c.activation = "swiglu";
    c.add_bias_linear = false;
    c.share_embeddings_and_output_weights = false;
  }
  return c;
}

bool is_qk_norm(const std::string& name) {
  return name.find("q_layernorm") != std::string::npos || name.find("k_layernorm") != std::string::npos;
}

// Megatron's initialisation, then the q/k norm parameters away from their initial ones and zeros
// (a pure function of the name and the element, so every tensor-parallel rank gets the same).
void init(GPTModel& model) {
  model.init_weights(1234);
  for (Parameter* p : model.params().parameters()) {
    if (!is_qk_norm(p->name)) continue;
    std::vector<float> v(size_t(p->data.numel()));
    const uint64_t key = std::hash<std::string>{}(p->name);
    for (size_t i = 0; i < v.size(); ++i) v[i] = 0.3f + 0.01f * float(philox_element(key, 0, i) % 100);
    p->data.copy_from(Tensor::from_floats(v, p->data.shape()));
  }
}

const std::vector<Style> kStyles = {
    {"rmsnorm_rope_gqa", true, true, true, false},
    {"layernorm_mha_fused_path", false, false, false, false},
    {"rmsnorm_zero_centered_gamma", true, true, false, true},
};

class QKLayernorm : public ::testing::TestWithParam<Style> {};

TEST_P(QKLayernorm, ParametersFollowMegatronCore) {
  GPTModel model(tiny_config(GetParam()));
  const int64_t d = model.config().kv_channels;
  for (const char* which : {"q_layernorm", "k_layernorm"}) {
    const std::string prefix = fmt::format("decoder.layers.0.self_attention.{}.", which);
    const Parameter* w = model.params().find(prefix + "weight");
    ASSERT_NE(w, nullptr) << prefix << "weight";
    EXPECT_EQ(w->data.shape(), Shape({d}));
    EXPECT_TRUE(w->no_weight_decay);
    EXPECT_EQ(model.params().find(prefix + "bias") != nullptr, !GetParam().rms) << prefix << "bias";
  }
}

// d(Σ losses · R)/dθ by finite differences for the q/k norm parameters and the QKV projection
// (whose gradient has gone back through the norms), against backward.
TEST_P(QKLayernorm, GradientsMatchFiniteDifferences) {
  GPTModel model(tiny_config(GetParam()));
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
    if (!is_qk_norm(p->name)) continue;
    gc.check(p->name, p->data, p->main_grad.clone(), tol);
    ++checked;
  }
  EXPECT_EQ(checked, GetParam().rms ? 2 : 4);
  // A few rows of the first group's query and key projections (the grouped QKV layout: per group
  // its query heads, then its key head, then its value head).
  const TransformerConfig& c = model.config();
  const int64_t q_rows = c.num_attention_heads / c.num_query_groups * c.kv_channels;
  Parameter* qkv = model.params().find("decoder.layers.0.self_attention.linear_qkv.weight");
  ASSERT_NE(qkv, nullptr);
  const Tensor analytic = qkv->main_grad.clone();
  for (int64_t row : {int64_t(0), q_rows}) {
    Tensor rows = qkv->data.slice(row, row + 3);
    gc.check(fmt::format("linear_qkv.weight rows {}..{}", row, row + 2), rows, analytic.slice(row, row + 3), tol);
  }
}

// The norms belong to the core attention that selective recomputation recomputes in backward.
TEST_P(QKLayernorm, SelectiveRecomputationGivesTheSameGradients) {
  std::vector<float> grads[2];
  for (int recompute = 0; recompute < 2; ++recompute) {
    TransformerConfig c = tiny_config(GetParam(), 2);
    if (recompute) c.recompute_granularity = "selective";
    GPTModel model(c);
    init(model);
    Context ctx;
    model.params().zero_grad();
    GPTModel::Stash stash;
    Tensor losses = model.forward(ctx, testing::random_ids(2, 8, 40, 1), Tensor(), testing::random_ids(2, 8, 40, 2), stash);
    model.backward(ctx, testing::random_tensor(losses.shape(), 5, 1.0f, DType::Float32), stash);
    grads[recompute] = model.params().grad_buffer().to_floats();
  }
  EXPECT_EQ(grads[0], grads[1]);
}

// Cached inference (prefill, then decode steps) normalises q and k as the training forward does.
TEST_P(QKLayernorm, KVCacheEqualsFullForward) {
  GPTModel model(tiny_config(GetParam(), 2));
  init(model);
  Context ctx;
  const int64_t v = model.config().padded_vocab_size;
  std::vector<int64_t> seq = {5, 17, 3, 9, 12};
  KVCache cache(model.config(), 1, 16, ctx.device());
  Tensor logits = model.forward_inference(ctx, Tensor::from_ints(seq, {1, int64_t(seq.size())}), {0}, {0}, cache);
  double worst = 0;
  for (int step = 0; step < 4; ++step) {
    Tensor full = model.forward_logits(ctx, Tensor::from_ints(seq, {1, int64_t(seq.size())}), Tensor());
    const int64_t n = int64_t(seq.size());
    const std::vector<float> want = full.slice(n - 1, n).to_floats();
    const std::vector<float> got = logits.slice(logits.size(0) - 1, logits.size(0)).to_floats();
    worst = std::max(worst, testing::max_abs_error(got, want));
    seq.push_back(int64_t(std::max_element(want.begin(), want.begin() + 40) - want.begin()));
    logits = model.forward_inference(ctx, Tensor::from_ints({seq.back()}, {1, 1}), {0}, {n}, cache);
  }
  EXPECT_LE(worst, 1e-5) << "logits differ by " << worst;
  EXPECT_EQ(logits.size(2), v);
}

INSTANTIATE_TEST_SUITE_P(Styles, QKLayernorm, ::testing::ValuesIn(kStyles),
                         [](const auto& info) { return info.param.name; });

// One forward and backward on every rank of a tensor-parallel group (threads over a local
// communicator), then finalize_model_grads as a training step ends; returns the gradients of the
// q/k norm parameters, which every rank must hold alike.
std::map<std::string, std::vector<float>> tp_gradients(const Style& st, int tp, bool sp) {
  std::vector<std::map<std::string, std::vector<float>>> per_rank(static_cast<size_t>(tp));
  auto comms = make_local_group(tp);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<size_t>(tp));
  for (int r = 0; r < tp; ++r) {
    threads.emplace_back([&, r] {
      try {
        ParallelConfig pc;
        pc.tensor_model_parallel_size = tp;
        pc.sequence_parallel = sp;
        ParallelState ps(std::move(comms[size_t(r)]), pc);
        TransformerConfig c = tiny_config(st, 2);
        c.tensor_model_parallel_size = tp;
        c.sequence_parallel = sp;
        GPTModel model(c, Device::cpu(), &ps);
        init(model);
        Context ctx(Device::cpu(), 1234);
        DistributedDataParallel ddp(ps, {&model.params()}, DDPConfig{});
        ddp.zero_grad(ctx);
        GPTModel::Stash stash;
        Tensor losses = model.forward(ctx, testing::random_ids(2, 8, 40, 1), Tensor(), testing::random_ids(2, 8, 40, 2), stash);
        model.backward(ctx, testing::random_tensor(losses.shape(), 5, 1.0f, DType::Float32), stash);
        finalize_model_grads(ctx, ddp);
        for (Parameter* p : model.params().parameters()) {
          if (!is_qk_norm(p->name)) continue;
          EXPECT_EQ(p->tp_duplicate, tp > 1) << p->name;
          EXPECT_FALSE(p->sequence_parallel) << p->name << " would be all-reduced a second time";
          per_rank[size_t(r)][p->name] = p->main_grad.to_floats();
        }
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < tp; ++r) {
    EXPECT_TRUE(errors[size_t(r)].empty()) << "rank " << r << ": " << errors[size_t(r)];
    EXPECT_EQ(per_rank[size_t(r)], per_rank[0]) << "the norm gradients differ between tensor-parallel ranks";
  }
  return per_rank[0];
}

TEST(QKLayernormTensorParallel, NormGradientsAreSummedOverTheRanksHeads) {
  for (const Style& st : {kStyles[0], kStyles[1]}) {
    const auto single = tp_gradients(st, 1, false);
    ASSERT_EQ(single.size(), st.rms ? 4u : 8u);
    for (bool sp : {false, true}) {
      const auto tp2 = tp_gradients(st, 2, sp);
      ASSERT_EQ(tp2.size(), single.size());
      for (const auto& [name, want] : single) {
        const std::vector<float>& got = tp2.at(name);
        double scale = 0;
        for (float x : want) scale = std::max(scale, double(std::fabs(x)));
        // The key bias shifts every score of a query alike, which softmax ignores: its gradient is
        // zero in exact arithmetic, rounding noise in both runs.
        const bool key_bias = name.find("k_layernorm.bias") != std::string::npos;
        EXPECT_LE(testing::max_abs_error(got, want), key_bias ? 1e-7 : 1e-5 * scale)
            << st.name << (sp ? " sp " : " ") << name;
      }
    }
  }
}

}  // namespace
}  // namespace megatron

// Multi-latent attention (Note [Multi-latent attention] in multi_latent_attention.h): Megatron-Core's
// parameter names and shapes, finite-difference gradients of every MLA parameter (with and without
// the low-rank query, YaRN and plain RoPE), selective recomputation giving the same gradients,
// tensor parallelism with and without sequence parallelism giving the single-process loss and
// gradients (Note [MLA tensor parallelism]), context parallelism with every --cp-comm-type and with
// TP x SP likewise (Note [MLA context parallelism]), the latent KV cache equal to the full forward (Note [MLA
// KV cache]), and the one-line refusals of shapes that do not fit.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <thread>

#include "megatron/core/comm/communicator.h"
#include "megatron/core/distributed/distributed_data_parallel.h"
#include "megatron/core/models/gpt/gpt_model.h"
#include "megatron/core/parallel_state.h"
#include "megatron/core/transformer/context_parallel.h"
#include "megatron/core/transformer/kv_cache.h"
#include "megatron/runtime/philox.h"
#include "tests/kernels/gradcheck.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

struct Style {
  std::string name;
  int q_lora_rank = 12;
  bool yarn = true;
};

void PrintTo(const Style& st, std::ostream* os) { *os << st.name; }

TransformerConfig mla_config(const Style& st, int layers = 1) {
  TransformerConfig c;
  c.num_layers = layers;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.ffn_hidden_size = 48;
  c.vocab_size = 40;
  c.make_vocab_size_divisible_by = 32;
  c.max_position_embeddings = 16;
  c.hidden_dropout = c.attention_dropout = 0.0f;
  c.normalization = "RMSNorm";
  c.activation = "swiglu";
  c.add_bias_linear = false;
  c.share_embeddings_and_output_weights = false;
  c.multi_latent_attention = true;
  c.qk_layernorm = true;
  c.q_lora_rank = st.q_lora_rank;
  c.kv_lora_rank = 10;
  c.qk_head_dim = 6;
  c.qk_pos_emb_head_dim = 4;
  c.v_head_dim = 5;  // dv != qk + pe
  c.position_embedding_type = st.yarn ? "yarn" : "rope";
  if (st.yarn) {
    c.yarn_rotary_scaling_factor = 4.0f;
    c.yarn_original_max_position_embeddings = 4;
    c.yarn_mscale = 0.9f;  // the concentration factor and the softmax mscale both differ from 1
    c.yarn_mscale_all_dim = 0.7f;
  }
  return c;
}

bool is_mla(const std::string& name) { return name.find("self_attention.") != std::string::npos; }

// Megatron's initialisation, then the latent norms away from ones (a pure function of the name and
// the element, so every tensor-parallel rank gets the same).
void init(GPTModel& model) {
  model.init_weights(1234);
  for (Parameter* p : model.params().parameters()) {
    if (p->name.find("layernorm.weight") == std::string::npos || !is_mla(p->name)) continue;
    std::vector<float> v(size_t(p->data.numel()));
    const uint64_t key = std::hash<std::string>{}(p->name);
    for (size_t i = 0; i < v.size(); ++i) v[i] = 0.5f + 0.01f * float(philox_element(key, 0, i) % 100);
    p->data.copy_from(Tensor::from_floats(v, p->data.shape()));
  }
}

const std::vector<Style> kStyles = {{"low_rank_q_yarn", 12, true}, {"plain_q_rope", 0, false}};

class MLA : public ::testing::TestWithParam<Style> {};

TEST_P(MLA, ParametersFollowMegatronCore) {
  GPTModel model(mla_config(GetParam()));
  const int64_t h = 32, n = 4, qk = 6, pe = 4, dv = 5, qr = GetParam().q_lora_rank, kvr = 10;
  std::map<std::string, Shape> want = {{"linear_kv_down_proj.weight", {kvr + pe, h}},
                                       {"kv_layernorm.weight", {kvr}},
                                       {"linear_kv_up_proj.weight", {n * (qk + dv), kvr}},
                                       {"linear_proj.weight", {h, n * dv}}};
  if (qr > 0) {
    want["linear_q_down_proj.weight"] = {qr, h};
    want["q_layernorm.weight"] = {qr};
    want["linear_q_up_proj.weight"] = {n * (qk + pe), qr};
  } else {
    want["linear_q_proj.weight"] = {n * (qk + pe), h};
  }
  int found = 0;
  for (Parameter* p : model.params().parameters()) {
    if (!is_mla(p->name)) continue;
    const std::string local = p->name.substr(p->name.find("self_attention.") + 15);
    ASSERT_TRUE(want.count(local)) << "unexpected parameter " << p->name;
    EXPECT_EQ(p->data.shape(), want.at(local)) << p->name;
    ++found;
  }
  EXPECT_EQ(found, int(want.size()));
}

// d(Σ losses · R)/dθ by finite differences for every MLA parameter (rows of the projections), against backward.
TEST_P(MLA, GradientsMatchFiniteDifferences) {
  GPTModel model(mla_config(GetParam()));
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
  // Norm weights whole; of each projection its first rows, the rows from qk (head 0's rope rows of the
  // q projections, its value rows of linear_kv_up_proj) and its last ones (the rope key's rows of
  // linear_kv_down_proj, the last head's).
  int checked = 0;
  for (Parameter* p : model.params().parameters()) {
    if (!is_mla(p->name)) continue;
    const Tensor analytic = p->main_grad.clone();
    ++checked;
    if (p->data.dim() == 1) {
      gc.check(p->name, p->data, analytic, tol);
      continue;
    }
    const int64_t rows = p->data.size(0), qk = 6;
    for (int64_t r0 : {int64_t(0), qk, rows - 2}) {
      Tensor block = p->data.slice(r0, r0 + 2);
      gc.check(fmt::format("{} rows {}..{}", p->name, r0, r0 + 1), block, analytic.slice(r0, r0 + 2), tol);
    }
  }
  EXPECT_EQ(checked, GetParam().q_lora_rank > 0 ? 7 : 5);
}

TEST_P(MLA, SelectiveRecomputationGivesTheSameGradients) {
  std::vector<float> grads[2];
  for (int recompute = 0; recompute < 2; ++recompute) {
    TransformerConfig c = mla_config(GetParam(), 2);
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

INSTANTIATE_TEST_SUITE_P(Styles, MLA, ::testing::ValuesIn(kStyles), [](const auto& info) { return info.param.name; });

// ---- tensor and context parallelism ------------------------------------------------------------
struct RankResult {
  std::vector<float> losses;
  std::map<std::string, Tensor> grads;  // this rank's shards
  std::map<std::string, ShardSpec> shards;
  int cp_rank = 0;
};

struct MlaLayout {
  int tp = 1;
  bool sp = false;
  int cp = 1;
  std::string cp_type = "p2p";
  std::string name() const {
    std::string n = fmt::format("tp{}{}", tp, sp ? " sp" : "");
    if (cp > 1) n += fmt::format(" cp{} {}", cp, cp_type);
    return n;
  }
};

// One forward and backward on every rank of the layout (threads over a local communicator; Megatron's
// rank order, tensor-parallel fastest), then finalize_model_grads as a training step ends. Sequences
// of 8: under CP each rank takes its chunks of the tokens, labels and the upstream gradient, the
// latter scaled by CP as the loss does (Note [Loss under context parallelism]), since the gradients
// are averaged over the data × context ranks.
std::vector<RankResult> layout_run(const Style& st, const MlaLayout& l) {
  const int world = l.tp * l.cp;
  std::vector<RankResult> out(static_cast<size_t>(world));
  auto comms = make_local_group(world);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        ParallelConfig pc;
        pc.tensor_model_parallel_size = l.tp;
        pc.sequence_parallel = l.sp;
        pc.context_parallel_size = l.cp;
        if (l.cp_type == "a2a+p2p") pc.hierarchical_context_parallel_sizes = {2, l.cp / 2};
        ParallelState ps(std::move(comms[size_t(r)]), pc);
        TransformerConfig c = mla_config(st, 2);
        c.tensor_model_parallel_size = l.tp;
        c.sequence_parallel = l.sp;
        c.context_parallel_size = l.cp;
        c.cp_comm_type = l.cp_type;
        GPTModel model(c, Device::cpu(), &ps);
        init(model);
        Context ctx(Device::cpu(), 1234);
        DistributedDataParallel ddp(ps, {&model.params()}, DDPConfig{});
        ddp.zero_grad(ctx);
        const int cp_rank = ps.context().rank();
        GPTModel::Stash stash;
        Tensor losses = model.forward(ctx, cp_split_rows(testing::random_ids(2, 8, 40, 1), cp_rank, l.cp), Tensor(),
                                      cp_split_rows(testing::random_ids(2, 8, 40, 2), cp_rank, l.cp), stash);
        Tensor grad = cp_split_rows(testing::random_tensor({2, 8}, 5, float(l.cp), DType::Float32), cp_rank, l.cp);
        model.backward(ctx, grad, stash);
        finalize_model_grads(ctx, ddp);
        out[size_t(r)].losses = losses.to_floats();
        out[size_t(r)].cp_rank = cp_rank;
        for (Parameter* p : model.params().parameters()) {
          out[size_t(r)].grads[p->name] = p->main_grad.clone();
          out[size_t(r)].shards[p->name] = p->shard;
        }
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) EXPECT_TRUE(errors[size_t(r)].empty()) << "rank " << r << ": " << errors[size_t(r)];
  return out;
}

// The elements of the whole tensor `full` that a shard (partition_dim, rank, size, chunks) holds, in
// the shard's row-major order.
std::vector<float> shard_of(const Tensor& full, const ShardSpec& s) {
  const std::vector<float> v = full.to_floats();
  if (s.partition_dim < 0 || s.size <= 1) return v;
  const Shape& shape = full.shape();
  const int64_t rows = shape[0], cols = full.numel() / rows;
  std::vector<float> out;
  if (s.partition_dim == 0) {
    const int64_t block = rows / s.chunks, local = block / s.size;
    for (int64_t c = 0; c < s.chunks; ++c)
      for (int64_t r = c * block + s.rank * local; r < c * block + (s.rank + 1) * local; ++r)
        out.insert(out.end(), v.begin() + r * cols, v.begin() + (r + 1) * cols);
  } else {
    const int64_t local = cols / s.size;
    for (int64_t r = 0; r < rows; ++r)
      out.insert(out.end(), v.begin() + r * cols + s.rank * local, v.begin() + r * cols + (s.rank + 1) * local);
  }
  return out;
}

// Every rank's losses (its rows) and gradients (its shards) against the single process's.
void expect_equals_single(const Style& st, const RankResult& single, const MlaLayout& l) {
  const std::vector<RankResult> ranks = layout_run(st, l);
  for (size_t r = 0; r < ranks.size(); ++r) {
    const std::string what = fmt::format("{} {} rank {}", st.name, l.name(), r);
    ASSERT_EQ(ranks[r].grads.size(), single.grads.size()) << what;
    const Tensor single_losses = Tensor::from_floats(single.losses, {2, 8});
    const std::vector<float> want_losses = cp_split_rows(single_losses, ranks[r].cp_rank, l.cp).to_floats();
    EXPECT_LE(testing::max_abs_error(ranks[r].losses, want_losses), 1e-5) << what << " losses";
    for (const auto& [name, g] : single.grads) {
      const std::vector<float> want = shard_of(g, ranks[r].shards.at(name));
      double scale = 1e-3;
      for (float x : want) scale = std::max(scale, double(std::fabs(x)));
      EXPECT_LE(testing::max_abs_error(ranks[r].grads.at(name).to_floats(), want), 1e-5 * scale)
          << what << " " << name;
    }
  }
}

TEST(MLATensorParallel, EqualsSingleProcess) {
  for (const Style& st : kStyles) {
    const RankResult single = layout_run(st, {}).at(0);
    for (bool sp : {false, true}) expect_equals_single(st, single, {2, sp});
  }
}

// Note [MLA context parallelism]: keys of qk + pe channels and values of dv through every
// --cp-comm-type (the rope channels turned at the global positions), CP x TP with sequence
// parallelism, and a2a+p2p over 2 x 2 ranks: the single process's losses and gradients.
TEST(MLAContextParallel, EqualsSingleProcess) {
  for (const Style& st : kStyles) {
    const RankResult single = layout_run(st, {}).at(0);
    for (const char* type : {"p2p", "all_gather", "a2a"}) expect_equals_single(st, single, {1, false, 2, type});
    expect_equals_single(st, single, {1, false, 4, "a2a+p2p"});
    expect_equals_single(st, single, {2, true, 2, "p2p"});
    expect_equals_single(st, single, {2, true, 2, "a2a"});
  }
}

TEST(MLATensorParallel, DownProjectionsAreDuplicatedAndSequenceParallel) {
  auto comms = make_local_group(2);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(2);
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        ParallelConfig pc;
        pc.tensor_model_parallel_size = 2;
        pc.sequence_parallel = true;
        ParallelState ps(std::move(comms[size_t(r)]), pc);
        TransformerConfig c = mla_config(kStyles[0]);
        c.tensor_model_parallel_size = 2;
        c.sequence_parallel = true;
        GPTModel model(c, Device::cpu(), &ps);
        for (const char* name : {"linear_q_down_proj.weight", "linear_kv_down_proj.weight", "q_layernorm.weight",
                                 "kv_layernorm.weight"}) {
          const Parameter* p = model.params().find(std::string("decoder.layers.0.self_attention.") + name);
          ASSERT_NE(p, nullptr) << name;
          EXPECT_TRUE(p->tp_duplicate && p->sequence_parallel && !p->tp_partial_grad) << name;
          EXPECT_LT(p->shard.partition_dim, 0) << name;
        }
        const Parameter* up = model.params().find("decoder.layers.0.self_attention.linear_kv_up_proj.weight");
        ASSERT_NE(up, nullptr);
        EXPECT_EQ(up->data.shape(), Shape({2 * (6 + 5), 10}));  // 2 of the 4 heads
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const std::string& e : errors) EXPECT_TRUE(e.empty()) << e;
}

// ---- refusals: one line naming the flag ------------------------------------------------------------
std::string finalize_error(const std::function<void(TransformerConfig&)>& change) {
  TransformerConfig c = mla_config(kStyles[0]);
  change(c);
  try {
    c.finalize();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(MLAConfig, BadShapesAreRefusedInOneLine) {
  const std::vector<std::pair<std::function<void(TransformerConfig&)>, std::string>> cases = {
      {[](TransformerConfig& c) { c.tensor_model_parallel_size = 3; }, "--tensor-model-parallel-size"},
      {[](TransformerConfig& c) { c.qk_pos_emb_head_dim = 5; }, "--qk-pos-emb-head-dim"},
      {[](TransformerConfig& c) { c.qk_pos_emb_head_dim = 0; }, "--qk-pos-emb-head-dim"},
      {[](TransformerConfig& c) { c.kv_lora_rank = 0; }, "--kv-lora-rank"},
      {[](TransformerConfig& c) { c.v_head_dim = 0; }, "--v-head-dim"},
      {[](TransformerConfig& c) { c.q_lora_rank = -1; }, "--q-lora-rank"},
      {[](TransformerConfig& c) { c.num_query_groups = 2; }, "--group-query-attention"},
      {[](TransformerConfig& c) { c.position_embedding_type = "learned_absolute"; }, "--rope-type"},
      {[](TransformerConfig& c) {
         c.position_embedding_type = "rope";
         c.rotary_interleaved = true;
       },
       "--rotary-interleaved"},
      {[](TransformerConfig& c) { c.softmax_type = "learnable"; }, "--softmax-type"},
      {[](TransformerConfig& c) { c.window_size_left = 3; }, "--window-size"},
  };
  for (const auto& [change, flag] : cases) {
    const std::string e = finalize_error(change);
    EXPECT_NE(e.find(flag), std::string::npos) << "expected an error naming " << flag << ", got: " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
  EXPECT_EQ(finalize_error([](TransformerConfig&) {}), "");
  for (const char* type : {"p2p", "all_gather", "a2a", "a2a+p2p"}) {  // context parallelism is no longer refused
    EXPECT_EQ(finalize_error([type](TransformerConfig& c) {
                c.context_parallel_size = 4;
                c.cp_comm_type = type;
              }),
              "")
        << type;
  }
}

// Note [MLA KV cache]: cached inference (prefill, then decode steps, two sequences at different
// positions in one batch) gives the full forward's logits.
TEST_P(MLA, KVCacheEqualsFullForward) {
  GPTModel model(mla_config(GetParam(), 2));
  init(model);
  Context ctx;
  KVCache cache(model.config(), 2, 16, ctx.device());
  EXPECT_EQ(cache.keys[0].shape(), Shape({2, 16, 1, 10}));  // the latent, not per-head keys
  EXPECT_EQ(cache.values[0].shape(), Shape({2, 16, 1, 4}));  // the rope key
  std::vector<std::vector<int64_t>> seqs = {{5, 17, 3, 9, 12}, {8, 1, 30}};
  std::vector<Tensor> last(2);
  for (int64_t i = 0; i < 2; ++i) {  // prefill each sequence into its slot
    const auto& seq = seqs[size_t(i)];
    Tensor logits = model.forward_inference(ctx, Tensor::from_ints(seq, {1, int64_t(seq.size())}), {i}, {0}, cache);
    last[size_t(i)] = logits.slice(logits.size(0) - 1, logits.size(0));
  }
  double worst = 0;
  for (int step = 0; step < 3; ++step) {
    std::vector<int64_t> next, starts;
    for (size_t i = 0; i < 2; ++i) {
      const auto& seq = seqs[i];
      Tensor full = model.forward_logits(ctx, Tensor::from_ints(seq, {1, int64_t(seq.size())}), Tensor());
      const int64_t n = int64_t(seq.size());
      const std::vector<float> want = full.slice(n - 1, n).to_floats();
      worst = std::max(worst, testing::max_abs_error(last[i].to_floats(), want));
      next.push_back(int64_t(std::max_element(want.begin(), want.begin() + 40) - want.begin()));
      starts.push_back(n);
    }
    for (size_t i = 0; i < 2; ++i) seqs[i].push_back(next[i]);
    // One decode step for both sequences: batch rows at positions 5+step and 3+step.
    Tensor logits = model.forward_inference(ctx, Tensor::from_ints(next, {2, 1}), {0, 1}, starts, cache);
    const int64_t v = logits.size(2);
    for (int64_t i = 0; i < 2; ++i) last[size_t(i)] = logits.view({2, v}).slice(i, i + 1).clone();
  }
  EXPECT_LE(worst, 1e-5) << "logits differ by " << worst;
}

}  // namespace
}  // namespace megatron

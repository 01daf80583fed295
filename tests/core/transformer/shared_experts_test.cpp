// The MoE shared experts (moe::SharedExpertMLP): the output is the dense MLP of the shared
// intermediate size, scaled by sigmoid(x·gᵀ) with the gate; the gradients of the input, the MLP's
// weights and the gate weight against central finite differences; and under tensor + sequence
// parallelism (two thread ranks) the same outputs and gradients as the single-rank module; in
// MoELayer, output and gradients are the routed experts' plus the shared experts'; with
// --moe-shared-expert-overlap (the side context, inline on the CPU) the layer's output, input
// gradient and every weight gradient are bit-identical to the plain layer's, alone and under
// tensor + sequence parallelism, and the side stream's gradient hooks reach the main context at
// the join.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <thread>

#include "megatron/core/distributed/param_and_grad_buffer.h"
#include "megatron/core/transformer/moe/moe_layer.h"
#include "megatron/core/transformer/moe/shared_experts.h"
#include "megatron/kernels/ops.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

TransformerConfig small_config(bool sequence_parallel = false) {
  TransformerConfig tc;
  tc.num_layers = 2;
  tc.hidden_size = 8;
  tc.num_attention_heads = 2;
  tc.vocab_size = 16;
  tc.activation = "swiglu";
  tc.add_bias_linear = false;
  tc.max_position_embeddings = 8;
  tc.sequence_parallel = sequence_parallel;
  tc.finalize();
  return tc;
}

constexpr const char* kPrefix = "decoder.layers.0.mlp.shared_experts";

void check_shared_experts(bool gate) {
  const TransformerConfig tc = small_config();
  const int64_t n = 6, h = 8, sffn = 10;
  ParamAndGradBuffer params(DType::Float32, Device::cpu());
  moe::SharedExpertMLP shared(tc, sffn, gate, params, kPrefix);
  params.allocate();
  params.init_weights(5, 0.5f, 2, false);
  params.zero_grad();
  EXPECT_EQ(params.find(std::string(kPrefix) + ".linear_fc1.weight")->data.shape(), (Shape{2 * sffn, h}));
  EXPECT_EQ(params.find(std::string(kPrefix) + ".linear_fc2.weight")->data.shape(), (Shape{h, sffn}));
  const Parameter* g = params.find(std::string(kPrefix) + ".gate_weight");
  ASSERT_EQ(g != nullptr, gate);
  if (gate) {
    EXPECT_EQ(g->data.shape(), (Shape{1, h}));
    EXPECT_FALSE(g->no_weight_decay);
  }

  Context ctx;
  const Tensor x = testing::random_tensor({n, h}, 11), w = testing::random_tensor({n, h}, 12);
  moe::SharedExpertMLP::Saved saved;
  const std::vector<float> y = shared.forward(ctx, x, saved).to_floats();
  // Outside check: the dense MLP over the same parameters, times the sigmoid of x·gᵀ.
  {
    ParamAndGradBuffer copy(DType::Float32, Device::cpu());
    MlpSpec spec;
    spec.ffn_hidden_size = int(sffn);
    MLP mlp(tc, spec, copy, kPrefix);
    copy.allocate();
    for (Parameter* q : copy.parameters()) q->data.copy_from(params.find(q->name)->data);
    MLP::Saved ms;
    const std::vector<float> m = mlp.forward(ctx, x, ms).to_floats(), xv = x.to_floats();
    for (int64_t r = 0; r < n; ++r) {
      double s = 1.0;
      if (gate) {
        double logit = 0;
        for (int64_t c = 0; c < h; ++c) logit += double(xv[size_t(r * h + c)]) * g->data.data<float>()[c];
        s = 1.0 / (1.0 + std::exp(-logit));
      }
      for (int64_t c = 0; c < h; ++c) EXPECT_NEAR(y[size_t(r * h + c)], s * m[size_t(r * h + c)], 1e-6);
    }
  }

  const std::vector<float> gx = shared.backward(ctx, w, saved).to_floats();
  auto loss = [&](const Tensor& xi) {
    moe::SharedExpertMLP::Saved s;
    const std::vector<float> yi = shared.forward(ctx, xi, s).to_floats(), wv = w.to_floats();
    double sum = 0;
    for (size_t i = 0; i < yi.size(); ++i) sum += double(yi[i]) * wv[i];
    return sum;
  };
  const float eps = 1e-3f;
  double worst = 0;
  for (int64_t i = 0; i < n * h; ++i) {
    Tensor up = x.clone(), down = x.clone();
    up.data<float>()[i] += eps, down.data<float>()[i] -= eps;
    const double numeric = (loss(up) - loss(down)) / (2 * eps);
    worst = std::max(worst, std::fabs(numeric - gx[size_t(i)]));
    EXPECT_NEAR(gx[size_t(i)], numeric, 2e-3) << "x " << i;
  }
  int checked = 0;
  for (Parameter* p : params.parameters()) {
    const std::vector<float> gp = p->main_grad.to_floats();
    for (int64_t i = 0; i < p->data.numel(); i += 3) {
      float* v = p->data.data<float>() + i;
      const float keep = *v;
      *v = keep + eps;
      const double up = loss(x);
      *v = keep - eps;
      const double down = loss(x);
      *v = keep;
      const double numeric = (up - down) / (2 * eps);
      worst = std::max(worst, std::fabs(numeric - gp[size_t(i)]));
      EXPECT_NEAR(gp[size_t(i)], numeric, 2e-3) << p->name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_GT(checked, 50);
  std::printf("shared experts (%s): finite differences agree on x and %d weight elements, worst |error| %.1e\n",
              gate ? "gated" : "no gate", checked, worst);
}

TEST(SharedExperts, GatedOutputAndGradientsMatchFiniteDifferences) { check_shared_experts(/*gate=*/true); }
TEST(SharedExperts, UngatedIsTheDenseMlp) { check_shared_experts(/*gate=*/false); }

TEST(SharedExperts, BiasesAreRefused) {
  TransformerConfig tc = small_config();
  tc.add_bias_linear = true;
  ParamAndGradBuffer params(DType::Float32, Device::cpu());
  const std::string e = testing::error_of([&] { moe::SharedExpertMLP s(tc, 10, true, params, kPrefix); });
  EXPECT_NE(e.find("--disable-bias-linear"), std::string::npos) << e;
}

// Two tensor-parallel ranks with sequence parallelism: each rank holds half of fc1's rows per
// [gate; up] block and half of fc2's columns, and gates its own half of the tokens. Outputs,
// input gradients and the weights' gradients (the gate's summed over the ranks, as
// finalize_model_grads does for sequence_parallel parameters) equal the single-rank module's.
TEST(SharedExperts, TensorAndSequenceParallelMatchOneRank) {
  const int64_t n = 8, h = 8, sffn = 10, tp = 2;
  const Tensor x = testing::random_tensor({n, h}, 21), w = testing::random_tensor({n, h}, 22);
  Context ctx;
  ParamAndGradBuffer ref_params(DType::Float32, Device::cpu());
  moe::SharedExpertMLP ref(small_config(), sffn, true, ref_params, kPrefix);
  ref_params.allocate();
  ref_params.init_weights(9, 0.5f, 2, false);
  ref_params.zero_grad();
  moe::SharedExpertMLP::Saved ref_saved;
  const std::vector<float> ref_y = ref.forward(ctx, x, ref_saved).to_floats();
  const std::vector<float> ref_gx = ref.backward(ctx, w, ref_saved).to_floats();

  auto comms = make_local_group(int(tp), "tensor-parallel");
  std::vector<std::vector<float>> y(tp), gx(tp), gate_grad(tp), fc1_grad(tp), fc2_grad(tp);
  std::vector<int> sp_flag(tp), dup_flag(tp);
  std::vector<std::thread> threads;
  for (int r = 0; r < int(tp); ++r) {
    threads.emplace_back([&, r] {
      Context c;
      ProcessGroupCollection pg;
      pg.tp = comms[size_t(r)].get();
      ParamAndGradBuffer params(DType::Float32, Device::cpu());
      moe::SharedExpertMLP shared(small_config(/*sequence_parallel=*/true), sffn, true, params, kPrefix, pg);
      params.allocate();
      params.init_weights(9, 0.5f, 2, false);
      params.zero_grad();
      const int64_t rows = n / tp;
      moe::SharedExpertMLP::Saved saved;
      y[size_t(r)] = shared.forward(c, x.slice(r * rows, (r + 1) * rows).clone(), saved).to_floats();
      gx[size_t(r)] = shared.backward(c, w.slice(r * rows, (r + 1) * rows).clone(), saved).to_floats();
      const Parameter* g = shared.gate_weight();
      gate_grad[size_t(r)] = g->main_grad.to_floats();
      sp_flag[size_t(r)] = g->sequence_parallel;
      dup_flag[size_t(r)] = g->tp_duplicate;
      fc1_grad[size_t(r)] = params.find(std::string(kPrefix) + ".linear_fc1.weight")->main_grad.to_floats();
      fc2_grad[size_t(r)] = params.find(std::string(kPrefix) + ".linear_fc2.weight")->main_grad.to_floats();
    });
  }
  for (auto& t : threads) t.join();
  const size_t half = size_t(n / tp * h);
  for (int r = 0; r < int(tp); ++r) {
    EXPECT_TRUE(sp_flag[size_t(r)] && dup_flag[size_t(r)]);
    for (size_t i = 0; i < half; ++i) {
      EXPECT_NEAR(y[size_t(r)][i], ref_y[size_t(r) * half + i], 1e-5) << "rank " << r << " y " << i;
      EXPECT_NEAR(gx[size_t(r)][i], ref_gx[size_t(r) * half + i], 1e-5) << "rank " << r << " grad x " << i;
    }
  }
  const std::vector<float> ref_gate = ref.gate_weight()->main_grad.to_floats();
  for (size_t i = 0; i < ref_gate.size(); ++i) EXPECT_NEAR(gate_grad[0][i] + gate_grad[1][i], ref_gate[i], 1e-5);
  // fc1 [2·sffn, h] = [gate; up]: rank r holds rows [r·sffn/2, (r+1)·sffn/2) of each block.
  const std::vector<float> ref_fc1 = ref_params.find(std::string(kPrefix) + ".linear_fc1.weight")->main_grad.to_floats();
  const std::vector<float> ref_fc2 = ref_params.find(std::string(kPrefix) + ".linear_fc2.weight")->main_grad.to_floats();
  const int64_t local = sffn / tp;
  for (int r = 0; r < int(tp); ++r) {
    for (int64_t block = 0; block < 2; ++block)
      for (int64_t i = 0; i < local; ++i)
        for (int64_t c = 0; c < h; ++c)
          EXPECT_NEAR(fc1_grad[size_t(r)][size_t((block * local + i) * h + c)],
                      ref_fc1[size_t((block * sffn + r * local + i) * h + c)], 1e-5);
    for (int64_t o = 0; o < h; ++o)
      for (int64_t i = 0; i < local; ++i)
        EXPECT_NEAR(fc2_grad[size_t(r)][size_t(o * local + i)], ref_fc2[size_t(o * sffn + r * local + i)], 1e-5);
  }
}

// MoELayer with shared experts (moe_config of a config with --moe-shared-expert-intermediate-size
// and --moe-shared-expert-gate): y = routed(x) + shared(x), and so are the input gradient and the
// shared experts' weight gradients, against a layer without them and a lone SharedExpertMLP over
// the same parameter values.
TEST(SharedExperts, MoELayerAddsThemToTheRoutedExperts) {
  TransformerConfig tc = small_config();
  tc.num_moe_experts = 4;
  tc.moe_router_topk = 2;
  tc.moe_ffn_hidden_size = 6;
  tc.moe_shared_expert_intermediate_size = 10;
  tc.moe_shared_expert_gate = true;
  tc.moe_shared_expert_overlap = true;  // the side context runs inline on the CPU: same values
  tc.finalize();
  EXPECT_NE(testing::error_of([&] { moe::moe_config(tc); }).find("alltoall or flex"), std::string::npos);
  tc.moe_token_dispatcher_type = "alltoall";
  const moe::MoEConfig with = moe::moe_config(tc);
  EXPECT_EQ(with.shared_expert_intermediate_size, 10);
  EXPECT_TRUE(with.shared_expert_gate);
  moe::MoEConfig without = with;
  without.shared_expert_overlap = false;
  without.shared_expert_intermediate_size = 0;
  without.shared_expert_gate = false;

  const std::string prefix = "decoder.layers.0.mlp";
  ParamAndGradBuffer pa(DType::Float32, Device::cpu()), pb(DType::Float32, Device::cpu()),
      pc(DType::Float32, Device::cpu());
  moe::MoELayer a(tc, with, pa, prefix, 0), b(tc, without, pb, prefix, 0);
  moe::SharedExpertMLP c(tc, 10, true, pc, prefix + ".shared_experts");
  pa.allocate(), pb.allocate(), pc.allocate();
  pa.init_weights(3, 0.5f, 2, false);
  for (ParamAndGradBuffer* other : {&pb, &pc})
    for (Parameter* q : other->parameters()) q->data.copy_from(pa.find(q->name)->data);
  EXPECT_EQ(pa.parameters().size(), pb.parameters().size() + pc.parameters().size());
  pa.zero_grad(), pb.zero_grad(), pc.zero_grad();

  Context ctx;
  const int64_t seq = 4, mb = 2;
  const Tensor x = testing::random_tensor({seq * mb, 8}, 41), w = testing::random_tensor({seq * mb, 8}, 42);
  moe::MoELayer::Saved sa, sb;
  moe::SharedExpertMLP::Saved sc;
  const std::vector<float> ya = a.forward(ctx, x, seq, mb, nullptr, sa).to_floats();
  const std::vector<float> yb = b.forward(ctx, x, seq, mb, nullptr, sb).to_floats();
  const std::vector<float> yc = c.forward(ctx, x, sc).to_floats();
  for (size_t i = 0; i < ya.size(); ++i) EXPECT_NEAR(ya[i], yb[i] + yc[i], 1e-6) << i;
  const std::vector<float> ga = a.backward(ctx, w, sa).to_floats(), gb = b.backward(ctx, w, sb).to_floats();
  const std::vector<float> gc = c.backward(ctx, w, sc).to_floats();
  for (size_t i = 0; i < ga.size(); ++i) EXPECT_NEAR(ga[i], gb[i] + gc[i], 1e-6) << i;
  for (Parameter* q : pc.parameters())
    EXPECT_EQ(pa.find(q->name)->main_grad.to_floats(), q->main_grad.to_floats()) << q->name;
}


// ---- --moe-shared-expert-overlap (Note [Shared experts on a side stream]) ----------------------

// Records which parameters reported their gradients, and on which context.
struct RecordingHook : GradHook {
  std::vector<std::string> names;
  int from_side = 0;
  void grad_accumulated(Context& ctx, Parameter& p) override {
    names.push_back(p.name);
    from_side += ctx.is_side();
  }
};

struct LayerRun {
  std::vector<float> y, grad_x;
  std::map<std::string, std::vector<float>> grads;
  std::vector<std::string> hooks;
  int hooks_from_side = 0;
};

// One forward and backward of an MoE layer (alltoall dispatcher, shared experts of 10, gated or
// not, overlapped or not) on `tokens` rows of x/w starting at `first`, the parameters initialised
// from one seed; pg: the tensor-parallel group (sequence parallelism on) or none.
LayerRun run_layer(bool gate, bool overlap, const ProcessGroupCollection& pg = {}, int64_t first = 0,
                   int64_t tokens = 8) {
  const bool tp = pg.tp != nullptr;
  TransformerConfig tc = small_config(/*sequence_parallel=*/tp);
  tc.num_moe_experts = 4;
  tc.moe_router_topk = 2;
  tc.moe_ffn_hidden_size = 6;
  tc.moe_shared_expert_intermediate_size = 10;
  tc.moe_shared_expert_gate = gate;
  tc.moe_shared_expert_overlap = overlap;
  tc.moe_token_dispatcher_type = "alltoall";
  tc.moe_router_load_balancing_type = {"aux_loss"};
  tc.moe_aux_loss_coeff = {1e-2f};
  tc.finalize();
  ParamAndGradBuffer params(DType::Float32, Device::cpu());
  moe::MoELayer layer(tc, moe::moe_config(tc), params, "decoder.layers.0.mlp", 0, pg);
  params.allocate();
  params.init_weights(17, 0.5f, 2, false);
  params.zero_grad();
  RecordingHook hook;
  for (Parameter* p : params.parameters()) p->grad_hook = &hook;
  const int64_t mb = 2;
  const Tensor x = testing::random_tensor({8, 8}, 51), w = testing::random_tensor({8, 8}, 52);
  Context ctx;
  moe::MoELayer::Saved saved;
  LayerRun r;
  const Tensor xs = x.slice(first, first + tokens).clone(), ws = w.slice(first, first + tokens).clone();
  r.y = layer.forward(ctx, xs, tokens / mb, mb, nullptr, saved).to_floats();
  r.grad_x = layer.backward(ctx, ws, saved).to_floats();
  for (Parameter* p : params.parameters()) r.grads[p->name] = p->main_grad.to_floats();
  r.hooks = hook.names;
  r.hooks_from_side = hook.from_side;
  return r;
}

void expect_same_bits(const LayerRun& a, const LayerRun& b, const std::string& what) {
  ASSERT_FALSE(b.y.empty()) << what;
  ASSERT_FALSE(b.hooks.empty()) << what;
  EXPECT_EQ(a.y, b.y) << what << ": output";
  EXPECT_EQ(a.grad_x, b.grad_x) << what << ": input gradient";
  ASSERT_EQ(a.grads.size(), b.grads.size()) << what;
  for (const auto& [name, g] : b.grads) EXPECT_EQ(a.grads.at(name), g) << what << ": " << name;
  // Every parameter reports its gradient once, on the main context (the side's at the join).
  std::vector<std::string> ha = a.hooks, hb = b.hooks;
  std::sort(ha.begin(), ha.end());
  std::sort(hb.begin(), hb.end());
  EXPECT_EQ(ha, hb) << what << ": gradient hooks";
  EXPECT_EQ(a.hooks_from_side, 0) << what;
}

TEST(SharedExperts, OverlapIsBitIdenticalGated) {
  const LayerRun plain = run_layer(true, false), overlap = run_layer(true, true);
  expect_same_bits(overlap, plain, "gated");
  EXPECT_EQ(plain.grads.count("decoder.layers.0.mlp.shared_experts.gate_weight"), 1u);
}

TEST(SharedExperts, OverlapIsBitIdenticalUngated) {
  expect_same_bits(run_layer(false, true), run_layer(false, false), "ungated");
}

// The side stream's gradient hooks run at the join: in backward, the shared experts' parameters
// report after the routed path's (the router's weight is the last one the main stream reports).
TEST(SharedExperts, OverlapReportsTheSideStreamsGradientsAtTheJoin) {
  const LayerRun r = run_layer(true, true);
  const auto pos = [&](const std::string& name) {
    return std::find(r.hooks.begin(), r.hooks.end(), "decoder.layers.0.mlp." + name) - r.hooks.begin();
  };
  const auto router = pos("router.weight"), fc1 = pos("shared_experts.linear_fc1.weight"),
             gate = pos("shared_experts.gate_weight");
  ASSERT_LT(size_t(router), r.hooks.size());
  ASSERT_LT(size_t(fc1), r.hooks.size());
  ASSERT_LT(size_t(gate), r.hooks.size());
  EXPECT_LT(router, fc1);
  EXPECT_LT(router, gate);
}

// Two tensor-parallel ranks with sequence parallelism (the shared experts' all-gather and
// reduce-scatter given to the side context): the overlapped layer gives each rank the plain
// layer's bits.
TEST(SharedExperts, OverlapIsBitIdenticalUnderTensorAndSequenceParallel) {
  for (const bool gate : {true, false}) {
    const int tp = 2;
    std::vector<LayerRun> plain(tp), overlap(tp);
    for (const bool o : {false, true}) {
      auto comms = make_local_group(tp, "tensor-parallel");
      std::vector<std::thread> threads;
      for (int r = 0; r < tp; ++r) {
        threads.emplace_back([&, r] {
          ProcessGroupCollection pg;
          pg.tp = comms[size_t(r)].get();
          (o ? overlap : plain)[size_t(r)] = run_layer(gate, o, pg, r * 4, 4);
        });
      }
      for (auto& t : threads) t.join();
    }
    for (int r = 0; r < tp; ++r) {
      EXPECT_EQ(plain[size_t(r)].y.size(), 4u * 8u);
      expect_same_bits(overlap[size_t(r)], plain[size_t(r)], std::string(gate ? "gated" : "ungated") + " tp rank " +
                                                                 std::to_string(r));
    }
  }
}

}  // namespace
}  // namespace megatron

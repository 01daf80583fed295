// Megatron-Core's routing functions' own outputs (fixtures/moe/router_<config>.safetensors, made
// with moe_utils.py at the reference commit): for every fixture in $MEGATRON_MOE_FIXTURES (default
// <fixtures>/moe), the probs, routing map, tokens per expert, aux/seq-aux/z losses, the gradient of
// sum(probs·W) + the losses with respect to the logits, and the expert-bias update — each shape and
// option read from the file. One line per fixture checked.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "megatron/core/distributed/param_and_grad_buffer.h"
#include "megatron/core/transformer/moe/moe_utils.h"
#include "megatron/core/transformer/mlp.h"
#include "megatron/core/transformer/moe/moe_layer.h"
#include "megatron/core/transformer/transformer_config.h"
#include "megatron/core/transformer/moe/router.h"
#include "megatron/kernels/ops.h"
#include "tests/moe_fixture_util.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

double rel_error(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    diff = std::max(diff, std::fabs(double(got[i]) - double(want[i])));
    scale = std::max(scale, std::fabs(double(want[i])));
  }
  return got.size() == want.size() ? diff / std::max(scale, 1e-30) : INFINITY;
}

class MegatronRouting : public ::testing::TestWithParam<std::string> {};

TEST_P(MegatronRouting, MatchesMegatronsRoutingFunctions) {
  safetensors::File f(testing::moe_fixtures_dir() + "/" + GetParam());
  const moe::RouterConfig c = testing::router_fixture_config(f);
  const int64_t seq = std::stoll(f.metadata().at("seq_length")), mb = std::stoll(f.metadata().at("micro_batch"));
  const Tensor bias = c.expert_bias ? f.read("expert_bias") : Tensor();
  moe::RoutingSaved saved;
  const moe::RoutingOutput r = moe::routing_forward(c, f.read("logits"), bias, seq, mb, saved);

  const std::vector<float> want_probs = f.read("probs").to_floats();
  EXPECT_LE(rel_error(r.probs.to_floats(), want_probs), 1e-5);
  const std::vector<int64_t> map = r.routing_map.to_ints(), want_map = f.read("routing_map").to_ints();
  ASSERT_EQ(map.size(), want_map.size());
  const int64_t e = c.num_experts, t_count = int64_t(map.size()) / e;
  if (c.pad_to_capacity) {
    // Padded slots carry probability 0; which zero-probability tokens fill them is PyTorch's top-k
    // tie-break, not part of the routing: the routed tokens and each expert's count must agree.
    for (int64_t x = 0; x < e; ++x) {
      int64_t n = 0, want_n = 0;
      for (int64_t t = 0; t < t_count; ++t) {
        const size_t i = size_t(t * e + x);
        n += map[i], want_n += want_map[i];
        if (want_probs[i] != 0.0f) EXPECT_EQ(map[i], 1) << "token " << t << " expert " << x;
      }
      EXPECT_EQ(n, want_n) << "expert " << x;
    }
  } else {
    EXPECT_EQ(map, want_map);
  }
  EXPECT_EQ(r.tokens_per_expert.to_floats(), f.read("tokens_per_expert").to_floats());
  const double aux = f.read("aux_loss").item(0), seq_aux = f.read("seq_aux_loss").item(0), z = f.read("z_loss").item(0);
  EXPECT_NEAR(r.aux_loss, aux, 1e-5 * std::fabs(aux) + 1e-12);
  EXPECT_NEAR(r.seq_aux_loss, seq_aux, 1e-5 * std::fabs(seq_aux) + 1e-12);
  EXPECT_NEAR(r.z_loss, z, 1e-5 * std::fabs(z) + 1e-12);

  const Tensor grad = moe::routing_backward(c, f.read("W"), saved, /*aux_loss_scale=*/1.0f);
  const double grad_err = rel_error(grad.to_floats(), f.read("grad_logits").to_floats());
  EXPECT_LE(grad_err, 1e-5);
  if (c.expert_bias) {
    EXPECT_EQ(moe::updated_expert_bias(r.tokens_per_expert, bias, 1e-3f).to_floats(),
              f.read("expert_bias_after_update").to_floats());
  }
  std::printf("router %s: top-%d of %d, %s%s%s%s: probs, map, tokens per expert, aux %.3e, seq-aux %.3e, z %.3e%s; "
              "grad_logits within %.1e of Megatron's\n",
              GetParam().c_str(), c.topk, c.num_experts, c.score_function.c_str(), c.pre_softmax ? ", pre-softmax" : "",
              c.group_topk ? ", group-limited" : "", c.capacity_factor ? (c.pad_to_capacity ? ", capacity, padded" : ", capacity") : "",
              r.aux_loss, r.seq_aux_loss, r.z_loss, c.expert_bias ? ", expert-bias update" : "", grad_err);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MegatronRouting, ::testing::ValuesIn(testing::router_fixtures()),
                         [](const auto& info) {
                           std::string n = info.param.substr(7, info.param.size() - 7 - 12);
                           return n;
                         });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(MegatronRouting);

// routing_backward against central finite differences of L = Σ probs·W + aux + seq_aux + z, for
// each score function and option (random logits: a small step changes no expert choice).
TEST(Routing, GradientsMatchFiniteDifferences) {
  struct Case {
    const char* name;
    moe::RouterConfig c;
  };
  auto base = [] {
    moe::RouterConfig c;
    c.num_experts = 8;
    c.topk = 2;
    c.aux_loss_coeff = 0.3f;
    c.seq_aux_loss_coeff = 0.2f;
    c.z_loss_coeff = 0.1f;
    return c;
  };
  std::vector<Case> cases;
  cases.push_back({"softmax", base()});
  cases.push_back({"pre-softmax", base()});
  cases.back().c.pre_softmax = true;
  cases.push_back({"sigmoid, groups, scaling", base()});
  cases.back().c.score_function = "sigmoid";
  cases.back().c.topk = 4;
  cases.back().c.num_groups = 4;
  cases.back().c.group_topk = 2;
  cases.back().c.topk_scaling_factor = 2.5f;
  cases.push_back({"sigmoid top-1", base()});
  cases.back().c.score_function = "sigmoid";
  cases.back().c.topk = 1;
  cases.push_back({"capacity (position)", base()});
  cases.back().c.capacity_factor = 0.5f;
  cases.back().c.drop_policy = "position";
  const int64_t seq = 6, mb = 2, t_count = seq * mb;
  for (const Case& k : cases) {
    const int64_t e = k.c.num_experts;
    Tensor logits = testing::random_tensor({t_count, e}, 11, 1.0f), w = testing::random_tensor({t_count, e}, 12, 1.0f);
    auto loss = [&](const Tensor& l) {
      moe::RoutingSaved saved;
      moe::RoutingOutput r = moe::routing_forward(k.c, l, Tensor(), seq, mb, saved);
      const std::vector<float> p = r.probs.to_floats(), wv = w.to_floats();
      double sum = r.aux_loss + r.seq_aux_loss + r.z_loss;
      for (size_t i = 0; i < p.size(); ++i) sum += double(p[i]) * wv[i];
      return sum;
    };
    moe::RoutingSaved saved;
    moe::routing_forward(k.c, logits, Tensor(), seq, mb, saved);
    const std::vector<float> grad = moe::routing_backward(k.c, w, saved, 1.0f).to_floats();
    double worst = 0;
    for (int64_t i = 0; i < t_count * e; i += 5) {
      Tensor up = logits.to(DType::Float32), down = logits.to(DType::Float32);
      const float h = 1e-3f;
      up.data<float>()[i] += h;
      down.data<float>()[i] -= h;
      const double numeric = (loss(up) - loss(down)) / (2.0 * h);
      worst = std::max(worst, std::fabs(numeric - grad[size_t(i)]));
      EXPECT_NEAR(grad[size_t(i)], numeric, 2e-3 + 1e-2 * std::fabs(numeric)) << k.name << " logit " << i;
    }
    std::printf("routing %s: finite differences agree, worst |error| %.1e\n", k.name, worst);
  }
}

TEST(Routing, BadOptionsAreClearErrors) {
  moe::RouterConfig c;
  c.num_experts = 8;
  c.topk = 2;
  c.expert_bias = true;
  EXPECT_NE(testing::error_of([&] { c.validate(); }).find("needs --moe-router-score-function sigmoid"),
            std::string::npos);
  c.expert_bias = false;
  c.score_function = "sigmoid";
  c.num_groups = 3;
  c.group_topk = 2;
  EXPECT_NE(testing::error_of([&] { c.validate(); }).find("group-limited routing needs"), std::string::npos);
  c.num_groups = c.group_topk = 0;
  c.topk = 9;
  EXPECT_NE(testing::error_of([&] { c.validate(); }).find("--moe-router-topk 9 must be between 1 and --num-experts 8"),
            std::string::npos);
}

// Note [Permuted order], written out for one map: expert-major, token order within each expert;
// with drop-and-pad, the unrouted tokens after the routed ones up to the capacity.
TEST(Permutation, OrderIsMegatrons) {
  // tokens 0..3, experts 0..2: token 0 -> {0, 2}, token 1 -> {1}, token 2 -> {0, 1}, token 3 -> {2}
  const Tensor map = Tensor::from_ints({1, 0, 1, 0, 1, 0, 1, 1, 0, 0, 0, 1}, {4, 3}, DType::UInt8);
  const moe::Permutation p = moe::make_permutation(map);
  EXPECT_EQ(p.sorted_indices, (std::vector<int64_t>{0, 2, 1, 2, 0, 3}));
  EXPECT_EQ(p.row_expert, (std::vector<int64_t>{0, 0, 1, 1, 2, 2}));
  EXPECT_EQ(p.tokens_per_expert, (std::vector<int64_t>{2, 2, 2}));
  const moe::Permutation padded = moe::make_permutation(map, 3);
  EXPECT_EQ(padded.sorted_indices, (std::vector<int64_t>{0, 2, 1, 1, 2, 0, 0, 3, 1}));
  EXPECT_EQ(padded.tokens_per_expert, (std::vector<int64_t>{3, 3, 3}));
}

// permute then unpermute with the routing probabilities is Σ_e p[t, e] · x[t] (experts as the
// identity); the backward passes agree with finite differences of a weighted sum.
TEST(Permutation, RoundTripAndGradients) {
  const int64_t t_count = 6, e = 4, h = 3;
  moe::RouterConfig c;
  c.num_experts = int(e);
  c.topk = 2;
  moe::RoutingSaved saved;
  const moe::RoutingOutput r = moe::routing_forward(c, testing::random_tensor({t_count, e}, 3), Tensor(), 3, 2, saved);
  const moe::Permutation p = moe::make_permutation(r.routing_map);
  const Tensor x = testing::random_tensor({t_count, h}, 4), w = testing::random_tensor({t_count, h}, 5);
  const Tensor probs = moe::permute_probs(r.probs, p);
  const Tensor y = moe::unpermute_forward(moe::permute_forward(x, p), probs, p);
  const std::vector<float> xv = x.to_floats(), yv = y.to_floats(), pv = r.probs.to_floats();
  for (int64_t t = 0; t < t_count; ++t) {
    double sum = 0;
    for (int64_t k = 0; k < e; ++k) sum += pv[size_t(t * e + k)];
    for (int64_t j = 0; j < h; ++j) EXPECT_NEAR(yv[size_t(t * h + j)], sum * xv[size_t(t * h + j)], 1e-6);
  }
  // L = Σ w ⊙ unpermute(permute(x), probs): gradients of x and of the probs.
  auto loss = [&](const Tensor& xi, const Tensor& pi) {
    Tensor px = moe::permute_forward(xi, p);
    const std::vector<float> v = moe::unpermute_forward(px, moe::permute_probs(pi, p), p).to_floats(), wv = w.to_floats();
    double s = 0;
    for (size_t i = 0; i < v.size(); ++i) s += double(v[i]) * wv[i];
    return s;
  };
  Tensor grad_permuted, grad_probs_perm;
  moe::unpermute_backward(w, moe::permute_forward(x, p), probs, p, grad_permuted, grad_probs_perm);
  const std::vector<float> gx = moe::permute_backward(grad_permuted, p).to_floats();
  const std::vector<float> gp = moe::permute_probs_backward(grad_probs_perm, p, e).to_floats();
  const float eps = 1e-3f;
  for (int64_t i = 0; i < t_count * h; ++i) {
    Tensor up = x.to(DType::Float32), down = x.to(DType::Float32);
    up.data<float>()[i] += eps, down.data<float>()[i] -= eps;
    EXPECT_NEAR(gx[size_t(i)], (loss(up, r.probs) - loss(down, r.probs)) / (2 * eps), 1e-3) << "x " << i;
  }
  for (int64_t i = 0; i < t_count * e; ++i) {
    Tensor up = r.probs.to(DType::Float32), down = r.probs.to(DType::Float32);
    up.data<float>()[i] += eps, down.data<float>()[i] -= eps;
    EXPECT_NEAR(gp[size_t(i)], (loss(x, up) - loss(x, down)) / (2 * eps), 1e-3) << "probs " << i;
  }
}

// TopKRouter: the gating linear and the routing together — gradients of the input and the weight
// by finite differences of L = Σ probs·W + the losses; the tracker gets each loss over its
// coefficient; the expert bias moves by the step's token counts.
TEST(TopKRouter, GradientsTrackerAndExpertBias) {
  moe::RouterConfig c;
  c.num_experts = 8;
  c.topk = 2;
  c.score_function = "sigmoid";
  c.expert_bias = true;
  c.aux_loss_coeff = 0.2f;
  c.z_loss_coeff = 0.1f;
  const int64_t h = 6, seq = 4, mb = 2, t_count = seq * mb;
  ParamAndGradBuffer params(DType::Float32, Device::cpu());
  moe::TopKRouter router(c, h, params, "decoder.layers.1.mlp.router", /*layer_number=*/1, /*num_layers=*/3);
  params.allocate();
  params.init_weights(5, 0.5f, 3, false);
  params.zero_grad();
  EXPECT_EQ(router.weight()->data.shape(), (Shape{8, h}));
  AuxLossTracker tracker;
  router.declare_losses(tracker);
  Context ctx;
  const Tensor x = testing::random_tensor({t_count, h}, 21), w = testing::random_tensor({t_count, 8}, 22);
  moe::TopKRouter::Saved saved;
  moe::TopKRouter::Output out = router.forward(ctx, x, seq, mb, &tracker, saved);
  const Tensor grad_x = router.backward(ctx, w, saved);
  // The tracker: each loss over its coefficient, for layer 1 of 3.
  moe::RoutingSaved rs;
  Tensor logits = Tensor::empty({t_count, 8}, DType::Float32);
  ops::linear_forward(ctx, x, router.weight()->data, Tensor(), logits);
  const moe::RoutingOutput ref = moe::routing_forward(c, logits, router.expert_bias(), seq, mb, rs);
  EXPECT_EQ(out.probs.to_floats(), ref.probs.to_floats());
  std::map<std::string, double> tracked;
  for (const auto& [name, value] : tracker.report(ctx, nullptr, nullptr, 1)) tracked[name] = value;
  EXPECT_NEAR(tracked.at("load_balancing_loss"), ref.aux_loss / 0.2, 1e-6);
  EXPECT_NEAR(tracked.at("z_loss"), ref.z_loss / 0.1, 1e-6);
  EXPECT_EQ(tracked.count("seq_load_balancing_loss"), 0u);
  // Finite differences through the gating linear.
  auto loss = [&](const Tensor& xi) {
    moe::TopKRouter::Saved s;
    moe::TopKRouter::Output o = router.forward(ctx, xi, seq, mb, nullptr, s);
    moe::RoutingSaved r2;
    Tensor l2 = Tensor::empty({t_count, 8}, DType::Float32);
    ops::linear_forward(ctx, xi, router.weight()->data, Tensor(), l2);
    const moe::RoutingOutput r = moe::routing_forward(c, l2, router.expert_bias(), seq, mb, r2);
    const std::vector<float> p = o.probs.to_floats(), wv = w.to_floats();
    double sum = r.aux_loss + r.z_loss;
    for (size_t i = 0; i < p.size(); ++i) sum += double(p[i]) * wv[i];
    return sum;
  };
  const std::vector<float> gx = grad_x.to_floats(), gw = router.weight()->main_grad.to_floats();
  const float eps = 1e-3f;
  for (int64_t i = 0; i < t_count * h; i += 3) {
    Tensor up = x.to(DType::Float32), down = x.to(DType::Float32);
    up.data<float>()[i] += eps, down.data<float>()[i] -= eps;
    EXPECT_NEAR(gx[size_t(i)], (loss(up) - loss(down)) / (2 * eps), 2e-3) << "x " << i;
  }
  Parameter* weight = params.find("decoder.layers.1.mlp.router.weight");
  for (int64_t i = 0; i < 8 * h; i += 5) {
    float* v = weight->data.data<float>() + i;
    const float saved_v = *v;
    *v = saved_v + eps;
    const double up = loss(x);
    *v = saved_v - eps;
    const double down = loss(x);
    *v = saved_v;
    EXPECT_NEAR(gw[size_t(i)], (up - down) / (2 * eps), 2e-3) << "weight " << i;
  }
  // The expert bias: every forward above counted its tokens; the update uses the counts of the step.
  router.update_expert_bias(ctx, 1e-3f);
  const std::vector<float> b = router.expert_bias().to_floats();
  for (float v : b) EXPECT_TRUE(v == 1e-3f || v == -1e-3f || v == 0.0f) << v;
  EXPECT_NE(b, std::vector<float>(8, 0.0f)) << "an uneven count moves the bias";
}

// MoELayer (SequentialMLP experts, one process): y[t] = Σ over t's experts of probs[t, e] ·
// expert_e(x[t]), checked against each expert run on every token; and its gradients (input, an
// expert's weights, the router's weight) against finite differences of Σ y·W + the router's losses.
void check_moe_layer(bool swiglu, bool bias) {
  TransformerConfig tc;
  tc.num_layers = 2;
  tc.hidden_size = 8;
  tc.num_attention_heads = 2;
  tc.vocab_size = 16;
  tc.activation = swiglu ? "swiglu" : "gelu";
  tc.add_bias_linear = bias;
  tc.max_position_embeddings = 8;
  tc.finalize();
  moe::RouterConfig rc;
  rc.num_experts = 4;
  rc.topk = 2;
  rc.aux_loss_coeff = 0.1f;
  const int64_t seq = 4, mb = 2, t_count = seq * mb, h = 8;
  ParamAndGradBuffer params(DType::Float32, Device::cpu());
  moe::MoEConfig mc;
  mc.router = rc;
  mc.ffn_hidden_size = 6;
  moe::MoELayer layer(tc, mc, params, "decoder.layers.0.mlp", 0);
  params.allocate();
  params.init_weights(7, 0.5f, 2, false);
  for (Parameter* q : params.parameters()) {  // biases start at zero: give them values the check can see
    if (q->name.ends_with(".bias")) q->data.copy_from(testing::random_tensor(q->data.shape(), 40));
  }
  params.zero_grad();
  ASSERT_NE(params.find("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"), nullptr);
  EXPECT_EQ(params.find("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight")->data.shape(),
            (Shape{swiglu ? 12 : 6, h}));
  Context ctx;
  const Tensor x = testing::random_tensor({t_count, h}, 31), w = testing::random_tensor({t_count, h}, 32);
  moe::MoELayer::Saved saved;
  const std::vector<float> y = layer.forward(ctx, x, seq, mb, nullptr, saved).to_floats();
  // Outside check: every expert on every token, mixed by the router's probabilities.
  moe::TopKRouter::Saved rs;
  const std::vector<float> probs = layer.router().forward(ctx, x, seq, mb, nullptr, rs).probs.to_floats();
  std::vector<double> want(size_t(t_count * h), 0.0);
  for (int e = 0; e < 4; ++e) {
    MLP::Saved ms;
    MlpSpec spec;
    spec.ffn_hidden_size = 6;
    // The layer's expert e, rebuilt over the same parameters (same names, same values).
    ParamAndGradBuffer copy(DType::Float32, Device::cpu());
    MLP expert(tc, spec, copy, "decoder.layers.0.mlp.experts.local_experts." + std::to_string(e));
    copy.allocate();
    for (Parameter* q : copy.parameters()) q->data.copy_from(params.find(q->name)->data);
    const std::vector<float> out = expert.forward(ctx, x, ms).to_floats();
    for (int64_t t = 0; t < t_count; ++t)
      for (int64_t j = 0; j < h; ++j) want[size_t(t * h + j)] += double(probs[size_t(t * 4 + e)]) * out[size_t(t * h + j)];
  }
  for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(y[i], want[i], 1e-5) << i;

  const Tensor grad_x = layer.backward(ctx, w, saved);
  auto loss = [&](const Tensor& xi) {
    moe::MoELayer::Saved s;
    const std::vector<float> yi = layer.forward(ctx, xi, seq, mb, nullptr, s).to_floats(), wv = w.to_floats();
    double sum = 0;
    for (size_t i = 0; i < yi.size(); ++i) sum += double(yi[i]) * wv[i];
    moe::RoutingSaved r;
    Tensor l = Tensor::empty({t_count, 4}, DType::Float32);
    ops::linear_forward(ctx, xi, layer.router().weight()->data, Tensor(), l);
    return sum + moe::routing_forward(rc, l, Tensor(), seq, mb, r).aux_loss;
  };
  const float eps = 1e-3f;
  const std::vector<float> gx = grad_x.to_floats();
  for (int64_t i = 0; i < t_count * h; i += 3) {
    Tensor up = x.to(DType::Float32), down = x.to(DType::Float32);
    up.data<float>()[i] += eps, down.data<float>()[i] -= eps;
    EXPECT_NEAR(gx[size_t(i)], (loss(up) - loss(down)) / (2 * eps), 2e-3) << "x " << i;
  }
  int checked = 0;
  for (const char* name : {"decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight",
                           "decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight",
                           "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.bias",
                           "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.bias",
                           "decoder.layers.0.mlp.router.weight"}) {
    Parameter* p = params.find(name);
    if (!p) {
      EXPECT_FALSE(bias) << name;
      continue;
    }
    const std::vector<float> g = p->main_grad.to_floats();
    for (int64_t i = 0; i < p->data.numel(); i += 7) {
      float* v = p->data.data<float>() + i;
      const float keep = *v;
      *v = keep + eps;
      const double up = loss(x);
      *v = keep - eps;
      const double down = loss(x);
      *v = keep;
      EXPECT_NEAR(g[size_t(i)], (up - down) / (2 * eps), 2e-3) << name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_GT(checked, 20);
}

TEST(MoELayer, MixesTheExpertsByTheirProbabilitiesWithExactGradients) {
  check_moe_layer(/*swiglu=*/true, /*bias=*/false);
}
// GeLU experts with biases: fc2's bias is applied with the routing probability (Megatron's _apply_bias).
TEST(MoELayer, GeluExpertsWithBiases) { check_moe_layer(/*swiglu=*/false, /*bias=*/true); }

TEST(MegatronRouting, FixturesAreFound) {
  EXPECT_FALSE(testing::router_fixtures().empty()) << "no router_*.safetensors in " << testing::moe_fixtures_dir()
                                          << ": set MEGATRON_MOE_FIXTURES";
}

}  // namespace
}  // namespace megatron

namespace megatron {
namespace {
// Note [Sinkhorn routing]: with logits that all prefer expert 0, training's Sinkhorn-balanced choice
// spreads the tokens evenly over the experts while evaluation's plain top-k sends them all to
// expert 0; the probabilities are sigmoid (top-1) or the softmax over all experts (top-2) on the
// chosen experts; the gradient agrees with finite differences.
TEST(SinkhornRouting, BalancesTrainingChoicesWithExactGradients) {
  for (int topk : {1, 2}) {
    SCOPED_TRACE("top-" + std::to_string(topk));
    moe::RouterConfig c;
    c.num_experts = 4;
    c.topk = topk;
    c.sinkhorn = true;
    c.z_loss_coeff = 0.1f;
    const int64_t seq = 8, mb = 2, t_count = seq * mb, e = 4;
    std::vector<float> l = testing::random_tensor({t_count, e}, 51).to_floats();
    for (int64_t t = 0; t < t_count; ++t) l[size_t(t * e)] += 6.0f;  // every token prefers expert 0
    const Tensor logits = Tensor::from_floats(l, {t_count, e});
    moe::RoutingSaved saved, eval_saved;
    const moe::RoutingOutput r = moe::routing_forward(c, logits, Tensor(), seq, mb, saved);
    const moe::RoutingOutput ev = moe::routing_forward(c, logits, Tensor(), seq, mb, eval_saved, nullptr, false);
    const std::vector<float> n = r.tokens_per_expert.to_floats(), n_eval = ev.tokens_per_expert.to_floats();
    for (int64_t x = 0; x < e; ++x) {
      const double mean = double(t_count * topk) / e;  // balanced in training (up to the top-k's rounding)
      EXPECT_GE(n[size_t(x)], 0.5 * mean) << "expert " << x;
      EXPECT_LE(n[size_t(x)], 1.5 * mean) << "expert " << x;
    }
    EXPECT_EQ(n_eval[0], float(t_count)) << "evaluation's top-k: every token has expert 0";
    const std::vector<float> p = r.probs.to_floats();
    const std::vector<int64_t> map = r.routing_map.to_ints();
    for (int64_t t = 0; t < t_count; ++t) {
      double sum = 0, m = -1e30;
      for (int64_t x = 0; x < e; ++x) m = std::max(m, double(l[size_t(t * e + x)]));
      for (int64_t x = 0; x < e; ++x) sum += std::exp(double(l[size_t(t * e + x)]) - m);
      for (int64_t x = 0; x < e; ++x) {
        const double lx = l[size_t(t * e + x)];
        const double want = !map[size_t(t * e + x)] ? 0.0 : topk == 1 ? 1.0 / (1.0 + std::exp(-lx)) : std::exp(lx - m) / sum;
        EXPECT_NEAR(p[size_t(t * e + x)], want, 1e-6) << t << "," << x;
      }
    }
    const Tensor w = testing::random_tensor({t_count, e}, 52);
    const std::vector<float> grad = moe::routing_backward(c, w, saved, 1.0f).to_floats(), wv = w.to_floats();
    auto loss = [&](std::vector<float> li) {  // the routing fixed (finite differences do not move the choice)
      moe::RoutingSaved s;
      const moe::RoutingOutput o = moe::routing_forward(c, Tensor::from_floats(li, {t_count, e}), Tensor(), seq, mb, s);
      EXPECT_EQ(o.routing_map.to_ints(), map);
      const std::vector<float> pi = o.probs.to_floats();
      double sum = o.z_loss;
      for (size_t i = 0; i < pi.size(); ++i) sum += double(pi[i]) * wv[i];
      return sum;
    };
    const float eps = 1e-3f;
    for (int64_t i = 0; i < t_count * e; i += 3) {
      std::vector<float> up = l, down = l;
      up[size_t(i)] += eps, down[size_t(i)] -= eps;
      EXPECT_NEAR(grad[size_t(i)], (loss(up) - loss(down)) / (2 * eps), 2e-3) << i;
    }
  }
  moe::RouterConfig bad;
  bad.num_experts = 4;
  bad.sinkhorn = true;
  bad.aux_loss_coeff = 0.01f;
  EXPECT_THROW(bad.validate(), Error);
}
}  // namespace
}  // namespace megatron

namespace megatron {
namespace {

// One router on one rank with its weight drawn, and a twin of another configuration with the same weight.
struct RouterRig {
  ParamAndGradBuffer params{DType::Float32, Device::cpu()};
  std::unique_ptr<moe::TopKRouter> router;
  RouterRig(const moe::RouterConfig& c, int64_t h, const RouterRig* same_weight = nullptr) {
    router = std::make_unique<moe::TopKRouter>(c, h, params, "decoder.layers.0.mlp.router", 0, 2);
    params.allocate();
    params.init_weights(5, 0.5f, 2, false);
    params.zero_grad();
    if (same_weight) weight().data.copy_from(same_weight->router->weight()->data);
  }
  Parameter& weight() { return *params.find("decoder.layers.0.mlp.router.weight"); }
  Tensor logits(Context& ctx, const Tensor& x) const {
    Tensor l = Tensor::empty({x.size(0), router->weight()->data.size(0)}, DType::Float32);
    ops::linear_forward(ctx, x, router->weight()->data, Tensor(), l);
    return l;
  }
};

std::map<std::string, double> reported(Context& ctx, AuxLossTracker& tracker, int microbatches) {
  std::map<std::string, double> out;
  for (const auto& [name, value] : tracker.report(ctx, nullptr, nullptr, microbatches)) out[name] = value;
  return out;
}

// Note [Global aux loss]: each tracked forward adds its aux map's counts to the step's buffer and its
// loss uses the buffer's mean over the forwards so far; a recomputed forward reuses its first pass's
// counts; evaluation has none; the step's end restarts the buffer. Composed with aux_loss.
TEST(TopKRouter, GlobalAuxLossCountsTheStepsMicrobatches) {
  moe::RouterConfig c;
  c.num_experts = 8;
  c.topk = 2;
  c.aux_loss_coeff = 0.1f;
  c.global_aux_loss_coeff = 0.3f;
  const int64_t h = 6, seq = 5, mb = 2, t = seq * mb;
  RouterRig rig(c, h);
  moe::TopKRouter& router = *rig.router;
  AuxLossTracker tracker;
  router.declare_losses(tracker);
  Context ctx;
  const Tensor xa = testing::random_tensor({t, h}, 61), xb = testing::random_tensor({t, h}, 62);
  const Tensor w = testing::random_tensor({t, 8}, 63);
  // The oracle: moe_utils.cpp's routing with the counts it is handed replaced by the step's mean.
  std::vector<float> counts_a, counts_b;
  auto oracle = [&](const Tensor& x, std::vector<float>* counts, const std::vector<float>* use, moe::RoutingSaved& s) {
    moe::CountReduction red;
    red.global_average = [&](std::vector<float> v) {
      *counts = v;
      return use ? *use : v;
    };
    return moe::routing_forward(c, rig.logits(ctx, x), Tensor(), seq, mb, s, &red);
  };
  moe::RoutingSaved sa, sb;
  const moe::RoutingOutput ra = oracle(xa, &counts_a, nullptr, sa);
  moe::RoutingSaved probe;
  oracle(xb, &counts_b, nullptr, probe);
  std::vector<float> mean(8);
  for (int x = 0; x < 8; ++x) mean[size_t(x)] = (counts_a[size_t(x)] + counts_b[size_t(x)]) / 2;
  const moe::RoutingOutput rb = oracle(xb, &counts_b, &mean, sb);
  ASSERT_NE(counts_a, counts_b) << "two microbatches with different counts";

  moe::TopKRouter::Saved a, b;
  router.forward(ctx, xa, seq, mb, &tracker, a, true, /*rng_base=*/10);
  router.forward(ctx, xb, seq, mb, &tracker, b, true, /*rng_base=*/20);
  ASSERT_TRUE(a.global_on && b.global_on);
  EXPECT_EQ(a.global_tokens.to_floats(), counts_a);
  EXPECT_EQ(b.global_tokens.to_floats(), mean);
  const std::map<std::string, double> step = reported(ctx, tracker, 2);
  EXPECT_NEAR(step.at("global_load_balancing_loss"), (ra.global_aux_loss + rb.global_aux_loss) / 0.3 / 2, 1e-6);
  EXPECT_NEAR(step.at("load_balancing_loss"), (ra.aux_loss + rb.aux_loss) / 0.1 / 2, 1e-6);

  // The gradient of microbatch b's forward is the oracle's with the step's mean counts.
  const Tensor gx = router.backward(ctx, w, b);
  const Tensor g_logits = moe::routing_backward(c, w, sb, 1.0f);
  Tensor want = Tensor::empty({t, h}, DType::Float32), no_bias;
  Tensor wgrad = Tensor::zeros({8, h}, DType::Float32);
  ops::linear_backward(ctx, g_logits, xb, router.weight()->data, want, wgrad, no_bias);
  EXPECT_LE(rel_error(gx.to_floats(), want.to_floats()), 1e-6);
  // Recomputing b (no tracker) reuses b's counts, not the buffer's state now.
  moe::TopKRouter::Saved b2;
  router.forward(ctx, xb, seq, mb, nullptr, b2, true, 20);
  ASSERT_TRUE(b2.global_on);
  EXPECT_EQ(b2.global_tokens.to_floats(), mean);
  EXPECT_EQ(router.backward(ctx, w, b2).to_floats(), gx.to_floats());
  // Evaluation and an untracked forward of no step: no global loss.
  moe::TopKRouter::Saved ev, untracked;
  router.forward(ctx, xa, seq, mb, nullptr, ev, false, 10);
  router.forward(ctx, xa, seq, mb, nullptr, untracked, true, 30);
  EXPECT_FALSE(ev.global_on);
  EXPECT_FALSE(untracked.global_on);
  // The next step starts over: microbatch a alone again.
  router.reset_global_aux_loss_tracker(ctx);
  moe::TopKRouter::Saved a2;
  router.forward(ctx, xa, seq, mb, &tracker, a2, true, 10);
  EXPECT_EQ(a2.global_tokens.to_floats(), counts_a);
  EXPECT_NEAR(reported(ctx, tracker, 1).at("global_load_balancing_loss"), ra.global_aux_loss / 0.3, 1e-6);
}

// Note [Router input jitter]: training multiplies the router input by U(1 - eps, 1 + eps) drawn from
// the layer's stream, evaluation does not; eps 0 is the plain router; the gradients agree with
// finite differences of the jittered routing.
TEST(TopKRouter, InputJitterInTrainingOnlyWithExactGradients) {
  moe::RouterConfig plain;
  plain.num_experts = 4;
  plain.topk = 2;
  plain.aux_loss_coeff = 0.1f;
  moe::RouterConfig c = plain;
  c.input_jitter_eps = 0.2f;
  const int64_t h = 5, seq = 3, mb = 2, t = seq * mb;
  RouterRig rig(c, h), twin(plain, h, &rig);
  Context ctx;
  const Tensor x = testing::random_tensor({t, h}, 71), w = testing::random_tensor({t, 4}, 72);
  moe::TopKRouter::Saved s_eval, s_plain, s_train, s_again, s_other;
  const Tensor p_eval = rig.router->forward(ctx, x, seq, mb, nullptr, s_eval, /*training=*/false, 5).probs;
  const Tensor p_plain = twin.router->forward(ctx, x, seq, mb, nullptr, s_plain, true, 5).probs;
  EXPECT_EQ(p_eval.to_floats(), p_plain.to_floats()) << "no jitter in evaluation";
  EXPECT_FALSE(s_eval.jitter);
  const Tensor p_train = rig.router->forward(ctx, x, seq, mb, nullptr, s_train, true, 5).probs;
  const uint64_t stream = moe::TopKRouter::kJitterStream + 5;
  const Tensor xj = moe::input_jitter(x, 0.2f, ctx.rng().seed, stream, mb, 0);
  moe::RoutingSaved rs;
  EXPECT_EQ(p_train.to_floats(), moe::routing_forward(plain, rig.logits(ctx, xj), Tensor(), seq, mb, rs).probs.to_floats());
  EXPECT_NE(p_train.to_floats(), p_plain.to_floats());
  EXPECT_EQ(rig.router->forward(ctx, x, seq, mb, nullptr, s_again, true, 5).probs.to_floats(), p_train.to_floats())
      << "the same stream replays (recomputation)";
  EXPECT_NE(rig.router->forward(ctx, x, seq, mb, nullptr, s_other, true, 6).probs.to_floats(), p_train.to_floats());
  // eps 0: the jitter-free router exactly.
  moe::RouterConfig zero = plain;
  zero.input_jitter_eps = 0.0f;
  RouterRig z(zero, h, &rig);
  moe::TopKRouter::Saved s_zero;
  EXPECT_EQ(z.router->forward(ctx, x, seq, mb, nullptr, s_zero, true, 5).probs.to_floats(), p_plain.to_floats());
  // Finite differences of L = Σ probs·w + aux over the jittered routing.
  rig.params.zero_grad();
  const std::vector<float> gx = rig.router->backward(ctx, w, s_train).to_floats();
  auto loss = [&](const Tensor& xi) {
    moe::TopKRouter::Saved s;
    const std::vector<float> p = rig.router->forward(ctx, xi, seq, mb, nullptr, s, true, 5).probs.to_floats();
    moe::RoutingSaved r2;
    const moe::RoutingOutput r = moe::routing_forward(
        plain, rig.logits(ctx, moe::input_jitter(xi, 0.2f, ctx.rng().seed, stream, mb, 0)), Tensor(), seq, mb, r2);
    double sum = r.aux_loss;
    const std::vector<float> wv = w.to_floats();
    for (size_t i = 0; i < p.size(); ++i) sum += double(p[i]) * wv[i];
    return sum;
  };
  const float eps = 1e-3f;
  for (int64_t i = 0; i < t * h; ++i) {
    Tensor up = x.clone(), down = x.clone();
    up.data<float>()[i] += eps, down.data<float>()[i] -= eps;
    EXPECT_NEAR(gx[size_t(i)], (loss(up) - loss(down)) / (2 * eps), 2e-3) << "x " << i;
  }
  const std::vector<float> gw = rig.weight().main_grad.to_floats();
  for (int64_t i = 0; i < 4 * h; i += 3) {
    float* v = rig.weight().data.data<float>() + i;
    const float keep = *v;
    *v = keep + eps;
    const double up = loss(x);
    *v = keep - eps;
    const double down = loss(x);
    *v = keep;
    EXPECT_NEAR(gw[size_t(i)], (up - down) / (2 * eps), 2e-3) << "weight " << i;
  }
  moe::RouterConfig bad = plain;
  bad.input_jitter_eps = 1.5f;
  EXPECT_THROW(bad.validate(), Error);
}

// Note [fp64 router]: the fp64 router agrees closely with the fp32 one, equals moe_utils.cpp's routing
// of logits computed in double here, and its gradients agree with fp64 finite differences to a
// tolerance fp32 could not reach.
TEST(TopKRouter, Fp64RouterMatchesTheOracleInDouble) {
  for (const char* score : {"softmax", "sigmoid"}) {
    SCOPED_TRACE(score);
    moe::RouterConfig c32;
    c32.num_experts = 8;
    c32.topk = 2;
    c32.score_function = score;
    c32.aux_loss_coeff = 0.1f;
    c32.global_aux_loss_coeff = 0.05f;
    c32.z_loss_coeff = 0.05f;
    moe::RouterConfig c64 = c32;
    c64.fp64 = true;
    const int64_t h = 6, seq = 4, mb = 2, t = seq * mb, e = 8;
    RouterRig r64(c64, h), r32(c32, h, &r64);
    AuxLossTracker tr64, tr32;
    r64.router->declare_losses(tr64);
    r32.router->declare_losses(tr32);
    Context ctx;
    const Tensor x = testing::random_tensor({t, h}, 81), w = testing::random_tensor({t, e}, 82);
    moe::TopKRouter::Saved s64, s32;
    const Tensor p64 = r64.router->forward(ctx, x, seq, mb, &tr64, s64, true, 1).probs;
    const Tensor p32 = r32.router->forward(ctx, x, seq, mb, &tr32, s32, true, 1).probs;
    EXPECT_EQ(r64.router->forward(ctx, x, seq, mb, nullptr, s64, true, 1).routing_map.to_ints(),
              r32.router->forward(ctx, x, seq, mb, nullptr, s32, true, 1).routing_map.to_ints());
    EXPECT_LE(rel_error(p64.to_floats(), p32.to_floats()), 1e-6);
    const std::map<std::string, double> l64 = reported(ctx, tr64, 1), l32 = reported(ctx, tr32, 1);
    for (const char* name : {"load_balancing_loss", "global_load_balancing_loss", "z_loss"}) {
      EXPECT_NEAR(l64.at(name), l32.at(name), 1e-6 * std::fabs(l32.at(name))) << name;
    }
    // Logits in double, here: x · Wᵀ over the fp32 values.
    const std::vector<float> xv = x.to_floats(), wv = r64.router->weight()->data.to_floats();
    auto logits64 = [&](const std::vector<double>& xd, const std::vector<double>& wd) {
      std::vector<double> l(size_t(t * e), 0.0);
      for (int64_t i = 0; i < t; ++i)
        for (int64_t k = 0; k < e; ++k)
          for (int64_t j = 0; j < h; ++j) l[size_t(i * e + k)] += xd[size_t(i * h + j)] * wd[size_t(k * h + j)];
      return l;
    };
    const std::vector<double> xd(xv.begin(), xv.end()), wd(wv.begin(), wv.end());
    moe::RoutingSaved rs;
    const moe::RoutingOutput want = moe::routing_forward_fp64(c64, logits64(xd, wd), Tensor(), seq, mb, rs);
    EXPECT_EQ(p64.to_floats(), want.probs.to_floats());
    if (std::string(score) == "softmax") {  // by hand: the softmax of each token's two chosen logits, in double
      const std::vector<double> l = logits64(xd, wd);
      const std::vector<float> pv = p64.to_floats();
      for (int64_t i = 0; i < t; ++i) {
        std::vector<int> idx(8);
        std::iota(idx.begin(), idx.end(), 0);
        std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return l[size_t(i * e + a)] > l[size_t(i * e + b)]; });
        const double a = l[size_t(i * e + idx[0])], b = l[size_t(i * e + idx[1])];
        EXPECT_EQ(pv[size_t(i * e + idx[0])], float(1.0 / (1.0 + std::exp(b - a))));
      }
    }
    // Gradients: fp64 finite differences of L = Σ probs·w + the losses, in x and in W; the fp32
    // router's gradient (its forward's counts are the same) is further from them.
    r64.params.zero_grad();
    r32.params.zero_grad();
    const std::vector<float> gx = r64.router->backward(ctx, w, s64).to_floats();
    const std::vector<float> gx32 = r32.router->backward(ctx, w, s32).to_floats();
    const std::vector<float> gw = r64.weight().main_grad.to_floats(), wg = w.to_floats();
    auto loss = [&](const std::vector<double>& xi, const std::vector<double>& wi) {
      moe::RoutingSaved s;
      moe::CountReduction red;  // the forward's counts (its global aux loss saw them), fixed
      const std::vector<float> fixed = s64.global_tokens.to_floats();
      red.global_average = [&](std::vector<float>) { return fixed; };
      const std::vector<double> li = logits64(xi, wi);
      const moe::RoutingOutput o = moe::routing_forward_fp64(c64, li, Tensor(), seq, mb, s, &red);
      // probs in double: the routing's own fp64 values, before their rounding to fp32
      std::vector<double> p(size_t(t * e), 0.0);
      for (int64_t i = 0; i < t; ++i) {
        const int64_t a = s.top[size_t(i * 2)], b = s.top[size_t(i * 2 + 1)];
        const double la = li[size_t(i * e + a)], lb = li[size_t(i * e + b)];
        if (std::string(score) == "softmax") {
          p[size_t(i * e + a)] = 1.0 / (1.0 + std::exp(lb - la));
          p[size_t(i * e + b)] = 1.0 / (1.0 + std::exp(la - lb));
        } else {
          const double sa = 1.0 / (1.0 + std::exp(-la)), sb = 1.0 / (1.0 + std::exp(-lb));
          p[size_t(i * e + a)] = sa / (sa + sb + 1e-20);
          p[size_t(i * e + b)] = sb / (sa + sb + 1e-20);
        }
      }
      double sum = o.aux_loss + o.global_aux_loss + o.z_loss;
      for (size_t i = 0; i < p.size(); ++i) sum += p[i] * wg[i];
      return sum;
    };
    const double eps = 1e-5;
    double worst64 = 0, worst32 = 0;
    for (int64_t i = 0; i < t * h; i += 2) {
      std::vector<double> up = xd, down = xd;
      up[size_t(i)] += eps, down[size_t(i)] -= eps;
      const double fd = (loss(up, wd) - loss(down, wd)) / (2 * eps);
      EXPECT_NEAR(gx[size_t(i)], fd, 1e-6) << "x " << i;
      worst64 = std::max(worst64, std::fabs(gx[size_t(i)] - fd));
      worst32 = std::max(worst32, std::fabs(gx32[size_t(i)] - fd));
    }
    std::printf("fp64 router (%s): grad_x within %.1e of fp64 finite differences (the fp32 router: %.1e)\n", score,
                worst64, worst32);
    EXPECT_LE(worst64, worst32);
    for (int64_t i = 0; i < e * h; i += 3) {
      std::vector<double> up = wd, down = wd;
      up[size_t(i)] += eps, down[size_t(i)] -= eps;
      EXPECT_NEAR(gw[size_t(i)], (loss(xd, up) - loss(xd, down)) / (2 * eps), 1e-6) << "weight " << i;
    }
  }
}

}  // namespace
}  // namespace megatron

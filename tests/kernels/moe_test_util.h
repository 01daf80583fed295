// Shared by the MoE op tests (tests/kernels/moe_test.cpp on the CPU, tests/gpu/moe_test.cpp CUDA vs
// CPU): the routing configurations and a call of the routing ops with every output allocated.
#pragma once

#include <string>
#include <vector>

#include "megatron/core/transformer/moe/moe_ops.h"
#include "megatron/kernels/ops.h"

namespace megatron::testing {

struct RoutingRun {
  Tensor probs, routing_map, topk_indices, aux_scores, aux_map, tokens_per_expert, losses;
};

inline RoutingRun run_routing(Context& ctx, const MoeRoutingParams& p, const Tensor& logits, const Tensor& bias) {
  const int64_t t = logits.size(0), e = p.num_experts;
  const Device d = ctx.device();
  RoutingRun r;
  r.probs = Tensor::empty({t, e}, DType::Float32, d);
  r.routing_map = Tensor::empty({t, e}, DType::UInt8, d);
  r.topk_indices = Tensor::empty({t, p.topk}, DType::Int32, d);
  if (p.aux_on()) {
    r.aux_scores = Tensor::empty({t, e}, DType::Float32, d);
    r.aux_map = Tensor::empty({t, e}, DType::UInt8, d);
  }
  r.tokens_per_expert = Tensor::empty({e}, DType::Float32, d);
  r.losses = Tensor::empty({3}, DType::Float32, d);
  ops::moe_routing_forward(ctx, logits.to(d), bias.defined() ? bias.to(d) : Tensor(), p, r.probs, r.routing_map,
                           r.topk_indices, r.aux_scores, r.aux_map, r.tokens_per_expert, r.losses);
  return r;
}

inline Tensor run_routing_backward(Context& ctx, const MoeRoutingParams& p, const RoutingRun& r, const Tensor& logits,
                                   const Tensor& grad_probs, float aux_loss_scale) {
  Tensor g = Tensor::empty(logits.shape(), DType::Float32, ctx.device());
  ops::moe_routing_backward(ctx, grad_probs.to(ctx.device()), logits.to(ctx.device()), r.topk_indices, r.routing_map,
                            r.aux_scores, r.aux_map, p, aux_loss_scale, g);
  return g;
}

struct RoutingCase {
  std::string name;
  moe::RouterConfig config;
  int64_t seq = 6, mb = 2;
  bool bias = false;
};

// Every routing option the ops have, on small random problems (the fixtures add Megatron's own).
inline std::vector<RoutingCase> routing_cases() {
  auto base = [](int e, int k) {
    moe::RouterConfig c;
    c.num_experts = e;
    c.topk = k;
    c.aux_loss_coeff = 0.3f;
    c.seq_aux_loss_coeff = 0.2f;
    c.z_loss_coeff = 0.1f;
    return c;
  };
  std::vector<RoutingCase> cases;
  cases.push_back({"softmax", base(8, 2), 13, 3});
  cases.push_back({"softmax_nolosses", base(16, 4), 40, 2});
  cases.back().config.aux_loss_coeff = cases.back().config.seq_aux_loss_coeff = cases.back().config.z_loss_coeff = 0;
  cases.push_back({"presoftmax", base(8, 2), 9, 4});
  cases.back().config.pre_softmax = true;
  cases.push_back({"sigmoid_groups_scaling_bias", base(64, 6), 33, 2, true});
  cases.back().config.score_function = "sigmoid";
  cases.back().config.num_groups = 8;
  cases.back().config.group_topk = 3;
  cases.back().config.topk_scaling_factor = 2.5f;
  cases.back().config.expert_bias = true;
  cases.push_back({"sigmoid_top1", base(8, 1), 10, 1});
  cases.back().config.score_function = "sigmoid";
  cases.push_back({"softmax_groups_fine", base(64, 8), 70, 3});
  cases.back().config.num_groups = 8;
  cases.back().config.group_topk = 4;
  return cases;
}

}  // namespace megatron::testing

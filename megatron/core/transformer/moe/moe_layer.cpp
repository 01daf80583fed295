#include "megatron/core/transformer/moe/moe_layer.h"

#include <fmt/format.h>

#include <optional>

#include "megatron/kernels/ops.h"

namespace megatron::moe {

MoEConfig moe_config(const TransformerConfig& c) {
  MG_CHECK(c.is_moe(), "an MoE layer needs --num-experts");
  MoEConfig m;
  RouterConfig& r = m.router;
  r.num_experts = c.num_moe_experts;
  r.topk = c.moe_router_topk;
  r.score_function = c.moe_router_score_function;
  r.pre_softmax = c.moe_router_pre_softmax;
  r.num_groups = c.moe_router_num_groups;
  r.group_topk = c.moe_router_group_topk;
  r.group_score_topk = c.moe_router_group_score_topk;
  r.topk_scaling_factor = c.moe_router_topk_scaling_factor;
  r.z_loss_coeff = c.moe_z_loss_coeff;
  if (c.moe_expert_capacity_factor > 0) r.capacity_factor = c.moe_expert_capacity_factor;
  r.drop_policy = c.moe_token_drop_policy;
  r.pad_to_capacity = c.moe_pad_expert_input_to_capacity;
  r.expert_bias = c.moe_router_enable_expert_bias;
  r.linear_bias = c.add_bias_linear;
  for (size_t i = 0; i < c.moe_router_load_balancing_type.size(); ++i) {
    const std::string& type = c.moe_router_load_balancing_type[i];
    const float coeff = i < c.moe_aux_loss_coeff.size() ? c.moe_aux_loss_coeff[i] : 0.0f;
    if (type == "aux_loss") {
      r.aux_loss_coeff = coeff;
    } else if (type == "seq_aux_loss") {
      r.seq_aux_loss_coeff = coeff;
    } else if (type == "global_aux_loss") {  // Note [Global aux loss] (router.h)
      r.global_aux_loss_coeff = coeff;
    } else if (type == "sinkhorn") {
      r.sinkhorn = true;
      MG_CHECK(coeff == 0.0f, "sinkhorn routing takes no aux loss (as Megatron): --moe-aux-loss-coeff must be 0 for it");
    } else {
      MG_CHECK(type == "none",
               "--moe-router-load-balancing-type {} is unknown: use aux_loss, seq_aux_loss, global_aux_loss, sinkhorn "
               "or none",
               type);
    }
  }
  r.input_jitter_eps = c.moe_input_jitter_eps;  // Note [Router input jitter] (router.h)
  MG_CHECK(c.moe_router_dtype == "fp32" || c.moe_router_dtype == "fp64",
           "--moe-router-dtype must be fp32 or fp64 (got '{}')", c.moe_router_dtype);
  r.fp64 = c.moe_router_dtype == "fp64";  // Note [fp64 router] (moe_utils.h)
  m.shared_expert_intermediate_size = c.moe_shared_expert_intermediate_size;
  m.shared_expert_gate = c.moe_shared_expert_gate;
  m.shared_expert_overlap = c.moe_shared_expert_overlap;
  MG_CHECK(!c.moe_shared_expert_overlap || c.moe_token_dispatcher_type == "alltoall" ||
               c.moe_token_dispatcher_type == "flex",
           "--moe-shared-expert-overlap works with --moe-token-dispatcher-type alltoall or flex (as in Megatron)");
  m.ffn_hidden_size = c.moe_ffn_hidden_size > 0 ? c.moe_ffn_hidden_size : c.ffn_hidden_size;
  m.dispatcher = c.moe_token_dispatcher_type;
  m.permute_fusion = c.moe_permute_fusion;
  m.grouped_gemm = c.moe_grouped_gemm;
  m.router_padding = c.moe_router_padding_for_quantization;
  r.validate();
  return m;
}

MoELayer::MoELayer(const TransformerConfig& config, const MoEConfig& moe, ParamAndGradBuffer& params,
                   const std::string& prefix, int layer_number, const ProcessGroupCollection& pg)
    : moe_(moe) {
  moe_.router.validate();
  router_ = std::make_unique<TopKRouter>(moe_.router, config.hidden_size, params, prefix + ".router", layer_number,
                                         config.num_layers, pg);
  DispatcherConfig d;
  d.type = moe.dispatcher;
  d.num_experts = moe_.router.num_experts;
  d.permute_fusion = moe.permute_fusion;  // Note [--moe-permute-fusion] in token_dispatcher.h
  if (moe_.router.pad_to_capacity) {  // drop-and-pad: fixed rows per expert (Note [Dispatch layout])
    d.pad_capacity_factor = moe_.router.capacity_factor;
    d.topk = moe_.router.topk;
  }
  dispatcher_ = make_token_dispatcher(d, pg);
  experts_ = std::make_unique<SequentialMLP>(config, dispatcher_->num_local_experts(),
                                             dispatcher_->first_local_expert(), moe.ffn_hidden_size, params,
                                             prefix + ".experts", pg, moe.grouped_gemm);
  if (moe.shared_expert_intermediate_size > 0) {
    shared_experts_ = std::make_unique<SharedExpertMLP>(config, moe.shared_expert_intermediate_size,
                                                        moe.shared_expert_gate, params, prefix + ".shared_experts", pg);
  } else {
    MG_CHECK(!moe.shared_expert_gate, "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size");
  }
}

void MoELayer::enable_fp8(const Fp8Config& config, Device device, std::vector<Linear*>& dense_linears,
                          std::vector<Linear*>& expert_linears) {
  experts_->enable_fp8(config, device, expert_linears);
  if (shared_experts_) shared_experts_->enable_fp8(config, device, dense_linears);
}

// Note [Shared experts on a side stream] (shared_experts.h): with --moe-shared-expert-overlap the
// shared experts' work is enqueued first, on the side stream, and the routed path's on the main
// stream; the join comes right before their sum. Each stream runs the ops the plain path runs, in
// the same order, on the same inputs, so the sum has the same bits. x, the shared output and the
// saved activations stay referenced across the join (Note [Side stream], rule 2).
Tensor MoELayer::forward(Context& ctx, const Tensor& x, int64_t seq_length, int64_t micro_batch,
                         AuxLossTracker* tracker, Saved& saved, bool training, uint64_t rng_base) const {
  TopKRouter::Output routed =
      router_->forward(ctx, x, seq_length, micro_batch, tracker, saved.router, training, rng_base);
  Tensor shared;  // declared before the side stream: released after its join, even on unwinding
  std::optional<SideStream> side;
  if (overlap_shared()) {
    side.emplace(ctx);
    shared = side->run([&](Context& s) { return shared_experts_->forward(s, x, saved.shared); });
  }
  std::unique_ptr<MoETokenDispatcher::Saved> dispatch_saved;
  // Note [Routing padding for FP8]
  const Tensor routing_map = moe_.router_padding ? pad_routing_map(routed.routing_map, SequentialMLP::kFp8ExpertAlign)
                                                 : routed.routing_map;
  MoETokenDispatcher::Dispatched d = dispatcher_->dispatch(ctx, x, routed.probs, routing_map, dispatch_saved);
  saved.dispatch = std::move(dispatch_saved);
  Tensor expert_out = experts_->forward(ctx, d.tokens, d.probs, d.tokens_per_expert, saved.experts);
  Tensor y = dispatcher_->combine(ctx, expert_out, *saved.dispatch);
  if (side) {
    side->join();
  } else if (shared_experts_) {
    shared = shared_experts_->forward(ctx, x, saved.shared);
  }
  if (shared_experts_) ops::add(ctx, y, shared, y);
  return y;
}

Tensor MoELayer::backward(Context& ctx, const Tensor& grad_out, Saved& saved, float aux_loss_scale) const {
  Tensor grad_x_shared;
  std::optional<SideStream> side;
  if (overlap_shared()) {
    side.emplace(ctx);
    grad_x_shared = side->run([&](Context& s) { return shared_experts_->backward(s, grad_out, saved.shared); });
  }
  const Tensor grad_expert_out = dispatcher_->combine_backward(ctx, grad_out, *saved.dispatch);
  Tensor grad_row_probs;
  const Tensor grad_rows = experts_->backward(ctx, grad_expert_out, saved.experts, grad_row_probs);
  Tensor grad_x, grad_probs;
  dispatcher_->dispatch_backward(ctx, grad_rows, grad_row_probs, *saved.dispatch, grad_x, grad_probs);
  const Tensor grad_x_router = router_->backward(ctx, grad_probs, saved.router, aux_loss_scale).to(grad_x.dtype());
  ops::add(ctx, grad_x, grad_x_router, grad_x);
  if (side) {
    side->join();  // also reports the shared experts' gradients (Note [Gradient hooks on the side stream])
  } else if (shared_experts_) {
    grad_x_shared = shared_experts_->backward(ctx, grad_out, saved.shared);
  }
  if (shared_experts_) ops::add(ctx, grad_x, grad_x_shared, grad_x);
  saved = Saved{};
  return grad_x;
}

}  // namespace megatron::moe

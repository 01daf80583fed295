#include "megatron/core/transformer/moe/router.h"

#include "megatron/kernels/ops.h"

namespace megatron::moe {

TopKRouter::TopKRouter(const RouterConfig& config, int64_t hidden_size, ParamAndGradBuffer& params,
                       const std::string& prefix, int layer_number, int num_layers, const ProcessGroupCollection& pg)
    : config_(config), layer_number_(layer_number), num_layers_(num_layers), tp_cp_(multi_rank(pg.tp_cp)) {
  config_.validate();
  weight_ = params.add(prefix + ".weight", {config_.num_experts, hidden_size}, /*no_weight_decay=*/false,
                       ParamInit::Normal);
  // The same weight on every tensor-parallel rank, each routing its own sequence shard.
  weight_->tp_duplicate = multi_rank(pg.tp) != nullptr;
  weight_->sequence_parallel = multi_rank(pg.tp) != nullptr;
  if (config_.expert_bias) expert_bias_ = Tensor::zeros({config_.num_experts}, DType::Float32);
  tokens_per_expert_ = Tensor::zeros({config_.num_experts}, DType::Float32);
}

void TopKRouter::declare_router_losses(AuxLossTracker& tracker, const RouterConfig& config, int num_layers,
                                       Communicator* tp_cp) {
  if (config.aux_loss_coeff > 0) tracker.declare("load_balancing_loss", num_layers, tp_cp);
  if (config.seq_aux_loss_coeff > 0) tracker.declare("seq_load_balancing_loss", num_layers, tp_cp);
  if (config.z_loss_coeff > 0) tracker.declare("z_loss", num_layers, nullptr, /*average_over_dp=*/false);
}

TopKRouter::Output TopKRouter::forward(Context& ctx, const Tensor& x, int64_t seq_length, int64_t micro_batch,
                                       AuxLossTracker* tracker, Saved& saved) {
  MG_CHECK(!ctx.is_cuda(), "the MoE router runs on the CPU only in this build (its routing is host code)");
  MG_CHECK(x.dim() == 2 && x.size(1) == weight_->data.size(1), "router input {} for a weight {}", shape_str(x.shape()),
           shape_str(weight_->data.shape()));
  saved.x = x.to(DType::Float32);
  const Tensor w = weight_->data.to(DType::Float32);
  Tensor logits = Tensor::empty({x.size(0), config_.num_experts}, DType::Float32);
  ops::linear_forward(ctx, saved.x, w, Tensor(), logits);  // Megatron's router_gating_linear in fp32
  CountReduction counts;
  if (tp_cp_) {
    counts.group_size = tp_cp_->size();
    counts.sum = [&](std::vector<float> v) {
      Tensor t = Tensor::from_floats(v, {int64_t(v.size())});
      tp_cp_->all_reduce(ctx, t)->wait();
      return t.to_floats();
    };
  }
  RoutingOutput r =
      routing_forward(routing_config(), logits, expert_bias_, seq_length, micro_batch, saved.routing, &counts);
  ops::add(ctx, tokens_per_expert_, r.tokens_per_expert, tokens_per_expert_);
  if (tracker) tracker->add_tokens_per_expert(ctx, layer_number_, r.tokens_per_expert);  // --moe-per-layer-logging
  if (tracker) {  // Megatron's save_to_aux_losses_tracker: each loss over its coefficient
    auto report = [&](const char* name, double loss, float coeff) {
      if (coeff > 0) tracker->add(ctx, name, layer_number_, Tensor::from_floats({float(loss / coeff)}, {1}));
    };
    report("load_balancing_loss", r.aux_loss, config_.aux_loss_coeff);
    report("seq_load_balancing_loss", r.seq_aux_loss, config_.seq_aux_loss_coeff);
    report("z_loss", r.z_loss, routing_config().z_loss_coeff);
  }
  return Output{r.probs, r.routing_map};
}

Tensor TopKRouter::backward(Context& ctx, const Tensor& grad_probs, const Saved& saved, float aux_loss_scale) const {
  const Tensor grad_logits = routing_backward(routing_config(), grad_probs, saved.routing, aux_loss_scale);
  const Tensor w = weight_->data.to(DType::Float32);
  Tensor grad_x = Tensor::empty(saved.x.shape(), DType::Float32), no_bias;
  ops::linear_backward(ctx, grad_logits, saved.x, w, grad_x, weight_->main_grad, no_bias);
  notify_grad_accumulated(ctx, weight_);
  return grad_x;
}

RouterConfig TopKRouter::routing_config() const {
  RouterConfig c = config_;
  if (tp_cp_) c.z_loss_coeff /= float(tp_cp_->size());  // Megatron's apply_z_loss: a share per rank of the group
  return c;
}

void TopKRouter::update_expert_bias(Context& ctx, float update_rate, const std::vector<Communicator*>& groups) {
  for (Communicator* g : groups) {
    if (g && g->size() > 1 && expert_bias_.defined()) g->all_reduce(ctx, tokens_per_expert_)->wait();
  }
  if (expert_bias_.defined()) expert_bias_ = updated_expert_bias(tokens_per_expert_, expert_bias_, update_rate);
  tokens_per_expert_ = Tensor::zeros({config_.num_experts}, DType::Float32);
}

}  // namespace megatron::moe

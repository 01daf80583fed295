#include "megatron/core/transformer/moe/router.h"

#include "megatron/core/transformer/moe/moe_ops.h"
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
  if (config_.expert_bias) expert_bias_ = Tensor::zeros({config_.num_experts}, DType::Float32, params.device());
  tokens_per_expert_ = Tensor::zeros({config_.num_experts}, DType::Float32, params.device());
}

void TopKRouter::declare_router_losses(AuxLossTracker& tracker, const RouterConfig& config, int num_layers,
                                       Communicator* tp_cp) {
  if (config.aux_loss_coeff > 0) tracker.declare("load_balancing_loss", num_layers, tp_cp);
  if (config.seq_aux_loss_coeff > 0) tracker.declare("seq_load_balancing_loss", num_layers, tp_cp);
  if (config.z_loss_coeff > 0) tracker.declare("z_loss", num_layers, nullptr, /*average_over_dp=*/false);
}

// Note [Load-balancing counts over tp x cp]: Megatron's aux and seq-aux losses multiply this rank's
// score sums by the token counts of the whole tp x cp group (get_tokens_per_expert_and_token_count),
// so every rank's loss and gradient depend on the other ranks' counts. ops::moe_routing_* count one
// rank's tokens; until they take the group's counts, a router with a load-balancing loss over more
// than one tp x cp rank routes with moe_utils.h's routing_forward/backward (the CPU reference),
// summing the counts over the group on the context's device.
bool TopKRouter::host_routing() const {
  // Sinkhorn's balancing is a whole-batch iteration, on the host (Note [Sinkhorn routing]).
  return config_.sinkhorn || (tp_cp_ && (config_.aux_loss_coeff > 0 || config_.seq_aux_loss_coeff > 0));
}

TopKRouter::Output TopKRouter::forward(Context& ctx, const Tensor& x, int64_t seq_length, int64_t micro_batch,
                                       AuxLossTracker* tracker, Saved& saved, bool training) {
  MG_CHECK(x.dim() == 2 && x.size(1) == weight_->data.size(1), "router input {} for a weight {}", shape_str(x.shape()),
           shape_str(weight_->data.shape()));
  const Device dev = ctx.device();
  const int64_t t_count = x.size(0), e = config_.num_experts;
  saved.x = x.dtype() == DType::Float32 ? x : x.to(DType::Float32);
  saved.seq_length = seq_length;
  saved.micro_batch = micro_batch;
  const Tensor w = weight_->data.dtype() == DType::Float32 ? weight_->data : weight_->data.to(DType::Float32);
  Tensor logits = Tensor::empty({t_count, e}, DType::Float32, dev);
  ops::linear_forward(ctx, saved.x, w, Tensor(), logits);  // Megatron's router_gating_linear in fp32
  MG_CHECK(tokens_per_expert_.device() == dev, "the router's state is on {}, its forward runs on {}",
           tokens_per_expert_.device().str(), dev.str());

  Output out;
  Tensor tokens, losses;  // [E] and [3] = {aux, seq_aux, z} with their coefficients, on dev
  if (host_routing()) {
    CountReduction counts;  // over tp × cp (one rank: none)
    if (tp_cp_) {
      counts.group_size = tp_cp_->size();
      counts.sum = [&](std::vector<float> v) {
        Tensor t = Tensor::from_floats(v, {int64_t(v.size())}).to(dev);
        tp_cp_->all_reduce(ctx, t)->wait();
        return t.to_floats();
      };
    }
    const RoutingOutput r =
        routing_forward(routing_config(), logits, expert_bias_, seq_length, micro_batch, saved.host, &counts, training);
    out.probs = r.probs.to(dev);
    out.routing_map = r.routing_map.to(dev);
    tokens = r.tokens_per_expert.to(dev);
    losses = Tensor::from_floats({float(r.aux_loss), float(r.seq_aux_loss), float(r.z_loss)}, {3}).to(dev);
  } else {
    const MoeRoutingParams p = routing_params(routing_config(), seq_length, micro_batch);
    out.probs = Tensor::empty({t_count, e}, DType::Float32, dev);
    out.routing_map = Tensor::empty({t_count, e}, DType::UInt8, dev);
    saved.topk_indices = Tensor::empty({t_count, int64_t(p.topk)}, DType::Int32, dev);
    if (p.aux_on()) {
      saved.aux_scores = Tensor::empty({t_count, e}, DType::Float32, dev);
      saved.aux_map = Tensor::empty({t_count, e}, DType::UInt8, dev);
    }
    tokens = Tensor::empty({e}, DType::Float32, dev);
    losses = Tensor::empty({3}, DType::Float32, dev);
    ops::moe_routing_forward(ctx, logits, expert_bias_, p, out.probs, out.routing_map, saved.topk_indices,
                             saved.aux_scores, saved.aux_map, tokens, losses);
    saved.logits = logits;
    saved.routing_map = out.routing_map;
  }
  // The expert bias counts the tokens of training forward passes only: `tracker` is null when the
  // layer is recomputed and in evaluation (Megatron counts under torch.is_grad_enabled() only).
  if (tracker) {
    ops::add(ctx, tokens_per_expert_, tokens, tokens_per_expert_);
    tracker->add_tokens_per_expert(ctx, layer_number_, tokens);  // --moe-per-layer-logging
  }
  if (tracker) {  // Megatron's save_to_aux_losses_tracker: each loss over its coefficient, a device scalar
    auto report = [&](const char* name, int64_t i, float coeff) {
      if (coeff <= 0) return;
      Tensor v = losses.slice(i, i + 1);
      ops::scale_(ctx, v, 1.0f / coeff);
      tracker->add(ctx, name, layer_number_, v);
    };
    report("load_balancing_loss", 0, config_.aux_loss_coeff);
    report("seq_load_balancing_loss", 1, config_.seq_aux_loss_coeff);
    report("z_loss", 2, routing_config().z_loss_coeff);
  }
  return out;
}

Tensor TopKRouter::backward(Context& ctx, const Tensor& grad_probs, const Saved& saved, float aux_loss_scale) const {
  const Device dev = ctx.device();
  Tensor grad_logits;
  if (host_routing()) {
    grad_logits = routing_backward(routing_config(), grad_probs, saved.host, aux_loss_scale).to(dev);
  } else {
    grad_logits = Tensor::empty(saved.logits.shape(), DType::Float32, dev);
    ops::moe_routing_backward(ctx, grad_probs, saved.logits, saved.topk_indices, saved.routing_map, saved.aux_scores,
                              saved.aux_map, routing_params(routing_config(), saved.seq_length, saved.micro_batch),
                              aux_loss_scale, grad_logits);
  }
  const Tensor w = weight_->data.dtype() == DType::Float32 ? weight_->data : weight_->data.to(DType::Float32);
  Tensor grad_x = Tensor::empty(saved.x.shape(), DType::Float32, dev), no_bias;
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
  if (!expert_bias_.defined()) return;
  for (Communicator* g : groups) {
    if (g && g->size() > 1) g->all_reduce(ctx, tokens_per_expert_)->wait();
  }
  ops::moe_expert_bias_update(ctx, tokens_per_expert_, update_rate, expert_bias_);
  ops::scale_(ctx, tokens_per_expert_, 0.0f);
}

}  // namespace megatron::moe

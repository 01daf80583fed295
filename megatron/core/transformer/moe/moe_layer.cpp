#include "megatron/core/transformer/moe/moe_layer.h"

#include <fmt/format.h>

#include "megatron/kernels/ops.h"

namespace megatron::moe {

MoELayer::MoELayer(const TransformerConfig& config, const MoEConfig& moe, ParamAndGradBuffer& params,
                   const std::string& prefix, int layer_number, const ProcessGroupCollection& pg)
    : moe_(moe) {
  moe_.router.validate();
  MG_CHECK(!moe.grouped_gemm, "--moe-grouped-gemm is not built yet: leave it off (the experts run one by one)");
  router_ = std::make_unique<TopKRouter>(moe_.router, config.hidden_size, params, prefix + ".router", layer_number,
                                         config.num_layers);
  DispatcherConfig d;
  d.type = moe.dispatcher;
  d.num_experts = moe_.router.num_experts;
  d.permute_fusion = moe.permute_fusion;
  dispatcher_ = make_token_dispatcher(d, pg);
  experts_ = std::make_unique<SequentialMLP>(config, dispatcher_->num_local_experts(),
                                             dispatcher_->first_local_expert(), moe.ffn_hidden_size, params,
                                             prefix + ".experts", pg);
}

Tensor MoELayer::forward(Context& ctx, const Tensor& x, int64_t seq_length, int64_t micro_batch,
                         AuxLossTracker* tracker, Saved& saved) const {
  saved.seq_length = seq_length;
  saved.micro_batch = micro_batch;
  TopKRouter::Output routed = router_->forward(ctx, x, seq_length, micro_batch, tracker, saved.router);
  MoETokenDispatcher::Dispatched d = dispatcher_->dispatch(ctx, x, routed.probs, routed.routing_map, saved.dispatch);
  Tensor expert_out = experts_->forward(ctx, d.tokens, d.probs, d.tokens_per_expert, saved.experts);
  return dispatcher_->combine(ctx, expert_out, *saved.dispatch);
}

Tensor MoELayer::backward(Context& ctx, const Tensor& grad_out, Saved& saved, float aux_loss_scale) const {
  const Tensor grad_expert_out = dispatcher_->combine_backward(ctx, grad_out, *saved.dispatch);
  Tensor grad_row_probs;
  const Tensor grad_rows = experts_->backward(ctx, grad_expert_out, saved.experts, grad_row_probs);
  Tensor grad_x, grad_probs;
  dispatcher_->dispatch_backward(ctx, grad_rows, grad_row_probs, *saved.dispatch, grad_x, grad_probs);
  const Tensor grad_x_router = router_->backward(ctx, grad_probs, saved.router, aux_loss_scale).to(grad_x.dtype());
  ops::add(ctx, grad_x, grad_x_router, grad_x);
  saved = Saved{};
  return grad_x;
}

}  // namespace megatron::moe

#include "megatron/core/transformer/moe/moe_layer.h"

#include <fmt/format.h>

#include "megatron/kernels/ops.h"

namespace megatron::moe {

MoELayer::MoELayer(const TransformerConfig& config, const RouterConfig& router_config, int64_t moe_ffn_hidden_size,
                   ParamAndGradBuffer& params, const std::string& prefix, int layer_number)
    : router_(router_config, config.hidden_size, params, prefix + ".router", layer_number, config.num_layers) {
  MlpSpec expert;
  expert.ffn_hidden_size = int(moe_ffn_hidden_size);
  for (int e = 0; e < router_config.num_experts; ++e) {
    experts_.push_back(
        std::make_unique<MLP>(config, expert, params, fmt::format("{}.experts.local_experts.{}", prefix, e)));
  }
}

Tensor MoELayer::forward(Context& ctx, const Tensor& x, int64_t seq_length, int64_t micro_batch,
                         AuxLossTracker* tracker, Saved& saved) {
  saved.dtype = x.dtype();
  TopKRouter::Output routed = router_.forward(ctx, x, seq_length, micro_batch, tracker, saved.router);
  saved.permutation = make_permutation(routed.routing_map);
  saved.probs = permute_probs(routed.probs, saved.permutation);
  const Tensor permuted = permute_forward(x, saved.permutation);
  saved.expert_out = Tensor::zeros(permuted.shape(), x.dtype());
  saved.experts.assign(experts_.size(), MLP::Saved{});
  int64_t row = 0;
  for (size_t e = 0; e < experts_.size(); ++e) {
    const int64_t n = saved.permutation.tokens_per_expert[e];
    if (n > 0) saved.expert_out.slice(row, row + n).copy_from(experts_[e]->forward(ctx, permuted.slice(row, row + n), saved.experts[e]));
    row += n;
  }
  return unpermute_forward(saved.expert_out, saved.probs, saved.permutation);
}

Tensor MoELayer::backward(Context& ctx, const Tensor& grad_out, Saved& saved) {
  Tensor grad_expert_out, grad_probs;
  unpermute_backward(grad_out, saved.expert_out, saved.probs, saved.permutation, grad_expert_out, grad_probs);
  Tensor grad_permuted = Tensor::zeros(grad_expert_out.shape(), saved.dtype);
  int64_t row = 0;
  for (size_t e = 0; e < experts_.size(); ++e) {
    const int64_t n = saved.permutation.tokens_per_expert[e];
    if (n > 0) {
      grad_permuted.slice(row, row + n).copy_from(experts_[e]->backward(ctx, grad_expert_out.slice(row, row + n), saved.experts[e]));
    }
    row += n;
  }
  Tensor grad_x = permute_backward(grad_permuted, saved.permutation);
  const Tensor grad_router_probs =
      permute_probs_backward(grad_probs, saved.permutation, router_.weight()->data.size(0));
  const Tensor grad_x_router = router_.backward(ctx, grad_router_probs, saved.router).to(grad_x.dtype());
  ops::add(ctx, grad_x, grad_x_router, grad_x);
  saved = Saved{};
  return grad_x;
}

}  // namespace megatron::moe

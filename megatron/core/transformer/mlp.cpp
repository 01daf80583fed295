#include "megatron/core/transformer/mlp.h"

#include "megatron/kernels/ops.h"

namespace megatron {

MLP::MLP(const TransformerConfig& config, ParamAndGradBuffer& params, const std::string& prefix)
    : swiglu_(config.gated_linear_unit),
      ffn_(config.ffn_hidden_size),
      linear_fc1_(params, prefix + ".linear_fc1", config.hidden_size,
                  config.gated_linear_unit ? 2 * int64_t(config.ffn_hidden_size) : config.ffn_hidden_size,
                  config.add_bias_linear, ParamInit::Normal),
      linear_fc2_(params, prefix + ".linear_fc2", config.ffn_hidden_size, config.hidden_size, config.add_bias_linear,
                  ParamInit::ScaledNormal) {}

Tensor MLP::forward(Context& ctx, const Tensor& x, Saved& saved) const {
  saved.x = x;
  saved.fc1 = linear_fc1_.forward(ctx, x);
  saved.act = Tensor::empty({x.size(0), ffn_}, x.dtype(), ctx.device());
  if (swiglu_) {
    ops::swiglu_forward(ctx, saved.fc1, saved.act);
  } else {
    ops::gelu_forward(ctx, saved.fc1, saved.act);
  }
  return linear_fc2_.forward(ctx, saved.act);
}

Tensor MLP::backward(Context& ctx, const Tensor& grad_out, const Saved& saved) const {
  Tensor grad_act = linear_fc2_.backward(ctx, grad_out, saved.act);
  Tensor grad_fc1 = Tensor::empty(saved.fc1.shape(), saved.fc1.dtype(), ctx.device());
  if (swiglu_) {
    ops::swiglu_backward(ctx, grad_act, saved.fc1, grad_fc1);
  } else {
    ops::gelu_backward(ctx, grad_act, saved.fc1, grad_fc1);
  }
  return linear_fc1_.backward(ctx, grad_fc1, saved.x);
}

}  // namespace megatron

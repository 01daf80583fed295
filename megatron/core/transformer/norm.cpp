#include "megatron/core/transformer/norm.h"

#include "megatron/kernels/ops.h"

namespace megatron {

Norm::Norm(const TransformerConfig& config, NormKind kind, ParamAndGradBuffer& params, const std::string& prefix,
           const ProcessGroupCollection& pg)
    : Norm(config, kind, params, prefix, pg, /*per_head=*/false, config.hidden_size) {}

Norm Norm::per_head(const TransformerConfig& config, ParamAndGradBuffer& params, const std::string& prefix,
                    const ProcessGroupCollection& pg) {
  return Norm(config, config.use_rmsnorm() ? NormKind::RMSNorm : NormKind::LayerNorm, params, prefix, pg,
              /*per_head=*/true, config.kv_channels);
}

Norm Norm::of_size(const TransformerConfig& config, NormKind kind, ParamAndGradBuffer& params, const std::string& prefix,
                   int64_t size, const ProcessGroupCollection& pg) {
  return Norm(config, kind, params, prefix, pg, /*per_head=*/false, size);
}

Norm::Norm(const TransformerConfig& config, NormKind kind, ParamAndGradBuffer& params, const std::string& prefix,
           const ProcessGroupCollection& pg, bool per_head, int64_t size)
    : rms_(kind == NormKind::RMSNorm),
      zero_centered_gamma_(config.layernorm_zero_centered_gamma),
      eps_(config.layernorm_epsilon) {
  const Shape shape{size};
  weight_ = params.add(prefix + ".weight", shape, /*no_weight_decay=*/true, ParamInit::Ones);
  if (!rms_) bias_ = params.add(prefix + ".bias", shape, /*no_weight_decay=*/true, ParamInit::Zeros);
  const bool tp = group_size(pg.tp) > 1;
  for (Parameter* p : {weight_, bias_}) {
    if (!p) continue;
    p->tp_duplicate = tp;
    p->sequence_parallel = tp && config.sequence_parallel && !per_head;
    p->tp_partial_grad = tp && per_head;  // reduced by finalize_model_grads
  }
}

Tensor Norm::forward(Context& ctx, const Tensor& x, Saved& saved) const {
  Tensor out = Tensor::empty(x.shape(), x.dtype(), ctx.device());
  saved.x = x;
  saved.rstd = Tensor::empty({x.size(0)}, DType::Float32, ctx.device());
  if (rms_) {
    ops::rmsnorm_forward(ctx, x, weight_->data, eps_, zero_centered_gamma_, out, saved.rstd);
  } else {
    saved.mean = Tensor::empty({x.size(0)}, DType::Float32, ctx.device());
    ops::layernorm_forward(ctx, x, weight_->data, bias_->data, eps_, zero_centered_gamma_, out, saved.mean, saved.rstd);
  }
  return out;
}

Tensor Norm::backward(Context& ctx, const Tensor& grad_out, const Saved& saved) const {
  Tensor grad_in = Tensor::empty(saved.x.shape(), saved.x.dtype(), ctx.device());
  if (rms_) {
    ops::rmsnorm_backward(ctx, grad_out, saved.x, weight_->data, saved.rstd, zero_centered_gamma_, grad_in,
                          weight_->main_grad);
  } else {
    ops::layernorm_backward(ctx, grad_out, saved.x, weight_->data, saved.mean, saved.rstd, zero_centered_gamma_,
                            grad_in, weight_->main_grad, bias_->main_grad);
  }
  notify_grad_accumulated(ctx, weight_);
  notify_grad_accumulated(ctx, bias_);
  return grad_in;
}

}  // namespace megatron

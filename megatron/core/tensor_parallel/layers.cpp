#include "megatron/core/tensor_parallel/layers.h"

#include "megatron/kernels/ops.h"

namespace megatron {

Linear::Linear(ParamAndGradBuffer& params, const std::string& prefix, int64_t in_features, int64_t out_features,
               bool bias, ParamInit weight_init) {
  weight_ = params.add(prefix + ".weight", {out_features, in_features}, /*no_weight_decay=*/false, weight_init);
  if (bias) bias_ = params.add(prefix + ".bias", {out_features}, /*no_weight_decay=*/true, ParamInit::Zeros);
}

Linear::Linear(Parameter* shared_weight) : weight_(shared_weight) {}

Tensor Linear::forward(Context& ctx, const Tensor& x) const {
  Tensor y = Tensor::empty({x.size(0), out_features()}, x.dtype(), ctx.device());
  ops::linear_forward(ctx, x, weight_->data, bias_ ? bias_->data : Tensor(), y);
  return y;
}

Tensor Linear::backward(Context& ctx, const Tensor& grad_out, const Tensor& x, bool need_grad_in) const {
  Tensor grad_in = need_grad_in ? Tensor::empty(x.shape(), x.dtype(), ctx.device()) : Tensor();
  Tensor no_grad;
  ops::linear_backward(ctx, grad_out, x, weight_->data, grad_in, weight_->main_grad,
                       bias_ ? bias_->main_grad : no_grad);
  return grad_in;
}

}  // namespace megatron

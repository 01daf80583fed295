// Note [Produced tensors] (produced_tensor.h).
#include "megatron/core/tensor_parallel/produced_tensor.h"

#include "megatron/kernels/ops.h"

namespace megatron {

namespace {
// The activation's output shape for input pre.
Shape output_shape(Fp8Activation act, const Tensor& pre) {
  Shape s = pre.shape();
  if (act == Fp8Activation::Swiglu) s.back() /= 2;
  return s;
}
}  // namespace

ProducedTensor ProducedTensor::activation(Fp8Activation act, const Tensor& pre) {
  MG_ASSERT(pre.defined() && pre.dim() >= 1 && (act != Fp8Activation::Swiglu || pre.size(-1) % 2 == 0),
            "a produced activation of {}", pre.str());
  return ProducedTensor(act, pre, Tensor());
}

ProducedTensor ProducedTensor::activation_grad(Fp8Activation act, const Tensor& grad, const Tensor& pre) {
  MG_ASSERT(pre.defined() && grad.defined() && pre.dim() >= 1 && grad.shape() == output_shape(act, pre),
            "a produced activation gradient {} at {}", grad.str(), pre.str());
  return ProducedTensor(act, pre, grad);
}

const Tensor& ProducedTensor::tensor() const {
  MG_ASSERT(is_tensor(), "a produced tensor used where its memory is needed: materialize it");
  return tensor_;
}

Shape ProducedTensor::shape() const {
  return produced_ && !grad_.defined() ? output_shape(act_, tensor_) : tensor_.shape();
}

ProducedTensor ProducedTensor::flat_rows() const {
  const int64_t k = tensor_.size(-1);
  if (!produced_) return ProducedTensor(tensor_.view({-1, k}));
  const Tensor pre = tensor_.view({-1, k});
  if (!grad_.defined()) return activation(act_, pre);
  return activation_grad(act_, grad_.view({-1, grad_.size(-1)}), pre);
}

Tensor ProducedTensor::materialize(Context& ctx) const {
  if (!produced_) return tensor_;
  return ops::fp8_activation_values(ctx, act_, tensor_, grad_);
}

}  // namespace megatron

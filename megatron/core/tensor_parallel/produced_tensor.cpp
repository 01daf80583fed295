// Note [Produced tensors] (produced_tensor.h).
#include "megatron/core/tensor_parallel/produced_tensor.h"

#include "megatron/kernels/ops.h"

namespace megatron {

ProducedTensor ProducedTensor::swiglu(const Tensor& fc1) {
  MG_ASSERT(fc1.defined() && fc1.dim() >= 1 && fc1.size(-1) % 2 == 0, "swiglu of {}: an even last dimension",
            fc1.str());
  return ProducedTensor(Kind::Swiglu, fc1, Tensor());
}

ProducedTensor ProducedTensor::swiglu_grad(const Tensor& grad, const Tensor& fc1) {
  MG_ASSERT(fc1.defined() && fc1.dim() >= 1 && fc1.size(-1) % 2 == 0 && grad.defined() &&
                grad.numel() * 2 == fc1.numel(),
            "swiglu_grad of {} at {}", grad.str(), fc1.str());
  return ProducedTensor(Kind::SwigluGrad, fc1, grad);
}

const Tensor& ProducedTensor::tensor() const {
  MG_ASSERT(is_tensor(), "a produced tensor used where its memory is needed: materialize it");
  return tensor_;
}

Shape ProducedTensor::shape() const {
  Shape s = tensor_.shape();
  if (kind_ == Kind::Swiglu) s.back() /= 2;
  return s;
}

ProducedTensor ProducedTensor::flat_rows() const {
  const int64_t k = tensor_.size(-1);
  switch (kind_) {
    case Kind::Tensor: return ProducedTensor(tensor_.view({-1, k}));
    case Kind::Swiglu: return swiglu(tensor_.view({-1, k}));
    case Kind::SwigluGrad: return swiglu_grad(grad_.view({-1, k / 2}), tensor_.view({-1, k}));
  }
  return *this;
}

Tensor ProducedTensor::materialize(Context& ctx) const {
  if (kind_ == Kind::Tensor) return tensor_;
  Tensor out = Tensor::empty(shape(), tensor_.dtype(), ctx.device());
  if (kind_ == Kind::Swiglu) {
    ops::swiglu_forward(ctx, tensor_, out);
  } else {
    ops::swiglu_backward(ctx, grad_, tensor_, out);
  }
  return out;
}

}  // namespace megatron

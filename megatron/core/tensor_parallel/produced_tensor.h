// Note [Produced tensors]: a linear layer's input or output gradient given as the pointwise pass
// that makes it instead of as memory — SwiGLU's output swiglu(fc1) (the MLP's fc2 input) or SwiGLU's
// input gradient for an output gradient (fc1's output gradient). A linear layer in FP8 under a
// per-tensor recipe quantises such a tensor inside that pass (ops::fp8_quantize_swiglu, Note
// [Quantising inside SwiGLU] in kernels/fp8_ops.h), so the bf16 tensor is never written; every other
// consumer (the bf16 layer, the blockwise recipe, --no-fp8-wgrad's bf16 weight gradient)
// materialises it — runs the pass into a tensor — and goes on as with a tensor. A Tensor converts
// to a ProducedTensor implicitly: a tensor is its own producer.
#pragma once

#include "megatron/runtime/context.h"

namespace megatron {

class ProducedTensor {
 public:
  enum class Kind { Tensor, Swiglu, SwigluGrad };

  ProducedTensor(const Tensor& t) : kind_(Kind::Tensor), tensor_(t) {}  // NOLINT: implicit by design
  /// swiglu(fc1) [..., f] for fc1 [..., 2f] ([gate | up] rows).
  static ProducedTensor swiglu(const Tensor& fc1);
  /// SwiGLU's input gradient [..., 2f] for its output gradient grad [..., f] at fc1 [..., 2f].
  static ProducedTensor swiglu_grad(const Tensor& grad, const Tensor& fc1);

  Kind kind() const { return kind_; }
  bool is_tensor() const { return kind_ == Kind::Tensor; }
  /// The tensor itself (Kind::Tensor only).
  const Tensor& tensor() const;
  const Tensor& fc1() const { return tensor_; }  // Swiglu, SwigluGrad
  const Tensor& grad() const { return grad_; }   // SwigluGrad
  Shape shape() const;
  DType dtype() const { return tensor_.dtype(); }
  /// The same tensor with its leading dimensions flattened: [rows, last dimension].
  ProducedTensor flat_rows() const;
  /// The values in memory: the tensor itself, or the pass run into a new tensor.
  Tensor materialize(Context& ctx) const;

 private:
  ProducedTensor(Kind kind, const Tensor& fc1, const Tensor& grad) : kind_(kind), tensor_(fc1), grad_(grad) {}
  Kind kind_;
  Tensor tensor_;  // the tensor, or fc1
  Tensor grad_;
};

}  // namespace megatron

// Note [Produced tensors]: a linear layer's input or output gradient given as the pointwise pass
// that makes it instead of as memory — the MLP activation's output act(fc1) (fc2's input) or the
// activation's input gradient for an output gradient (fc1's output gradient), for SwiGLU and GeLU.
// A linear layer in FP8 under a per-tensor recipe quantises such a tensor inside that pass
// (ops::fp8_quantize_activation, Note [Quantising inside the activation] in kernels/fp8_ops.h), so
// the bf16 tensor is never written; every other consumer (the bf16 layer, the blockwise recipe,
// --no-fp8-wgrad's bf16 weight gradient, a communication) materialises it — runs the pass into a
// tensor — and goes on as with a tensor. A Tensor converts to a ProducedTensor implicitly: a tensor
// is its own producer.
#pragma once

#include "megatron/kernels/fp8_ops.h"
#include "megatron/runtime/context.h"

namespace megatron {

class ProducedTensor {
 public:
  ProducedTensor(const Tensor& t) : tensor_(t) {}  // NOLINT: implicit by design
  /// act(pre): SwiGLU's [..., f] for pre [..., 2f] ([gate | up] rows), GeLU's of pre's shape.
  static ProducedTensor activation(Fp8Activation act, const Tensor& pre);
  /// The activation's input gradient (pre's shape) for its output gradient grad at pre.
  static ProducedTensor activation_grad(Fp8Activation act, const Tensor& grad, const Tensor& pre);

  bool is_tensor() const { return !produced_; }
  /// The tensor itself (is_tensor() only).
  const Tensor& tensor() const;
  Fp8Activation act() const { return act_; }
  const Tensor& pre() const { return tensor_; }  // produced: the activation's input
  const Tensor& grad() const { return grad_; }   // produced: the output gradient (undefined: act(pre))
  Shape shape() const;
  DType dtype() const { return tensor_.dtype(); }
  /// The same tensor with its leading dimensions flattened: [rows, last dimension].
  ProducedTensor flat_rows() const;
  /// The values in memory: the tensor itself, or the pass run into a new tensor.
  Tensor materialize(Context& ctx) const;

 private:
  ProducedTensor(Fp8Activation act, const Tensor& pre, const Tensor& grad)
      : produced_(true), act_(act), tensor_(pre), grad_(grad) {}
  bool produced_ = false;
  Fp8Activation act_ = Fp8Activation::Swiglu;
  Tensor tensor_;  // the tensor, or pre
  Tensor grad_;
};

}  // namespace megatron

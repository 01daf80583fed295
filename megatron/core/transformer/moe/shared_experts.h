// Shared experts (Megatron-Core's moe/shared_experts.py SharedExpertMLP): a dense MLP of
// --moe-shared-expert-intermediate-size that every token goes through, beside the routed experts;
// MoELayer adds its output to theirs. With --moe-shared-expert-gate its output is scaled per token
// by a sigmoid gate (Qwen2-MoE's shared_expert_gate):
//   y[n] = sigmoid(x[n] · gᵀ) · mlp(x[n])        g = "<prefix>.gate_weight" [1, h]
// Backward, with s = sigmoid(x·gᵀ) and m = mlp(x):
//   d mlp = s · dy,   dlogit[n] = <dy[n], m[n]> · s(1 - s),   dg += dlogitᵀ x,   dx += dlogit · g.
//
// The MLP is the dense one (mlp.h) over the tensor-parallel group: fc1 column-parallel, fc2
// row-parallel, with sequence parallelism as configured; its weights are
// "<prefix>.linear_fc1.weight" [2·sffn, h] ([gate; up] with SwiGLU) and "<prefix>.linear_fc2.weight"
// [h, sffn]. Biases are refused, as Megatron does. The gate weight is whole on every
// tensor-parallel rank (tp_duplicate); under sequence parallelism each rank gates its own sequence
// shard, so its gradient is a partial sum all-reduced like the norm weights' (sequence_parallel).
//
// --moe-shared-expert-overlap (Megatron runs the shared experts on a side CUDA stream, overlapped
// with the token dispatch) is accepted; the MoE layer runs on the CPU, where it computes the same
// values without the overlap.
#pragma once

#include <string>

#include "megatron/core/transformer/mlp.h"

namespace megatron::moe {

class SharedExpertMLP {
 public:
  /// intermediate_size: --moe-shared-expert-intermediate-size; gate: --moe-shared-expert-gate.
  SharedExpertMLP(const TransformerConfig& config, int64_t intermediate_size, bool gate, ParamAndGradBuffer& params,
                  const std::string& prefix, const ProcessGroupCollection& pg = {});

  struct Saved {
    MLP::Saved mlp;
    Tensor x;         // [N, h] (gated only)
    Tensor mlp_out;   // [N, h] (gated only): the gate's gradient needs it
    Tensor score;     // [N] fp32 sigmoid(x · gᵀ) (gated only)
  };
  /// x [N, h] (this rank's sequence shard under sequence parallelism) -> [N, h].
  Tensor forward(Context& ctx, const Tensor& x, Saved& saved) const;
  /// grad_out [N, h] -> grad_x [N, h]; accumulates the weight gradients. Releases `saved`.
  Tensor backward(Context& ctx, const Tensor& grad_out, Saved& saved) const;

  const Parameter* gate_weight() const { return gate_weight_; }

 private:
  MLP mlp_;
  Parameter* gate_weight_ = nullptr;  // null without the gate
};

}  // namespace megatron::moe

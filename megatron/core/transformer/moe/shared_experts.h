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
// Note [Shared experts on a side stream] (--moe-shared-expert-overlap; alltoall or flex dispatcher,
// as Megatron). Megatron runs the shared experts on a side CUDA stream so that their GEMMs fill the
// GPU while the dispatcher's all-to-alls move tokens. MoELayer does the same, in forward and in
// backward, through the context's side stream (Note [Side stream], runtime/context.h):
//   forward:  router (main) -> fork -> shared forward (side) | dispatch -> experts -> combine (main)
//             -> join -> y = combine + shared
//   backward: fork -> shared backward (side) | combine^T -> experts^T -> dispatch^T -> router^T (main)
//             -> join -> grad_x = routed + router + shared
// The shared experts' work is enqueued first, so the host is free to enqueue the routed path while
// the side stream computes; their tensor-parallel collectives (sequence-parallel all-gather and
// reduce-scatter) are ordered after the side stream, as every collective is after the stream of
// the context it is given. Differences from Megatron: its overlap interleaves fc1, activation and
// fc2 between the dispatcher's steps (pre_forward_comm, linear_fc1_forward_and_act, ...); ours hands
// the whole MLP to the side stream at once and lets the GPU interleave — the same overlap without
// the dispatcher knowing about the shared experts. Its gradients are reported to the data-parallel
// hooks at the join (Note [Gradient hooks on the side stream], core/parameter.h).
// Values: each stream runs exactly the ops of the plain path, in the same order, so the outputs
// and every gradient are bit-identical to it (tests: SharedExperts.Overlap* on the CPU, where the
// side context runs inline; MoeSharedOverlapGpu.* on a GPU).
// The gate's sigmoid and its gradient's row dot products are host code: the forward reads the gate
// logits back before it enqueues the MLP (the host waits for the side stream: that one small GEMM
// after the main stream's work before the fork), the backward reads the score, grad_out and the
// MLP's output at its start; the row scalings and everything after are device ops, so the routed
// path is enqueued while the side stream computes the MLP, in both directions.
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
    Tensor score;     // [N] fp32 sigmoid(x · gᵀ) on the device (gated only)
  };
  /// x [N, h] (this rank's sequence shard under sequence parallelism) -> [N, h].
  Tensor forward(Context& ctx, const Tensor& x, Saved& saved) const;
  /// grad_out [N, h] -> grad_x [N, h]; accumulates the weight gradients. Releases `saved`.
  Tensor backward(Context& ctx, const Tensor& grad_out, Saved& saved) const;

  const Parameter* gate_weight() const { return gate_weight_; }
  /// Runs fc1 and fc2 in FP8, as a dense MLP's (Megatron's shared experts are TE linears; the gate
  /// stays in bf16); appends them to `fp8_linears`.
  void enable_fp8(const Fp8Config& config, Device device, std::vector<Linear*>& fp8_linears) {
    mlp_.enable_fp8(config, device, fp8_linears);
  }

 private:
  MLP mlp_;
  Parameter* gate_weight_ = nullptr;  // null without the gate
};

}  // namespace megatron::moe

// The routed experts (Megatron-Core's moe/experts.py): this rank's local experts, each a dense MLP
// of --moe-ffn-hidden-size, over the rows the token dispatcher brought them (sorted by local
// expert, `tokens_per_expert` rows each). As in Megatron, the routing probabilities are applied
// inside the experts, after the activation, and to the fc2 bias:
//   y[n] = W2 · (p[n] · act(W1 · x[n] + b1)) + p[n] · b2
// so the dispatcher's combine is a plain sum. Backward gives the rows' gradient and the gradient
// of each row's probability,
//   dp[n] = <W2ᵀ dy[n], act[n]> + <dy[n], b2>.
//
// SequentialMLP (Megatron's SequentialMLP) runs the experts one after another; with
// --moe-grouped-gemm the same weights run through one grouped GEMM per linear layer on the GPU.
// The weights are "<prefix>.local_experts.<g>.linear_fc1.weight" / "...linear_fc2.weight" (and
// biases) with g the GLOBAL expert index (ep_rank · local experts + local index), so checkpoints
// name each expert once whatever the expert-parallel layout. Under expert tensor parallelism fc1
// is split by output features and fc2 by input features over the expert-TP group, with no
// communication in the layers (ParallelMode::ExpertColumn / ExpertRow); their gradients reduce
// over the expert-data-parallel group.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "megatron/core/tensor_parallel/layers.h"
#include "megatron/core/transformer/transformer_config.h"

namespace megatron::moe {

class SequentialMLP {
 public:
  /// Experts [first_expert, first_expert + num_local_experts) of width ffn_hidden_size, split over pg.expt_tp.
  SequentialMLP(const TransformerConfig& config, int num_local_experts, int first_expert, int64_t ffn_hidden_size,
                ParamAndGradBuffer& params, const std::string& prefix, const ProcessGroupCollection& pg = {});

  struct Saved {
    Tensor x;        // [N, h] the dispatched rows
    Tensor probs;    // [N] fp32
    Tensor fc1;      // [N, ffn/etp] or [N, 2·ffn/etp]
    Tensor scaled;   // [N, ffn/etp]: p · act(fc1), fc2's input
    std::vector<int64_t> tokens_per_expert;
  };
  /// x [N, h], probs [N] fp32, rows per local expert -> [N, h] (this rank's partial sum under expert TP).
  Tensor forward(Context& ctx, const Tensor& x, const Tensor& probs, const std::vector<int64_t>& tokens_per_expert,
                 Saved& saved) const;
  /// grad_out [N, h] -> grad_x [N, h] and grad_probs [N] (fp32; partial under expert TP, like the
  /// output). Accumulates the weight gradients. Releases `saved`.
  Tensor backward(Context& ctx, const Tensor& grad_out, Saved& saved, Tensor& grad_probs) const;

  int num_local_experts() const { return int(fc1_.size()); }

 private:
  bool swiglu_;
  int64_t ffn_;  // local intermediate features (ffn / etp)
  std::vector<std::unique_ptr<Linear>> fc1_, fc2_;
  std::vector<Parameter*> fc2_bias_;  // applied with the probabilities (null without biases)
};

}  // namespace megatron::moe

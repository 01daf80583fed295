// The routed experts (Megatron-Core's moe/experts.py): this rank's local experts, each a dense MLP
// of --moe-ffn-hidden-size, over the rows the token dispatcher brought them (sorted by local
// expert, `tokens_per_expert` rows each). As in Megatron, the routing probabilities are applied
// inside the experts, after the activation, and to the fc2 bias:
//   y[n] = W2 · (p[n] · act(W1 · x[n] + b1)) + p[n] · b2
// so the dispatcher's combine is a plain sum. Backward gives the rows' gradient and the gradient
// of each row's probability,
//   dp[n] = <W2ᵀ dy[n], act[n]> + <dy[n], b2>.
//
// SequentialMLP (Megatron's SequentialMLP) runs each linear layer's GEMMs expert after expert; with
// --moe-grouped-gemm (grouped = true, Megatron's GroupedMLP / TEGroupedMLP) each linear layer is one
// ops::moe_grouped_linear_forward/backward over every local expert's rows. The same parameters
// either way, so a checkpoint of one loads into the other. The activation and the scaling by the
// probabilities run once over all rows (ops::swiglu_* / gelu_*, ops::moe_scale_rows_*), on the
// context's device. The activation is the model's (MlpActivation: GeLU, SwiGLU or GPT-OSS's clamped
// quick-GeGLU). Note [Grouped experts with biases]: the grouped GEMM has no bias epilogue, so with
// --add-bias-linear (GPT-OSS) ops::moe_grouped_bias_forward adds each expert's fc1 bias to its rows
// after it, and the p·b2 term of fc2 (sequential or grouped) the same way with the probabilities
// as the rows' weights; its backward gives db = Σ_rows s·dy per expert and dp += <dy, b2>. One
// launch per 64 experts, where a GEMM and an add per expert (the first design) cost GPT-OSS a
// tenth of its step in launches.
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
#include "megatron/core/transformer/mlp.h"
#include "megatron/core/transformer/transformer_config.h"

namespace megatron::moe {

class SequentialMLP {
 public:
  /// Experts [first_expert, first_expert + num_local_experts) of width ffn_hidden_size, split over pg.expt_tp.
  SequentialMLP(const TransformerConfig& config, int num_local_experts, int first_expert, int64_t ffn_hidden_size,
                ParamAndGradBuffer& params, const std::string& prefix, const ProcessGroupCollection& pg = {},
                bool grouped = false);

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
  bool grouped() const { return grouped_; }

 private:
  // y [N, out] = rows of expert e times W_e^T (+ b_e), each expert's rows in order.
  void linear_forward(Context& ctx, const std::vector<Parameter*>& w, const std::vector<Parameter*>& b,
                      const Tensor& x, const std::vector<int64_t>& rows, Tensor& y) const;
  // grad_in (undefined: skipped) and the weight (and bias) gradients of linear_forward.
  void linear_backward(Context& ctx, const std::vector<Parameter*>& w, const std::vector<Parameter*>& b,
                       const Tensor& grad_out, const Tensor& x, const std::vector<int64_t>& rows, Tensor& grad_in) const;

  MlpActivation act_;
  bool swiglu_, grouped_;
  int64_t ffn_;  // local intermediate features (ffn / etp)
  std::vector<std::unique_ptr<Linear>> layers_;  // the registration (names, shards) of fc1 and fc2
  std::vector<Parameter*> fc1_, fc1_bias_, fc2_;  // per local expert (biases null without them)
  std::vector<Parameter*> fc2_bias_;  // applied with the probabilities (null without biases)
};

}  // namespace megatron::moe

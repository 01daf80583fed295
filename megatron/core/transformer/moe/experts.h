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
//
// Note [FP8 experts]: with --fp8-format an FP8 layer's experts run fc1 and fc2 in FP8, each expert
// with its own scaling state — TE's GroupedLinear keeps per-GEMM scales and amax histories (input,
// weight; grad-output), Megatron's SequentialMLP a TE linear per expert; both are one
// Fp8LinearState per expert linear here (enable_fp8, on the registration Linears), so the state is
// "<prefix>.local_experts.<g>.linear_fc{1,2}.fp8_*" in checkpoints, named by the global expert
// like the weights (Megatron splits GroupedLinear's extra state per GEMM the same way), and the
// grouped and sequential forms are one computation. Each expert with rows runs its three FP8 GEMMs
// (Note [FP8 linear layer]) on its row block; an expert without rows is skipped (its delayed
// history does not roll: Note [Delayed scaling]). The rows are padded to a multiple of
// kFp8ExpertAlign (16, Megatron's get_fp8_align_size for the per-tensor and block recipes: the
// weight gradient's K is the row count, which cuBLASLt's FP8 GEMM needs in multiples of 16) with
// zero rows, as Megatron's Fp8Padding / Fp8Unpadding around TE's grouped GEMM: zero rows change no
// amax, no tile scale and no real row's result, and add nothing to the weight gradient, so the
// padding is invisible in the values (and runs on every device, so the CPU reference covers it).
// The fc1 bias rides the FP8 GEMM's epilogue (as TE's), the p·b2 term stays the grouped bias op.
// The delayed recipe's amax reduces over the ranks that hold the same expert (expert tensor ×
// expert data parallel: Note [FP8 scaling under parallelism]).
// Note [Grouped FP8 experts on the GPU]: the sequential form (and the blockwise recipe) runs each
// expert's row block through its Fp8LinearState — per expert and linear layer five quantisation
// passes and three GEMMs, plus the padding's row copies: for 64 fine-grained experts more launches
// than work (0.57x of the bf16 step). With --moe-grouped-gemm and a per-tensor recipe the experts'
// linear layers run as TE's GroupedLinear (fp8_grouped_forward / backward, Note [Grouped FP8
// linear layers]): each quantisation is one pass over every expert's rows or weights with each
// expert's own scale and amax (Note [Grouped quantisation]), the weight gradient's padding is
// written by that pass (no row copies), each weight is quantised in one pass a step (both copies in
// the forward: Note [FP8 weight cache], kept transposes), and the GEMMs run expert after expert as
// the bf16 experts' do; the step's delayed update is one launch for all states (update_fp8_scaling).
// The per-expert states and their checkpoint names are the same in both forms.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "megatron/core/fp8_utils.h"
#include "megatron/core/tensor_parallel/fp8_grouped_linear.h"
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
  /// Runs every local expert's fc1 and fc2 in FP8 with its own scaling state (Note [FP8 experts]);
  /// appends their Linears to `fp8_linears`. The blockwise recipe needs the hidden size and the
  /// local expert width (--moe-ffn-hidden-size / expert TP) to be multiples of 128.
  void enable_fp8(const Fp8Config& config, Device device, std::vector<Linear*>& fp8_linears);
  /// The FP8 state of local expert e's fc1 (fc = 1) or fc2 (fc = 2); null when FP8 is off.
  Fp8LinearState* fp8_state(int e, int fc) const;

  /// Rows per expert are padded to this multiple for its FP8 GEMMs (Note [FP8 experts]).
  static constexpr int64_t kFp8ExpertAlign = kFp8GroupRowAlign;

 private:
  // y [N, out] = rows of expert e times W_e^T (+ b_e), each expert's rows in order; fc: 1 or 2
  // (which FP8 states, when on).
  void linear_forward(Context& ctx, int fc, const std::vector<Parameter*>& w, const std::vector<Parameter*>& b,
                      const Tensor& x, const std::vector<int64_t>& rows, Tensor& y) const;
  // grad_in (undefined: skipped) and the weight (and bias) gradients of linear_forward.
  void linear_backward(Context& ctx, int fc, const std::vector<Parameter*>& w, const std::vector<Parameter*>& b,
                       const Tensor& grad_out, const Tensor& x, const std::vector<int64_t>& rows, Tensor& grad_in) const;
  // Grouped and a per-tensor recipe: the FP8 GEMMs through fp8_grouped_forward / backward (Note
  // [Grouped FP8 linear layers]); the states of every local expert's fc1 or fc2.
  bool fp8_grouped() const { return grouped_ && fp8_recipe_ != Fp8Recipe::Blockwise; }
  std::vector<Fp8LinearState*> fp8_states(int fc) const;
  // linear_forward / linear_backward in FP8: each expert's row block through its Fp8LinearState.
  void fp8_forward(Context& ctx, int fc, const std::vector<Parameter*>& w, const std::vector<Parameter*>& b,
                   const Tensor& x, const std::vector<int64_t>& rows, Tensor& y) const;
  void fp8_backward(Context& ctx, int fc, const std::vector<Parameter*>& w, const std::vector<Parameter*>& b,
                    const Tensor& grad_out, const Tensor& x, const std::vector<int64_t>& rows, Tensor& grad_in) const;

  MlpActivation act_;
  bool swiglu_, grouped_;
  int64_t hidden_;  // --hidden-size
  int64_t ffn_;     // local intermediate features (ffn / etp)
  std::vector<std::unique_ptr<Linear>> layers_;  // the registration (names, shards) of fc1 and fc2
  std::vector<Parameter*> fc1_, fc1_bias_, fc2_;  // per local expert (biases null without them)
  std::vector<Parameter*> fc2_bias_;  // applied with the probabilities (null without biases)
  bool fp8_ = false;                  // Note [FP8 experts]
  Fp8Recipe fp8_recipe_ = Fp8Recipe::Delayed;
};

}  // namespace megatron::moe

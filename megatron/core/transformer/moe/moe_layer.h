// MoELayer (Megatron-Core's moe/moe_layer.py): route -> dispatch -> experts -> combine (+ shared
// experts), forward and backward side by side.
//   probs, routing_map = router(x)                      (TopKRouter, fp32)
//   rows, row_probs    = dispatcher.dispatch(x, probs)  (MoETokenDispatcher, over the EP / expert-TP groups)
//   expert_out         = experts(rows, row_probs)       (SequentialMLP: probabilities applied inside)
//   y                  = dispatcher.combine(expert_out)
// Backward: the gradient reaches x through the combine, the experts and the dispatch, and through
// the routed probabilities into the router (with the router's own losses).
//
// Under tensor parallelism MoE needs sequence parallelism (as in Megatron): x is this rank's
// sequence shard [T/tp, h] and each rank routes its own tokens; the router's weight gradient is then
// a partial sum over the tensor-parallel ranks (Parameter::tp_partial_grad).
//
// With --moe-shared-expert-intermediate-size the shared experts (shared_experts.h) see every token
// and their output is added: y = combine(...) + shared(x); their gradient joins grad_x. With
// --moe-shared-expert-overlap they run on the context's side stream beside dispatch -> experts ->
// combine, in forward and in backward (Note [Shared experts on a side stream], shared_experts.h).
//
// One code path on the CPU and on CUDA: every step is an op of the op library on the context's
// device (routing, permutation, row scaling, the experts' GEMMs — grouped with --moe-grouped-gemm);
// the host sees the rows per expert (one device->host copy per layer, as Megatron's
// tokens_per_expert.cpu()). Token dropping (--moe-expert-capacity-factor, with or without padding)
// runs on both (Note [Token dropping on the device] in kernels/cuda/moe.cu). The fp64 router
// (--moe-router-dtype fp64) is CPU-only: a GPU model refuses it when it is built.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "megatron/core/process_groups_config.h"
#include "megatron/core/transformer/moe/experts.h"
#include "megatron/core/transformer/moe/router.h"
#include "megatron/core/transformer/moe/shared_experts.h"
#include "megatron/core/transformer/moe/token_dispatcher.h"

namespace megatron::moe {

/// What an MoE layer is, beyond the TransformerConfig (the MoE flags).
struct MoEConfig {
  RouterConfig router;
  int64_t ffn_hidden_size = 0;  // --moe-ffn-hidden-size
  std::string dispatcher = "allgather";
  bool permute_fusion = false;
  bool grouped_gemm = false;
  bool router_padding = false;  // --moe-router-padding-for-quantization (Note [Routing padding for FP8])
  int64_t shared_expert_intermediate_size = 0;  // --moe-shared-expert-intermediate-size (0: none)
  bool shared_expert_gate = false;              // --moe-shared-expert-gate
  bool shared_expert_overlap = false;           // --moe-shared-expert-overlap (inline on the CPU)
};

/// The MoE settings of a finalized TransformerConfig (its moe_* fields), with one clear line for
/// a setting that is unknown or not built (the input jitter under context parallelism and the
/// fp64 router on a GPU are refused by the router when it is built).
MoEConfig moe_config(const TransformerConfig& config);

class MoELayer {
 public:
  MoELayer(const TransformerConfig& config, const MoEConfig& moe, ParamAndGradBuffer& params,
           const std::string& prefix, int layer_number, const ProcessGroupCollection& pg = {});

  struct Saved {
    TopKRouter::Saved router;
    std::shared_ptr<MoETokenDispatcher::Saved> dispatch;  // shared: a layer's Saved is copyable
    SequentialMLP::Saved experts;
    SharedExpertMLP::Saved shared;
    float aux_loss_scale = 1.0f;  // the losses' backward scale of this forward's step
  };
  /// x [T, h] (T = seq_length · micro_batch tokens, sequence-major; this rank's sequence shard
  /// under sequence parallelism) -> [T, h]. The router reports its losses to `tracker` (may be null).
  /// rng_base: the layer's random-stream base (the router's input jitter, TopKRouter::forward).
  Tensor forward(Context& ctx, const Tensor& x, int64_t seq_length, int64_t micro_batch, AuxLossTracker* tracker,
                 Saved& saved, bool training = true, uint64_t rng_base = 0) const;
  /// The aux losses' gradients get the backward scale `aux_loss_scale` (Note [Router losses' gradients]).
  Tensor backward(Context& ctx, const Tensor& grad_out, Saved& saved, float aux_loss_scale = 1.0f) const;

  TopKRouter& router() { return *router_; }
  const TopKRouter& router() const { return *router_; }
  int num_local_experts() const { return dispatcher_->num_local_experts(); }
  /// Runs the experts (Note [FP8 experts], experts.h) and the shared experts in FP8; the router
  /// stays in its own precision. Appends the experts' Linears to `expert_linears` (their amax
  /// reduces over the expert groups) and the shared experts' to `dense_linears`.
  void enable_fp8(const Fp8Config& config, Device device, std::vector<Linear*>& dense_linears,
                  std::vector<Linear*>& expert_linears);
  SequentialMLP& experts() { return *experts_; }
  const SequentialMLP& experts() const { return *experts_; }
  /// Declares the router's losses (every rank of the model, before the first step).
  void declare_losses(AuxLossTracker& tracker) const { router_->declare_losses(tracker); }

 private:
  bool overlap_shared() const { return shared_experts_ && moe_.shared_expert_overlap; }

  MoEConfig moe_;
  std::unique_ptr<TopKRouter> router_;
  std::unique_ptr<MoETokenDispatcher> dispatcher_;
  std::unique_ptr<SequentialMLP> experts_;
  std::unique_ptr<SharedExpertMLP> shared_experts_;  // null without shared experts
};

}  // namespace megatron::moe

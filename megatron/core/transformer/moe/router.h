// TopKRouter (Megatron-Core's moe/router.py): the gating linear "<prefix>.weight" [E, h], applied in
// fp32 (Megatron's --moe-router-dtype fp32), then the routing of moe_utils.h (top-k with its score
// function, token dropping, the aux and z losses), forward and backward side by side. The losses
// go to the AuxLossTracker as Megatron logs them: "load_balancing_loss" (aux_loss / coeff),
// "seq_load_balancing_loss" (seq_aux_loss / coeff) and "z_loss" (z_loss / coeff), per layer; their
// gradients join the logits' in backward (Note [Router losses' gradients]).
//
// The aux-loss-free expert bias (--moe-router-enable-expert-bias) is state, not a parameter: the
// tokens each expert received are counted over the step's training forward passes (those given a
// tracker: not recomputation, not evaluation) and update_expert_bias()
// moves the bias after the step (Megatron sums the counts over tp × cp × dp first).
//
// Under tensor (sequence) and context parallelism each rank routes its own tokens: the
// load-balancing losses count tokens over the tp × cp group (pg.tp_cp), so each rank's loss is its
// share of the group's, the z-loss coefficient is divided by the group's size, and the weight's
// gradient is a partial sum over the tensor-parallel ranks (Parameter::sequence_parallel).
//
// One code path for both backends: the gating GEMM is ops::linear_* in fp32 and the routing is
// ops::moe_routing_forward/backward on the context's device; the losses go to the tracker as device
// scalars and the token counts stay on the device (no host wait in the router). One exception
// (Note [Load-balancing counts over tp x cp]): with a load-balancing loss and more than one rank in
// tp x cp, the losses need the token counts summed over the group between the counting and the
// loss, which the routing op does not take; that case routes with moe_utils.h's host routing (a
// device->host copy of the logits and the count all-reduce on the context's device).
#pragma once

#include <string>
#include <vector>

#include "megatron/core/distributed/param_and_grad_buffer.h"
#include "megatron/core/process_groups_config.h"
#include "megatron/core/transformer/aux_loss_tracker.h"
#include "megatron/core/transformer/moe/moe_utils.h"
#include "megatron/runtime/context.h"

namespace megatron::moe {

class TopKRouter {
 public:
  /// Registers "<prefix>.weight" [num_experts, hidden]. layer_number: the decoder layer (0-based),
  /// num_layers the decoder's, for the tracker.
  TopKRouter(const RouterConfig& config, int64_t hidden_size, ParamAndGradBuffer& params, const std::string& prefix,
             int layer_number, int num_layers, const ProcessGroupCollection& pg = {});

  struct Saved {
    Tensor x;  // [T, h] fp32
    // What ops::moe_routing_backward needs (on the context's device).
    Tensor logits, topk_indices, routing_map, aux_scores, aux_map;
    int64_t seq_length = 0, micro_batch = 0;
    RoutingSaved host;  // host routing only (Note [Load-balancing counts over tp x cp])
  };
  struct Output {
    Tensor probs;        // [T, E] fp32
    Tensor routing_map;  // [T, E] uint8
  };
  /// x [T, h] (T = seq_length · micro_batch, sequence-major) -> probs and routing map. Reports the
  /// losses to `tracker` and counts the tokens per expert for the bias update (neither when null).
  /// training: false in evaluation (sinkhorn routing balances in training only).
  Output forward(Context& ctx, const Tensor& x, int64_t seq_length, int64_t micro_batch, AuxLossTracker* tracker,
                 Saved& saved, bool training = true);
  /// grad_probs [T, E] -> grad_x [T, h] (fp32); accumulates the weight gradient. The losses'
  /// gradients have the backward scale `aux_loss_scale`.
  Tensor backward(Context& ctx, const Tensor& grad_probs, const Saved& saved, float aux_loss_scale = 1.0f) const;

  /// Declares this router's tracked losses in `tracker` (every rank, before the first step).
  void declare_losses(AuxLossTracker& tracker) const { declare_router_losses(tracker, config_, num_layers_, tp_cp_); }
  /// After a step: the expert bias moves by the step's token counts summed over `groups` in turn
  /// (Megatron's tp × cp × dp: the tp × cp group, then the data-parallel one; null entries are one
  /// rank), and the counts restart. A no-op without the expert bias.
  void update_expert_bias(Context& ctx, float update_rate, const std::vector<Communicator*>& groups = {});
  /// Whether this router routes on the host (Note [Load-balancing counts over tp x cp]).
  bool host_routing() const;
  /// The expert bias as checkpoint state (undefined without it; on the parameters' device).
  Tensor& expert_bias() { return expert_bias_; }
  /// The losses a router of `config` reports, declared in `tracker` as Megatron tracks them: the
  /// load-balancing losses summed over `tp_cp` and averaged over data-parallel ranks, the z loss
  /// neither (Note in aux_loss_tracker.h).
  static void declare_router_losses(AuxLossTracker& tracker, const RouterConfig& config, int num_layers,
                                    Communicator* tp_cp);
  const Tensor& expert_bias() const { return expert_bias_; }
  const Parameter* weight() const { return weight_; }

 private:
  RouterConfig routing_config() const;  // config_ with this rank's share of the z-loss coefficient

  RouterConfig config_;
  int layer_number_, num_layers_;
  Communicator* tp_cp_;  // null: one rank
  Parameter* weight_;
  Tensor expert_bias_;       // [E] fp32 (undefined without --moe-router-enable-expert-bias)
  Tensor tokens_per_expert_;  // [E] fp32, summed over the step's microbatches (on the parameters' device)
};

}  // namespace megatron::moe

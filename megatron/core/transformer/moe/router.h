// TopKRouter (Megatron-Core's moe/router.py): the gating linear "<prefix>.weight" [E, h] (and with
// --add-bias-linear its bias "<prefix>.bias" [E], as Megatron's router and GPT-OSS's), applied in
// fp32 (--moe-router-dtype fp32) or fp64 (Note [fp64 router] in moe_utils.h), then the routing of
// moe_utils.h (top-k with its score function, token dropping, the aux and z losses), forward and
// backward side by side. The losses go to the AuxLossTracker as Megatron logs them:
// "load_balancing_loss" (aux_loss / coeff), "seq_load_balancing_loss" (seq_aux_loss / coeff),
// "global_load_balancing_loss" (global_aux_loss / coeff) and "z_loss" (z_loss / coeff), per layer;
// their gradients join the logits' in backward (Note [Router losses' gradients]).
//
// Note [Global aux loss] (--moe-router-load-balancing-type global_aux_loss, Megatron's
// _apply_global_aux_loss): the switch load-balancing loss of this microbatch's aux scores against
// tokens per expert counted over the whole step: each training forward sums its aux map's counts
// over tp × dp × cp (Megatron's tp_dp_cp group: here the tp × cp group, then the data-parallel
// one), adds them to the router's buffer and uses the buffer over the number of forwards so far
// (Megatron's global_tokens_per_expert / ga_steps); the loss's token total is T · |tp × dp × cp|.
// The buffer restarts after each step (reset_global_aux_loss_tracker, as Megatron's
// reset_model_temporary_tensors in finalize_model_grads). The counts carry no gradient: each
// token's gradient is count[x] · E·coeff/(k·N²) through its aux scores. A recomputed forward (no
// tracker) reuses the counts its first pass used (kept by its random-stream base until the step
// ends), so recomputation changes nothing; evaluation has no global loss (Megatron: training only).
// Logged summed over tp × dp × cp (Megatron's reduce_group_has_dp: no data-parallel mean).
//
// Note [Router input jitter] (--moe-input-jitter-eps, Megatron's apply_input_jitter): in training
// the router input is multiplied by U(1 - eps, 1 + eps) elementwise, the gating GEMM sees the
// jittered input and its gradient is multiplied by the same noise (the experts see x unjittered, as
// in Megatron). Megatron draws from torch's generator; we draw from Philox (runtime/philox.h) with
// the run's seed, at the stream offset kJitterStream + the layer's random-stream base (the base is
// the microbatch's place in the global batch and the layer's global index, schedules.h and
// gpt_model.h; the high bit keeps the stream apart from every sequential one), element
// ((s·B + b)·h + j) for sequence position s of the whole sequence, sample b of the microbatch and
// hidden index j. So recomputation replays it and every tensor, pipeline and data-parallel layout
// draws the same noise. Applied to the router's fp32 copy of the input (Megatron multiplies in the
// input's dtype). Context parallelism is refused with jitter (its sequence chunks are not mapped).
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
// ops::moe_routing_forward/backward on the context's device (the global aux loss
// ops::moe_global_aux_loss_*, the jitter ops::moe_input_jitter); the losses go to the tracker as
// device scalars and the token counts stay on the device (no host wait in the router). The
// exceptions route with moe_utils.h's host routing (a device->host copy of the logits): with an
// aux or seq-aux loss and more than one rank in tp x cp (Note [Load-balancing counts over tp x
// cp]: the losses need the group's counts between the counting and the loss, which the routing op
// does not take), sinkhorn, and the fp64 router (CPU only).
#pragma once

#include <map>
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
  /// The input jitter's stream: kJitterStream + the layer's random-stream base (Note [Router input jitter]).
  static constexpr uint64_t kJitterStream = uint64_t(1) << 62;

  /// Registers "<prefix>.weight" [num_experts, hidden]. layer_number: the decoder layer (0-based),
  /// num_layers the decoder's, for the tracker.
  TopKRouter(const RouterConfig& config, int64_t hidden_size, ParamAndGradBuffer& params, const std::string& prefix,
             int layer_number, int num_layers, const ProcessGroupCollection& pg = {});

  struct Saved {
    Tensor x;  // [T, h] fp32 (jittered when jitter is on)
    // What ops::moe_routing_backward needs (on the context's device).
    Tensor logits, topk_indices, routing_map, aux_scores, aux_map;
    Tensor global_tokens;      // [E] fp32: the global aux loss's tokens per expert (undefined: no global loss)
    bool global_on = false;    // this forward has the global aux loss (Note [Global aux loss])
    bool jitter = false;       // this forward jittered its input, from stream (seed, jitter_offset)
    uint64_t jitter_seed = 0, jitter_offset = 0;
    int64_t seq_length = 0, micro_batch = 0;
    RoutingSaved host;  // host routing only (Note [Load-balancing counts over tp x cp])
  };
  struct Output {
    Tensor probs;        // [T, E] fp32
    Tensor routing_map;  // [T, E] uint8
  };
  /// x [T, h] (T = seq_length · micro_batch, sequence-major) -> probs and routing map. Reports the
  /// losses to `tracker` and counts the tokens per expert for the bias update (neither when null).
  /// training: false in evaluation (sinkhorn routing balances, the input jitter and the global aux
  /// loss apply, in training only). rng_base: the layer's random-stream base (Note [Router input jitter];
  /// it also names the forward for the global aux loss's recomputation).
  Output forward(Context& ctx, const Tensor& x, int64_t seq_length, int64_t micro_batch, AuxLossTracker* tracker,
                 Saved& saved, bool training = true, uint64_t rng_base = 0);
  /// grad_probs [T, E] -> grad_x [T, h] (fp32); accumulates the weight gradient. The losses'
  /// gradients have the backward scale `aux_loss_scale`.
  Tensor backward(Context& ctx, const Tensor& grad_probs, const Saved& saved, float aux_loss_scale = 1.0f) const;

  /// Declares this router's tracked losses in `tracker` (every rank, before the first step).
  void declare_losses(AuxLossTracker& tracker) const { declare_router_losses(tracker, config_, num_layers_, tp_cp_); }
  /// After a step: the expert bias moves by the step's token counts summed over `groups` in turn
  /// (Megatron's tp × cp × dp: the tp × cp group, then the data-parallel one; null entries are one
  /// rank), and the counts restart. A no-op without the expert bias.
  void update_expert_bias(Context& ctx, float update_rate, const std::vector<Communicator*>& groups = {});
  /// After a step: the global aux loss's token counts restart (Megatron's reset_global_aux_loss_tracker;
  /// a no-op without it).
  void reset_global_aux_loss_tracker(Context& ctx);
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
  // config_ with this rank's share of the z-loss coefficient; the global aux loss only when `global`.
  RouterConfig routing_config(bool global) const;
  // The global aux loss's tokens per expert for a forward with aux-map counts `counts` [E] (Note
  // [Global aux loss]): reduced, accumulated and averaged for a tracked training forward, the first
  // pass's for a recomputed one.
  Tensor global_tokens(Context& ctx, const Tensor& counts, bool tracked, uint64_t rng_base);
  // logits [T, E] fp32 = x · Wᵀ in fp64 on the host (Note [fp64 router]), into saved.host's routing.
  std::vector<double> logits_fp64(const Tensor& x) const;
  Tensor weight_fp32() const;
  // The ranks whose tokens the global aux loss counts: |tp × cp| · |dp|.
  int64_t global_aux_group() const { return int64_t(group_size(tp_cp_)) * group_size(dp_); }

  RouterConfig config_;
  int layer_number_, num_layers_;
  Communicator* tp_cp_;  // null: one rank
  Communicator* tp_;     // null: one rank (the jitter's sequence offset under sequence parallelism)
  Communicator* dp_;     // null: one rank (the global aux loss's counts)
  Parameter* weight_;
  Parameter* bias_ = nullptr;  // RouterConfig::linear_bias
  Tensor bias_fp32() const;    // undefined without a bias
  Tensor expert_bias_;       // [E] fp32 (undefined without --moe-router-enable-expert-bias)
  Tensor tokens_per_expert_;  // [E] fp32, summed over the step's microbatches (on the parameters' device)
  // The global aux loss (Note [Global aux loss]): [E] fp32 counts summed over the step's forwards,
  // their number, and each forward's averaged counts by its random-stream base (for recomputation).
  Tensor global_tokens_;
  int global_steps_ = 0;
  std::map<uint64_t, Tensor> global_by_stream_;
};

}  // namespace megatron::moe

// Megatron-Core's routing functions (megatron/core/transformer/moe/moe_utils.py and the loss
// handling of router.py's TopKRouter.routing), forward and backward side by side, as the CPU
// reference: top-k routing with a score function, group-limited routing, the top-k scaling factor
// and the aux-loss-free expert bias, token dropping to the expert capacity, and the load-balancing
// (aux_loss, seq_aux_loss) and z losses with their gradients; and the token permutation the
// dispatchers use locally (permute / unpermute with merging probabilities, drop-and-pad).
//
// Layout: logits [T, E] fp32 with T = seq_length · micro_batch tokens, sequence-major (token
// t = s·B + b), as Megatron's router sees them. Outputs: probs [T, E] (zero off the chosen
// experts), routing_map [T, E] uint8.
//
// Note [Router losses' gradients]: Megatron attaches the aux losses to the probs and the z loss to
// the logits with MoEAuxLossAutoScaler, whose backward gives each loss the gradient
// `aux_loss_scale` (the main loss's backward scale: 1 for one microbatch of a single rank). The
// load-balancing losses see scores of their own (compute_routing_scores_for_aux_loss: the softmax
// over every expert, or the sigmoid normalised over every expert) and the plain top-k of those,
// not the routed selection; the expert bias changes only which experts are chosen, never a value,
// so it passes no gradient.
//
// These host functions are the oracle the op library's MoE ops (kernels/op_list.inc) are tested
// against; the modules run the ops. The router still routes with routing_forward/backward when
// its load-balancing counts span tp x cp ranks (Note [Load-balancing counts over tp x cp]), for
// sinkhorn, and for --moe-router-dtype fp64 (Note [fp64 router]).
// Not here: padding masks (Megatron's padding_mask argument).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "megatron/runtime/tensor.h"

namespace megatron::moe {

struct RouterConfig {
  int num_experts = 0;
  int topk = 2;                            // --moe-router-topk
  std::string score_function = "softmax";  // --moe-router-score-function softmax | sigmoid
  bool pre_softmax = false;                // --moe-router-pre-softmax
  int num_groups = 0, group_topk = 0;      // --moe-router-num-groups, --moe-router-group-topk (0: off)
  int group_score_topk = 0;                // --moe-router-group-score-topk (0: topk / group_topk, Megatron's)
  float topk_scaling_factor = 0.0f;        // --moe-router-topk-scaling-factor (0: none)
  float aux_loss_coeff = 0.0f;             // aux_loss (switch load balancing) coefficient
  float seq_aux_loss_coeff = 0.0f;         // seq_aux_loss coefficient
  float z_loss_coeff = 0.0f;               // --moe-z-loss-coeff
  float global_aux_loss_coeff = 0.0f;      // global_aux_loss coefficient (Note [Global aux loss], router.h)
  float input_jitter_eps = 0.0f;           // --moe-input-jitter-eps (0: none; Note [Router input jitter], router.h)
  bool fp64 = false;                       // --moe-router-dtype fp64 (Note [fp64 router])
  std::optional<float> capacity_factor;    // --moe-expert-capacity-factor (unset: dropless)
  std::string drop_policy = "probs";       // --moe-token-drop-policy probs | position
  bool pad_to_capacity = false;            // --moe-pad-expert-input-to-capacity
  bool expert_bias = false;                // --moe-router-enable-expert-bias
  bool linear_bias = false;                // the gating linear's own bias "<router>.bias" (add_bias_linear; GPT-OSS)
  bool sinkhorn = false;                   // --moe-router-load-balancing-type sinkhorn (Note [Sinkhorn routing])

  /// One clear line for a combination Megatron refuses or this file does not have.
  void validate() const;
};

/// What routing_backward needs. Values are kept in fp64: the fp32 ones exactly (Note [fp64 router]).
struct RoutingSaved {
  std::vector<double> logits;       // [T, E]
  std::vector<int64_t> top;         // [T, topk]: the chosen experts of each token
  std::vector<uint8_t> routing_map; // [T, E], after token dropping
  std::vector<double> aux_scores;   // [T, E]: the aux losses' scores (when a load-balancing loss is on)
  std::vector<uint8_t> aux_map;     // [T, E]: their top-k
  std::vector<float> aux_counts;      // [E] tokens per expert of aux_map, summed over the count group
  std::vector<float> seq_aux_counts;  // [B, E] per sequence, summed over the count group
  double aux_total_tokens = 0, seq_aux_total_tokens = 0;  // over the count group
  std::vector<float> global_tokens;   // [E] the global aux loss's tokens per expert (empty: no global aux loss)
  double global_total_tokens = 0;     // T · |tp × dp × cp|
  int64_t seq_length = 0, micro_batch = 0;
  bool fp64 = false;
};

struct RoutingOutput {
  Tensor probs;              // [T, E] fp32 (fp64 routing: rounded once)
  Tensor routing_map;        // [T, E] uint8
  Tensor tokens_per_expert;  // [E] fp32: Σ over tokens of routing_map
  // With their coefficients, as Megatron's functions return them.
  double aux_loss = 0, seq_aux_loss = 0, z_loss = 0, global_aux_loss = 0;
};

/// The load-balancing losses' token counts are global over the ranks that split the tokens of one
/// batch (Megatron's get_tokens_per_expert_and_token_count over tp × cp): `sum` adds a count
/// vector over that group, `group_size` ranks of equal token counts.
/// The global aux loss (Note [Global aux loss], router.h) counts over tp × dp × cp and the step:
/// `global_average` takes this microbatch's aux-map counts [E] and returns the tokens per expert
/// the loss uses (summed over the group, accumulated over the step's microbatches, averaged over
/// them); unset: the counts themselves (one rank, one microbatch). `global_group_size`: the ranks.
struct CountReduction {
  std::function<std::vector<float>(std::vector<float>)> sum;
  int group_size = 1;
  std::function<std::vector<float>(std::vector<float>)> global_average;
  int global_group_size = 1;
};

/// Megatron's TopKRouter.routing (after the gating GEMM). expert_bias [E] fp32 (undefined unless
/// config.expert_bias). counts: null for one rank.
/// training: Megatron's self.training (sinkhorn balances the choice in training only).
/// With config.fp64 the fp32 logits are widened and routed in fp64.
RoutingOutput routing_forward(const RouterConfig& config, const Tensor& logits, const Tensor& expert_bias,
                              int64_t seq_length, int64_t micro_batch, RoutingSaved& saved,
                              const CountReduction* counts = nullptr, bool training = true);
// Note [fp64 router] (--moe-router-dtype fp64; Megatron casts the router input and weight to fp64
// and routes the fp64 logits): the gating GEMM, the score function, the top-k, token dropping, the
// losses and every gradient in fp64; the probabilities the experts see are rounded to fp32 once.
// On the host only (there is no fp64 tensor type): a GPU model refuses it when it is built.
/// The fp64 routing of logits [T·E] (row-major).
RoutingOutput routing_forward_fp64(const RouterConfig& config, const std::vector<double>& logits,
                                   const Tensor& expert_bias, int64_t seq_length, int64_t micro_batch,
                                   RoutingSaved& saved, const CountReduction* counts = nullptr, bool training = true);

// Note [Sinkhorn routing] (Megatron's sinkhorn_load_balancing, S-BASE): in training each token's
// experts are the top-k of the Sinkhorn-balanced exp(logits) (alternate row and column scaling of
// the [T, E] matrix until the column scales move by less than 1e-4 on average); in evaluation the
// top-k of the probabilities. The probabilities are sigmoid(logits) for top-1 and softmax over all
// experts for top-k > 1, kept on the chosen experts without renormalising, so their gradient is the
// sigmoid's or the pre-softmax one; the balancing passes none. No aux loss (Megatron asserts it).
/// grad_logits [T, E] from grad_probs [T, E] plus the gradients of the aux and z losses, each given
/// the backward scale `aux_loss_scale` (Note [Router losses' gradients]).
Tensor routing_backward(const RouterConfig& config, const Tensor& grad_probs, const RoutingSaved& saved,
                        float aux_loss_scale);
/// The same in fp64 (saved from routing_forward_fp64): grad_logits [T·E].
std::vector<double> routing_backward_fp64(const RouterConfig& config, const Tensor& grad_probs,
                                          const RoutingSaved& saved, float aux_loss_scale);

/// Megatron's _apply_global_aux_loss on its own (Note [Global aux loss], router.h):
/// switch_load_balancing_loss_func(aux_scores [T, E], tokens [E], total_tokens): coeff·E/(k·N²) ·
/// Σ_x (Σ_t aux_scores[t, x]) · tokens[x], N = total_tokens.
double global_aux_loss(const std::vector<double>& aux_scores, const std::vector<float>& tokens, double total_tokens,
                       int topk, float coeff);

/// Megatron's apply_input_jitter (Note [Router input jitter], router.h): x [T, h] fp32 times
/// 1 - eps + 2·eps·uniform(seed, offset, i), i the element's place in the whole sequence
/// ((seq_offset + t / micro_batch) · micro_batch + t % micro_batch) · h + j. The gradient is the same
/// product of grad_out. On the host.
Tensor input_jitter(const Tensor& x, float eps, uint64_t seed, uint64_t offset, int64_t micro_batch,
                    int64_t seq_offset);

// ---- token permutation (Megatron's permute / unpermute, the token dispatchers' local step) ----
// Note [Permuted order]: the routed (token, expert) pairs grouped by expert, in expert order, and
// within an expert in token order — row n of the permuted tokens is token sorted_indices[n]. With
// drop-and-pad (--moe-pad-expert-input-to-capacity) every expert has exactly `capacity` rows: its
// routed tokens in token order, then its unrouted tokens in token order as padding.

struct Permutation {
  std::vector<int64_t> sorted_indices;   // [N]: the token of each permuted row
  std::vector<int64_t> row_expert;       // [N]: the expert of each permuted row
  std::vector<int64_t> tokens_per_expert;  // [E]: rows per expert
  int64_t num_tokens = 0;
};
/// The permutation of routing_map [T, E] (uint8); capacity > 0: drop-and-pad to that many rows per expert.
Permutation make_permutation(const Tensor& routing_map, int64_t capacity = 0);
/// tokens [T, h] -> permuted [N, h] (the rows of Note [Permuted order]); any float dtype, on the host.
Tensor permute_forward(const Tensor& tokens, const Permutation& perm);
/// The gradient of permute_forward: grad_permuted [N, h] summed back into grad_tokens [T, h].
Tensor permute_backward(const Tensor& grad_permuted, const Permutation& perm);
/// probs [T, E] -> the permuted rows' probabilities [N].
Tensor permute_probs(const Tensor& probs, const Permutation& perm);
/// out [T, h] = Σ over permuted rows n of probs_permuted[n] · permuted[n] into its token
/// (probs_permuted undefined: weight 1) — Megatron's unpermute with merging probs.
Tensor unpermute_forward(const Tensor& permuted, const Tensor& probs_permuted, const Permutation& perm);
/// Gradients of unpermute_forward: grad_permuted [N, h], and grad_probs [N] (when probs were given).
void unpermute_backward(const Tensor& grad_out, const Tensor& permuted, const Tensor& probs_permuted,
                        const Permutation& perm, Tensor& grad_permuted, Tensor& grad_probs);
/// The gradient of permute_probs: grad_probs_permuted [N] scattered into grad_probs [T, E].
Tensor permute_probs_backward(const Tensor& grad_probs_permuted, const Permutation& perm, int64_t num_experts);

/// Megatron's get_updated_expert_bias: bias + sign(mean(tokens) - tokens) · rate, tokens being the
/// tokens per expert summed over tp × cp × dp and the step's microbatches.
Tensor updated_expert_bias(const Tensor& tokens_per_expert, const Tensor& expert_bias, float update_rate);

/// Megatron's get_capacity: ceil(num_tokens / num_experts · capacity_factor).
int64_t expert_capacity(int64_t num_tokens, int num_experts, float capacity_factor);

// Note [Routing padding for FP8] (--moe-router-padding-for-quantization, alias
// --moe-router-padding-for-fp8): Megatron's pad_routing_map. Before the alltoall or flex dispatch,
// each expert's column of this rank's routing map gets its first (-count mod multiple) unrouted
// tokens (in token order) marked as routed, so every source sends each expert a multiple of 16 rows
// and every expert's total is one: the experts' FP8 GEMMs then need no zero padding (Note [FP8
// experts]). The added rows carry probability 0 (probs is zero off the chosen experts): they add
// nothing to the output and nothing to any weight gradient, but they are real tokens, so they enter
// fc1's input amax and fc2's output-gradient amax as in Megatron, and their probability gradients
// fall on experts the router did not choose, which its backward ignores. The router's losses and
// token counts come from the unpadded map (Megatron pads in the dispatcher, after the router). An
// expert with fewer unrouted tokens than it needs is padded as far as they go (the experts pad the
// rest). The map comes to the host and back: one synchronisation per layer, where Megatron's
// alltoall dispatcher also waits for the padded token count.
/// routing_map [T, E] uint8 (any device) -> the padded map on the same device.
Tensor pad_routing_map(const Tensor& routing_map, int64_t multiple);

}  // namespace megatron::moe

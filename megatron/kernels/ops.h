// The op library: every op family declared once, forward next to backward.
//
// The declarations are in op_list.inc, one list included into three namespaces. Model code calls
// megatron::ops and never says "cuda": each op dispatches on the Context's device to kernels/cpu
// (the reference: fp32 compute, bf16/fp16 storage converted on load and store) or kernels/cuda (the
// fast path), which implement the same list as megatron::cpu and megatron::cuda.
//
// Conventions
//  * Activations are sequence-first: [s, b, h]. 2-D ops take [N, h] with N = s*b (callers view).
//  * Outputs are preallocated by the caller with the right shape and dtype (usually the input's).
//  * Parameter gradients ("weight_grad", "bias_grad", ...) are fp32 and ACCUMULATED into (beta = 1):
//    Megatron's gradient-accumulation fusion into the main_grad buffer. An undefined grad tensor
//    means "not needed" and is skipped.
//  * Input gradients ("grad_in") are overwritten, in the activation dtype.
//  * Random ops take (seed, offset) explicitly: Note [Random stream layout] in runtime/philox.h.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "megatron/runtime/context.h"
#include "megatron/runtime/tensor.h"

namespace megatron {

struct AdamHyperParams {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // decoupled (AdamW): p -= lr · wd · p
  int64_t step = 1;           // 1-based, for bias correction
  bool bias_correction = true;
  float grad_scale = 1.0f;  // grads are multiplied by this first (1/loss_scale, clipping coefficient)
};

/// One parameter of a multi-tensor AdamW step (adamw_step_multi): adamw_step's tensors and the
/// parameter's own weight decay.
struct AdamTensors {
  Tensor main_param, grad, exp_avg, exp_avg_sq, model_param;
  float weight_decay = 0.0f;
};

/// Which keys each query of the attention ops sees: Note [Attention masks] in op_list.inc.
struct AttnMask {
  enum class Kind {
    Causal,            // key j <= query i (Megatron's AttnMaskType.causal)
    CausalWithOffset,  // j + k_offset <= i + q_offset, sq and sk may differ (context-parallel chunks)
    Documents,         // causal within each document of cu_seqlens (PackedSeqParams, THD)
  };
  Kind kind = Kind::Causal;
  int64_t q_offset = 0, k_offset = 0;  // CausalWithOffset: global positions of query row 0 and key row 0
  Tensor cu_seqlens;                   // Documents: int32 [n + 1] for every batch row, or [b, n + 1]
  // Sliding window (Note [Sliding-window attention]): query i also sees only keys j >= i - window_left
  // (global positions); -1: no window. Megatron's window_size (left, 0); HF's sliding_window W is W - 1.
  int64_t window_left = -1;

  static AttnMask causal() { return {}; }
  /// This mask with a left window (-1: none).
  AttnMask with_window(int64_t left) const {
    AttnMask m = *this;
    m.window_left = left;
    return m;
  }
  bool windowed() const { return window_left >= 0; }
  static AttnMask causal_with_offset(int64_t q_offset, int64_t k_offset) {
    return {Kind::CausalWithOffset, q_offset, k_offset, Tensor()};
  }
  static AttnMask documents(Tensor cu_seqlens) { return {Kind::Documents, 0, 0, std::move(cu_seqlens)}; }
};

struct GradStats {
  double sum_sq = 0.0;
  bool found_inf_or_nan = false;
  int64_t num_zeros = 0;
};

/// The routing options of the mixture-of-experts ops (moe_routing_forward/backward): Megatron's
/// TopKRouter.routing, as megatron::moe::RouterConfig holds them, plus the token layout.
struct MoeRoutingParams {
  int num_experts = 0;
  int topk = 2;
  bool sigmoid = false;       // --moe-router-score-function sigmoid (else softmax)
  bool pre_softmax = false;   // --moe-router-pre-softmax
  int num_groups = 0;         // --moe-router-num-groups (group-limited routing when group_topk > 0)
  int group_topk = 0;         // --moe-router-group-topk
  int group_score_topk = 0;   // --moe-router-group-score-topk: experts summed into a group's score (0: topk / group_topk)
  float topk_scaling_factor = 0.0f;  // 0: none
  float aux_loss_coeff = 0.0f, seq_aux_loss_coeff = 0.0f, z_loss_coeff = 0.0f;
  // --moe-router-load-balancing-type global_aux_loss: its coefficient and the ranks whose tokens its
  // counts cover (tp × dp × cp; the loss's total tokens are T · global_aux_group).
  float global_aux_loss_coeff = 0.0f;
  int64_t global_aux_group = 1;
  float capacity_factor = 0.0f;  // --moe-expert-capacity-factor (0: dropless)
  bool drop_by_position = false; // --moe-token-drop-policy position (else probs)
  bool pad_to_capacity = false;  // --moe-pad-expert-input-to-capacity
  int64_t seq_length = 0, micro_batch = 0;  // T = seq_length · micro_batch, token t = s·micro_batch + b

  /// The load-balancing losses whose token counts the routing ops take themselves (aux, seq-aux).
  constexpr bool local_aux_on() const { return aux_loss_coeff > 0 || seq_aux_loss_coeff > 0; }
  /// Any load-balancing loss: the routing ops then write the aux scores and their top-k map.
  constexpr bool aux_on() const { return local_aux_on() || global_aux_loss_coeff > 0; }
};

/// The token permutation of a routing map (Note [Permuted order], moe_utils.h), built by
/// moe_permutation on the op's device; N = Σ rows_per_expert permuted rows.
struct MoePermutation {
  Tensor sorted_indices;  // [N] int32: the token of each permuted row
  Tensor row_expert;      // [N] int32: the expert of each permuted row
  Tensor token_rows;      // [T, E] int32: the permuted row of (token, expert), -1 when it has none
  std::vector<int64_t> rows_per_expert;  // [E], on the host
  int64_t num_tokens = 0, num_experts = 0;
  int64_t rows() const {
    int64_t n = 0;
    for (int64_t r : rows_per_expert) n += r;
    return n;
  }
};

}  // namespace megatron

namespace megatron::ops {
/// Whether this build has the CUDA op library (kernels/cuda).
bool has_cuda_kernels();

/// The user's error of an id outside its table, worded once for the CPU reference, the CUDA kernels
/// (Note [Device-side id checks]) and the host checks before a step (check_batch_ids): `what` is
/// "token id" or "position id", `flat` the id's index in ids [b, s] with `s` columns.
[[noreturn]] void throw_bad_table_id(const char* what, int64_t id, int64_t flat, int64_t s, int64_t rows);
/// The same for a label outside the vocabulary [0, vocab) at flat `position`.
[[noreturn]] void throw_bad_label(int64_t label, int64_t position, int64_t vocab);

/// The checks of an attention mask that need no look at its values, worded once for the CPU
/// reference and the CUDA ops: the kind against the query and key lengths (only CausalWithOffset
/// takes sq != sk) and Documents' cu_seqlens (int32 [n + 1] or [b, n + 1] on `device`, n >= 1).
void check_attention_mask(const AttnMask& mask, const Device& device, int64_t b, int64_t sq, int64_t sk);

/// The checks of the routing ops' options and inputs, worded once for both backends: logits [T, E]
/// fp32 with T = seq_length · micro_batch, expert_bias [E] fp32 or undefined, and the options as
/// moe::RouterConfig::validate has them (group-limited routing: at most 64 groups).
void check_moe_routing(const MoeRoutingParams& p, const Tensor& logits, const Tensor& expert_bias);

/// The first row of each expert's block in a grouped GEMM's x ([E + 1], the last = rows), checked:
/// one count per expert weight, none negative, summing to rows.
std::vector<int64_t> moe_expert_row_starts(const std::vector<int64_t>& rows_per_expert, size_t experts, int64_t rows);

#define MG_OP(ret, name, params, args) ret name params;
#define MG_OP_AS(ret, name, label, params, args) ret name params;
#include "megatron/kernels/op_list.inc"
#undef MG_OP
#undef MG_OP_AS
}  // namespace megatron::ops

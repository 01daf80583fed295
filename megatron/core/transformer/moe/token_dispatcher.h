// Token dispatchers (Megatron-Core's moe/token_dispatcher.py): they bring each token to the ranks
// that hold its experts and the experts' outputs back, forward and backward side by side.
//
//   dispatch  x [T, h], probs [T, E], routing_map [T, E]  ->  the rows of this rank's local
//             experts [N, h] sorted by local expert, their probabilities [N] (fp32) and the rows
//             per local expert (host counts: the grouped GEMM and the all-to-all splits need them)
//   combine   the experts' outputs [N, h] (the probabilities already applied by the experts, as
//             Megatron's experts do) -> [T, h], each token the sum of its rows
//
// The experts' rows of this rank: for the local experts [first_local, first_local + L) of the
// expert-parallel rank (E / EP experts each), the tokens every rank of the EP group (and, with
// expert tensor parallelism, of the expert-TP group) routed to them.
//
// Kinds (--moe-token-dispatcher-type):
//   allgather  (MoEAllGatherTokenDispatcher) x, probs and the routing map are all-gathered over the
//              EP × expert-TP ranks (pg.tp_ep); each rank permutes the gathered tokens routed to its
//              local experts; combine unpermutes into the gathered [T·EP·ETP, h] and reduce-scatters
//              it back. Every rank of tp_ep must have the same T.
//   alltoall   (MoEAlltoAllTokenDispatcher) permute locally by expert over all E experts (Note
//              [Permuted order]), exchange the rows per local expert, all-to-all-v over the EP group
//              (splits: rows per destination rank), with expert-TP the all-gather over the expert-TP
//              group (variable sizes), then the chunks sorted by local expert (sort_chunks_by_idxs);
//              combine is the reverse: unsort, reduce-scatter over expert-TP, all-to-all-v back,
//              unpermute (a sum: the probabilities were applied by the experts).
//   flex       (MoEFlexTokenDispatcher) one communication group over all EP × expert-TP ranks
//              (pg.tp_ep): each token goes to every expert-TP rank of its experts' EP rank by one
//              all-to-all-v over tp_ep, then the rows are sorted by local expert; combine sends the
//              partial outputs back and sums them. DeepEP and HybridEP (Megatron's fused kernels) are
//              not used: the exchange is the Communicator's all_to_all_v, as for alltoall.
// With one rank in every group all kinds are the local permutation.
//
// Note [Dispatch layout]: the rows of a local expert are ordered by source rank, then by the
// source's permuted order (its tokens in token order, then with drop-and-pad its padding). The
// source ranks are taken in tp_ep order (expert-TP rank fastest) for allgather and flex, and
// expert-TP rank major, EP rank minor for alltoall (Megatron's all-gather after the all-to-all).
// Backward of every step is its adjoint: all-to-all-v back, all-gather <-> reduce-scatter, a copy
// to several ranks <-> the sum of their gradients.
//
// Token dropping: the router has already dropped what exceeds the capacity. Drop-and-pad
// (DispatcherConfig::capacity > 0, --moe-pad-expert-input-to-capacity): every expert receives
// exactly `capacity` rows from each source rank (its routed tokens, then unrouted ones with
// probability 0 as padding), so the splits are fixed and no counts are exchanged: no counts come
// back to the host either, which lets a CUDA graph capture the layer. MoELayer sets the padded
// capacity from the router's flags (DispatcherConfig::pad_capacity_factor); without them it
// dispatches dropless, or what the router kept.
//
// Every row movement is an ops::moe_permute_* gather on the context's device (CPU or CUDA); the
// communication is the Communicator's. The host holds only the counts: the rows per expert of the
// routing map's permutation (one device->host copy per layer) and the split sizes built from them.
//
// Note [--moe-permute-fusion]: Megatron's flag picks TransformerEngine's fused permute/unpermute
// kernels over its PyTorch index_select / scatter_add. Ours are fused already on both backends
// (one gather kernel per permute, one gather-sum per unpermute, no atomics), so the flag is accepted
// and selects the same kernels.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "megatron/core/process_groups_config.h"
#include "megatron/core/transformer/moe/moe_utils.h"
#include "megatron/runtime/context.h"

namespace megatron::moe {

struct DispatcherConfig {
  std::string type = "allgather";  // allgather | alltoall | flex
  int num_experts = 0;
  int64_t capacity = 0;         // > 0: drop-and-pad, every expert gets exactly this many rows per source rank
  // --moe-pad-expert-input-to-capacity: the capacity of each dispatch from its token count, as the
  // router's (Megatron's get_capacity(tokens · topk, experts, factor)); unset: `capacity` as given.
  std::optional<float> pad_capacity_factor;
  int topk = 0;
  bool permute_fusion = false;  // --moe-permute-fusion: accepted, the same kernels (Note [--moe-permute-fusion])
};

class MoETokenDispatcher {
 public:
  virtual ~MoETokenDispatcher() = default;

  struct Dispatched {
    Tensor tokens;                           // [N, h] this rank's local experts' rows, by local expert
    Tensor probs;                            // [N] fp32
    std::vector<int64_t> tokens_per_expert;  // [num_local_experts] rows per local expert (host)
  };
  /// What backward needs (each kind keeps its own permutation and splits in it).
  struct Saved {
    virtual ~Saved() = default;
  };

  /// x [T, h] (model dtype), probs [T, E] fp32 (zero off the routed experts), routing_map [T, E] uint8.
  virtual Dispatched dispatch(Context& ctx, const Tensor& x, const Tensor& probs, const Tensor& routing_map,
                              std::unique_ptr<Saved>& saved) = 0;
  /// expert_out [N, h] -> [T, h].
  virtual Tensor combine(Context& ctx, const Tensor& expert_out, Saved& saved) = 0;
  /// The gradient of combine: grad_out [T, h] -> grad_expert_out [N, h].
  virtual Tensor combine_backward(Context& ctx, const Tensor& grad_out, Saved& saved) = 0;
  /// The gradient of dispatch: grad_tokens [N, h], grad_probs [N] -> grad_x [T, h] and grad of
  /// probs [T, E] (fp32; zero off the routed experts). Releases `saved`.
  virtual void dispatch_backward(Context& ctx, const Tensor& grad_tokens, const Tensor& grad_probs, Saved& saved,
                                 Tensor& grad_x, Tensor& grad_probs_full) = 0;

  int num_local_experts() const { return num_local_experts_; }
  /// The global index of local expert 0 (ep_rank · num_local_experts).
  int first_local_expert() const { return first_local_expert_; }

 protected:
  MoETokenDispatcher(const DispatcherConfig& config, const ProcessGroupCollection& pg);
  DispatcherConfig config_;
  /// The rows per expert and source of a dispatch of `tokens` tokens: 0 is dropless.
  int64_t capacity(int64_t tokens) const;
  Communicator* ep_;     // null: one rank
  Communicator* etp_;    // expert tensor parallel; null: one rank
  Communicator* tp_ep_;  // expert-TP × EP, expert-TP rank fastest (pg.tp_ep); null: one rank
  int num_local_experts_ = 0, first_local_expert_ = 0;
};

/// The dispatcher of `config.type` over pg.ep, pg.expt_tp and pg.tp_ep (one clear line for an
/// unknown type, experts not divisible by the expert-parallel size, or a missing tp_ep group).
std::unique_ptr<MoETokenDispatcher> make_token_dispatcher(const DispatcherConfig& config,
                                                          const ProcessGroupCollection& pg);

}  // namespace megatron::moe

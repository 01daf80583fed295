// Context parallelism (Megatron's --context-parallel-size with --cp-comm-type, the attention
// TransformerEngine runs for it: AttnFuncWithCPAndKVP2P, ...KVAllGather, ...QKVOA2A): the sequence
// of each microbatch is split over the CP ranks, every module but the core attention works on its
// rank's rows alone, and the core attention brings the other ranks' keys and values to its queries.
//
// Note [Load-balanced chunks]: the sequence of S positions is cut into 2N chunks of C = S / 2N
// (N ranks); rank r holds chunks r and 2N-1-r, in that order (Megatron's get_batch_on_this_cp_rank).
// Under the causal mask an early chunk sees few keys and a late one many, so each rank's pair does
// the same attention work. Tokens, labels, the loss mask and the position ids are split so
// (cp_split_rows), the rotary angles are those of the rank's positions (cp_positions), and the
// packed documents stay global (Note [Packed sequences], packed_seq_params.h).
//
// Note [Context-parallel attention]: the attention of a query chunk is the merge of its attention
// over each key chunk it sees (Note [Merging attention over key blocks], kernels/op_list.inc): for
// query chunk q and key chunk k (global chunk indices), k < q is a full block, k == q the causal
// diagonal, k > q nothing. With packed documents (micro-batch 1, as Megatron's THD format) the
// diagonal is the Documents mask of the documents inside the chunk, and k < q is the full block of
// the one document, if any, that runs from chunk k into chunk q: keys from its start (or the chunk's)
// to the end of chunk k, queries from the start of chunk q to its end (or the chunk's) — every other
// query/key pair of the two chunks is in different documents. The backward needs no merge: each
// block's attention_backward with the merged out and lse gives that block's share of dq, dk, dv.
// The comm types move the keys and values differently:
//   p2p        a ring over the CP group: at step t rank r holds the keys/values of rank r - t, sends
//              them on to r + 1 while it computes (the transfer overlaps the blocks), N steps. The
//              backward runs the ring again with the key/value gradients travelling beside them,
//              their exchange overlapped with the next step's blocks; after N steps each rank's
//              gradients come home.
//   all_gather the keys/values all-gathered (in the global order), each query chunk attending to the
//              prefix it sees in one call; the backward's key/value gradients reduce-scattered.
//   a2a        Ulysses: an all-to-all over heads gives each rank the whole sequence for nq/N query
//              heads and ng/N key/value heads, the ordinary (causal or Documents) attention runs on
//              it, and an all-to-all brings the output back to the rank's rows with all heads.
//   a2a+p2p    hierarchical (--hierarchical-context-parallel-sizes A P, A·P = N): the a2a over the
//              A consecutive CP ranks of each level-0 group, then the p2p ring over the P ranks of
//              each level-1 group (same position in their level-0 groups), whose chunks are the 2A
//              chunks the a2a gathered.
// Keys and values may differ in width (MLA: keys of qk + pe channels, values of dv); every comm type
// moves them as two tensors. Attention sinks (--softmax-type) work with every comm type.
// In bf16 the merged output and the summed gradients are rounded once per block (the arithmetic is
// fp32). Attention dropout draws its mask per block from a seed of the block's chunk pair, so it
// is replayable (recomputation, backward) but not the single-process mask.
#pragma once

#include <string>
#include <vector>

#include "megatron/core/comm/communicator.h"
#include "megatron/core/packed_seq_params.h"
#include "megatron/runtime/context.h"

namespace megatron {

enum class CpCommType { P2P, AllGather, A2A, A2AP2P };

/// "p2p", "all_gather", "a2a", "a2a+p2p" (Megatron's --cp-comm-type); anything else is one line.
CpCommType cp_comm_type_from_string(const std::string& s);
std::string to_string(CpCommType t);

/// The global sequence positions of rank r's rows, of N ranks, for a sequence of s_global
/// (Note [Load-balanced chunks]).
std::vector<int64_t> cp_positions(int r, int n, int64_t s_global);

/// Rank r's rows of t [b, s_global, ...] (host; any dtype): [b, s_global / N, ...], chunks r and
/// 2N-1-r of each row (Megatron's get_batch_on_this_cp_rank). Undefined stays undefined.
Tensor cp_split_rows(const Tensor& t, int r, int n);

/// Rows [positions] of x [S, ...] (on any device) as a new tensor [positions.size(), ...], in
/// runs of consecutive positions (the rotary angles of this rank's rows).
Tensor gather_rows(Context& ctx, const Tensor& x, const std::vector<int64_t>& positions);

/// The core attention of one layer under context parallelism.
class ContextParallelAttention {
 public:
  /// cp: the context-parallel group (size N > 1). a2a+p2p needs its level-0 (a2a, A ranks) and
  /// level-1 (ring, P ranks) groups (ParallelState::hierarchical_cp_groups).
  /// window_left: the layer's sliding window (Note [Sliding-window attention]; -1: none), which every
  /// block's mask carries in global positions.
  ContextParallelAttention(Communicator* cp, CpCommType type, Communicator* a2a = nullptr, Communicator* ring = nullptr,
                           int64_t window_left = -1);

  struct Saved {
    Tensor lse;            // p2p, all_gather: [b, nq, s] of this rank's rows; a2a: of the gathered sequence
    Tensor q, k, v, out;   // a2a, a2a+p2p: the head-split tensors the local attention ran on
    Tensor k_all, v_all;   // all_gather: the gathered keys/values, in the global order (packed: rank-major)
  };

  /// q [s, b, nq, d], k [s, b, ng, d], v [s, b, ng, dv] (dv may differ from d: MLA; Note [Keys and
  /// values of two widths] in the .cpp): this rank's rows (Note [Load-balanced chunks]) after RoPE.
  /// out [s, b, nq, dv] is written. packed: the documents (micro-batch 1), or null (causal).
  /// sinks [nq]: the attention sinks of this rank's heads (Note [Attention sinks]), folded in here
  /// (Note [Context-parallel attention sinks] in the .cpp); undefined: none.
  void forward(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const PackedSeqParams* packed,
               float softmax_scale, float dropout_p, uint64_t seed, uint64_t offset, const Tensor& sinks, Tensor& out,
               Saved& saved) const;
  /// grad_q/grad_k/grad_v (shapes of q/k/v) are overwritten; sinks_grad [nq] fp32 (undefined for
  /// fixed sinks) is added to.
  void backward(Context& ctx, const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                const Tensor& out, const PackedSeqParams* packed, float softmax_scale, float dropout_p, uint64_t seed,
                uint64_t offset, const Tensor& sinks, Tensor& sinks_grad, Saved& saved, Tensor& grad_q, Tensor& grad_k,
                Tensor& grad_v) const;

  CpCommType type() const { return type_; }
  int size() const { return n_; }
  int rank() const { return r_; }

 private:
  Communicator* cp_;
  CpCommType type_;
  int n_ = 1, r_ = 0;
  int64_t window_left_ = -1;
  Communicator* a2a_ = nullptr;   // a2a: cp; a2a+p2p: the level-0 group
  Communicator* ring_ = nullptr;  // p2p: cp; a2a+p2p: the level-1 group
};

}  // namespace megatron

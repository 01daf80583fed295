// ProcessGroupCollection (Megatron-Core's process_groups_config.py, the pg_collection argument):
// the process groups a module uses, handed to it when it is built instead of the whole
// ParallelState. A module reads only the groups of its own kind of parallelism — the attention and
// the dense MLP the tensor-parallel group, the experts their expert groups — so a new layout (the
// experts' own tensor/expert/expert-data groups under parallel folding, context parallelism) is a
// matter of which groups are passed, not of code in the modules.
//
// A null group stands for a one-rank group (the single-device run and every kind of parallelism
// that is off): size 1, rank 0, and no communication. Groups are owned by the ParallelState the
// collection was made from, which must outlive the modules.
#pragma once

#include "megatron/core/comm/communicator.h"

namespace megatron {

class ParallelState;

struct ProcessGroupCollection {
  Communicator* tp = nullptr;     // tensor parallel
  Communicator* cp = nullptr;     // context parallel
  Communicator* hcp_a2a = nullptr, *hcp_p2p = nullptr;  // --cp-comm-type a2a+p2p: levels 0 and 1
  Communicator* dp = nullptr;     // data parallel
  Communicator* dp_cp = nullptr;  // data × context parallel: dense gradients reduce over it
  Communicator* tp_cp = nullptr;  // tensor × context parallel: the MoE router's token counts sum over it
  Communicator* pp = nullptr;     // pipeline parallel
  Communicator* embd = nullptr;   // first and last pipeline stage (tied embeddings); null elsewhere
  Communicator* ep = nullptr;       // expert parallel
  Communicator* expt_tp = nullptr;  // expert tensor parallel
  Communicator* expt_dp = nullptr;  // expert data parallel: expert gradients reduce over it
  /// Expert tensor × expert model parallel (Megatron's tp_ep), group rank = etp + ETP·ep: the
  /// allgather and flex token dispatchers communicate over it.
  Communicator* tp_ep = nullptr;

  /// Every group of `ps` (groups of size 1 are left null).
  static ProcessGroupCollection from(const ParallelState& ps);
  /// `ps` may be null: the one-rank collection.
  static ProcessGroupCollection from(const ParallelState* ps) { return ps ? from(*ps) : ProcessGroupCollection{}; }
};

/// Size and rank of a group that may be null (a one-rank group).
inline int group_size(const Communicator* g) { return g ? g->size() : 1; }
inline int group_rank(const Communicator* g) { return g ? g->rank() : 0; }
/// The group when it has more than one rank, else null (no communication needed).
inline Communicator* multi_rank(Communicator* g) { return g && g->size() > 1 ? g : nullptr; }

}  // namespace megatron

// parallel_state: the process groups of a run (Megatron-Core's parallel_state.py), built from the
// world group by Megatron's RankGenerator with "parallel folding": one rank order for the dense
// layers and another for the experts (mixture-of-experts layers), over the same world.
//
// Dense layers, Megatron's order "tp-cp-ep-dp-pp" with EP = 1 (the dense generator has no expert
// dimension): the tensor-parallel rank varies fastest, then the context-, data- and pipeline-
// parallel ranks:
//   world rank = tp + TP·(cp + CP·(dp + DP·pp)),   DP = world / (TP·CP·PP)
// Experts, the same order with CP = 1 and the expert sizes ("tp-ep-dp-pp"): the expert-tensor rank
// varies fastest, then the expert-model (EP), expert-data and pipeline ranks:
//   world rank = etp + ETP·(ep + EP·(edp + EDP·pp)),   EDP = world / (ETP·EP·PP)
// ETP defaults to TP (expert_tensor_parallel_size 0, Megatron's None). Both orders end in pp, so
// the pipeline groups are the same in both (Megatron asserts it); the dense CP and DP dimensions
// are refolded into EP and EDP.
//
// Groups (each a Communicator; every rank belongs to exactly one group of each kind; a group
// lists its world ranks in increasing order, as Megatron's do):
//   tensor   ranks that differ only in tp          model     tp × pp (same dp, cp)
//   pipeline ranks that differ only in pp          data      ranks that differ only in dp
//   context  ranks that differ only in cp          data-context  dp × cp (gradient reduction)
//   tensor-context tp × cp
//   hierarchical context (--hierarchical-context-parallel-sizes A P): level 0 the A consecutive
//              ranks of the context group, level 1 the P ranks at the same place in their level-0
//              group (Megatron's create_hierarchical_groups)
//   embedding  the first and last pipeline stage of this rank's pipeline (tied embeddings); null
//              on middle stages and when PP = 1.
//   expert-model   ranks that differ only in ep (the token dispatcher's all-to-all)
//   expert-tensor  ranks that differ only in etp
//   expert-tensor-and-model  etp × ep             expert-tensor-model-pipeline  etp × ep × pp
//   expert-data    ranks that differ only in edp (the experts' gradient reduction)
// Virtual pipeline (interleaved 1F1B): each rank holds V model chunks; the schedule sets the
// current chunk with set_virtual_pipeline_rank.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "megatron/core/comm/communicator.h"

namespace megatron {

struct ParallelConfig {
  int tensor_model_parallel_size = 1;
  int pipeline_model_parallel_size = 1;
  int context_parallel_size = 1;
  int expert_model_parallel_size = 1;
  int expert_tensor_parallel_size = 0;           // 0: the tensor-parallel size (Megatron's default)
  int virtual_pipeline_model_parallel_size = 1;  // model chunks per pipeline rank (1: not interleaved)
  bool sequence_parallel = false;
  /// --hierarchical-context-parallel-sizes (a2a+p2p): level sizes whose product is the CP size;
  /// empty: none.
  std::vector<int> hierarchical_context_parallel_sizes;
};

class ParallelState {
 public:
  /// Collective over `world`: checks the sizes divide the world size (one-line error naming the
  /// flags) and splits the groups. config().expert_tensor_parallel_size is the resolved size.
  ParallelState(std::unique_ptr<Communicator> world, const ParallelConfig& config);
  ParallelState(const ParallelState&) = delete;
  ParallelState& operator=(const ParallelState&) = delete;

  const ParallelConfig& config() const { return config_; }
  Communicator& world() const { return *world_; }
  Communicator& tensor() const { return *tp_; }
  Communicator& pipeline() const { return *pp_; }
  Communicator& data() const { return *dp_; }
  Communicator& context() const { return *cp_; }
  Communicator& data_context() const { return *dp_cp_; }
  Communicator& tensor_context() const { return *tp_cp_; }
  Communicator& model() const { return *mp_; }
  /// The hierarchical context-parallel groups, one per level (empty without the flag).
  std::vector<Communicator*> hierarchical_context() const;
  /// Null unless this rank is on the first or last pipeline stage and PP > 1.
  Communicator* embedding() const { return embedding_.get(); }
  Communicator& expert_model() const { return *ep_; }
  Communicator& expert_tensor() const { return *etp_; }
  Communicator& expert_tensor_and_model() const { return *etp_ep_; }
  Communicator& expert_tensor_model_pipeline() const { return *etp_ep_pp_; }
  Communicator& expert_data() const { return *edp_; }

  int world_size() const { return world_->size(); }
  int rank() const { return world_->rank(); }
  int tp_size() const { return config_.tensor_model_parallel_size; }
  int pp_size() const { return config_.pipeline_model_parallel_size; }
  int cp_size() const { return config_.context_parallel_size; }
  int dp_size() const { return dp_size_; }
  int tp_rank() const { return tp_rank_; }
  int pp_rank() const { return pp_rank_; }
  int cp_rank() const { return cp_rank_; }
  int dp_rank() const { return dp_rank_; }
  int ep_size() const { return config_.expert_model_parallel_size; }
  int etp_size() const { return config_.expert_tensor_parallel_size; }
  int edp_size() const { return edp_size_; }
  int ep_rank() const { return ep_rank_; }
  int etp_rank() const { return etp_rank_; }
  int edp_rank() const { return edp_rank_; }
  int vpp_size() const { return config_.virtual_pipeline_model_parallel_size; }
  bool sequence_parallel() const { return config_.sequence_parallel; }

  /// The model chunk the schedule is working on (0 when not interleaved).
  int virtual_pipeline_rank() const { return vpp_rank_; }
  void set_virtual_pipeline_rank(int r) { vpp_rank_ = r; }
  /// Megatron's is_pipeline_first_stage / is_pipeline_last_stage: with ignore_virtual=false, also
  /// the first (last) model chunk.
  bool is_pipeline_first_stage(bool ignore_virtual = false) const;
  bool is_pipeline_last_stage(bool ignore_virtual = false) const;
  /// Ranks within the pipeline group of the next and previous stage (wrapping around).
  int pipeline_next_rank() const { return (pp_rank_ + 1) % pp_size(); }
  int pipeline_prev_rank() const { return (pp_rank_ + pp_size() - 1) % pp_size(); }

  /// The world rank of the given coordinates (Megatron's rank order).
  int world_rank_of(int tp, int cp, int dp, int pp) const;
  /// The world rank of the given expert coordinates (the expert rank order).
  int expert_world_rank_of(int etp, int ep, int edp, int pp) const;
  /// "tp 1/2, pp 0/2, dp 0/1" for messages (with the expert ranks when EP > 1 or ETP != TP).
  std::string describe() const;

 private:
  ParallelConfig config_;
  std::unique_ptr<Communicator> world_;
  // Shared: the expert groups are the dense ones where the layouts coincide (Note [Dense expert
  // groups] in parallel_state.cpp).
  std::shared_ptr<Communicator> tp_, pp_, dp_, cp_, dp_cp_, tp_cp_, mp_, embedding_;
  std::shared_ptr<Communicator> ep_, etp_, etp_ep_, etp_ep_pp_, edp_;
  std::vector<std::shared_ptr<Communicator>> hcp_;
  int dp_size_ = 1, edp_size_ = 1;
  int tp_rank_ = 0, pp_rank_ = 0, cp_rank_ = 0, dp_rank_ = 0;
  int ep_rank_ = 0, etp_rank_ = 0, edp_rank_ = 0;
  int vpp_rank_ = 0;
};

}  // namespace megatron

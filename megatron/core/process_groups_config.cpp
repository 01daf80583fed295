#include "megatron/core/process_groups_config.h"

#include "megatron/core/parallel_state.h"

namespace megatron {

ProcessGroupCollection ProcessGroupCollection::from(const ParallelState& ps) {
  ProcessGroupCollection pg;
  pg.tp = multi_rank(&ps.tensor());
  pg.cp = multi_rank(&ps.context());
  const std::vector<Communicator*> hcp = ps.hierarchical_context();
  if (hcp.size() == 2) pg.hcp_a2a = hcp[0], pg.hcp_p2p = hcp[1];
  pg.dp = multi_rank(&ps.data());
  pg.dp_cp = multi_rank(&ps.data_context());
  pg.tp_cp = multi_rank(&ps.tensor_context());
  pg.pp = multi_rank(&ps.pipeline());
  pg.embd = ps.embedding();
  pg.ep = multi_rank(&ps.expert_model());
  pg.expt_tp = multi_rank(&ps.expert_tensor());
  pg.expt_dp = multi_rank(&ps.expert_data());
  pg.tp_ep = multi_rank(&ps.expert_tensor_and_model());
  return pg;
}

}  // namespace megatron

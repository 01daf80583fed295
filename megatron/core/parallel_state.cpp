#include "megatron/core/parallel_state.h"

#include <fmt/format.h>

namespace megatron {
namespace {

// One dimension of a rank order: this rank's coordinate, the dimension's size, and whether it
// varies inside the group being built.
struct Dim {
  int rank, size;
  bool in_group;
};

// The index of this rank's group among the groups over the `in_group` dimensions: the other
// coordinates, mixed-radix, fastest first (Megatron's group index). It is the split's color; the
// key is the world rank, which orders each group as Megatron's generator lists it (increasing).
int group_index(std::initializer_list<Dim> dims) {
  int index = 0, stride = 1;
  for (const Dim& d : dims) {
    if (d.in_group) continue;
    index += d.rank * stride;
    stride *= d.size;
  }
  return index;
}

}  // namespace

ParallelState::ParallelState(std::unique_ptr<Communicator> world, const ParallelConfig& config)
    : config_(config), world_(std::move(world)) {
  const int ws = world_->size();
  const int tp = config_.tensor_model_parallel_size, pp = config_.pipeline_model_parallel_size,
            cp = config_.context_parallel_size, vpp = config_.virtual_pipeline_model_parallel_size,
            ep = config_.expert_model_parallel_size;
  MG_CHECK(tp >= 1 && pp >= 1 && cp >= 1 && vpp >= 1 && ep >= 1,
           "parallel sizes must be >= 1 (tensor {}, pipeline {}, context {}, virtual pipeline {}, expert {})", tp, pp,
           cp, vpp, ep);
  MG_CHECK(config_.expert_tensor_parallel_size >= 0,
           "--expert-tensor-parallel-size {}: use a size >= 1, or leave it unset for the tensor-parallel size",
           config_.expert_tensor_parallel_size);
  if (config_.expert_tensor_parallel_size == 0) config_.expert_tensor_parallel_size = tp;
  const int etp = config_.expert_tensor_parallel_size;
  MG_CHECK(ws % (tp * pp * cp) == 0,
           "world size {} is not divisible by --tensor-model-parallel-size ({}) x --pipeline-model-parallel-size "
           "({}) x --context-parallel-size ({}): launch a multiple of {} processes",
           ws, tp, pp, cp, tp * pp * cp);
  MG_CHECK(ws % (etp * ep * pp) == 0,
           "world size {} is not divisible by --expert-tensor-parallel-size ({}) x --expert-model-parallel-size ({}) x "
           "--pipeline-model-parallel-size ({}): launch a multiple of {} processes or change the expert sizes",
           ws, etp, ep, pp, etp * ep * pp);
  MG_CHECK(vpp == 1 || pp > 1, "virtual pipeline stages need --pipeline-model-parallel-size > 1");
  dp_size_ = ws / (tp * pp * cp);
  edp_size_ = ws / (etp * ep * pp);
  const int r = world_->rank();
  tp_rank_ = r % tp;
  cp_rank_ = (r / tp) % cp;
  dp_rank_ = (r / (tp * cp)) % dp_size_;
  pp_rank_ = r / (tp * cp * dp_size_);
  etp_rank_ = r % etp;
  ep_rank_ = (r / etp) % ep;
  edp_rank_ = (r / (etp * ep)) % edp_size_;
  MG_ASSERT(r / (etp * ep * edp_size_) == pp_rank_, "rank {}: the expert order's pipeline rank differs", r);

  auto dense = [&](bool t, bool c, bool d, bool p) {  // true: the dimension varies inside the group
    return group_index({{tp_rank_, tp, t}, {cp_rank_, cp, c}, {dp_rank_, dp_size_, d}, {pp_rank_, pp, p}});
  };
  auto expert = [&](bool t, bool e, bool d, bool p) {
    return group_index({{etp_rank_, etp, t}, {ep_rank_, ep, e}, {edp_rank_, edp_size_, d}, {pp_rank_, pp, p}});
  };
  tp_ = world_->split(dense(true, false, false, false), r, "tensor-parallel");
  pp_ = world_->split(dense(false, false, false, true), r, "pipeline-parallel");
  dp_ = world_->split(dense(false, false, true, false), r, "data-parallel");
  cp_ = world_->split(dense(false, true, false, false), r, "context-parallel");
  dp_cp_ = world_->split(dense(false, true, true, false), r, "data-context-parallel");
  tp_cp_ = world_->split(dense(true, true, false, false), r, "tensor-context-parallel");
  mp_ = world_->split(dense(true, false, false, true), r, "model-parallel");
  // Megatron's create_hierarchical_groups over the context group: level l groups the ranks whose
  // context rank differs only in digit l of its mixed-radix form (level 0 varies fastest).
  const std::vector<int>& hs = config_.hierarchical_context_parallel_sizes;
  if (!hs.empty()) {
    int prod = 1;
    for (int h : hs) {
      MG_CHECK(h >= 1, "--hierarchical-context-parallel-sizes: {} is not a positive size", h);
      prod *= h;
    }
    MG_CHECK(prod == cp, "--hierarchical-context-parallel-sizes multiply to {}, not --context-parallel-size {}", prod,
             cp);
    int below = 1;
    for (size_t level = 0; level < hs.size(); ++level) {
      const int digit = (cp_rank_ / below) % hs[level];
      const int others = cp_rank_ - digit * below;  // the context rank with this level's digit zeroed
      hcp_.push_back(world_->split(dense(false, true, false, false) * cp + others, r,
                                   fmt::format("hierarchical-context-parallel-{}", level)));
      below *= hs[level];
    }
  }
  const bool in_embedding = pp > 1 && (pp_rank_ == 0 || pp_rank_ == pp - 1);
  embedding_ = world_->split(in_embedding ? dense(false, false, false, true) : -1, r, "embedding");

  ep_ = world_->split(expert(false, true, false, false), r, "expert-model-parallel");
  // Note [Dense expert groups]: with EP = 1 and ETP = TP the expert order is the dense one with CP
  // folded into expert-data (edp = cp + CP·dp), so four expert groups are dense groups: shared, not
  // split again (an NCCL split creates its communicator at once, where torch creates Megatron's
  // lazily, on first use).
  if (ep == 1 && etp == tp) {
    etp_ = tp_;
    etp_ep_ = tp_;
    etp_ep_pp_ = mp_;
    edp_ = dp_cp_;
  } else {
    etp_ = world_->split(expert(true, false, false, false), r, "expert-tensor-parallel");
    etp_ep_ = world_->split(expert(true, true, false, false), r, "expert-tensor-and-model-parallel");
    etp_ep_pp_ = world_->split(expert(true, true, false, true), r, "expert-tensor-model-pipeline-parallel");
    edp_ = world_->split(expert(false, false, true, false), r, "expert-data-parallel");
  }
}

std::vector<Communicator*> ParallelState::hierarchical_context() const {
  std::vector<Communicator*> out;
  for (const auto& g : hcp_) out.push_back(g.get());
  return out;
}

bool ParallelState::is_pipeline_first_stage(bool ignore_virtual) const {
  if (!ignore_virtual && vpp_size() > 1 && vpp_rank_ != 0) return false;
  return pp_rank_ == 0;
}

bool ParallelState::is_pipeline_last_stage(bool ignore_virtual) const {
  if (!ignore_virtual && vpp_size() > 1 && vpp_rank_ != vpp_size() - 1) return false;
  return pp_rank_ == pp_size() - 1;
}

int ParallelState::world_rank_of(int tp, int cp, int dp, int pp) const {
  return tp + tp_size() * (cp + cp_size() * (dp + dp_size_ * pp));
}

int ParallelState::expert_world_rank_of(int etp, int ep, int edp, int pp) const {
  return etp + etp_size() * (ep + ep_size() * (edp + edp_size_ * pp));
}

std::string ParallelState::describe() const {
  std::string s = fmt::format("rank {}: tp {}/{}, cp {}/{}, dp {}/{}, pp {}/{}", rank(), tp_rank_, tp_size(), cp_rank_,
                              cp_size(), dp_rank_, dp_size_, pp_rank_, pp_size());
  if (ep_size() > 1 || etp_size() != tp_size()) {
    s += fmt::format(", ep {}/{}, etp {}/{}, edp {}/{}", ep_rank_, ep_size(), etp_rank_, etp_size(), edp_rank_,
                     edp_size_);
  }
  return s;
}

}  // namespace megatron

#include "megatron/core/parallel_state.h"

#include <fmt/format.h>

namespace megatron {

ParallelState::ParallelState(std::unique_ptr<Communicator> world, const ParallelConfig& config)
    : config_(config), world_(std::move(world)) {
  const int ws = world_->size();
  const int tp = config_.tensor_model_parallel_size, pp = config_.pipeline_model_parallel_size,
            cp = config_.context_parallel_size, vpp = config_.virtual_pipeline_model_parallel_size;
  MG_CHECK(tp >= 1 && pp >= 1 && cp >= 1 && vpp >= 1,
           "parallel sizes must be >= 1 (tensor {}, pipeline {}, context {}, virtual pipeline {})", tp, pp, cp, vpp);
  MG_CHECK(config_.expert_model_parallel_size == 1,
           "--expert-model-parallel-size {}: expert parallelism needs a mixture-of-experts model, which this "
           "build does not have; use 1",
           config_.expert_model_parallel_size);
  MG_CHECK(ws % (tp * pp * cp) == 0,
           "world size {} is not divisible by --tensor-model-parallel-size ({}) x --pipeline-model-parallel-size "
           "({}) x --context-parallel-size ({}): launch a multiple of {} processes",
           ws, tp, pp, cp, tp * pp * cp);
  MG_CHECK(vpp == 1 || pp > 1, "virtual pipeline stages need --pipeline-model-parallel-size > 1");
  dp_size_ = ws / (tp * pp * cp);
  const int r = world_->rank();
  tp_rank_ = r % tp;
  cp_rank_ = (r / tp) % cp;
  dp_rank_ = (r / (tp * cp)) % dp_size_;
  pp_rank_ = r / (tp * cp * dp_size_);

  // Each split's color is the index of this rank's group; key the rank within it.
  auto color = [&](bool t, bool c, bool d, bool p) {  // true: the dimension varies inside the group
    int col = 0, mul = 1;
    if (!t) col += tp_rank_ * mul, mul *= tp;
    if (!c) col += cp_rank_ * mul, mul *= cp;
    if (!d) col += dp_rank_ * mul, mul *= dp_size_;
    if (!p) col += pp_rank_ * mul;
    return col;
  };
  tp_ = world_->split(color(true, false, false, false), r, "tensor-parallel");
  pp_ = world_->split(color(false, false, false, true), r, "pipeline-parallel");
  dp_ = world_->split(color(false, false, true, false), r, "data-parallel");
  cp_ = world_->split(color(false, true, false, false), r, "context-parallel");
  dp_cp_ = world_->split(color(false, true, true, false), r, "data-context-parallel");
  tp_cp_ = world_->split(color(true, true, false, false), r, "tensor-context-parallel");
  mp_ = world_->split(color(true, false, false, true), r, "model-parallel");
  const bool in_embedding = pp > 1 && (pp_rank_ == 0 || pp_rank_ == pp - 1);
  embedding_ = world_->split(in_embedding ? color(false, false, false, true) : -1, r, "embedding");
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

std::string ParallelState::describe() const {
  return fmt::format("rank {}: tp {}/{}, cp {}/{}, dp {}/{}, pp {}/{}", rank(), tp_rank_, tp_size(), cp_rank_,
                     cp_size(), dp_rank_, dp_size_, pp_rank_, pp_size());
}

}  // namespace megatron

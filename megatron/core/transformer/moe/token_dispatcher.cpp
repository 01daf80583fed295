#include "megatron/core/transformer/moe/token_dispatcher.h"

#include <fmt/format.h>

namespace megatron::moe {

MoETokenDispatcher::MoETokenDispatcher(const DispatcherConfig& config, const ProcessGroupCollection& pg)
    : config_(config), ep_(multi_rank(pg.ep)), etp_(multi_rank(pg.expt_tp)) {
  const int ep = group_size(ep_);
  MG_CHECK(config.num_experts > 0 && config.num_experts % ep == 0,
           "--num-experts ({}) must be divisible by --expert-model-parallel-size ({})", config.num_experts, ep);
  num_local_experts_ = config.num_experts / ep;
  first_local_expert_ = group_rank(ep_) * num_local_experts_;
}

namespace {

// One rank in the expert-parallel and expert-TP groups: every kind is the local permutation.
class LocalDispatcher final : public MoETokenDispatcher {
 public:
  LocalDispatcher(const DispatcherConfig& config, const ProcessGroupCollection& pg) : MoETokenDispatcher(config, pg) {}

  struct State : Saved {
    Permutation perm;
    int64_t num_experts = 0;
  };

  Dispatched dispatch(Context&, const Tensor& x, const Tensor& probs, const Tensor& routing_map,
                      std::unique_ptr<Saved>& saved) override {
    auto state = std::make_unique<State>();
    state->perm = make_permutation(routing_map, config_.capacity);
    state->num_experts = routing_map.size(1);
    Dispatched d;
    d.tokens = permute_forward(x, state->perm);
    d.probs = permute_probs(probs, state->perm);
    d.tokens_per_expert = state->perm.tokens_per_expert;
    saved = std::move(state);
    return d;
  }
  Tensor combine(Context&, const Tensor& expert_out, Saved& saved) override {
    return unpermute_forward(expert_out, Tensor(), state(saved).perm);
  }
  Tensor combine_backward(Context&, const Tensor& grad_out, Saved& saved) override {
    return permute_forward(grad_out, state(saved).perm);  // the gradient of an unweighted unpermute
  }
  void dispatch_backward(Context&, const Tensor& grad_tokens, const Tensor& grad_probs, Saved& saved, Tensor& grad_x,
                         Tensor& grad_probs_full) override {
    State& s = state(saved);
    grad_x = permute_backward(grad_tokens, s.perm);
    grad_probs_full = permute_probs_backward(grad_probs, s.perm, s.num_experts);
    s.perm = Permutation{};
  }

 private:
  static State& state(Saved& saved) {
    auto* s = dynamic_cast<State*>(&saved);
    MG_ASSERT(s, "token dispatcher state of another kind");
    return *s;
  }
};

}  // namespace

std::unique_ptr<MoETokenDispatcher> make_token_dispatcher(const DispatcherConfig& config,
                                                          const ProcessGroupCollection& pg) {
  MG_CHECK(config.type == "allgather" || config.type == "alltoall" || config.type == "flex",
           "unknown --moe-token-dispatcher-type {}: use allgather, alltoall or flex", config.type);
  if (!multi_rank(pg.ep) && !multi_rank(pg.expt_tp)) return std::make_unique<LocalDispatcher>(config, pg);
  MG_CHECK(false, "the {} token dispatcher over {} expert-parallel x {} expert-tensor-parallel ranks is not built yet",
           config.type, group_size(pg.ep), group_size(pg.expt_tp));
  return nullptr;
}

}  // namespace megatron::moe

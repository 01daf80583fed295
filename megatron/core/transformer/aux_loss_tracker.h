// AuxLossTracker (Megatron's MoE aux-loss tracker: save_to_aux_losses_tracker,
// reduce_aux_losses_tracker_across_ranks, track_moe_metrics): the extra losses modules compute
// beside the language-model loss — a mixture of experts' load-balancing and z losses, later the
// multi-token-prediction loss — collected per name and layer during a step, on the device, and
// read once per step to reach the log line and TensorBoard.
//
// Every rank declares the same names (the model does, at construction, for every loss any of its
// layers may report), so the reduction over the ranks is the same collective on each of them:
// a name's per-layer values are summed over the pipeline ranks (each stage adds its own layers),
// then over the name's reduce group when it has one (the load-balancing losses are partial sums
// over tensor × context parallel ranks), and averaged over the data-parallel ranks unless the name
// says otherwise (Megatron averages the losses it reduces; its z-loss is logged as the rank's own;
// the global load-balancing loss is a partial sum over tp × dp × cp, so it is summed over dp too:
// Megatron's reduce_group_has_dp).
// The value reported is the mean over the layers that reported the name of the per-microbatch mean.
//
// The tracker also carries the aux losses' backward scale for the step (Megatron's
// MoEAuxLossAutoScaler.set_loss_scale: the main loss's scale over the number of microbatches).
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "megatron/core/comm/communicator.h"

namespace megatron {

class AuxLossTracker {
 public:
  /// What a name's values do over the data-parallel ranks at report().
  enum class OverDp { Mean, Sum, None };
  /// A loss that layers [0, num_layers) may report (idempotent; on every rank, before the first step).
  void declare(const std::string& name, int num_layers, Communicator* reduce_group = nullptr,
               OverDp over_dp = OverDp::Mean);
  bool empty() const { return entries_.empty(); }
  /// Adds `value` (one fp32 element on ctx's device; no host wait) to layer `layer`'s `name`.
  void add(Context& ctx, const std::string& name, int layer, const Tensor& value);
  /// Reduces over `pp` (sum) and `dp` (mean) — either may be null — and returns, per declared name
  /// in name order, the mean over the reporting layers of Σ values / num_microbatches; then
  /// clears the values. One read of the device. Collective over pp and dp.
  std::vector<std::pair<std::string, double>> report(Context& ctx, Communicator* pp, Communicator* dp,
                                                     int num_microbatches);
  /// Drops this step's values and token counts (evaluation steps do not report).
  void clear();

  /// The last report()'s per-layer values of each name (the layers that reported it; Megatron's
  /// --moe-per-layer-logging), by name and layer.
  const std::map<std::string, std::map<int, double>>& last_per_layer() const { return per_layer_; }

  /// Tokens routed to each expert, per layer ([E] fp32 on the device; summed over the step's
  /// microbatches), for --moe-per-layer-logging. take_tokens_per_expert sums them over `groups`
  /// (tp × cp, data parallel, pipeline: collective on every rank, each declaring the same layers
  /// through declare_tokens_per_expert), returns them per layer and restarts the counts.
  void declare_tokens_per_expert(int num_layers, int num_experts);
  void add_tokens_per_expert(Context& ctx, int layer, const Tensor& counts);
  std::map<int, std::vector<double>> take_tokens_per_expert(Context& ctx, const std::vector<Communicator*>& groups);
  bool tracks_tokens_per_expert() const { return token_layers_ > 0; }

  /// Forward passes of evaluation: the MoE layers report nothing (no losses, no token counts; the
  /// expert biases count training tokens only, as Megatron's under torch.no_grad()).
  void set_evaluating(bool evaluating) { evaluating_ = evaluating; }
  bool evaluating() const { return evaluating_; }

  /// The gradient each aux loss gets in backward (set once per step, before the forward passes).
  void set_backward_scale(float scale) { backward_scale_ = scale; }
  float backward_scale() const { return backward_scale_; }

 private:
  struct Entry {
    Tensor values;               // [num_layers] fp32 on the device, allocated at the first add
    std::vector<bool> reported;  // per layer, host-side
    Communicator* reduce_group = nullptr;
    OverDp over_dp = OverDp::Mean;
  };
  void clear_losses();

  float backward_scale_ = 1.0f;
  bool evaluating_ = false;
  std::map<std::string, std::map<int, double>> per_layer_;
  int token_layers_ = 0, token_experts_ = 0;
  Tensor tokens_;                   // [layers, E] fp32
  std::vector<bool> token_reported_;  // per layer
  std::map<std::string, Entry> entries_;
};

}  // namespace megatron

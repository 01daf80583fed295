#include "megatron/core/transformer/aux_loss_tracker.h"

#include "megatron/kernels/ops.h"

namespace megatron {

void AuxLossTracker::declare(const std::string& name, int num_layers, Communicator* reduce_group,
                             OverDp over_dp) {
  MG_CHECK(num_layers > 0, "aux loss '{}' declared for {} layers", name, num_layers);
  Entry& e = entries_[name];
  MG_CHECK(e.reported.empty() || int(e.reported.size()) == num_layers,
           "aux loss '{}' declared for {} layers, then for {}", name, e.reported.size(), num_layers);
  e.reported.resize(size_t(num_layers), false);
  e.reduce_group = reduce_group && reduce_group->size() > 1 ? reduce_group : nullptr;
  e.over_dp = over_dp;
}

void AuxLossTracker::add(Context& ctx, const std::string& name, int layer, const Tensor& value) {
  auto it = entries_.find(name);
  MG_CHECK(it != entries_.end(), "aux loss '{}' was not declared: declare every tracked loss when the model is built",
           name);
  Entry& e = it->second;
  MG_CHECK(layer >= 0 && layer < int(e.reported.size()), "aux loss '{}' reported for layer {} of {}", name, layer,
           e.reported.size());
  MG_CHECK(value.numel() == 1 && value.dtype() == DType::Float32, "aux loss '{}' must be one fp32 value, got {}",
           name, value.str());
  if (!e.values.defined() || e.values.device() != ctx.device()) {
    e.values = Tensor::zeros({int64_t(e.reported.size())}, DType::Float32, ctx.device());
  }
  Tensor slot = e.values.flat_slice(layer, 1);
  ops::add(ctx, slot, value.view({1}), slot);
  e.reported[size_t(layer)] = true;
}

std::vector<std::pair<std::string, double>> AuxLossTracker::report(Context& ctx, Communicator* pp, Communicator* dp,
                                                                   int num_microbatches) {
  std::vector<std::pair<std::string, double>> out;
  for (auto& [name, e] : entries_) {
    const int64_t n = int64_t(e.reported.size());
    // values and the layers that reported, in one tensor so one reduction carries both.
    Tensor both = Tensor::zeros({2 * n}, DType::Float32, ctx.device());
    if (e.values.defined()) both.flat_slice(0, n).copy_from(e.values);
    std::vector<float> flags(static_cast<size_t>(n), 0.0f);
    for (int64_t i = 0; i < n; ++i) flags[size_t(i)] = e.reported[size_t(i)] ? 1.0f : 0.0f;
    both.flat_slice(n, n).copy_from(Tensor::from_floats(flags, {n}, DType::Float32, ctx.device()));
    if (pp && pp->size() > 1) pp->all_reduce(ctx, both)->wait();
    if (e.reduce_group) e.reduce_group->all_reduce(ctx, both)->wait();
    const bool over_dp = e.over_dp != OverDp::None && dp && dp->size() > 1;
    if (over_dp) dp->all_reduce(ctx, both)->wait();
    const std::vector<float> host = both.to_floats();
    const double dp_size = over_dp && e.over_dp == OverDp::Mean ? double(dp->size()) : 1.0;  // Sum: as reduced
    double sum = 0;
    int layers = 0;
    std::map<int, double>& per_layer = per_layer_[name];
    per_layer.clear();
    for (int64_t i = 0; i < n; ++i) {
      if (host[size_t(n + i)] == 0.0f) continue;
      const double v = double(host[size_t(i)]) / dp_size / double(num_microbatches);
      per_layer[int(i)] = v;
      sum += v;
      ++layers;
    }
    out.emplace_back(name, layers > 0 ? sum / layers : 0.0);
  }
  clear_losses();
  return out;
}

void AuxLossTracker::declare_tokens_per_expert(int num_layers, int num_experts) {
  MG_CHECK(num_layers > 0 && num_experts > 0, "tokens per expert declared for {} layers of {} experts", num_layers,
           num_experts);
  MG_CHECK(token_layers_ == 0 || (token_layers_ == num_layers && token_experts_ == num_experts),
           "tokens per expert declared for {}x{}, then for {}x{}", token_layers_, token_experts_, num_layers,
           num_experts);
  token_layers_ = num_layers;
  token_experts_ = num_experts;
  token_reported_.resize(size_t(num_layers), false);
}

void AuxLossTracker::add_tokens_per_expert(Context& ctx, int layer, const Tensor& counts) {
  if (token_layers_ == 0) return;  // not asked for
  MG_CHECK(layer >= 0 && layer < token_layers_ && counts.numel() == token_experts_,
           "tokens per expert of layer {} ({} values) for {} layers of {} experts", layer, counts.numel(),
           token_layers_, token_experts_);
  if (!tokens_.defined() || tokens_.device() != ctx.device()) {
    tokens_ = Tensor::zeros({int64_t(token_layers_) * token_experts_}, DType::Float32, ctx.device());
  }
  Tensor slot = tokens_.flat_slice(int64_t(layer) * token_experts_, token_experts_);
  ops::add(ctx, slot, counts.to(DType::Float32).view({int64_t(token_experts_)}), slot);
  token_reported_[size_t(layer)] = true;
}

std::map<int, std::vector<double>> AuxLossTracker::take_tokens_per_expert(Context& ctx,
                                                                         const std::vector<Communicator*>& groups) {
  std::map<int, std::vector<double>> out;
  if (token_layers_ == 0) return out;
  const int64_t n = int64_t(token_layers_) * token_experts_;
  Tensor both = Tensor::zeros({n + token_layers_}, DType::Float32, ctx.device());
  if (tokens_.defined()) both.flat_slice(0, n).copy_from(tokens_);
  std::vector<float> flags(static_cast<size_t>(token_layers_));
  for (int i = 0; i < token_layers_; ++i) flags[size_t(i)] = token_reported_[size_t(i)] ? 1.0f : 0.0f;
  both.flat_slice(n, token_layers_).copy_from(Tensor::from_floats(flags, {int64_t(token_layers_)}, DType::Float32, ctx.device()));
  for (Communicator* g : groups) {
    if (g && g->size() > 1) g->all_reduce(ctx, both)->wait();
  }
  const std::vector<float> host = both.to_floats();
  for (int i = 0; i < token_layers_; ++i) {
    if (host[size_t(n + i)] == 0.0f) continue;
    std::vector<double>& v = out[i];
    for (int e = 0; e < token_experts_; ++e) v.push_back(host[size_t(int64_t(i) * token_experts_ + e)]);
  }
  if (tokens_.defined()) tokens_.zero_();
  std::fill(token_reported_.begin(), token_reported_.end(), false);
  return out;
}

void AuxLossTracker::clear() {
  if (tokens_.defined()) tokens_.zero_();
  std::fill(token_reported_.begin(), token_reported_.end(), false);
  clear_losses();
}

void AuxLossTracker::clear_losses() {
  for (auto& [name, e] : entries_) {
    if (e.values.defined()) e.values.zero_();
    std::fill(e.reported.begin(), e.reported.end(), false);
  }
}

}  // namespace megatron

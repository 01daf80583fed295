#include "megatron/core/transformer/aux_loss_tracker.h"

#include "megatron/kernels/ops.h"

namespace megatron {

void AuxLossTracker::declare(const std::string& name, int num_layers, Communicator* reduce_group,
                             bool average_over_dp) {
  MG_CHECK(num_layers > 0, "aux loss '{}' declared for {} layers", name, num_layers);
  Entry& e = entries_[name];
  MG_CHECK(e.reported.empty() || int(e.reported.size()) == num_layers,
           "aux loss '{}' declared for {} layers, then for {}", name, e.reported.size(), num_layers);
  e.reported.resize(size_t(num_layers), false);
  e.reduce_group = reduce_group && reduce_group->size() > 1 ? reduce_group : nullptr;
  e.average_over_dp = average_over_dp;
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
    const bool average = e.average_over_dp && dp && dp->size() > 1;
    if (average) dp->all_reduce(ctx, both)->wait();
    const std::vector<float> host = both.to_floats();
    const double dp_size = average ? double(dp->size()) : 1.0;
    double sum = 0;
    int layers = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (host[size_t(n + i)] == 0.0f) continue;
      sum += double(host[size_t(i)]) / dp_size / double(num_microbatches);
      ++layers;
    }
    out.emplace_back(name, layers > 0 ? sum / layers : 0.0);
  }
  clear();
  return out;
}

void AuxLossTracker::clear() {
  for (auto& [name, e] : entries_) {
    if (e.values.defined()) e.values.zero_();
    std::fill(e.reported.begin(), e.reported.end(), false);
  }
}

}  // namespace megatron

// Global L2 norm, clipping and zero counting over a list of fp32 gradients.
#include "megatron/core/optimizer/clip_grads.h"

#include <cmath>
#include <cstring>
#include <limits>

namespace megatron {

GradStats grad_stats_fp32(Context& ctx, const std::vector<Tensor>& grads) {
  GradStats total;
  for (const Tensor& g : grads) {
    if (!g.defined()) continue;
    MG_CHECK(g.dtype() == DType::Float32, "gradient norm: gradients must be fp32, got {}", g.str());
    const GradStats s = ops::grad_stats(ctx, g);
    total.sum_sq += s.sum_sq;
    total.found_inf_or_nan = total.found_inf_or_nan || s.found_inf_or_nan;
    total.num_zeros += s.num_zeros;
  }
  return total;
}

GradStats all_reduce_grad_stats(Context& ctx, Communicator& group, const GradStats& local) {
  if (group.size() == 1) return local;
  // Raw bits of Σg² through an int64 all-gather: exact, and summed in the same order everywhere.
  int64_t bits = 0;
  std::memcpy(&bits, &local.sum_sq, sizeof bits);
  const Tensor mine = Tensor::from_ints({bits, local.found_inf_or_nan ? 1 : 0, local.num_zeros}, {3}, DType::Int64,
                                        ctx.device());
  Tensor all = Tensor::empty({3 * int64_t(group.size())}, DType::Int64, ctx.device());
  group.all_gather(ctx, mine, all)->wait();
  const std::vector<int64_t> v = all.to_ints();
  GradStats total;
  for (int r = 0; r < group.size(); ++r) {
    double sum_sq = 0;
    std::memcpy(&sum_sq, &v[size_t(3 * r)], sizeof sum_sq);
    total.sum_sq += sum_sq;
    total.found_inf_or_nan = total.found_inf_or_nan || v[size_t(3 * r + 1)] != 0;
    total.num_zeros += v[size_t(3 * r + 2)];
  }
  return total;
}

double grad_norm_from_stats(const GradStats& stats, double scale) {
  const double norm = std::sqrt(stats.sum_sq) * scale;
  // Σg² already carries an inf/nan; this keeps the contract when a backend saturates the sum.
  if (stats.found_inf_or_nan && std::isfinite(norm)) return std::numeric_limits<double>::quiet_NaN();
  return norm;
}

double get_grad_norm_fp32(Context& ctx, const std::vector<Tensor>& grads) {
  return grad_norm_from_stats(grad_stats_fp32(ctx, grads));
}

double clip_coefficient(double max_norm, double total_norm) { return max_norm / (total_norm + 1.0e-6); }

void clip_grad_by_total_norm_fp32(Context& ctx, const std::vector<Tensor>& grads, double max_norm, double total_norm) {
  const double coeff = clip_coefficient(max_norm, total_norm);
  if (!(coeff < 1.0)) return;
  for (const Tensor& g : grads) {
    if (!g.defined()) continue;
    Tensor t = g;
    ops::scale_(ctx, t, float(coeff));
  }
}

double clip_grad_norm_fp32(Context& ctx, const std::vector<Tensor>& grads, double max_norm) {
  MG_CHECK(max_norm > 0.0, "clip_grad is {}: it must be > 0 to clip", max_norm);
  const double norm = get_grad_norm_fp32(ctx, grads);
  clip_grad_by_total_norm_fp32(ctx, grads, max_norm, norm);
  return norm;
}

int64_t count_zeros_fp32(Context& ctx, const std::vector<Tensor>& grads) {
  return grad_stats_fp32(ctx, grads).num_zeros;
}

}  // namespace megatron

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
  const std::vector<double> sum = sum_in_rank_order(
      ctx, group, {local.sum_sq, local.found_inf_or_nan ? 1.0 : 0.0, double(local.num_zeros)});
  return GradStats{sum[0], sum[1] != 0.0, int64_t(sum[2])};
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

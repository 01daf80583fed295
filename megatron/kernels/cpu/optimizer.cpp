// CPU reference of the optimizer ops: the AdamW update, gradient statistics, in-place scaling.
//
// adamw_step follows torch.optim.AdamW / apex FusedAdam(adam_w_mode=True) in fp32: the decoupled
// weight decay uses the parameter before the Adam update. grad_stats sums squares in fp64 so the
// global norm does not depend on the order of a long sum; inf and nan propagate into the sum, so
// sqrt(sum_sq) is itself inf/nan when a gradient is.
#include <cmath>

#include "megatron/kernels/cpu/cpu_common.h"
#include "megatron/kernels/cpu/cpu_ops.h"

namespace megatron::cpu {

void adamw_step(Context& ctx, Tensor& main_param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                const AdamHyperParams& hp, Tensor& model_param) {
  assert_fp32(main_param, "main_param");
  const int64_t n = main_param.numel();
  assert_fp32(grad, "grad");
  assert_fp32(exp_avg, "exp_avg");
  assert_fp32(exp_avg_sq, "exp_avg_sq");
  assert_numel(grad, n, "grad");
  assert_numel(exp_avg, n, "exp_avg");
  assert_numel(exp_avg_sq, n, "exp_avg_sq");
  if (model_param.defined()) {
    assert_float(model_param, "model_param");
    assert_numel(model_param, n, "model_param");
  }
  MG_ASSERT(hp.step >= 1, "adamw_step: step is {}, it counts from 1", hp.step);

  const double bc1 = hp.bias_correction ? 1.0 - std::pow(double(hp.beta1), double(hp.step)) : 1.0;
  const double bc2 = hp.bias_correction ? 1.0 - std::pow(double(hp.beta2), double(hp.step)) : 1.0;
  const float inv_bc1 = float(1.0 / bc1);
  const float inv_bc2 = float(1.0 / bc2);
  const float b1 = hp.beta1, b2 = hp.beta2, lr = hp.lr, eps = hp.eps, wd = hp.weight_decay;

  float* p = main_param.data<float>();
  const float* g_in = grad.data<float>();
  float* m = exp_avg.data<float>();
  float* v = exp_avg_sq.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    const float g = g_in[i] * hp.grad_scale;
    m[i] = b1 * m[i] + (1.0f - b1) * g;
    v[i] = b2 * v[i] + (1.0f - b2) * g * g;
    const float update = (m[i] * inv_bc1) / (std::sqrt(v[i] * inv_bc2) + eps);
    const float decayed = p[i] - lr * wd * p[i];
    p[i] = decayed - lr * update;
  }

  if (model_param.defined() && model_param.raw_data() != main_param.raw_data()) model_param.copy_from(main_param);
}

GradStats grad_stats(Context& ctx, const Tensor& grad) {
  assert_fp32(grad, "grad");
  GradStats s;
  const float* g = grad.data<float>();
  const int64_t n = grad.numel();
  for (int64_t i = 0; i < n; ++i) {
    const double x = g[i];
    s.sum_sq += x * x;
    if (!std::isfinite(g[i])) s.found_inf_or_nan = true;
    if (g[i] == 0.0f) ++s.num_zeros;
  }
  return s;
}

void scale_(Context& ctx, Tensor& x, float s) {
  FloatOut out(x, /*load=*/true);
  const int64_t n = x.numel();
  for (int64_t i = 0; i < n; ++i) out[i] *= s;
}

void adamw_step_multi(Context& ctx, std::vector<AdamTensors>& params, const AdamHyperParams& hp) {
  for (AdamTensors& t : params) {
    AdamHyperParams h = hp;
    h.weight_decay = t.weight_decay;
    adamw_step(ctx, t.main_param, t.grad, t.exp_avg, t.exp_avg_sq, h, t.model_param);
  }
}

}  // namespace megatron::cpu

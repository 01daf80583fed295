// LayerNorm and RMSNorm over the last dimension, CPU reference.
//
// The two share one row kernel: RMSNorm is LayerNorm without the mean subtraction and the bias.
// With x̂ = (x - μ)·rstd (μ = 0 for RMSNorm), rstd = 1/sqrt(var + eps) (biased variance, as PyTorch
// and Megatron; for RMSNorm var = mean(x²)), and γ = weight (+ 1 under zero_centered_gamma,
// Megatron's --apply-layernorm-1p):
//   forward   y = x̂·γ + β
//   backward  dx̂ = dy·γ;  dx = rstd·(dx̂ - mean(dx̂) - x̂·mean(dx̂·x̂))   (no mean(dx̂) term for RMSNorm)
//             dweight += Σ_rows dy·x̂ (d/dweight = d/dγ);  dbias += Σ_rows dy
// Row statistics are accumulated in fp64; mean and rstd are saved in fp32 for the backward (either
// may be undefined in the forward when no backward follows).
#include <cmath>
#include <optional>

#include "megatron/kernels/cpu/cpu_common.h"
#include "megatron/kernels/cpu/cpu_ops.h"

namespace megatron::cpu {

namespace {

// The effective γ: weight, plus one under zero_centered_gamma.
std::vector<float> effective_gamma(const Tensor& weight, int64_t h, bool zero_centered_gamma) {
  assert_numel(weight, h, "weight");
  std::vector<float> gamma = weight.to_floats();
  if (zero_centered_gamma)
    for (float& g : gamma) g += 1.0f;
  return gamma;
}

// centered = true: LayerNorm (mean may be undefined when not needed); false: RMSNorm.
void norm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps, bool zero_centered_gamma,
                  bool centered, Tensor& out, Tensor* mean, Tensor& rstd) {
  assert_float(x, "x");
  const int64_t h = x.size(-1);
  const int64_t n = rows_of(x, h, "x");
  assert_numel(out, x.numel(), "out");
  const std::vector<float> gamma = effective_gamma(weight, h, zero_centered_gamma);
  std::vector<float> beta(size_t(h), 0.0f);
  if (bias.defined()) {
    assert_numel(bias, h, "bias");
    beta = bias.to_floats();
  }
  float* mean_out = nullptr;
  if (mean && mean->defined()) {
    assert_fp32(*mean, "mean");
    assert_numel(*mean, n, "mean");
    mean_out = mean->data<float>();
  }
  float* rstd_out = nullptr;
  if (rstd.defined()) {
    assert_fp32(rstd, "rstd");
    assert_numel(rstd, n, "rstd");
    rstd_out = rstd.data<float>();
  }

  FloatIn xin(x);
  FloatOut y(out);
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = xin.data() + r * h;
    double mu = 0.0;
    if (centered) {
      for (int64_t c = 0; c < h; ++c) mu += xr[c];
      mu /= double(h);
    }
    double var = 0.0;
    for (int64_t c = 0; c < h; ++c) var += (xr[c] - mu) * (xr[c] - mu);
    var /= double(h);
    const float rs = float(1.0 / std::sqrt(var + double(eps)));
    const float m = float(mu);
    float* yr = y.data() + r * h;
    for (int64_t c = 0; c < h; ++c) yr[c] = (xr[c] - m) * rs * gamma[c] + beta[c];
    if (mean_out) mean_out[r] = m;
    if (rstd_out) rstd_out[r] = rs;
  }
}

// mean is null for RMSNorm; bias_grad may be undefined.
void norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor* mean,
                   const Tensor& rstd, bool zero_centered_gamma, Tensor& grad_in, Tensor& weight_grad,
                   Tensor& bias_grad) {
  assert_float(x, "x");
  const int64_t h = x.size(-1);
  const int64_t n = rows_of(x, h, "x");
  assert_numel(grad_out, x.numel(), "grad_out");
  const std::vector<float> gamma = effective_gamma(weight, h, zero_centered_gamma);
  assert_fp32(rstd, "rstd");
  assert_numel(rstd, n, "rstd");
  const float* rstd_in = rstd.data<float>();
  const float* mean_in = nullptr;
  if (mean) {
    assert_fp32(*mean, "mean");
    assert_numel(*mean, n, "mean");
    mean_in = mean->data<float>();
  }
  float* dw = nullptr;
  if (weight_grad.defined()) {
    assert_fp32(weight_grad, "weight_grad");
    assert_numel(weight_grad, h, "weight_grad");
    dw = weight_grad.data<float>();
  }
  float* db = nullptr;
  if (bias_grad.defined()) {
    assert_fp32(bias_grad, "bias_grad");
    assert_numel(bias_grad, h, "bias_grad");
    db = bias_grad.data<float>();
  }
  if (grad_in.defined()) assert_numel(grad_in, x.numel(), "grad_in");

  FloatIn xin(x), dyin(grad_out);
  std::vector<float> xhat(static_cast<size_t>(h)), dxhat(static_cast<size_t>(h));
  std::vector<double> dw_acc(size_t(h), 0.0), db_acc(size_t(h), 0.0);
  std::optional<FloatOut> dx;
  if (grad_in.defined()) dx.emplace(grad_in);
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = xin.data() + r * h;
    const float* dyr = dyin.data() + r * h;
    const float m = mean_in ? mean_in[r] : 0.0f;
    const float rs = rstd_in[r];
    double sum_dxhat = 0.0, sum_dxhat_xhat = 0.0;
    for (int64_t c = 0; c < h; ++c) {
      xhat[c] = (xr[c] - m) * rs;
      dxhat[c] = dyr[c] * gamma[c];
      sum_dxhat += dxhat[c];
      sum_dxhat_xhat += double(dxhat[c]) * xhat[c];
      dw_acc[c] += double(dyr[c]) * xhat[c];
      db_acc[c] += dyr[c];
    }
    if (!dx) continue;
    const float a = mean_in ? float(sum_dxhat / double(h)) : 0.0f;
    const float b = float(sum_dxhat_xhat / double(h));
    float* dxr = dx->data() + r * h;
    for (int64_t c = 0; c < h; ++c) dxr[c] = rs * (dxhat[c] - a - xhat[c] * b);
  }
  for (int64_t c = 0; c < h; ++c) {
    if (dw) dw[c] += float(dw_acc[c]);
    if (db) db[c] += float(db_acc[c]);
  }
}

}  // namespace

void layernorm_forward(Context& ctx, const Tensor& x, const Tensor& weight, const Tensor& bias, float eps,
                       bool zero_centered_gamma, Tensor& out, Tensor& mean, Tensor& rstd) {
  norm_forward(x, weight, bias, eps, zero_centered_gamma, /*centered=*/true, out, &mean, rstd);
}

void layernorm_backward(Context& ctx, const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& mean,
                        const Tensor& rstd, bool zero_centered_gamma, Tensor& grad_in, Tensor& weight_grad,
                        Tensor& bias_grad) {
  norm_backward(grad_out, x, weight, &mean, rstd, zero_centered_gamma, grad_in, weight_grad, bias_grad);
}

void rmsnorm_forward(Context& ctx, const Tensor& x, const Tensor& weight, float eps, bool zero_centered_gamma,
                     Tensor& out, Tensor& rstd) {
  norm_forward(x, weight, Tensor(), eps, zero_centered_gamma, /*centered=*/false, out, nullptr, rstd);
}

void rmsnorm_backward(Context& ctx, const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                      bool zero_centered_gamma, Tensor& grad_in, Tensor& weight_grad) {
  Tensor no_bias_grad;
  norm_backward(grad_out, x, weight, nullptr, rstd, zero_centered_gamma, grad_in, weight_grad, no_bias_grad);
}

}  // namespace megatron::cpu

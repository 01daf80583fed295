// Linear layer y = x·Wᵀ + b, CPU reference on OpenBLAS sgemm.
//
// x [N, in] (any leading dims), weight [out, in] (PyTorch's layout), y [N, out]. All products are
// row-major fp32 sgemm; bf16/fp16 operands are converted to fp32 temporaries first (FloatIn).
//   forward       y = x·Wᵀ (+ b)
//   grad_in       = dy·W                      (overwritten; skipped when undefined)
//   weight_grad  += dyᵀ·x                     (sgemm with beta = 1 straight into the fp32 buffer)
//   bias_grad    += Σ_rows dy                 (fp64 column sums)
#include <cblas.h>

#include <algorithm>

#include "megatron/kernels/cpu/cpu_common.h"
#include "megatron/kernels/cpu/cpu_ops.h"

namespace megatron::cpu {

namespace {

struct LinearDims {
  int64_t n = 0, in = 0, out = 0;
};

LinearDims linear_dims(const Tensor& x, const Tensor& weight) {
  assert_float(weight, "weight");
  MG_ASSERT(weight.dim() == 2, "weight must be [out, in], got {}", weight.str());
  assert_float(x, "x");
  LinearDims d;
  d.out = weight.size(0);
  d.in = weight.size(1);
  d.n = rows_of(x, d.in, "x");
  return d;
}

}  // namespace

void linear_forward(Context& ctx, const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y) {
  const LinearDims d = linear_dims(x, weight);
  assert_float(y, "y");
  MG_ASSERT(rows_of(y, d.out, "y") == d.n, "y is {}, expected {} rows of {}", y.str(), d.n, d.out);
  FloatIn xin(x), w(weight);
  FloatOut yout(y);
  if (d.n > 0 && d.out > 0) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(d.n), int(d.out), int(d.in), 1.0f, xin.data(), int(d.in),
                w.data(), int(d.in), 0.0f, yout.data(), int(d.out));
  }
  if (bias.defined()) {
    assert_numel(bias, d.out, "bias");
    FloatIn b(bias);
    for (int64_t r = 0; r < d.n; ++r) {
      float* yr = yout.data() + r * d.out;
      for (int64_t c = 0; c < d.out; ++c) yr[c] += b[c];
    }
  }
}

void linear_backward(Context& ctx, const Tensor& grad_out, const Tensor& x, const Tensor& weight, Tensor& grad_in,
                     Tensor& weight_grad, Tensor& bias_grad) {
  const LinearDims d = linear_dims(x, weight);
  assert_float(grad_out, "grad_out");
  MG_ASSERT(rows_of(grad_out, d.out, "grad_out") == d.n, "grad_out is {}, expected {} rows of {}", grad_out.str(), d.n,
            d.out);
  FloatIn dy(grad_out);
  if (grad_in.defined()) {
    assert_numel(grad_in, d.n * d.in, "grad_in");
    FloatIn w(weight);
    FloatOut dx(grad_in);
    if (d.out == 0) {
      std::fill(dx.data(), dx.data() + d.n * d.in, 0.0f);
    } else if (d.n > 0) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(d.n), int(d.in), int(d.out), 1.0f, dy.data(),
                  int(d.out), w.data(), int(d.in), 0.0f, dx.data(), int(d.in));
    }
  }
  if (weight_grad.defined() && d.n > 0) {
    assert_fp32(weight_grad, "weight_grad");
    assert_numel(weight_grad, d.out * d.in, "weight_grad");
    FloatIn xin(x);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(d.out), int(d.in), int(d.n), 1.0f, dy.data(), int(d.out),
                xin.data(), int(d.in), 1.0f, weight_grad.data<float>(), int(d.in));
  }
  if (bias_grad.defined()) {
    assert_fp32(bias_grad, "bias_grad");
    assert_numel(bias_grad, d.out, "bias_grad");
    std::vector<double> sums(size_t(d.out), 0.0);
    for (int64_t r = 0; r < d.n; ++r) {
      const float* dyr = dy.data() + r * d.out;
      for (int64_t c = 0; c < d.out; ++c) sums[c] += dyr[c];
    }
    float* db = bias_grad.data<float>();
    for (int64_t c = 0; c < d.out; ++c) db[c] += float(sums[c]);
  }
}

}  // namespace megatron::cpu

namespace megatron::cpu {

// The CPU reference of the grouped GEMM: one linear per expert over its rows.
void moe_grouped_linear_forward(Context& ctx, const Tensor& x, const std::vector<Tensor>& weights,
                                const std::vector<int64_t>& rows_per_expert, Tensor& y) {
  const std::vector<int64_t> starts = ops::moe_expert_row_starts(rows_per_expert, weights.size(), x.size(0));
  for (size_t e = 0; e < weights.size(); ++e) {
    if (rows_per_expert[e] == 0) continue;
    Tensor ye = y.slice(starts[e], starts[e + 1]);
    linear_forward(ctx, x.slice(starts[e], starts[e + 1]), weights[e], Tensor(), ye);
  }
}

void moe_grouped_linear_backward(Context& ctx, const Tensor& grad_out, const Tensor& x,
                                 const std::vector<Tensor>& weights, const std::vector<int64_t>& rows_per_expert,
                                 Tensor& grad_in, std::vector<Tensor>& weight_grads) {
  const std::vector<int64_t> starts = ops::moe_expert_row_starts(rows_per_expert, weights.size(), x.size(0));
  MG_ASSERT(weight_grads.empty() || weight_grads.size() == weights.size(), "{} weight gradients for {} experts",
            weight_grads.size(), weights.size());
  for (size_t e = 0; e < weights.size(); ++e) {
    if (rows_per_expert[e] == 0) continue;
    Tensor gi = grad_in.defined() ? grad_in.slice(starts[e], starts[e + 1]) : Tensor();
    Tensor wg = weight_grads.empty() ? Tensor() : weight_grads[e];
    Tensor none;
    linear_backward(ctx, grad_out.slice(starts[e], starts[e + 1]), x.slice(starts[e], starts[e + 1]), weights[e], gi,
                    wg, none);
  }
}

}  // namespace megatron::cpu

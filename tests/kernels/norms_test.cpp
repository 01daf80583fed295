// LayerNorm and RMSNorm: naive fp64 references, gradient checks, zero-centred gamma, bf16 storage.
#include <gtest/gtest.h>

#include <cmath>

#include "megatron/kernels/cpu/cpu_ops.h"
#include "tests/kernels/gradcheck.h"

namespace megatron {
namespace {

using testing::GradCheck;
using testing::max_abs_error;
using testing::random_tensor;
using testing::zeros_like;

constexpr int64_t kN = 3, kH = 5;
constexpr float kEps = 1e-5f;

// y = (x - μ)/sqrt(var + eps)·γ + β per row (μ = 0, var = mean(x²) when !centered).
std::vector<float> naive_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, bool centered) {
  std::vector<float> xv = x.to_floats(), g = gamma.to_floats(), out(xv.size());
  std::vector<float> b = beta.defined() ? beta.to_floats() : std::vector<float>(size_t(kH), 0.0f);
  for (int64_t r = 0; r < kN; ++r) {
    const float* xr = xv.data() + r * kH;
    double mu = 0, var = 0;
    if (centered) {
      for (int64_t c = 0; c < kH; ++c) mu += xr[c];
      mu /= kH;
    }
    for (int64_t c = 0; c < kH; ++c) var += (xr[c] - mu) * (xr[c] - mu);
    var /= kH;
    for (int64_t c = 0; c < kH; ++c)
      out[size_t(r * kH + c)] = float((xr[c] - mu) / std::sqrt(var + kEps) * g[size_t(c)] + b[size_t(c)]);
  }
  return out;
}

struct NormCase {
  bool rms;
  bool zero_centered;
};

class Norm : public ::testing::TestWithParam<NormCase> {
 protected:
  // Runs the op; out, mean (LayerNorm only) and rstd are written.
  void forward(const Tensor& x, Tensor& out, Tensor& rstd) {
    if (GetParam().rms) {
      cpu::rmsnorm_forward(ctx, x, weight, kEps, GetParam().zero_centered, out, rstd);
    } else {
      cpu::layernorm_forward(ctx, x, weight, bias, kEps, GetParam().zero_centered, out, mean, rstd);
    }
  }

  Context ctx;
  Tensor weight = random_tensor({kH}, 11, 0.5f);
  Tensor bias = random_tensor({kH}, 12, 0.5f);
  Tensor mean = Tensor::empty({kN}, DType::Float32);
};

TEST_P(Norm, ForwardMatchesNaive) {
  Tensor x = random_tensor({kN, kH}, 1, 2.0f);
  Tensor out = Tensor::empty({kN, kH}, DType::Float32), rstd = Tensor::empty({kN}, DType::Float32);
  forward(x, out, rstd);
  Tensor gamma = weight.clone();
  if (GetParam().zero_centered) {
    std::vector<float> g = weight.to_floats();
    for (float& v : g) v += 1.0f;
    gamma = Tensor::from_floats(g, {kH});
  }
  std::vector<float> ref = naive_norm(x, gamma, GetParam().rms ? Tensor() : bias, !GetParam().rms);
  EXPECT_LT(max_abs_error(out.to_floats(), ref), 1e-5);
}

TEST_P(Norm, GradCheck) {
  Tensor x = random_tensor({kN, kH}, 2, 1.5f);
  Tensor rstd = Tensor::empty({kN}, DType::Float32);
  GradCheck gc([&] {
    Tensor out = Tensor::empty({kN, kH}, DType::Float32);
    forward(x, out, rstd);
    return std::vector<Tensor>{out};
  });
  gc.loss();  // leaves mean and rstd of the unperturbed x
  Tensor grad_in = Tensor::empty({kN, kH}, DType::Float32);
  Tensor weight_grad = zeros_like(weight), bias_grad = zeros_like(bias);
  if (GetParam().rms) {
    cpu::rmsnorm_backward(ctx, gc.upstream(), x, weight, rstd, GetParam().zero_centered, grad_in, weight_grad);
  } else {
    cpu::layernorm_backward(ctx, gc.upstream(), x, weight, mean, rstd, GetParam().zero_centered, grad_in, weight_grad,
                            bias_grad);
  }
  gc.check("grad_in", x, grad_in);
  gc.check("weight_grad", weight, weight_grad);
  if (!GetParam().rms) gc.check("bias_grad", bias, bias_grad);
}

TEST_P(Norm, Bf16StorageTracksFp32) {
  Tensor x = random_tensor({kN, kH}, 3, 1.0f);
  Tensor out = Tensor::empty({kN, kH}, DType::Float32), rstd = Tensor::empty({kN}, DType::Float32);
  forward(x.to(DType::BFloat16).to(DType::Float32), out, rstd);
  Tensor out16 = Tensor::empty({kN, kH}, DType::BFloat16), rstd16 = Tensor::empty({kN}, DType::Float32);
  forward(x.to(DType::BFloat16), out16, rstd16);
  // Same bf16 input: the only difference is the output's rounding (2^-8 relative).
  EXPECT_LT(testing::max_rel_error(out16.to_floats(), out.to_floats(), 1.0), 1.0 / 128);
  EXPECT_LT(max_abs_error(rstd16.to_floats(), rstd.to_floats()), 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Kinds, Norm,
                         ::testing::Values(NormCase{false, false}, NormCase{false, true}, NormCase{true, false},
                                           NormCase{true, true}),
                         [](const auto& info) {
                           return std::string(info.param.rms ? "RMSNorm" : "LayerNorm") +
                                  (info.param.zero_centered ? "ZeroCenteredGamma" : "");
                         });

}  // namespace
}  // namespace megatron

// Linear: forward against a naive product, gradient checks with and without bias, accumulation.
#include <gtest/gtest.h>

#include "megatron/kernels/cpu/cpu_ops.h"
#include "tests/kernels/gradcheck.h"

namespace megatron {
namespace {

using testing::GradCheck;
using testing::max_abs_error;
using testing::random_tensor;
using testing::zeros_like;

constexpr int64_t kN = 4, kIn = 3, kOut = 5;

TEST(Linear, ForwardMatchesNaive) {
  Context ctx;
  Tensor x = random_tensor({2, 2, kIn}, 1), w = random_tensor({kOut, kIn}, 2), b = random_tensor({kOut}, 3);
  Tensor y = Tensor::empty({2, 2, kOut}, DType::Float32);
  cpu::linear_forward(ctx, x, w, b, y);
  std::vector<float> xv = x.to_floats(), wv = w.to_floats(), bv = b.to_floats(), ref(size_t(kN * kOut));
  for (int64_t n = 0; n < kN; ++n)
    for (int64_t o = 0; o < kOut; ++o) {
      double acc = bv[size_t(o)];
      for (int64_t i = 0; i < kIn; ++i) acc += double(xv[size_t(n * kIn + i)]) * wv[size_t(o * kIn + i)];
      ref[size_t(n * kOut + o)] = float(acc);
    }
  EXPECT_LT(max_abs_error(y.to_floats(), ref), 1e-5);
}

class LinearGrad : public ::testing::TestWithParam<bool> {};

TEST_P(LinearGrad, GradCheck) {
  const bool with_bias = GetParam();
  Context ctx;
  Tensor x = random_tensor({kN, kIn}, 4), w = random_tensor({kOut, kIn}, 5);
  Tensor b = with_bias ? random_tensor({kOut}, 6) : Tensor();
  GradCheck gc([&] {
    Tensor y = Tensor::empty({kN, kOut}, DType::Float32);
    cpu::linear_forward(ctx, x, w, b, y);
    return std::vector<Tensor>{y};
  });
  Tensor grad_in = Tensor::empty({kN, kIn}, DType::Float32), weight_grad = zeros_like(w);
  Tensor bias_grad = with_bias ? zeros_like(b) : Tensor();
  cpu::linear_backward(ctx, gc.upstream(), x, w, grad_in, weight_grad, bias_grad);
  gc.check("grad_in", x, grad_in);
  gc.check("weight_grad", w, weight_grad);
  if (with_bias) gc.check("bias_grad", b, bias_grad);
}

INSTANTIATE_TEST_SUITE_P(Bias, LinearGrad, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "WithBias" : "NoBias"; });

TEST(Linear, ParameterGradsAccumulate) {
  Context ctx;
  Tensor x = random_tensor({kN, kIn}, 7), w = random_tensor({kOut, kIn}, 8), dy = random_tensor({kN, kOut}, 9);
  Tensor grad_in = Tensor::empty({kN, kIn}, DType::Float32);
  Tensor weight_grad = zeros_like(w), bias_grad = Tensor::zeros({kOut}, DType::Float32);
  cpu::linear_backward(ctx, dy, x, w, grad_in, weight_grad, bias_grad);
  std::vector<float> once_w = weight_grad.to_floats(), once_b = bias_grad.to_floats(), once_in = grad_in.to_floats();
  cpu::linear_backward(ctx, dy, x, w, grad_in, weight_grad, bias_grad);
  for (float& v : once_w) v *= 2;
  for (float& v : once_b) v *= 2;
  EXPECT_LT(max_abs_error(weight_grad.to_floats(), once_w), 1e-5);
  EXPECT_LT(max_abs_error(bias_grad.to_floats(), once_b), 1e-5);
  EXPECT_EQ(grad_in.to_floats(), once_in);  // the input gradient is overwritten, not accumulated

  // Undefined gradients are skipped.
  Tensor none;
  cpu::linear_backward(ctx, dy, x, w, none, none, none);
}

TEST(Linear, Bf16OperandsTrackFp32) {
  Context ctx;
  Tensor x = random_tensor({kN, kIn}, 10, 1.0f, DType::BFloat16),
         w = random_tensor({kOut, kIn}, 11, 1.0f, DType::BFloat16);
  Tensor y16 = Tensor::empty({kN, kOut}, DType::BFloat16), y = Tensor::empty({kN, kOut}, DType::Float32);
  cpu::linear_forward(ctx, x, w, Tensor(), y16);
  cpu::linear_forward(ctx, x.to(DType::Float32), w.to(DType::Float32), Tensor(), y);
  EXPECT_LT(testing::max_rel_error(y16.to_floats(), y.to_floats(), 1.0), 1.0 / 128);
}

}  // namespace
}  // namespace megatron

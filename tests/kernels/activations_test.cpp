// GeLU (tanh) and SwiGLU: values at known points and gradient checks.
#include <gtest/gtest.h>

#include <cmath>

#include "megatron/kernels/cpu/cpu_ops.h"
#include "tests/kernels/gradcheck.h"

namespace megatron {
namespace {

using testing::GradCheck;
using testing::random_tensor;

TEST(Gelu, MatchesTanhFormula) {
  Context ctx;
  std::vector<float> xs = {-3.0f, -1.0f, -0.1f, 0.0f, 0.5f, 2.0f};
  Tensor x = Tensor::from_floats(xs, {6}), out = Tensor::empty({6}, DType::Float32);
  cpu::gelu_forward(ctx, x, out);
  for (size_t i = 0; i < xs.size(); ++i) {
    const double v = xs[i];
    const double ref = 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
    EXPECT_NEAR(out.item(int64_t(i)), ref, 1e-6) << v;
  }
}

TEST(Gelu, GradCheck) {
  Context ctx;
  Tensor x = random_tensor({3, 4}, 1, 2.0f);
  GradCheck gc([&] {
    Tensor out = Tensor::empty({3, 4}, DType::Float32);
    cpu::gelu_forward(ctx, x, out);
    return std::vector<Tensor>{out};
  });
  Tensor grad_in = Tensor::empty({3, 4}, DType::Float32);
  cpu::gelu_backward(ctx, gc.upstream(), x, grad_in);
  gc.check("grad_in", x, grad_in);
}

TEST(Swiglu, IsSiluOfGateTimesUp) {
  Context ctx;
  // One row: gate = [1, -2], up = [3, 0.5].
  Tensor x = Tensor::from_floats({1.0f, -2.0f, 3.0f, 0.5f}, {1, 4}), out = Tensor::empty({1, 2}, DType::Float32);
  cpu::swiglu_forward(ctx, x, out);
  auto silu = [](double g) { return g / (1 + std::exp(-g)); };
  EXPECT_NEAR(out.item(0), silu(1.0) * 3.0, 1e-6);
  EXPECT_NEAR(out.item(1), silu(-2.0) * 0.5, 1e-6);
}

TEST(Swiglu, GradCheck) {
  Context ctx;
  Tensor x = random_tensor({3, 8}, 2, 1.5f);
  GradCheck gc([&] {
    Tensor out = Tensor::empty({3, 4}, DType::Float32);
    cpu::swiglu_forward(ctx, x, out);
    return std::vector<Tensor>{out};
  });
  Tensor grad_in = Tensor::empty({3, 8}, DType::Float32);
  cpu::swiglu_backward(ctx, gc.upstream(), x, grad_in);
  gc.check("grad_in", x, grad_in);
}

}  // namespace
}  // namespace megatron

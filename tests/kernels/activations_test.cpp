// GeLU (tanh), SwiGLU and the clamped quick-GeGLU: values at known points and gradient checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

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

// GPT-OSS's experts: quick_gelu(min(gate, L))·(clamp(up, -L, L) + 1), HF's _apply_gate written out.
TEST(QuickGeglu, MatchesClampedFormula) {
  Context ctx;
  const float alpha = 1.702f, limit = 2.0f, offset = 1.0f;
  // gate = [1, -3, 5], up = [0.5, -4, 3]: the second and third of each are clamped.
  Tensor x = Tensor::from_floats({1.0f, -3.0f, 5.0f, 0.5f, -4.0f, 3.0f}, {1, 6}), out = Tensor::empty({1, 3}, DType::Float32);
  cpu::quick_geglu_forward(ctx, x, alpha, limit, offset, out);
  auto glu = [&](double g, double u) {
    g = std::min(g, double(limit));
    u = std::clamp(u, -double(limit), double(limit));
    return g / (1 + std::exp(-alpha * g)) * (u + offset);
  };
  EXPECT_NEAR(out.item(0), glu(1.0, 0.5), 1e-6);
  EXPECT_NEAR(out.item(1), glu(-3.0, -4.0), 1e-6);
  EXPECT_NEAR(out.item(2), glu(5.0, 3.0), 1e-6);
  // No clamp and no offset: plain quick-GeGLU.
  cpu::quick_geglu_forward(ctx, x, alpha, std::numeric_limits<float>::infinity(), 0.0f, out);
  EXPECT_NEAR(out.item(2), 5.0 / (1 + std::exp(-alpha * 5.0)) * 3.0, 1e-5);
}

TEST(QuickGeglu, GradCheck) {
  Context ctx;
  for (float limit : {1.5f, std::numeric_limits<float>::infinity()}) {
    SCOPED_TRACE(limit);
    Tensor x = random_tensor({4, 10}, 3, 2.0f);  // some entries beyond the clamp: their gradient is 0
    GradCheck gc([&] {
      Tensor out = Tensor::empty({4, 5}, DType::Float32);
      cpu::quick_geglu_forward(ctx, x, 1.702f, limit, 1.0f, out);
      return std::vector<Tensor>{out};
    });
    Tensor grad_in = Tensor::empty({4, 10}, DType::Float32);
    cpu::quick_geglu_backward(ctx, gc.upstream(), x, 1.702f, limit, 1.0f, grad_in);
    gc.check("grad_in", x, grad_in);
  }
}

}  // namespace
}  // namespace megatron

// Dropout, dropout-add and add: the documented mask, p = 0, in-place use, and a gradient check.
#include <gtest/gtest.h>

#include "megatron/kernels/cpu/cpu_ops.h"
#include "tests/kernels/gradcheck.h"

namespace megatron {
namespace {

using testing::GradCheck;
using testing::random_tensor;

constexpr uint64_t kSeed = 9, kOffset = 3;

TEST(Dropout, MaskFollowsTheStreamLayout) {
  Context ctx;
  const int64_t n = 4099;  // not a multiple of the 4-wide Philox block nor of the kernel's chunk
  const float p = 0.25f;
  Tensor x = random_tensor({n}, 1), out = Tensor::empty({n}, DType::Float32);
  cpu::dropout_forward(ctx, x, p, kSeed, kOffset, out);
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool keep = philox_uniform(kSeed, kOffset, uint64_t(i)) >= p;
    kept += keep;
    EXPECT_FLOAT_EQ(out.item(i), keep ? x.item(i) / (1 - p) : 0.0f) << i;
  }
  EXPECT_NEAR(double(kept) / n, 1 - p, 0.03);
}

TEST(Dropout, ZeroProbabilityCopiesAndWorksInPlace) {
  Context ctx;
  Tensor x = random_tensor({3, 5}, 2), out = Tensor::empty({3, 5}, DType::Float32);
  cpu::dropout_forward(ctx, x, 0.0f, kSeed, kOffset, out);
  EXPECT_EQ(out.to_floats(), x.to_floats());
  std::vector<float> before = x.to_floats();
  cpu::dropout_forward(ctx, x, 0.0f, kSeed, kOffset, x);
  EXPECT_EQ(x.to_floats(), before);

  Tensor ref = Tensor::empty({3, 5}, DType::Float32);
  cpu::dropout_forward(ctx, x, 0.5f, kSeed, kOffset, ref);
  cpu::dropout_forward(ctx, x, 0.5f, kSeed, kOffset, x);
  EXPECT_EQ(x.to_floats(), ref.to_floats());
}

TEST(Dropout, GradCheck) {
  Context ctx;
  Tensor x = random_tensor({4, 6}, 3);
  GradCheck gc([&] {
    Tensor out = Tensor::empty({4, 6}, DType::Float32);
    cpu::dropout_forward(ctx, x, 0.4f, kSeed, kOffset, out);
    return std::vector<Tensor>{out};
  });
  Tensor grad_in = Tensor::empty({4, 6}, DType::Float32);
  cpu::dropout_backward(ctx, gc.upstream(), 0.4f, kSeed, kOffset, grad_in);
  gc.check("grad_in", x, grad_in);
}

TEST(DropoutAdd, IsResidualPlusDropout) {
  Context ctx;
  Tensor x = random_tensor({40}, 4), residual = random_tensor({40}, 5);
  Tensor dropped = Tensor::empty({40}, DType::Float32), out = Tensor::empty({40}, DType::Float32);
  cpu::dropout_forward(ctx, x, 0.3f, kSeed, kOffset, dropped);
  cpu::dropout_add_forward(ctx, x, residual, 0.3f, kSeed, kOffset, out);
  for (int64_t i = 0; i < 40; ++i) EXPECT_FLOAT_EQ(out.item(i), residual.item(i) + dropped.item(i));
  // In place over the residual, as the transformer layer uses it.
  cpu::dropout_add_forward(ctx, x, residual, 0.3f, kSeed, kOffset, residual);
  EXPECT_EQ(residual.to_floats(), out.to_floats());
}

TEST(Add, SumsAndAliases) {
  Context ctx;
  Tensor a = random_tensor({2, 3}, 6), b = random_tensor({2, 3}, 7, 1.0f, DType::BFloat16);
  Tensor out = Tensor::empty({2, 3}, DType::Float32);
  cpu::add(ctx, a, b, out);
  for (int64_t i = 0; i < 6; ++i) EXPECT_FLOAT_EQ(out.item(i), a.item(i) + b.item(i));
  cpu::add(ctx, a, b, a);
  EXPECT_EQ(a.to_floats(), out.to_floats());
}

}  // namespace
}  // namespace megatron

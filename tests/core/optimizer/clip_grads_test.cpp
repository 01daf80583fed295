// Gradient norm, clipping and zero counting, and the CPU grad_stats / scale_ kernels under them.
#include "megatron/core/optimizer/clip_grads.h"

#include <gtest/gtest.h>

#include <cmath>

#include "megatron/kernels/cpu/cpu_ops.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

TEST(ClipGrads, GradStatsKernel) {
  Context ctx;
  Tensor g = Tensor::from_floats({3.0f, 0.0f, -4.0f, 0.0f, 1e-3f}, {5});
  const GradStats s = cpu::grad_stats(ctx, g);
  EXPECT_DOUBLE_EQ(s.sum_sq, 25.0 + double(1e-3f) * double(1e-3f));
  EXPECT_EQ(s.num_zeros, 2);
  EXPECT_FALSE(s.found_inf_or_nan);
  Tensor bad = Tensor::from_floats({1.0f, NAN}, {2});
  EXPECT_TRUE(cpu::grad_stats(ctx, bad).found_inf_or_nan);
}

TEST(ClipGrads, ScaleKernelAnyFloatDtype) {
  Context ctx;
  for (DType dt : {DType::Float32, DType::BFloat16, DType::Float16}) {
    Tensor x = Tensor::from_floats({1.0f, -2.0f, 0.5f}, {3}, dt);
    cpu::scale_(ctx, x, 0.25f);
    EXPECT_EQ(x.to_floats(), (std::vector<float>{0.25f, -0.5f, 0.125f})) << to_string(dt);
  }
}

TEST(ClipGrads, NormOverSeveralTensors) {
  Context ctx;
  std::vector<Tensor> grads = {Tensor::from_floats({3.0f, 0.0f}, {2}), Tensor(),
                               Tensor::from_floats({0.0f, 4.0f, 0.0f, 12.0f}, {2, 2})};
  EXPECT_DOUBLE_EQ(get_grad_norm_fp32(ctx, grads), 13.0);
  EXPECT_EQ(count_zeros_fp32(ctx, grads), 3);
  EXPECT_DOUBLE_EQ(grad_norm_from_stats(grad_stats_fp32(ctx, grads), 0.5), 6.5);
}

TEST(ClipGrads, ClipsOnlyWhenCoefficientBelowOne) {
  Context ctx;
  std::vector<Tensor> grads = {Tensor::from_floats({3.0f, 4.0f}, {2})};
  // max_norm 1, norm 5: coefficient 1 / (5 + 1e-6).
  const double norm = clip_grad_norm_fp32(ctx, grads, 1.0);
  EXPECT_DOUBLE_EQ(norm, 5.0);
  const double coeff = 1.0 / (5.0 + 1e-6);
  EXPECT_DOUBLE_EQ(clip_coefficient(1.0, 5.0), coeff);
  EXPECT_EQ(grads[0].to_floats(), (std::vector<float>{3.0f * float(coeff), 4.0f * float(coeff)}));
  EXPECT_NEAR(get_grad_norm_fp32(ctx, grads), 1.0, 1e-6);

  std::vector<Tensor> small = {Tensor::from_floats({0.3f, 0.4f}, {2})};
  EXPECT_NEAR(clip_grad_norm_fp32(ctx, small, 1.0), 0.5, 1e-7);
  EXPECT_EQ(small[0].to_floats(), (std::vector<float>{0.3f, 0.4f}));  // coefficient > 1: untouched
}

TEST(ClipGrads, InfAndNanPropagateToTheNorm) {
  Context ctx;
  std::vector<Tensor> with_inf = {Tensor::from_floats({1.0f, INFINITY}, {2})};
  EXPECT_TRUE(std::isinf(get_grad_norm_fp32(ctx, with_inf)));
  std::vector<Tensor> with_nan = {Tensor::from_floats({1.0f}, {1}), Tensor::from_floats({NAN}, {1})};
  const double norm = clip_grad_norm_fp32(ctx, with_nan, 1.0);
  EXPECT_TRUE(std::isnan(norm));
  EXPECT_EQ(with_nan[0].item(0), 1.0f);  // nan coefficient is not < 1: no clipping
  GradStats saturated;
  saturated.sum_sq = 4.0;
  saturated.found_inf_or_nan = true;
  EXPECT_TRUE(std::isnan(grad_norm_from_stats(saturated)));
}

TEST(ClipGrads, RejectsNonFp32Grads) {
  Context ctx;
  std::vector<Tensor> grads = {Tensor::from_floats({1.0f}, {1}, DType::BFloat16)};
  EXPECT_THROW(get_grad_norm_fp32(ctx, grads), Error);
  std::vector<Tensor> ok = {Tensor::from_floats({1.0f}, {1})};
  EXPECT_THROW(clip_grad_norm_fp32(ctx, ok, 0.0), Error);
}

}  // namespace
}  // namespace megatron

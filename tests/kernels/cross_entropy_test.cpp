// Cross entropy and the masked loss mean: naive reference, gradient checks (plain and through the
// masked mean), in-place backward, bf16 logits, bad labels.
#include <gtest/gtest.h>

#include <cmath>

#include "megatron/kernels/cpu/cpu_ops.h"
#include "tests/kernels/gradcheck.h"

namespace megatron {
namespace {

using testing::GradCheck;
using testing::max_abs_error;
using testing::random_tensor;

constexpr int64_t kN = 4, kV = 7;

Tensor labels() { return Tensor::from_ints({3, 0, 6, 3}, {kN}, DType::Int64); }

TEST(CrossEntropy, ForwardMatchesNaive) {
  Context ctx;
  Tensor logits = random_tensor({kN, kV}, 1, 3.0f);
  Tensor losses = Tensor::empty({kN}, DType::Float32), lse = Tensor::empty({kN}, DType::Float32);
  cpu::cross_entropy_forward(ctx, logits, labels(), losses, lse);
  std::vector<float> l = logits.to_floats();
  std::vector<int64_t> y = labels().to_ints();
  for (int64_t n = 0; n < kN; ++n) {
    double sum = 0;
    for (int64_t c = 0; c < kV; ++c) sum += std::exp(double(l[size_t(n * kV + c)]));
    EXPECT_NEAR(lse.item(n), std::log(sum), 1e-5);
    EXPECT_NEAR(losses.item(n), std::log(sum) - l[size_t(n * kV + y[size_t(n)])], 1e-5);
  }
}

TEST(CrossEntropy, GradCheck) {
  Context ctx;
  Tensor logits = random_tensor({kN, kV}, 2, 2.0f), lse = Tensor::empty({kN}, DType::Float32);
  GradCheck gc([&] {
    Tensor losses = Tensor::empty({kN}, DType::Float32);
    cpu::cross_entropy_forward(ctx, logits, labels(), losses, lse);
    return std::vector<Tensor>{losses};
  });
  gc.loss();
  Tensor grad = Tensor::empty({kN, kV}, DType::Float32);
  cpu::cross_entropy_backward(ctx, gc.upstream(), logits, labels(), lse, grad);
  gc.check("grad_logits", logits, grad);

  // The fused in-place form gives the same gradient.
  Tensor in_place = logits.clone();
  cpu::cross_entropy_backward(ctx, gc.upstream(), in_place, labels(), lse, in_place);
  EXPECT_LT(max_abs_error(in_place.to_floats(), grad.to_floats()), 1e-6);
}

TEST(CrossEntropy, GradCheckThroughMaskedMean) {
  Context ctx;
  Tensor logits = random_tensor({kN, kV}, 3, 2.0f), lse = Tensor::empty({kN}, DType::Float32);
  Tensor mask = Tensor::from_floats({1, 0, 1, 1}, {kN}, DType::BFloat16);
  // Objective: the masked mean loss Σ loss·mask / Σ mask.
  GradCheck gc([&] {
    Tensor losses = Tensor::empty({kN}, DType::Float32), sums = Tensor::empty({2}, DType::Float32);
    cpu::cross_entropy_forward(ctx, logits, labels(), losses, lse);
    cpu::masked_loss_sums(ctx, losses, mask, sums);
    return std::vector<Tensor>{Tensor::from_floats({sums.item(0) / sums.item(1)}, {1})};
  });
  gc.loss();
  Tensor grad_losses = Tensor::empty({kN}, DType::Float32), grad = Tensor::empty({kN, kV}, DType::Float32);
  cpu::masked_loss_backward(ctx, mask, gc.upstream().item(0) / 3.0f, grad_losses);
  cpu::cross_entropy_backward(ctx, grad_losses, logits, labels(), lse, grad);
  gc.check("grad_logits", logits, grad);
  for (int64_t c = 0; c < kV; ++c) EXPECT_EQ(grad.item(kV + c), 0.0f);  // the masked row
}

TEST(MaskedLoss, SumsAndBackward) {
  Context ctx;
  Tensor losses = Tensor::from_floats({1.5f, 2.0f, 4.0f}, {3}), sums = Tensor::empty({2}, DType::Float32);
  cpu::masked_loss_sums(ctx, losses, Tensor::from_floats({1, 0, 1}, {3}), sums);
  EXPECT_FLOAT_EQ(sums.item(0), 5.5f);
  EXPECT_FLOAT_EQ(sums.item(1), 2.0f);
  cpu::masked_loss_sums(ctx, losses, Tensor(), sums);
  EXPECT_FLOAT_EQ(sums.item(0), 7.5f);
  EXPECT_FLOAT_EQ(sums.item(1), 3.0f);
  Tensor grad = Tensor::empty({3}, DType::Float32);
  cpu::masked_loss_backward(ctx, Tensor::from_floats({1, 0, 1}, {3}, DType::Float16), 0.5f, grad);
  EXPECT_EQ(grad.to_floats(), (std::vector<float>{0.5f, 0.0f, 0.5f}));
  cpu::masked_loss_backward(ctx, Tensor(), 0.25f, grad);
  EXPECT_EQ(grad.to_floats(), (std::vector<float>{0.25f, 0.25f, 0.25f}));
}

// The gradient normalised on the device: mask · scale / Σ mask, and 0 (not inf or NaN) when every
// token is masked.
TEST(MaskedLoss, NormalizedBackwardDividesByTheTokenCount) {
  Context ctx;
  Tensor grad = Tensor::empty({3}, DType::Float32);
  Tensor mask = Tensor::from_floats({1, 0, 1}, {3});
  cpu::masked_loss_backward_normalized(ctx, mask, Tensor::from_floats({5.5f, 2.0f}, {2}),
                                       Tensor::from_floats({0.25f}, {1}), grad);
  EXPECT_EQ(grad.to_floats(), (std::vector<float>{0.125f, 0.0f, 0.125f}));
  cpu::masked_loss_backward_normalized(ctx, Tensor(), Tensor::from_floats({7.5f, 3.0f}, {2}),
                                       Tensor::from_floats({3.0f}, {1}), grad);
  EXPECT_EQ(grad.to_floats(), (std::vector<float>{1.0f, 1.0f, 1.0f}));
  cpu::masked_loss_backward_normalized(ctx, Tensor::from_floats({0, 0, 0}, {3}), Tensor::from_floats({0.0f, 0.0f}, {2}),
                                       Tensor::from_floats({1.0f}, {1}), grad);
  EXPECT_EQ(grad.to_floats(), (std::vector<float>{0.0f, 0.0f, 0.0f}));
}

TEST(CrossEntropy, Bf16LogitsTrackFp32) {
  Context ctx;
  Tensor logits16 = random_tensor({kN, kV}, 4, 3.0f, DType::BFloat16), logits = logits16.to(DType::Float32);
  Tensor losses = Tensor::empty({kN}, DType::Float32), lse = Tensor::empty({kN}, DType::Float32);
  Tensor losses16 = Tensor::empty({kN}, DType::Float32), lse16 = Tensor::empty({kN}, DType::Float32);
  cpu::cross_entropy_forward(ctx, logits, labels(), losses, lse);
  cpu::cross_entropy_forward(ctx, logits16, labels(), losses16, lse16);
  EXPECT_LT(max_abs_error(losses16.to_floats(), losses.to_floats()), 1e-6);
  Tensor gl = random_tensor({kN}, 5), grad = Tensor::empty({kN, kV}, DType::Float32);
  cpu::cross_entropy_backward(ctx, gl, logits, labels(), lse, grad);
  cpu::cross_entropy_backward(ctx, gl, logits16, labels(), lse16, logits16);  // in place, bf16
  EXPECT_LT(testing::max_rel_error(logits16.to_floats(), grad.to_floats(), 1e-2), 1.0 / 128);
}

TEST(CrossEntropy, OutOfRangeLabelIsAUserError) {
  Context ctx;
  Tensor logits = random_tensor({kN, kV}, 6);
  Tensor losses = Tensor::empty({kN}, DType::Float32), lse = Tensor::empty({kN}, DType::Float32);
  for (int64_t bad : {int64_t(-100), kV}) {
    Tensor y = Tensor::from_ints({0, 1, bad, 2}, {kN}, DType::Int32);
    try {
      cpu::cross_entropy_forward(ctx, logits, y, losses, lse);
      FAIL() << "expected megatron::Error for label " << bad;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("label " + std::to_string(bad)), std::string::npos) << msg;
      EXPECT_NE(msg.find("[0, 7)"), std::string::npos) << msg;
    }
  }
}

}  // namespace
}  // namespace megatron

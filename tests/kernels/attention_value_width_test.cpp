// Attention whose value heads are wider or narrower than its query/key heads (dv != d, as
// multi-latent attention has them): each output channel is the same softmax-weighted sum of one value
// channel, so out[..., c] must equal the equal-width attention's output over a 3-channel window of v
// that holds channel c (zero-padded when dv < d); gradient checks with GQA, dropout and a document mask.
#include <gtest/gtest.h>

#include <cmath>

#include "megatron/kernels/cpu/cpu_ops.h"
#include "tests/kernels/gradcheck.h"

namespace megatron {
namespace {

using testing::GradCheck;
using testing::random_tensor;

constexpr int64_t kS = 6, kB = 2, kNq = 4, kNg = 2, kD = 3;
constexpr uint64_t kSeed = 91, kOffset = 3;

// Channels [c0, c0 + kD) of v [s, b, ng, dv] as a [s, b, ng, kD] tensor (zeros past dv).
Tensor channel_window(const Tensor& v, int64_t c0) {
  const int64_t dv = v.size(3), rows = v.numel() / dv;
  std::vector<float> in = v.to_floats(), out(size_t(rows * kD), 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < kD && c0 + c < dv; ++c) out[size_t(r * kD + c)] = in[size_t(r * dv + c0 + c)];
  return Tensor::from_floats(out, {v.size(0), v.size(1), v.size(2), kD});
}

struct WidthCase {
  int64_t dv;
  float dropout_p;
};

class AttentionValueWidth : public ::testing::TestWithParam<WidthCase> {
 protected:
  Context ctx;
  const float scale = 0.4f;
  const int64_t dv = GetParam().dv;
  const float p = GetParam().dropout_p;
  Tensor q = random_tensor({kS, kB, kNq, kD}, 11);
  Tensor k = random_tensor({kS, kB, kNg, kD}, 12);
  Tensor v = random_tensor({kS, kB, kNg, GetParam().dv}, 13);
  Tensor lse = Tensor::empty({kB, kNq, kS}, DType::Float32);
};

TEST_P(AttentionValueWidth, EachChannelIsTheEqualWidthAttention) {
  Tensor out = Tensor::empty({kS, kB, kNq, dv}, DType::Float32);
  cpu::attention_forward(ctx, q, k, v, AttnMask::causal(), scale, p, kSeed, kOffset, out, lse);
  const std::vector<float> got = out.to_floats(), got_lse = lse.to_floats();
  for (int64_t c = 0; c < dv; ++c) {
    const int64_t c0 = std::max<int64_t>(0, std::min(c, dv - kD));  // a window of kD channels holding c
    Tensor ref = Tensor::empty({kS, kB, kNq, kD}, DType::Float32), ref_lse = Tensor::empty(lse.shape(), DType::Float32);
    cpu::attention_forward(ctx, q, k, channel_window(v, c0), AttnMask::causal(), scale, p, kSeed, kOffset, ref,
                           ref_lse);
    const std::vector<float> r = ref.to_floats();
    for (int64_t row = 0; row < kS * kB * kNq; ++row)
      ASSERT_NEAR(got[size_t(row * dv + c)], r[size_t(row * kD + c - c0)], 1e-6) << "channel " << c << " row " << row;
    EXPECT_EQ(ref_lse.to_floats(), got_lse);
  }
}

TEST_P(AttentionValueWidth, GradCheck) {
  const Tensor cu = Tensor::from_floats({0, 2, 6}, {3}, DType::Int32);
  for (const AttnMask& mask : {AttnMask::causal(), AttnMask::documents(cu)}) {
    Tensor out = Tensor::empty({kS, kB, kNq, dv}, DType::Float32);
    GradCheck gc([&] {
      cpu::attention_forward(ctx, q, k, v, mask, scale, p, kSeed, kOffset, out, lse);
      return std::vector<Tensor>{out.clone()};
    });
    gc.loss();
    Tensor gq = Tensor::empty(q.shape(), DType::Float32), gk = Tensor::empty(k.shape(), DType::Float32),
           gv = Tensor::empty(v.shape(), DType::Float32);
    cpu::attention_backward(ctx, gc.upstream(), q, k, v, out, lse, mask, scale, p, kSeed, kOffset, gq, gk, gv);
    gc.check("grad_q", q, gq);
    gc.check("grad_k", k, gk);
    gc.check("grad_v", v, gv);
  }
}

TEST(AttentionValueWidthShapes, MismatchedValueRowsAreRefused) {
  Context ctx;
  Tensor q = random_tensor({kS, kB, kNq, kD}, 1), k = random_tensor({kS, kB, kNg, kD}, 2);
  Tensor v = random_tensor({kS, kB, kNg + 1, 5}, 3);  // value groups differ from the key groups
  Tensor out = Tensor::empty({kS, kB, kNq, 5}, DType::Float32), lse = Tensor::empty({kB, kNq, kS}, DType::Float32);
  EXPECT_ANY_THROW(cpu::attention_forward(ctx, q, k, v, AttnMask::causal(), 1.0f, 0.0f, 0, 0, out, lse));
}

INSTANTIATE_TEST_SUITE_P(Widths, AttentionValueWidth,
                         ::testing::Values(WidthCase{5, 0.0f}, WidthCase{5, 0.25f}, WidthCase{2, 0.0f}, WidthCase{2, 0.25f}),
                         [](const auto& info) {
                           return "Dv" + std::to_string(info.param.dv) + (info.param.dropout_p > 0 ? "Dropout" : "");
                         });

}  // namespace
}  // namespace megatron

// Rotary embedding: both layouts against a naive per-pair rotation (full and partial rotary
// dimension, with and without YaRN's scale on cos and sin), the layouts differ, and gradient checks.
#include <gtest/gtest.h>

#include <cmath>

#include "megatron/kernels/cpu/cpu_ops.h"
#include "tests/kernels/gradcheck.h"

namespace megatron {
namespace {

using testing::GradCheck;
using testing::max_abs_error;
using testing::random_tensor;

constexpr int64_t kS = 4, kB = 2, kN = 3, kD = 8;

// freqs [s, r/2]: θ = pos · 10000^(-2k/r), as Megatron's RotaryEmbedding builds them.
Tensor make_freqs(int64_t r) {
  std::vector<float> f;
  for (int64_t pos = 0; pos < kS; ++pos)
    for (int64_t k = 0; k < r / 2; ++k) f.push_back(float(pos * std::pow(10000.0, -2.0 * k / r)));
  return Tensor::from_floats(f, {kS, r / 2});
}

std::vector<float> naive_rope(const Tensor& x, const Tensor& freqs, int64_t r, bool interleaved, double scale) {
  std::vector<float> xv = x.to_floats(), fv = freqs.to_floats(), out = xv;
  for (int64_t pos = 0; pos < kS; ++pos)
    for (int64_t head = 0; head < kB * kN; ++head) {
      const size_t base = size_t((pos * kB * kN + head) * kD);
      for (int64_t k = 0; k < r / 2; ++k) {
        const size_t i = base + size_t(interleaved ? 2 * k : k), j = base + size_t(interleaved ? 2 * k + 1 : k + r / 2);
        const double th = fv[size_t(pos * (r / 2) + k)];
        out[i] = float(scale * (xv[i] * std::cos(th) - xv[j] * std::sin(th)));
        out[j] = float(scale * (xv[j] * std::cos(th) + xv[i] * std::sin(th)));
      }
    }
  return out;
}

struct RopeCase {
  int64_t r;
  bool interleaved;
  float scale;  // YaRN's attention factor (1: plain RoPE)
};

class Rope : public ::testing::TestWithParam<RopeCase> {};

TEST_P(Rope, ForwardMatchesNaive) {
  Context ctx;
  const auto [r, interleaved, scale] = GetParam();
  Tensor x = random_tensor({kS, kB, kN, kD}, 1), freqs = make_freqs(r);
  Tensor out = Tensor::empty(x.shape(), DType::Float32);
  cpu::rope_forward(ctx, x, freqs, interleaved, scale, out);
  EXPECT_LT(max_abs_error(out.to_floats(), naive_rope(x, freqs, r, interleaved, scale)), 1e-5);
  if (r < kD) {
    EXPECT_EQ(out.item(kD - 1), x.item(kD - 1));  // channels past r pass through
  }
}

TEST_P(Rope, GradCheck) {
  Context ctx;
  const auto [r, interleaved, scale] = GetParam();
  Tensor x = random_tensor({kS, kB, kN, kD}, 2), freqs = make_freqs(r);
  GradCheck gc([&] {
    Tensor out = Tensor::empty(x.shape(), DType::Float32);
    cpu::rope_forward(ctx, x, freqs, interleaved, scale, out);
    return std::vector<Tensor>{out};
  });
  Tensor grad_in = Tensor::empty(x.shape(), DType::Float32);
  cpu::rope_backward(ctx, gc.upstream(), freqs, interleaved, scale, grad_in);
  gc.check("grad_in", x, grad_in);
}

INSTANTIATE_TEST_SUITE_P(Layouts, Rope,
                         ::testing::Values(RopeCase{kD, false, 1.0f}, RopeCase{kD, true, 1.0f},
                                           RopeCase{4, false, 1.0f}, RopeCase{4, true, 1.0f},
                                           RopeCase{kD, false, 1.25f}, RopeCase{4, true, 0.75f}),
                         [](const auto& info) {
                           return std::string(info.param.interleaved ? "Interleaved" : "RotateHalf") +
                                  (info.param.r == kD ? "Full" : "Partial") +
                                  (info.param.scale != 1.0f ? "Scaled" : "");
                         });

TEST(RopeLayouts, RotateHalfAndInterleavedDiffer) {
  Context ctx;
  Tensor x = random_tensor({kS, kB, kN, kD}, 3), freqs = make_freqs(kD);
  Tensor half = Tensor::empty(x.shape(), DType::Float32), inter = Tensor::empty(x.shape(), DType::Float32);
  cpu::rope_forward(ctx, x, freqs, false, 1.0f, half);
  cpu::rope_forward(ctx, x, freqs, true, 1.0f, inter);
  EXPECT_GT(max_abs_error(half.to_floats(), inter.to_floats()), 1e-2);
  // Position 0 has θ = 0: both are the identity there.
  for (int64_t i = 0; i < kB * kN * kD; ++i) EXPECT_EQ(half.item(i), x.item(i));
}

TEST(RopeLayouts, InPlace) {
  Context ctx;
  Tensor x = random_tensor({kS, kB, kN, kD}, 4), freqs = make_freqs(6);
  Tensor ref = Tensor::empty(x.shape(), DType::Float32);
  cpu::rope_forward(ctx, x, freqs, false, 1.5f, ref);
  cpu::rope_forward(ctx, x, freqs, false, 1.5f, x);
  EXPECT_EQ(x.to_floats(), ref.to_floats());
}

}  // namespace
}  // namespace megatron

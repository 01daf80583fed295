// Causal GQA attention: forward against an explicit softmax of the full score matrix (with and
// without dropout), gradient checks (GQA, MHA, dropout), bf16 storage.
#include <gtest/gtest.h>

#include <cmath>

#include "megatron/kernels/cpu/cpu_ops.h"
#include "tests/kernels/gradcheck.h"

namespace megatron {
namespace {

using testing::GradCheck;
using testing::max_abs_error;
using testing::random_tensor;

constexpr int64_t kS = 5, kB = 2, kD = 3;
constexpr uint64_t kSeed = 77, kOffset = 5;

struct AttnCase {
  int64_t nq, ng;
  float dropout_p;
};

struct Naive {
  std::vector<float> out, lse;
};

// Explicit [s, s] scores per (batch, head), causal mask, softmax, dropout, then P̃·V.
Naive naive_attention(const Tensor& q, const Tensor& k, const Tensor& v, const AttnCase& c, float scale) {
  std::vector<float> qv = q.to_floats(), kv = k.to_floats(), vv = v.to_floats();
  Naive r{std::vector<float>(qv.size()), std::vector<float>(size_t(kB * c.nq * kS))};
  auto at = [](const std::vector<float>& t, int64_t n, int64_t s, int64_t b, int64_t h, int64_t x) {
    return double(t[size_t(((s * kB + b) * n + h) * kD + x)]);
  };
  for (int64_t b = 0; b < kB; ++b)
    for (int64_t h = 0; h < c.nq; ++h) {
      const int64_t g = h / (c.nq / c.ng);
      for (int64_t i = 0; i < kS; ++i) {
        std::vector<double> p(size_t(kS), 0.0);
        double m = -1e300, sum = 0;
        for (int64_t j = 0; j <= i; ++j) {
          for (int64_t x = 0; x < kD; ++x) p[size_t(j)] += at(qv, c.nq, i, b, h, x) * at(kv, c.ng, j, b, g, x);
          p[size_t(j)] *= scale;
          m = std::max(m, p[size_t(j)]);
        }
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(p[size_t(j)] - m);
        r.lse[size_t((b * c.nq + h) * kS + i)] = float(m + std::log(sum));
        for (int64_t j = 0; j <= i; ++j) {
          p[size_t(j)] = std::exp(p[size_t(j)] - m) / sum;
          const uint64_t idx = uint64_t(((b * c.nq + h) * kS + i) * kS + j);
          if (c.dropout_p > 0)
            p[size_t(j)] = philox_uniform(kSeed, kOffset, idx) >= c.dropout_p ? p[size_t(j)] / (1 - c.dropout_p) : 0;
        }
        for (int64_t x = 0; x < kD; ++x) {
          double o = 0;
          for (int64_t j = 0; j <= i; ++j) o += p[size_t(j)] * at(vv, c.ng, j, b, g, x);
          r.out[size_t(((i * kB + b) * c.nq + h) * kD + x)] = float(o);
        }
      }
    }
  return r;
}

class Attention : public ::testing::TestWithParam<AttnCase> {
 protected:
  void forward(Tensor& out, Tensor& lse) {
    const AttnCase& c = GetParam();
    cpu::attention_forward(ctx, q, k, v, AttnMask::causal(), scale, c.dropout_p, kSeed, kOffset, out, lse);
  }

  Context ctx;
  const float scale = 1.0f / std::sqrt(float(kD));
  Tensor q = random_tensor({kS, kB, GetParam().nq, kD}, 1);
  Tensor k = random_tensor({kS, kB, GetParam().ng, kD}, 2);
  Tensor v = random_tensor({kS, kB, GetParam().ng, kD}, 3);
  Tensor lse = Tensor::empty({kB, GetParam().nq, kS}, DType::Float32);
};

TEST_P(Attention, ForwardMatchesNaive) {
  Tensor out = Tensor::empty(q.shape(), DType::Float32);
  forward(out, lse);
  Naive ref = naive_attention(q, k, v, GetParam(), scale);
  EXPECT_LT(max_abs_error(out.to_floats(), ref.out), 1e-5);
  EXPECT_LT(max_abs_error(lse.to_floats(), ref.lse), 1e-5);
}

TEST_P(Attention, GradCheck) {
  Tensor out = Tensor::empty(q.shape(), DType::Float32);
  GradCheck gc([&] {
    forward(out, lse);
    return std::vector<Tensor>{out.clone()};
  });
  gc.loss();  // out and lse of the unperturbed inputs
  Tensor grad_q = Tensor::empty(q.shape(), DType::Float32);
  Tensor grad_k = Tensor::empty(k.shape(), DType::Float32), grad_v = Tensor::empty(v.shape(), DType::Float32);
  cpu::attention_backward(ctx, gc.upstream(), q, k, v, out, lse, AttnMask::causal(), scale, GetParam().dropout_p, kSeed,
                          kOffset, grad_q, grad_k, grad_v);
  gc.check("grad_q", q, grad_q);
  gc.check("grad_k", k, grad_k);
  gc.check("grad_v", v, grad_v);
}

TEST_P(Attention, Bf16StorageTracksFp32) {
  Tensor q16 = q.to(DType::BFloat16), k16 = k.to(DType::BFloat16), v16 = v.to(DType::BFloat16);
  Tensor out = Tensor::empty(q.shape(), DType::Float32), out16 = Tensor::empty(q.shape(), DType::BFloat16);
  const float p = GetParam().dropout_p;
  cpu::attention_forward(ctx, q16.to(DType::Float32), k16.to(DType::Float32), v16.to(DType::Float32),
                         AttnMask::causal(), scale, p, kSeed, kOffset, out, lse);
  Tensor lse16 = Tensor::empty(lse.shape(), DType::Float32);
  cpu::attention_forward(ctx, q16, k16, v16, AttnMask::causal(), scale, p, kSeed, kOffset, out16, lse16);
  EXPECT_LT(max_abs_error(out16.to_floats(), out.to_floats()), 2e-2);
  EXPECT_LT(max_abs_error(lse16.to_floats(), lse.to_floats()), 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Heads, Attention,
                         ::testing::Values(AttnCase{4, 2, 0.0f}, AttnCase{3, 3, 0.0f}, AttnCase{4, 2, 0.3f},
                                           AttnCase{2, 2, 0.3f}),
                         [](const auto& info) {
                           return (info.param.nq == info.param.ng ? std::string("MHA") : std::string("GQA")) +
                                  (info.param.dropout_p > 0 ? "Dropout" : "");
                         });

TEST(AttentionDropout, ZeroProbabilityIgnoresTheStream) {
  Context ctx;
  Tensor q = random_tensor({kS, kB, 2, kD}, 4), k = random_tensor({kS, kB, 1, kD}, 5),
         v = random_tensor({kS, kB, 1, kD}, 6);
  Tensor a = Tensor::empty(q.shape(), DType::Float32), b = Tensor::empty(q.shape(), DType::Float32);
  Tensor lse = Tensor::empty({kB, 2, kS}, DType::Float32);
  cpu::attention_forward(ctx, q, k, v, AttnMask::causal(), 0.5f, 0.0f, 1, 2, a, lse);
  cpu::attention_forward(ctx, q, k, v, AttnMask::causal(), 0.5f, 0.0f, 99, 1000, b, lse);
  EXPECT_EQ(a.to_floats(), b.to_floats());
  // The first query position attends only to the first key: its output is v[0] of its group.
  for (int64_t x = 0; x < kD; ++x) EXPECT_FLOAT_EQ(a.item(x), v.item(x));
}

}  // namespace
}  // namespace megatron

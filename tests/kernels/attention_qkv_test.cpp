// Attention read from the fused MHA QKV buffer (attention_forward_qkv / attention_backward_qkv):
// equal, bit for bit, to qkv_split_forward + attention_forward (+ attention_backward +
// qkv_split_backward), with and without dropout, in fp32 and bf16 storage and odd shapes; the
// per-head offsets the GPU's strided views rely on; a finite-difference check through the buffer.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "megatron/kernels/cpu/cpu_ops.h"
#include "tests/kernels/gradcheck.h"

namespace megatron {
namespace {

using testing::GradCheck;
using testing::random_tensor;

constexpr uint64_t kSeed = 91, kOffset = 3;

struct QkvCase {
  int64_t s, b, nq, d;
  float dropout_p;
  DType dtype;
};

std::string case_name(const QkvCase& c) {
  return std::string(to_string(c.dtype)) + "_s" + std::to_string(c.s) + "_b" + std::to_string(c.b) + "_nq" +
         std::to_string(c.nq) + "_d" + std::to_string(c.d) + (c.dropout_p > 0 ? "_dropout" : "");
}

// q, k, v [s, b, nq, d] and the fused buffer holding them (built by the merge, qkv_split_backward).
struct Fused {
  Tensor q, k, v, qkv;
};

Fused make_fused(const QkvCase& c, uint64_t seed) {
  Context ctx;
  const Shape heads = {c.s, c.b, c.nq, c.d};
  Fused f{random_tensor(heads, seed, 1.0f, c.dtype), random_tensor(heads, seed + 1, 1.0f, c.dtype),
          random_tensor(heads, seed + 2, 1.0f, c.dtype), Tensor::empty({c.s, c.b, 3 * c.nq * c.d}, c.dtype)};
  cpu::qkv_split_backward(ctx, f.q, f.k, f.v, f.qkv);
  return f;
}

class AttentionQkv : public ::testing::TestWithParam<QkvCase> {};

// The layout the cuDNN strides describe: head h's q, k, v at h·3d, h·3d + d, h·3d + 2d of a token row.
TEST_P(AttentionQkv, HeadOffsetsInTheFusedRow) {
  const QkvCase& c = GetParam();
  const Fused f = make_fused(c, 5);
  const std::vector<float> qkv = f.qkv.to_floats(), q = f.q.to_floats(), k = f.k.to_floats(), v = f.v.to_floats();
  const std::vector<float>* parts[3] = {&q, &k, &v};
  for (int64_t t = 0; t < c.s * c.b; ++t)
    for (int64_t h = 0; h < c.nq; ++h)
      for (int part = 0; part < 3; ++part)
        for (int64_t x = 0; x < c.d; ++x)
          ASSERT_EQ(qkv[size_t(t * 3 * c.nq * c.d + h * 3 * c.d + part * c.d + x)],
                    (*parts[part])[size_t((t * c.nq + h) * c.d + x)])
              << "token " << t << " head " << h << " part " << part << " channel " << x;
}

TEST_P(AttentionQkv, EqualsSplitAttentionMerge) {
  const QkvCase& c = GetParam();
  Context ctx;
  const Fused f = make_fused(c, 17);
  const float scale = 1.0f / std::sqrt(float(c.d));
  const Shape heads = f.q.shape(), lse_shape = {c.b, c.nq, c.s};
  const Tensor grad_out = random_tensor(heads, 23, 1.0f, c.dtype);

  // Reference: the separate tensors through the existing ops, gradients merged.
  Tensor out_ref = Tensor::empty(heads, c.dtype), lse_ref = Tensor::empty(lse_shape, DType::Float32);
  cpu::attention_forward(ctx, f.q, f.k, f.v, AttnMask::causal(), scale, c.dropout_p, kSeed, kOffset, out_ref, lse_ref);
  Tensor gq = Tensor::empty(heads, c.dtype), gk = Tensor::empty(heads, c.dtype), gv = Tensor::empty(heads, c.dtype);
  cpu::attention_backward(ctx, grad_out, f.q, f.k, f.v, out_ref, lse_ref, AttnMask::causal(), scale, c.dropout_p, kSeed,
                          kOffset, gq, gk, gv);
  Tensor grad_qkv_ref = Tensor::empty(f.qkv.shape(), c.dtype);
  cpu::qkv_split_backward(ctx, gq, gk, gv, grad_qkv_ref);

  Tensor out = Tensor::empty(heads, c.dtype), lse = Tensor::empty(lse_shape, DType::Float32);
  cpu::attention_forward_qkv(ctx, f.qkv, AttnMask::causal(), scale, c.dropout_p, kSeed, kOffset, out, lse);
  Tensor grad_qkv = Tensor::empty(f.qkv.shape(), c.dtype);
  grad_qkv.fill_(std::nanf(""));
  cpu::attention_backward_qkv(ctx, grad_out, f.qkv, out, lse, AttnMask::causal(), scale, c.dropout_p, kSeed, kOffset,
                              grad_qkv);

  EXPECT_EQ(out.to_floats(), out_ref.to_floats());
  EXPECT_EQ(lse.to_floats(), lse_ref.to_floats());
  EXPECT_EQ(grad_qkv.to_floats(), grad_qkv_ref.to_floats());
}

// The ops dispatcher on a CPU context takes the same path.
TEST_P(AttentionQkv, DispatchMatchesReference) {
  const QkvCase& c = GetParam();
  Context ctx;
  const Fused f = make_fused(c, 29);
  const float scale = 0.5f;
  const Shape heads = f.q.shape(), lse_shape = {c.b, c.nq, c.s};
  const Tensor grad_out = random_tensor(heads, 31, 1.0f, c.dtype);
  Tensor out_a = Tensor::empty(heads, c.dtype), lse_a = Tensor::empty(lse_shape, DType::Float32);
  Tensor out_b = Tensor::empty(heads, c.dtype), lse_b = Tensor::empty(lse_shape, DType::Float32);
  Tensor grad_a = Tensor::empty(f.qkv.shape(), c.dtype), grad_b = Tensor::empty(f.qkv.shape(), c.dtype);
  ops::attention_forward_qkv(ctx, f.qkv, AttnMask::causal(), scale, c.dropout_p, kSeed, kOffset, out_a, lse_a);
  ops::attention_backward_qkv(ctx, grad_out, f.qkv, out_a, lse_a, AttnMask::causal(), scale, c.dropout_p, kSeed,
                              kOffset, grad_a);
  cpu::attention_forward_qkv(ctx, f.qkv, AttnMask::causal(), scale, c.dropout_p, kSeed, kOffset, out_b, lse_b);
  cpu::attention_backward_qkv(ctx, grad_out, f.qkv, out_b, lse_b, AttnMask::causal(), scale, c.dropout_p, kSeed,
                              kOffset, grad_b);
  EXPECT_EQ(out_a.to_floats(), out_b.to_floats());
  EXPECT_EQ(lse_a.to_floats(), lse_b.to_floats());
  EXPECT_EQ(grad_a.to_floats(), grad_b.to_floats());
}

std::vector<QkvCase> qkv_cases() {
  std::vector<QkvCase> cases;
  for (DType t : {DType::Float32, DType::BFloat16})
    for (float p : {0.0f, 0.3f}) {
      cases.push_back({1, 1, 1, 3, p, t});   // one token, one head
      cases.push_back({5, 2, 3, 7, p, t});   // odd heads and head size
      cases.push_back({16, 3, 4, 8, p, t});  // odd batch
    }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionQkv, ::testing::ValuesIn(qkv_cases()),
                         [](const auto& info) { return case_name(info.param); });

// dL/dqkv through the fused op against central differences (fp32, with dropout: the mask is fixed
// by (seed, offset), so L is smooth in qkv).
TEST(AttentionQkvGrad, FiniteDifferences) {
  for (float p : {0.0f, 0.25f}) {
    SCOPED_TRACE(p);
    Context ctx;
    const int64_t s = 4, b = 2, nq = 2, d = 3;
    const float scale = 1.0f / std::sqrt(float(d));
    Tensor qkv = random_tensor({s, b, 3 * nq * d}, 41);
    Tensor out = Tensor::empty({s, b, nq, d}, DType::Float32), lse = Tensor::empty({b, nq, s}, DType::Float32);
    GradCheck gc([&] {
      cpu::attention_forward_qkv(ctx, qkv, AttnMask::causal(), scale, p, kSeed, kOffset, out, lse);
      return std::vector<Tensor>{out.clone()};
    });
    gc.loss();  // out and lse of the unperturbed input
    Tensor grad_qkv = Tensor::empty(qkv.shape(), DType::Float32);
    cpu::attention_backward_qkv(ctx, gc.upstream(), qkv, out, lse, AttnMask::causal(), scale, p, kSeed, kOffset,
                                grad_qkv);
    gc.check("grad_qkv", qkv, grad_qkv);
  }
}

// A buffer that is not 3·out wide is a caller bug, reported as such.
TEST(AttentionQkvShapes, RejectsAMismatchedBuffer) {
  Context ctx;
  Tensor qkv = Tensor::zeros({4, 2, 5 * 3}, DType::Float32);  // GQA-shaped: nq 3, ng 1, d 3
  Tensor out = Tensor::empty({4, 2, 3, 3}, DType::Float32), lse = Tensor::empty({2, 3, 4}, DType::Float32);
  EXPECT_ANY_THROW(cpu::attention_forward_qkv(ctx, qkv, AttnMask::causal(), 1.0f, 0.0f, kSeed, kOffset, out, lse));
}

}  // namespace
}  // namespace megatron

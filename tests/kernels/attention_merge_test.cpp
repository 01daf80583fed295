// Merging attention over key blocks (Note [Merging attention over key blocks] in op_list.inc), the
// math of context-parallel attention, on the CPU reference: the keys of a causal attention cut into
// blocks (as a context-parallel rank's query chunk sees them), each block's attention merged with
// attention_merge, gives the whole attention's out and lse; the blocks' backward with the merged
// out and lse sums to the whole backward; and the merged attention's gradient passes a finite-
// difference check. Also the row copies (lse_copy_rows, copy_rows).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "megatron/kernels/cpu/cpu_ops.h"
#include "tests/kernels/gradcheck.h"

namespace megatron {
namespace {

using testing::GradCheck;
using testing::max_abs_error;
using testing::random_tensor;

constexpr int64_t kB = 2, kNq = 4, kNg = 2, kD = 8;

struct Blocks {
  int64_t q_offset;            // global position of the query chunk's row 0
  std::vector<int64_t> edges;  // key blocks [edges[i], edges[i + 1]) of keys 0 .. sk
};

// Query chunk of 5 rows at positions 10..14 against keys 0..14 in blocks (the last one holds the
// diagonal): the merged result, and each block's own.
void merged_forward(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Blocks& bl, float scale,
                    Tensor& out, Tensor& lse) {
  const int64_t sq = q.size(0);
  out.zero_();
  lse.fill_(-std::numeric_limits<float>::infinity());
  for (size_t i = 0; i + 1 < bl.edges.size(); ++i) {
    const int64_t k0 = bl.edges[i], k1 = bl.edges[i + 1];
    Tensor kb = k.slice(k0, k1), vb = v.slice(k0, k1);
    Tensor ob = Tensor::empty(q.shape(), DType::Float32), lb = Tensor::empty({kB, kNq, sq}, DType::Float32);
    cpu::attention_forward(ctx, q, kb, vb, AttnMask::causal_with_offset(bl.q_offset, k0), scale, 0.0f, 0, 0, ob, lb);
    cpu::attention_merge(ctx, ob, lb, 0, out, lse);
  }
}

TEST(AttentionMerge, BlocksMergeToTheWholeAttention) {
  Context ctx(Device::cpu());
  const int64_t sq = 5, sk = 15;
  const float scale = 1.0f / std::sqrt(float(kD));
  Tensor q = random_tensor({sq, kB, kNq, kD}, 1), k = random_tensor({sk, kB, kNg, kD}, 2),
         v = random_tensor({sk, kB, kNg, kD}, 3);
  const AttnMask whole = AttnMask::causal_with_offset(10, 0);
  Tensor out = Tensor::empty(q.shape(), DType::Float32), lse = Tensor::empty({kB, kNq, sq}, DType::Float32);
  cpu::attention_forward(ctx, q, k, v, whole, scale, 0.0f, 0, 0, out, lse);
  for (const Blocks& bl : {Blocks{10, {0, 15}}, Blocks{10, {0, 5, 10, 15}}, Blocks{10, {0, 12, 15}},
                           Blocks{10, {0, 7, 11, 13, 15}}}) {
    Tensor m_out = Tensor::empty(q.shape(), DType::Float32), m_lse = Tensor::empty({kB, kNq, sq}, DType::Float32);
    merged_forward(ctx, q, k, v, bl, scale, m_out, m_lse);
    const double e_out = max_abs_error(m_out.to_floats(), out.to_floats());
    const double e_lse = max_abs_error(m_lse.to_floats(), lse.to_floats());
    std::printf("%zu key blocks: out err %.2e, lse err %.2e\n", bl.edges.size() - 1, e_out, e_lse);
    EXPECT_LT(e_out, 1e-6);
    EXPECT_LT(e_lse, 1e-5);

    // Backward: each block with the merged out and lse; dq sums, dk/dv land in their block.
    Tensor go = random_tensor(q.shape(), 9);
    Tensor gq = Tensor::empty(q.shape(), DType::Float32), gk = Tensor::empty(k.shape(), DType::Float32),
           gv = Tensor::empty(v.shape(), DType::Float32);
    cpu::attention_backward(ctx, go, q, k, v, out, lse, whole, scale, 0.0f, 0, 0, gq, gk, gv);
    std::vector<float> sq_(size_t(q.numel()), 0.0f), sk_(size_t(k.numel()), 0.0f), sv_(size_t(v.numel()), 0.0f);
    for (size_t i = 0; i + 1 < bl.edges.size(); ++i) {
      const int64_t k0 = bl.edges[i], k1 = bl.edges[i + 1];
      Tensor bq = Tensor::empty(q.shape(), DType::Float32), bk = Tensor::empty({k1 - k0, kB, kNg, kD}, DType::Float32),
             bv = Tensor::empty({k1 - k0, kB, kNg, kD}, DType::Float32);
      cpu::attention_backward(ctx, go, q, k.slice(k0, k1), v.slice(k0, k1), m_out, m_lse,
                              AttnMask::causal_with_offset(bl.q_offset, k0), scale, 0.0f, 0, 0, bq, bk, bv);
      const std::vector<float> a = bq.to_floats(), b = bk.to_floats(), c = bv.to_floats();
      for (size_t j = 0; j < a.size(); ++j) sq_[j] += a[j];
      const size_t off = size_t(k0 * kB * kNg * kD);
      for (size_t j = 0; j < b.size(); ++j) sk_[off + j] += b[j], sv_[off + j] += c[j];
    }
    EXPECT_LT(max_abs_error(sq_, gq.to_floats()), 1e-5);
    EXPECT_LT(max_abs_error(sk_, gk.to_floats()), 1e-5);
    EXPECT_LT(max_abs_error(sv_, gv.to_floats()), 1e-5);
  }
}

// The merged attention as a function of q, k, v: its gradient (blocks' backward with the merged
// out/lse) against central differences.
TEST(AttentionMerge, MergedGradientPassesFiniteDifferences) {
  Context ctx(Device::cpu());
  const int64_t sq = 3, sk = 7;
  const float scale = 0.5f;
  Tensor q = random_tensor({sq, kB, kNq, kD}, 4), k = random_tensor({sk, kB, kNg, kD}, 5),
         v = random_tensor({sk, kB, kNg, kD}, 6);
  const Blocks bl{4, {0, 2, 5, 7}};
  Tensor out = Tensor::empty(q.shape(), DType::Float32), lse = Tensor::empty({kB, kNq, sq}, DType::Float32);
  GradCheck gc([&] {
    merged_forward(ctx, q, k, v, bl, scale, out, lse);
    return std::vector<Tensor>{out.clone()};
  });
  gc.loss();
  Tensor gq = Tensor::zeros(q.shape(), DType::Float32), gk = Tensor::zeros(k.shape(), DType::Float32),
         gv = Tensor::zeros(v.shape(), DType::Float32);
  for (size_t i = 0; i + 1 < bl.edges.size(); ++i) {
    const int64_t k0 = bl.edges[i], k1 = bl.edges[i + 1];
    Tensor bq = Tensor::empty(q.shape(), DType::Float32), bk = Tensor::empty({k1 - k0, kB, kNg, kD}, DType::Float32),
           bv = Tensor::empty({k1 - k0, kB, kNg, kD}, DType::Float32);
    cpu::attention_backward(ctx, gc.upstream(), q, k.slice(k0, k1), v.slice(k0, k1), out, lse,
                            AttnMask::causal_with_offset(bl.q_offset, k0), scale, 0.0f, 0, 0, bq, bk, bv);
    cpu::add(ctx, gq, bq, gq);
    Tensor gks = gk.slice(k0, k1), gvs = gv.slice(k0, k1);
    cpu::add(ctx, gks, bk, gks);
    cpu::add(ctx, gvs, bv, gvs);
  }
  gc.check("grad_q", q, gq);
  gc.check("grad_k", k, gk);
  gc.check("grad_v", v, gv);
}

// A block that gives a row nothing (lse -inf) leaves it; merging into an empty row takes the block.
TEST(AttentionMerge, RowsWithoutKeys) {
  Context ctx(Device::cpu());
  const float inf = std::numeric_limits<float>::infinity();
  Tensor acc = Tensor::from_floats({1, 2, 0, 0}, {2, 1, 1, 2}), acc_lse = Tensor::from_floats({0.5f, -inf}, {1, 1, 2});
  Tensor blk = Tensor::from_floats({7, 7, 3, 4}, {2, 1, 1, 2}), blk_lse = Tensor::from_floats({-inf, 1.0f}, {1, 1, 2});
  cpu::attention_merge(ctx, blk, blk_lse, 0, acc, acc_lse);
  EXPECT_EQ(acc.to_floats(), (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(acc_lse.to_floats(), (std::vector<float>{0.5f, 1.0f}));
  // Equal lse: the mean; into rows 1.. of a longer accumulator.
  Tensor acc3 = Tensor::from_floats({9, 9, 2, 2, 0, 0}, {3, 1, 1, 2}), lse3 = Tensor::from_floats({0, 1, -inf}, {1, 1, 3});
  Tensor b2 = Tensor::from_floats({4, 6, 5, 5}, {2, 1, 1, 2}), l2 = Tensor::from_floats({1, 2}, {1, 1, 2});
  cpu::attention_merge(ctx, b2, l2, 1, acc3, lse3);
  const std::vector<float> o = acc3.to_floats(), l = lse3.to_floats();
  EXPECT_FLOAT_EQ(o[2], 3.0f);
  EXPECT_FLOAT_EQ(o[3], 4.0f);
  EXPECT_FLOAT_EQ(o[4], 5.0f);
  EXPECT_FLOAT_EQ(l[1], 1.0f + std::log(2.0f));
  EXPECT_FLOAT_EQ(l[2], 2.0f);
  EXPECT_FLOAT_EQ(o[0], 9.0f);
}

TEST(AttentionMerge, RowCopies) {
  Context ctx(Device::cpu());
  Tensor src = Tensor::from_floats({0, 1, 2, 3, 10, 11, 12, 13}, {2, 1, 4}), dst = Tensor::zeros({2, 1, 3}, DType::Float32);
  cpu::lse_copy_rows(ctx, src, 1, dst, 1, 2);
  EXPECT_EQ(dst.to_floats(), (std::vector<float>{0, 1, 2, 0, 11, 12}));
  Tensor a = Tensor::from_ints({1, 2, 3, 4, 5, 6}, {3, 2}), b = Tensor::zeros({4, 2}, DType::Int64);
  cpu::copy_rows(ctx, a, 1, b, 2, 2);
  EXPECT_EQ(b.to_ints(), (std::vector<int64_t>{0, 0, 0, 0, 3, 4, 5, 6}));
}

}  // namespace
}  // namespace megatron

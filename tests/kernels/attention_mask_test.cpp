// The attention ops' masks (Note [Attention masks] in op_list.inc) on the CPU reference: each kind
// against an explicit softmax over the keys it lets through (with and without dropout, GQA and
// MHA, rows that see no key), gradient checks for each kind, and the identities that tie the kinds
// together (windows included: Note [Sliding-window attention]): one document is Causal, CausalWithOffset with equal offsets is Causal, and Documents is
// each document run on its own through Causal.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "megatron/kernels/cpu/cpu_ops.h"
#include "tests/kernels/gradcheck.h"

namespace megatron {
namespace {

using testing::GradCheck;
using testing::max_abs_error;
using testing::random_tensor;

constexpr int64_t kB = 2, kD = 3;
constexpr uint64_t kSeed = 19, kOffset = 4;

Tensor ints(const std::vector<int64_t>& values, const Shape& shape) {
  return Tensor::from_ints(values, shape, DType::Int32);
}

struct MaskCase {
  std::string name;
  int64_t sq, sk, nq, ng;
  float dropout_p;
  std::function<AttnMask()> mask;
  std::function<bool(int64_t b, int64_t i, int64_t j)> visible;  // the mask, written out
};

// Documents of every batch row: [0, 2) [2, 7); per row: {0, 3, 3, 7} (an empty document) and
// {0, 1, 5, 7}.
bool in_one_document(const std::vector<int64_t>& cu, int64_t i, int64_t j) {
  for (size_t t = 0; t + 1 < cu.size(); ++t)
    if (cu[t] <= i && i < cu[t + 1]) return cu[t] <= j && j < cu[t + 1];
  return false;
}
const std::vector<int64_t> kShared = {0, 2, 7};
const std::vector<std::vector<int64_t>> kPerRow = {{0, 3, 3, 7}, {0, 1, 5, 7}};

std::vector<MaskCase> mask_cases() {
  std::vector<MaskCase> cases;
  for (float p : {0.0f, 0.3f}) {
    const std::string drop = p > 0 ? "Dropout" : "";
    for (auto [nq, ng] : std::vector<std::pair<int64_t, int64_t>>{{4, 2}, {2, 2}}) {
      const std::string heads = nq == ng ? "MHA" : "GQA";
      cases.push_back({"Causal" + heads + drop, 5, 5, nq, ng, p, [] { return AttnMask::causal(); },
                       [](int64_t, int64_t i, int64_t j) { return j <= i; }});
      // Query chunk at 2..5 against keys at 3..8: query row 0 sees nothing.
      cases.push_back({"Offset" + heads + drop, 4, 6, nq, ng, p, [] { return AttnMask::causal_with_offset(2, 3); },
                       [](int64_t, int64_t i, int64_t j) { return j + 3 <= i + 2; }});
      // Bottom-right: the last 3 of 6 positions against all 6 keys.
      cases.push_back({"BottomRight" + heads + drop, 3, 6, nq, ng, p, [] { return AttnMask::causal_with_offset(3, 0); },
                       [](int64_t, int64_t i, int64_t j) { return j <= i + 3; }});
      cases.push_back({"SharedDocuments" + heads + drop, 7, 7, nq, ng, p,
                       [] { return AttnMask::documents(ints(kShared, {3})); },
                       [](int64_t, int64_t i, int64_t j) { return j <= i && in_one_document(kShared, i, j); }});
      cases.push_back(
          {"RowDocuments" + heads + drop, 7, 7, nq, ng, p,
           [] {
             return AttnMask::documents(ints({kPerRow[0][0], kPerRow[0][1], kPerRow[0][2], kPerRow[0][3], kPerRow[1][0],
                                              kPerRow[1][1], kPerRow[1][2], kPerRow[1][3]},
                                             {kB, 4}));
           },
           [](int64_t b, int64_t i, int64_t j) { return j <= i && in_one_document(kPerRow[size_t(b)], i, j); }});
      // Note [Sliding-window attention]: the window cuts each kind's interval from the left.
      cases.push_back({"CausalWindow" + heads + drop, 7, 7, nq, ng, p,
                       [] { return AttnMask::causal().with_window(2); },
                       [](int64_t, int64_t i, int64_t j) { return j <= i && j >= i - 2; }});
      cases.push_back({"CausalWindow0" + heads + drop, 5, 5, nq, ng, p,
                       [] { return AttnMask::causal().with_window(0); },
                       [](int64_t, int64_t i, int64_t j) { return j == i; }});
      cases.push_back({"OffsetWindow" + heads + drop, 4, 6, nq, ng, p,
                       [] { return AttnMask::causal_with_offset(4, 1).with_window(3); },
                       [](int64_t, int64_t i, int64_t j) { return j + 1 <= i + 4 && j + 1 >= i + 4 - 3; }});
      cases.push_back({"RowDocumentsWindow" + heads + drop, 7, 7, nq, ng, p,
                       [] {
                         return AttnMask::documents(ints({kPerRow[0][0], kPerRow[0][1], kPerRow[0][2], kPerRow[0][3],
                                                          kPerRow[1][0], kPerRow[1][1], kPerRow[1][2], kPerRow[1][3]},
                                                         {kB, 4}))
                             .with_window(1);
                       },
                       [](int64_t b, int64_t i, int64_t j) {
                         return j <= i && j >= i - 1 && in_one_document(kPerRow[size_t(b)], i, j);
                       }});
    }
  }
  return cases;
}

struct Naive {
  std::vector<float> out, lse;
};

// Explicit [sq, sk] scores per (batch, head) over the visible keys, softmax, dropout, then P̃·V;
// a row that sees no key has out 0 and lse -inf.
Naive naive_attention(const Tensor& q, const Tensor& k, const Tensor& v, const MaskCase& c, float scale) {
  std::vector<float> qv = q.to_floats(), kv = k.to_floats(), vv = v.to_floats();
  Naive r{std::vector<float>(qv.size(), 0.0f), std::vector<float>(size_t(kB * c.nq * c.sq))};
  auto at = [](const std::vector<float>& t, int64_t n, int64_t s, int64_t b, int64_t h, int64_t x) {
    return double(t[size_t(((s * kB + b) * n + h) * kD + x)]);
  };
  for (int64_t b = 0; b < kB; ++b)
    for (int64_t h = 0; h < c.nq; ++h) {
      const int64_t g = h / (c.nq / c.ng);
      for (int64_t i = 0; i < c.sq; ++i) {
        std::vector<double> p(size_t(c.sk), 0.0);
        double m = -1e300, sum = 0;
        bool any = false;
        for (int64_t j = 0; j < c.sk; ++j) {
          if (!c.visible(b, i, j)) continue;
          any = true;
          for (int64_t x = 0; x < kD; ++x) p[size_t(j)] += at(qv, c.nq, i, b, h, x) * at(kv, c.ng, j, b, g, x);
          p[size_t(j)] *= scale;
          m = std::max(m, p[size_t(j)]);
        }
        const size_t row = size_t((b * c.nq + h) * c.sq + i);
        if (!any) {
          r.lse[row] = -std::numeric_limits<float>::infinity();
          continue;
        }
        for (int64_t j = 0; j < c.sk; ++j)
          if (c.visible(b, i, j)) sum += std::exp(p[size_t(j)] - m);
        r.lse[row] = float(m + std::log(sum));
        for (int64_t j = 0; j < c.sk; ++j) {
          if (!c.visible(b, i, j)) continue;
          p[size_t(j)] = std::exp(p[size_t(j)] - m) / sum;
          if (c.dropout_p > 0)
            p[size_t(j)] = philox_uniform(kSeed, kOffset, uint64_t(row) * uint64_t(c.sk) + uint64_t(j)) >= c.dropout_p
                               ? p[size_t(j)] / (1 - c.dropout_p)
                               : 0;
        }
        for (int64_t x = 0; x < kD; ++x) {
          double o = 0;
          for (int64_t j = 0; j < c.sk; ++j)
            if (c.visible(b, i, j)) o += p[size_t(j)] * at(vv, c.ng, j, b, g, x);
          r.out[size_t(((i * kB + b) * c.nq + h) * kD + x)] = float(o);
        }
      }
    }
  return r;
}

class AttentionMasks : public ::testing::TestWithParam<MaskCase> {
 protected:
  void forward(Tensor& out, Tensor& lse) {
    const MaskCase& c = GetParam();
    cpu::attention_forward(ctx, q, k, v, mask, scale, c.dropout_p, kSeed, kOffset, out, lse);
  }

  Context ctx;
  const float scale = 1.0f / std::sqrt(float(kD));
  const AttnMask mask = GetParam().mask();
  Tensor q = random_tensor({GetParam().sq, kB, GetParam().nq, kD}, 1);
  Tensor k = random_tensor({GetParam().sk, kB, GetParam().ng, kD}, 2);
  Tensor v = random_tensor({GetParam().sk, kB, GetParam().ng, kD}, 3);
  Tensor lse = Tensor::empty({kB, GetParam().nq, GetParam().sq}, DType::Float32);
};

TEST_P(AttentionMasks, ForwardMatchesNaive) {
  Tensor out = Tensor::empty(q.shape(), DType::Float32);
  forward(out, lse);
  const Naive ref = naive_attention(q, k, v, GetParam(), scale);
  EXPECT_LT(max_abs_error(out.to_floats(), ref.out), 1e-5);
  const std::vector<float> got = lse.to_floats();
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isinf(ref.lse[i])) {
      EXPECT_TRUE(std::isinf(got[i]) && got[i] < 0) << "lse[" << i << "] = " << got[i] << ", expected -inf";
    } else {
      EXPECT_NEAR(got[i], ref.lse[i], 1e-5) << "lse[" << i << "]";
    }
  }
}

TEST_P(AttentionMasks, GradCheck) {
  Tensor out = Tensor::empty(q.shape(), DType::Float32);
  GradCheck gc([&] {
    forward(out, lse);
    return std::vector<Tensor>{out.clone()};
  });
  gc.loss();  // out and lse of the unperturbed inputs
  Tensor grad_q = Tensor::empty(q.shape(), DType::Float32);
  Tensor grad_k = Tensor::empty(k.shape(), DType::Float32), grad_v = Tensor::empty(v.shape(), DType::Float32);
  cpu::attention_backward(ctx, gc.upstream(), q, k, v, out, lse, mask, scale, GetParam().dropout_p, kSeed, kOffset,
                          grad_q, grad_k, grad_v);
  for (const Tensor* g : {&grad_q, &grad_k, &grad_v})
    for (float x : g->to_floats()) ASSERT_TRUE(std::isfinite(x)) << "a gradient is not finite";
  gc.check("grad_q", q, grad_q);
  gc.check("grad_k", k, grad_k);
  gc.check("grad_v", v, grad_v);
}

INSTANTIATE_TEST_SUITE_P(Kinds, AttentionMasks, ::testing::ValuesIn(mask_cases()),
                         [](const auto& info) { return info.param.name; });

// Forward and backward of one mask, every output.
struct Outputs {
  std::vector<float> out, lse, grad_q, grad_k, grad_v;
};

Outputs run_mask(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& grad_out, const AttnMask& mask,
                 float p) {
  Context ctx;
  const float scale = 0.7f;
  Tensor out = Tensor::empty(q.shape(), DType::Float32),
         lse = Tensor::empty({q.size(1), q.size(2), q.size(0)}, DType::Float32);
  Tensor gq = Tensor::empty(q.shape(), DType::Float32), gk = Tensor::empty(k.shape(), DType::Float32),
         gv = Tensor::empty(v.shape(), DType::Float32);
  cpu::attention_forward(ctx, q, k, v, mask, scale, p, kSeed, kOffset, out, lse);
  cpu::attention_backward(ctx, grad_out, q, k, v, out, lse, mask, scale, p, kSeed, kOffset, gq, gk, gv);
  return {out.to_floats(), lse.to_floats(), gq.to_floats(), gk.to_floats(), gv.to_floats()};
}

void expect_same_bits(const Outputs& a, const Outputs& b) {
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.lse, b.lse);
  EXPECT_EQ(a.grad_q, b.grad_q);
  EXPECT_EQ(a.grad_k, b.grad_k);
  EXPECT_EQ(a.grad_v, b.grad_v);
}

TEST(AttentionMaskIdentities, OneDocumentIsCausal) {
  const int64_t s = 6;
  const Tensor q = random_tensor({s, kB, 4, kD}, 5), k = random_tensor({s, kB, 2, kD}, 6),
               v = random_tensor({s, kB, 2, kD}, 7), dout = random_tensor({s, kB, 4, kD}, 8);
  for (float p : {0.0f, 0.25f}) {
    SCOPED_TRACE(p);
    const Outputs causal = run_mask(q, k, v, dout, AttnMask::causal(), p);
    expect_same_bits(run_mask(q, k, v, dout, AttnMask::documents(ints({0, s}, {2})), p), causal);
    expect_same_bits(run_mask(q, k, v, dout, AttnMask::documents(ints({0, s, 0, s}, {kB, 2})), p), causal);
  }
}

TEST(AttentionMaskIdentities, EqualOffsetsAreCausal) {
  const int64_t s = 6;
  const Tensor q = random_tensor({s, kB, 4, kD}, 9), k = random_tensor({s, kB, 2, kD}, 10),
               v = random_tensor({s, kB, 2, kD}, 11), dout = random_tensor({s, kB, 4, kD}, 12);
  for (float p : {0.0f, 0.25f}) {
    SCOPED_TRACE(p);
    const Outputs causal = run_mask(q, k, v, dout, AttnMask::causal(), p);
    expect_same_bits(run_mask(q, k, v, dout, AttnMask::causal_with_offset(0, 0), p), causal);
    expect_same_bits(run_mask(q, k, v, dout, AttnMask::causal_with_offset(37, 37), p), causal);
  }
}

// Rows [begin, end) of batch row b of x [s, B, n, d], as [end - begin, 1, n, d].
Tensor rows_of(const Tensor& x, int64_t b, int64_t begin, int64_t end) {
  const int64_t batch = x.size(1), n = x.size(2), d = x.size(3);
  const std::vector<float> all = x.to_floats();
  std::vector<float> part;
  for (int64_t i = begin; i < end; ++i)
    for (int64_t c = 0; c < n * d; ++c) part.push_back(all[size_t((i * batch + b) * n * d + c)]);
  return Tensor::from_floats(part, {end - begin, 1, n, d});
}

// The outside check: with documents, every output equals attention over each document alone.
TEST(AttentionMaskIdentities, DocumentsAreSeparateCausalRuns) {
  const int64_t s = 9, nq = 4, ng = 2;
  const std::vector<std::vector<int64_t>> cu = {{0, 4, 4, 9}, {0, 1, 6, 9}};
  const Tensor q = random_tensor({s, kB, nq, kD}, 13), k = random_tensor({s, kB, ng, kD}, 14),
               v = random_tensor({s, kB, ng, kD}, 15), dout = random_tensor({s, kB, nq, kD}, 16);
  const Outputs docs =
      run_mask(q, k, v, dout,
               AttnMask::documents(
                   ints({cu[0][0], cu[0][1], cu[0][2], cu[0][3], cu[1][0], cu[1][1], cu[1][2], cu[1][3]}, {kB, 4})),
               0.0f);
  for (int64_t b = 0; b < kB; ++b)
    for (size_t t = 0; t + 1 < cu[size_t(b)].size(); ++t) {
      const int64_t begin = cu[size_t(b)][t], end = cu[size_t(b)][t + 1], len = end - begin;
      if (len == 0) continue;
      SCOPED_TRACE("batch row " + std::to_string(b) + ", document " + std::to_string(t));
      const Outputs one = run_mask(rows_of(q, b, begin, end), rows_of(k, b, begin, end), rows_of(v, b, begin, end),
                                   rows_of(dout, b, begin, end), AttnMask::causal(), 0.0f);
      for (int64_t i = 0; i < len; ++i) {
        for (int64_t h = 0; h < nq; ++h) {
          EXPECT_NEAR(docs.lse[size_t((b * nq + h) * s + begin + i)], one.lse[size_t(h * len + i)], 1e-5);
          for (int64_t x = 0; x < kD; ++x) {
            const size_t full = size_t((((begin + i) * kB + b) * nq + h) * kD + x),
                         part = size_t((i * nq + h) * kD + x);
            EXPECT_NEAR(docs.out[full], one.out[part], 1e-5);
            EXPECT_NEAR(docs.grad_q[full], one.grad_q[part], 1e-5);
          }
        }
        for (int64_t g = 0; g < ng; ++g)
          for (int64_t x = 0; x < kD; ++x) {
            const size_t full = size_t((((begin + i) * kB + b) * ng + g) * kD + x),
                         part = size_t((i * ng + g) * kD + x);
            EXPECT_NEAR(docs.grad_k[full], one.grad_k[part], 1e-5);
            EXPECT_NEAR(docs.grad_v[full], one.grad_v[part], 1e-5);
          }
      }
    }
}

// The fused QKV forms take the mask as the split ops do.
TEST(AttentionMaskIdentities, FusedQkvDocumentsEqualSplit) {
  Context ctx;
  const int64_t s = 7, nq = 2;
  const Tensor q = random_tensor({s, kB, nq, kD}, 17), k = random_tensor({s, kB, nq, kD}, 18),
               v = random_tensor({s, kB, nq, kD}, 19), dout = random_tensor({s, kB, nq, kD}, 20);
  Tensor qkv = Tensor::empty({s, kB, 3 * nq * kD}, DType::Float32);
  cpu::qkv_split_backward(ctx, q, k, v, qkv);
  const AttnMask mask = AttnMask::documents(ints(kShared, {3}));
  const Outputs split = run_mask(q, k, v, dout, mask, 0.25f);
  Tensor out = Tensor::empty(q.shape(), DType::Float32), lse = Tensor::empty({kB, nq, s}, DType::Float32),
         grad_qkv = Tensor::empty(qkv.shape(), DType::Float32);
  cpu::attention_forward_qkv(ctx, qkv, mask, 0.7f, 0.25f, kSeed, kOffset, out, lse);
  cpu::attention_backward_qkv(ctx, dout, qkv, out, lse, mask, 0.7f, 0.25f, kSeed, kOffset, grad_qkv);
  EXPECT_EQ(out.to_floats(), split.out);
  EXPECT_EQ(lse.to_floats(), split.lse);
  Tensor gq = Tensor::empty(q.shape(), DType::Float32), gk = Tensor::empty(q.shape(), DType::Float32),
         gv = Tensor::empty(q.shape(), DType::Float32);
  cpu::qkv_split_forward(ctx, grad_qkv, gq, gk, gv);
  EXPECT_EQ(gq.to_floats(), split.grad_q);
  EXPECT_EQ(gk.to_floats(), split.grad_k);
  EXPECT_EQ(gv.to_floats(), split.grad_v);
}

TEST(AttentionMaskChecks, BadMasksAreRefused) {
  Context ctx;
  const int64_t s = 5;
  const Tensor q = random_tensor({s, kB, 2, kD}, 21), k = random_tensor({s, kB, 1, kD}, 22),
               v = random_tensor({s, kB, 1, kD}, 23);
  Tensor out = Tensor::empty(q.shape(), DType::Float32), lse = Tensor::empty({kB, 2, s}, DType::Float32);
  auto forward = [&](const AttnMask& mask) { cpu::attention_forward(ctx, q, k, v, mask, 1.0f, 0.0f, 0, 0, out, lse); };
  EXPECT_NO_THROW(forward(AttnMask::documents(ints({0, 2, 5}, {3}))));
  EXPECT_THROW(forward(AttnMask::documents(ints({1, 2, 5}, {3}))), Error);              // not from 0
  EXPECT_THROW(forward(AttnMask::documents(ints({0, 2, 4}, {3}))), Error);              // not to s
  EXPECT_THROW(forward(AttnMask::documents(ints({0, 3, 2, 5}, {4}))), Error);           // decreasing
  EXPECT_THROW(forward(AttnMask::documents(Tensor::from_ints({0, 5}, {2}))), Error);    // int64
  EXPECT_THROW(forward(AttnMask::documents(ints({0, 5, 0, 5, 0, 5}, {3, 2}))), Error);  // 3 rows for b = 2
  EXPECT_THROW(forward(AttnMask::documents(Tensor())), Error);
  // Different query and key lengths need CausalWithOffset.
  const Tensor k7 = random_tensor({7, kB, 1, kD}, 24), v7 = random_tensor({7, kB, 1, kD}, 25);
  EXPECT_THROW(cpu::attention_forward(ctx, q, k7, v7, AttnMask::causal(), 1.0f, 0.0f, 0, 0, out, lse), Error);
  EXPECT_NO_THROW(
      cpu::attention_forward(ctx, q, k7, v7, AttnMask::causal_with_offset(2, 0), 1.0f, 0.0f, 0, 0, out, lse));
}

// A window no shorter than the sequence is no window; a negative one other than -1 is refused.
TEST(AttentionMaskIdentities, WideWindowIsCausal) {
  const int64_t s = 6;
  const Tensor q = random_tensor({s, kB, 4, kD}, 31), k = random_tensor({s, kB, 2, kD}, 32),
               v = random_tensor({s, kB, 2, kD}, 33), dout = random_tensor({s, kB, 4, kD}, 34);
  for (float p : {0.0f, 0.25f}) {
    SCOPED_TRACE(p);
    const Outputs causal = run_mask(q, k, v, dout, AttnMask::causal(), p);
    expect_same_bits(run_mask(q, k, v, dout, AttnMask::causal().with_window(s - 1), p), causal);
    expect_same_bits(run_mask(q, k, v, dout, AttnMask::causal().with_window(100), p), causal);
  }
  Context ctx;
  Tensor out = Tensor::empty(q.shape(), DType::Float32), lse = Tensor::empty({kB, 4, s}, DType::Float32);
  EXPECT_THROW(cpu::attention_forward(ctx, q, k, v, AttnMask::causal().with_window(-2), 1.0f, 0.0f, 0, 0, out, lse),
               Error);
}

}  // namespace
}  // namespace megatron

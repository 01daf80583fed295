// Attention sinks (Note [Attention sinks] in op_list.inc) on the CPU reference: the core attention
// followed by attention_sink_forward against an explicit softmax whose denominator holds the sink
// (GQA, with and without a sliding window, a row that sees no key), and finite-difference checks of
// the claim the design rests on: attention_backward given the sink-adjusted (out, lse) gives exact
// dq, dk, dv, and attention_sink_backward the sinks' gradient.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "megatron/kernels/cpu/cpu_ops.h"
#include "tests/kernels/gradcheck.h"

namespace megatron {
namespace {

using testing::GradCheck;
using testing::max_abs_error;
using testing::random_tensor;

constexpr int64_t kB = 2, kD = 3, kNq = 4, kNg = 2;

struct SinkCase {
  const char* name;
  int64_t sq, sk;
  std::function<AttnMask()> mask;
  std::function<bool(int64_t i, int64_t j)> visible;
};

std::vector<SinkCase> sink_cases() {
  return {
      {"Causal", 5, 5, [] { return AttnMask::causal(); }, [](int64_t i, int64_t j) { return j <= i; }},
      {"Window", 7, 7, [] { return AttnMask::causal().with_window(2); },
       [](int64_t i, int64_t j) { return j <= i && j >= i - 2; }},
      // Query chunk at 2..5 against keys at 3..8: query row 0 sees no key, only the sink.
      {"EmptyRow", 4, 6, [] { return AttnMask::causal_with_offset(2, 3); },
       [](int64_t i, int64_t j) { return j + 3 <= i + 2; }},
  };
}

// out [sq, b, nq, d] and lse [b, nq, sq] of softmax over [scores of the visible keys, sink_h] with
// the sink's column dropped before P·V.
void naive_sink_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sinks, const SinkCase& c,
                          float scale, std::vector<float>& out, std::vector<float>& lse) {
  const std::vector<float> qv = q.to_floats(), kv = k.to_floats(), vv = v.to_floats(), sv = sinks.to_floats();
  out.assign(qv.size(), 0.0f);
  lse.assign(size_t(kB * kNq * c.sq), 0.0f);
  auto at = [](const std::vector<float>& t, int64_t n, int64_t s, int64_t b, int64_t h, int64_t x) {
    return double(t[size_t(((s * kB + b) * n + h) * kD + x)]);
  };
  for (int64_t b = 0; b < kB; ++b)
    for (int64_t h = 0; h < kNq; ++h) {
      const int64_t g = h / (kNq / kNg);
      for (int64_t i = 0; i < c.sq; ++i) {
        std::vector<double> s(size_t(c.sk), 0.0);
        double m = sv[size_t(h)];
        for (int64_t j = 0; j < c.sk; ++j) {
          if (!c.visible(i, j)) continue;
          for (int64_t x = 0; x < kD; ++x) s[size_t(j)] += at(qv, kNq, i, b, h, x) * at(kv, kNg, j, b, g, x);
          s[size_t(j)] *= scale;
          m = std::max(m, s[size_t(j)]);
        }
        double sum = std::exp(double(sv[size_t(h)]) - m);
        for (int64_t j = 0; j < c.sk; ++j)
          if (c.visible(i, j)) sum += std::exp(s[size_t(j)] - m);
        lse[size_t((b * kNq + h) * c.sq + i)] = float(m + std::log(sum));
        for (int64_t x = 0; x < kD; ++x) {
          double o = 0;
          for (int64_t j = 0; j < c.sk; ++j)
            if (c.visible(i, j)) o += std::exp(s[size_t(j)] - m) / sum * at(vv, kNg, j, b, g, x);
          out[size_t(((i * kB + b) * kNq + h) * kD + x)] = float(o);
        }
      }
    }
}

class AttentionSinks : public ::testing::TestWithParam<SinkCase> {
 protected:
  // The op sequence SelfAttention runs: core attention, then the sinks folded in place.
  void forward(Tensor& out, Tensor& lse) {
    cpu::attention_forward(ctx, q, k, v, mask, scale, 0.0f, 0, 0, out, lse);
    cpu::attention_sink_forward(ctx, out, lse, sinks, out, lse);
  }

  Context ctx;
  const float scale = 0.8f;
  const AttnMask mask = GetParam().mask();
  Tensor q = random_tensor({GetParam().sq, kB, kNq, kD}, 1);
  Tensor k = random_tensor({GetParam().sk, kB, kNg, kD}, 2);
  Tensor v = random_tensor({GetParam().sk, kB, kNg, kD}, 3);
  Tensor sinks = random_tensor({kNq}, 4);
  Tensor lse = Tensor::empty({kB, kNq, GetParam().sq}, DType::Float32);
};

TEST_P(AttentionSinks, ForwardMatchesNaive) {
  Tensor out = Tensor::empty(q.shape(), DType::Float32);
  forward(out, lse);
  std::vector<float> ref_out, ref_lse;
  naive_sink_attention(q, k, v, sinks, GetParam(), scale, ref_out, ref_lse);
  EXPECT_LT(max_abs_error(out.to_floats(), ref_out), 1e-5);
  EXPECT_LT(max_abs_error(lse.to_floats(), ref_lse), 1e-5);
}

TEST_P(AttentionSinks, GradCheck) {
  Tensor out = Tensor::empty(q.shape(), DType::Float32);
  GradCheck gc([&] {
    forward(out, lse);
    return std::vector<Tensor>{out.clone()};
  });
  gc.loss();  // out and lse of the unperturbed inputs
  Tensor grad_q = Tensor::empty(q.shape(), DType::Float32);
  Tensor grad_k = Tensor::empty(k.shape(), DType::Float32), grad_v = Tensor::empty(v.shape(), DType::Float32);
  Tensor grad_sinks = Tensor::zeros({kNq}, DType::Float32);
  cpu::attention_sink_backward(ctx, gc.upstream(), out, lse, sinks, grad_sinks);
  cpu::attention_backward(ctx, gc.upstream(), q, k, v, out, lse, mask, scale, 0.0f, 0, 0, grad_q, grad_k, grad_v);
  gc.check("grad_q", q, grad_q);
  gc.check("grad_k", k, grad_k);
  gc.check("grad_v", v, grad_v);
  gc.check("grad_sinks", sinks, grad_sinks);
}

INSTANTIATE_TEST_SUITE_P(Masks, AttentionSinks, ::testing::ValuesIn(sink_cases()),
                         [](const auto& info) { return std::string(info.param.name); });

// The sinks' gradient accumulates (beta = 1), and in-place and out-of-place forwards agree.
TEST(AttentionSinkOps, AccumulatesAndRunsInPlace) {
  Context ctx;
  const int64_t s = 4;
  Tensor q = random_tensor({s, kB, kNq, kD}, 11), k = random_tensor({s, kB, kNg, kD}, 12),
         v = random_tensor({s, kB, kNg, kD}, 13), sinks = random_tensor({kNq}, 14), dout = random_tensor(q.shape(), 15);
  Tensor out0 = Tensor::empty(q.shape(), DType::Float32), lse0 = Tensor::empty({kB, kNq, s}, DType::Float32);
  cpu::attention_forward(ctx, q, k, v, AttnMask::causal(), 0.5f, 0.0f, 0, 0, out0, lse0);
  Tensor out = Tensor::empty(q.shape(), DType::Float32), lse = Tensor::empty(lse0.shape(), DType::Float32);
  cpu::attention_sink_forward(ctx, out0, lse0, sinks, out, lse);
  Tensor out_in = out0.clone(), lse_in = lse0.clone();
  cpu::attention_sink_forward(ctx, out_in, lse_in, sinks, out_in, lse_in);
  EXPECT_EQ(out.to_floats(), out_in.to_floats());
  EXPECT_EQ(lse.to_floats(), lse_in.to_floats());
  Tensor once = Tensor::zeros({kNq}, DType::Float32), twice = Tensor::from_floats({1, 2, 3, 4}, {kNq});
  cpu::attention_sink_backward(ctx, dout, out, lse, sinks, once);
  cpu::attention_sink_backward(ctx, dout, out, lse, sinks, twice);
  const std::vector<float> a = once.to_floats(), b = twice.to_floats();
  for (int64_t h = 0; h < kNq; ++h) EXPECT_NEAR(b[size_t(h)], a[size_t(h)] + float(h + 1), 1e-5);
  // A very negative sink changes nothing: the softmax without sinks.
  Tensor off = Tensor::from_floats(std::vector<float>(size_t(kNq), -1e4f), {kNq});
  cpu::attention_sink_forward(ctx, out0, lse0, off, out, lse);
  EXPECT_LT(max_abs_error(out.to_floats(), out0.to_floats()), 1e-6);
}

}  // namespace
}  // namespace megatron

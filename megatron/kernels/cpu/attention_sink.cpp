// Attention sinks, CPU reference (Note [Attention sinks] in kernels/op_list.inc): the sink-adjusted
// attention output and log-sum-exp from the core attention's, and the sinks' gradient.
//   forward:  lse_i = logaddexp(lse0_i, s_h), out_i = out0_i · exp(lse0_i - lse_i) (= sigmoid(lse0_i - s_h))
//   backward: ds_h += -Σ_{b,i} exp(s_h - lse_i) · (dO_i · out_i)
// A row without visible keys (lse0 = -inf) keeps out 0 and gets lse = s_h.
#include <cmath>
#include <limits>

#include "megatron/kernels/cpu/cpu_common.h"
#include "megatron/kernels/cpu/cpu_ops.h"

namespace megatron::cpu {

namespace {
struct SinkShape {
  int64_t s = 0, b = 0, nq = 0, d = 0;
};

SinkShape check_sink(const Tensor& out, const Tensor& lse, const Tensor& sinks) {
  assert_float(out, "out");
  assert_fp32(lse, "lse");
  assert_float(sinks, "sinks");
  MG_ASSERT(out.dim() == 4, "attention sinks: out {} is not [s, b, nq, d]", out.str());
  SinkShape a{out.size(0), out.size(1), out.size(2), out.size(3)};
  MG_ASSERT(lse.shape() == Shape({a.b, a.nq, a.s}), "attention sinks: lse {} for out {}", lse.str(), out.str());
  MG_ASSERT(sinks.dim() == 1 && sinks.size(0) == a.nq, "attention sinks: sinks {} for {} heads", sinks.str(), a.nq);
  return a;
}
}  // namespace

void attention_sink_forward(Context& ctx, const Tensor& out0, const Tensor& lse0, const Tensor& sinks, Tensor& out,
                            Tensor& lse) {
  (void)ctx;
  const SinkShape a = check_sink(out0, lse0, sinks);
  check_sink(out, lse, sinks);
  MG_ASSERT(out.shape() == out0.shape(), "attention_sink_forward: out {} for out0 {}", out.str(), out0.str());
  FloatIn o0(out0), sk(sinks);
  FloatOut o(out);
  const float* l0 = lse0.data<float>();
  float* l = lse.data<float>();
  for (int64_t bi = 0; bi < a.b; ++bi)
    for (int64_t h = 0; h < a.nq; ++h)
      for (int64_t i = 0; i < a.s; ++i) {
        const int64_t st = (bi * a.nq + h) * a.s + i;
        const float x = l0[st], s = sk[h];
        const float m = std::max(x, s);
        const float total = m + std::log(std::exp(x - m) + std::exp(s - m));  // x = -inf: total = s
        const float w = std::exp(x - total);
        const int64_t row = ((i * a.b + bi) * a.nq + h) * a.d;
        for (int64_t c = 0; c < a.d; ++c) o[row + c] = o0[row + c] * w;
        l[st] = total;
      }
}

void attention_sink_backward(Context& ctx, const Tensor& grad_out, const Tensor& out, const Tensor& lse,
                             const Tensor& sinks, Tensor& sinks_grad) {
  (void)ctx;
  const SinkShape a = check_sink(out, lse, sinks);
  MG_ASSERT(grad_out.shape() == out.shape(), "attention_sink_backward: grad_out {} for out {}", grad_out.str(),
            out.str());
  if (!sinks_grad.defined()) return;
  assert_fp32(sinks_grad, "sinks_grad");
  assert_numel(sinks_grad, a.nq, "sinks_grad");
  FloatIn o(out), dy(grad_out), sk(sinks);
  const float* l = lse.data<float>();
  float* g = sinks_grad.data<float>();
  for (int64_t h = 0; h < a.nq; ++h) {
    double acc = 0.0;
    for (int64_t bi = 0; bi < a.b; ++bi)
      for (int64_t i = 0; i < a.s; ++i) {
        const int64_t row = ((i * a.b + bi) * a.nq + h) * a.d;
        double dot = 0.0;
        for (int64_t c = 0; c < a.d; ++c) dot += double(dy[row + c]) * double(o[row + c]);
        acc += std::exp(double(sk[h]) - double(l[(bi * a.nq + h) * a.s + i])) * dot;
      }
    g[h] += float(-acc);
  }
}

}  // namespace megatron::cpu

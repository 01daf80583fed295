// Causal self-attention with grouped-query heads, CPU reference (flash-attention semantics).
//
// q [s, b, nq, d]; k, v [s, b, ng, d]; query head h reads key/value group h / (nq/ng). For one
// (batch, head) the rows of Q, K, V, O are d contiguous floats a fixed stride apart (sequence-
// first), so they feed cblas_sgemm directly through the leading dimension, with no gathering:
//   S = scale·Q·Kᵀ [s, s]; P = softmax over j <= i (fp32, lse saved); P̃ = P∘M; O = P̃·V
// where M = keep/(1-p) is the dropout mask, keep = philox_uniform(seed, offset, idx) >= p with
// idx = ((b·nq + h)·s + i)·s + j (dropout_p = 0 never touches the generator).
// The backward recomputes P from the saved lse instead of storing it:
//   dV += P̃ᵀ·dO;  dP̃ = dO·Vᵀ;  D_i = Σ_c dO_ic·O_ic (= Σ_j P̃_ij·dP̃_ij)
//   dS = P∘(dP̃∘M - D) = P̃∘dP̃ - P∘D;  dQ = scale·dS·K;  dK += scale·dSᵀ·Q
// dK and dV sum over the heads of their group (sgemm with beta = 1 into zeroed buffers).
// The score matrix is computed in full and masked: simple, and sgemm makes it cheap at CPU sizes.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "megatron/kernels/cpu/cpu_common.h"
#include "megatron/kernels/cpu/cpu_ops.h"

namespace megatron::cpu {

namespace {

struct AttnShape {
  int64_t s = 0, b = 0, nq = 0, ng = 0, d = 0;
  int64_t ldq() const { return b * nq * d; }  // stride between sequence positions of q, o, dq
  int64_t ldk() const { return b * ng * d; }  // of k, v, dk, dv
  int64_t q_off(int64_t bi, int64_t h) const { return (bi * nq + h) * d; }
  int64_t k_off(int64_t bi, int64_t h) const { return (bi * ng + h / (nq / ng)) * d; }
};

AttnShape attention_shape(const Tensor& q, const Tensor& k, const Tensor& v, float dropout_p) {
  assert_float(q, "q");
  assert_float(k, "k");
  assert_float(v, "v");
  MG_ASSERT(q.dim() == 4 && k.dim() == 4 && k.shape() == v.shape(),
            "attention expects q [s, b, nq, d], k/v [s, b, ng, d]; got {}, {}, {}", q.str(), k.str(), v.str());
  AttnShape a{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
  MG_ASSERT(k.size(0) == a.s && k.size(1) == a.b && k.size(3) == a.d && a.ng > 0 && a.nq % a.ng == 0,
            "q {} and k {} do not fit causal GQA attention", q.str(), k.str());
  MG_ASSERT(a.d > 0, "attention head dimension must be positive, q is {}", q.str());
  MG_ASSERT(dropout_p >= 0.0f && dropout_p < 1.0f, "attention dropout_p {} must be in [0, 1)", dropout_p);
  return a;
}

void check_lse(const Tensor& lse, const AttnShape& a) {
  assert_fp32(lse, "lse");
  MG_ASSERT(lse.shape() == Shape({a.b, a.nq, a.s}), "lse is {}, expected [{}, {}, {}]", lse.str(), a.b, a.nq, a.s);
}

// Scores S = scale·Q·Kᵀ of one (batch, head) into scores [s, s].
void scores(const AttnShape& a, const float* q, const float* k, float scale, float* out) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(a.s), int(a.s), int(a.d), scale, q, int(a.ldq()), k,
              int(a.ldk()), 0.0f, out, int(a.s));
}

// Row i of P̃ = P∘M from row i of P (j <= i), for the stream element base + j.
void dropout_row(const float* p_row, int64_t n, float p, uint64_t seed, uint64_t offset, uint64_t base, float* uniform,
                 float* out_row) {
  philox_uniforms(seed, offset, base, n, uniform);
  const float keep_scale = 1.0f / (1.0f - p);
  for (int64_t j = 0; j < n; ++j) out_row[j] = uniform[j] >= p ? p_row[j] * keep_scale : 0.0f;
}

}  // namespace

void attention_forward(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v, float softmax_scale,
                       float dropout_p, uint64_t seed, uint64_t offset, Tensor& out, Tensor& lse) {
  const AttnShape a = attention_shape(q, k, v, dropout_p);
  assert_numel(out, q.numel(), "out");
  check_lse(lse, a);
  FloatIn qin(q), kin(k), vin(v);
  FloatOut o(out);
  float* lse_out = lse.data<float>();
  const int64_t s = a.s;
  if (s == 0) return;
  std::vector<float> probs(static_cast<size_t>(s * s)), uniform(static_cast<size_t>(s));
  for (int64_t bi = 0; bi < a.b; ++bi) {
    for (int64_t h = 0; h < a.nq; ++h) {
      scores(a, qin.data() + a.q_off(bi, h), kin.data() + a.k_off(bi, h), softmax_scale, probs.data());
      for (int64_t i = 0; i < s; ++i) {
        float* row = probs.data() + i * s;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j <= i; ++j) m = std::max(m, row[j]);
        double sum = 0.0;
        for (int64_t j = 0; j <= i; ++j) {
          row[j] = std::exp(row[j] - m);
          sum += row[j];
        }
        const float inv = float(1.0 / sum);
        for (int64_t j = 0; j <= i; ++j) row[j] *= inv;
        std::fill(row + i + 1, row + s, 0.0f);
        lse_out[(bi * a.nq + h) * s + i] = m + float(std::log(sum));
        if (dropout_p > 0.0f)
          dropout_row(row, i + 1, dropout_p, seed, offset, uint64_t(((bi * a.nq + h) * s + i) * s), uniform.data(),
                      row);
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(s), int(a.d), int(s), 1.0f, probs.data(), int(s),
                  vin.data() + a.k_off(bi, h), int(a.ldk()), 0.0f, o.data() + a.q_off(bi, h), int(a.ldq()));
    }
  }
}

void attention_backward(Context& ctx, const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, float softmax_scale, float dropout_p, uint64_t seed,
                        uint64_t offset, Tensor& grad_q, Tensor& grad_k, Tensor& grad_v) {
  const AttnShape a = attention_shape(q, k, v, dropout_p);
  assert_numel(grad_out, q.numel(), "grad_out");
  assert_numel(out, q.numel(), "out");
  assert_numel(grad_q, q.numel(), "grad_q");
  assert_numel(grad_k, k.numel(), "grad_k");
  assert_numel(grad_v, v.numel(), "grad_v");
  check_lse(lse, a);
  FloatIn qin(q), kin(k), vin(v), oin(out), dout(grad_out);
  FloatOut dq(grad_q), dk(grad_k), dv(grad_v);
  std::fill(dk.data(), dk.data() + k.numel(), 0.0f);
  std::fill(dv.data(), dv.data() + v.numel(), 0.0f);
  const float* lse_in = lse.data<float>();
  const int64_t s = a.s;
  if (s == 0) return;
  std::vector<float> probs(static_cast<size_t>(s * s)), dropped(dropout_p > 0.0f ? size_t(s * s) : 0),
      dscores(size_t(s * s));
  std::vector<float> uniform(static_cast<size_t>(s));
  float* pd = dropout_p > 0.0f ? dropped.data() : probs.data();  // P̃
  for (int64_t bi = 0; bi < a.b; ++bi) {
    for (int64_t h = 0; h < a.nq; ++h) {
      const float* qh = qin.data() + a.q_off(bi, h);
      const float* kh = kin.data() + a.k_off(bi, h);
      const float* vh = vin.data() + a.k_off(bi, h);
      const float* oh = oin.data() + a.q_off(bi, h);
      const float* doh = dout.data() + a.q_off(bi, h);
      scores(a, qh, kh, softmax_scale, probs.data());
      for (int64_t i = 0; i < s; ++i) {
        float* row = probs.data() + i * s;
        const float l = lse_in[(bi * a.nq + h) * s + i];
        for (int64_t j = 0; j <= i; ++j) row[j] = std::exp(row[j] - l);
        std::fill(row + i + 1, row + s, 0.0f);
        if (dropout_p > 0.0f) {
          float* drow = pd + i * s;
          dropout_row(row, i + 1, dropout_p, seed, offset, uint64_t(((bi * a.nq + h) * s + i) * s), uniform.data(),
                      drow);
          std::fill(drow + i + 1, drow + s, 0.0f);
        }
      }
      // dV += P̃ᵀ·dO; dP̃ = dO·Vᵀ.
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(s), int(a.d), int(s), 1.0f, pd, int(s), doh,
                  int(a.ldq()), 1.0f, dv.data() + a.k_off(bi, h), int(a.ldk()));
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(s), int(s), int(a.d), 1.0f, doh, int(a.ldq()), vh,
                  int(a.ldk()), 0.0f, dscores.data(), int(s));
      // dS = P̃∘dP̃ - P∘D, in place of dP̃.
      for (int64_t i = 0; i < s; ++i) {
        double di = 0.0;
        for (int64_t c = 0; c < a.d; ++c) di += double(doh[i * a.ldq() + c]) * oh[i * a.ldq() + c];
        float* ds = dscores.data() + i * s;
        const float* prow = probs.data() + i * s;
        const float* pdrow = pd + i * s;
        for (int64_t j = 0; j <= i; ++j) ds[j] = pdrow[j] * ds[j] - prow[j] * float(di);
        std::fill(ds + i + 1, ds + s, 0.0f);
      }
      // dQ = scale·dS·K; dK += scale·dSᵀ·Q.
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(s), int(a.d), int(s), softmax_scale, dscores.data(),
                  int(s), kh, int(a.ldk()), 0.0f, dq.data() + a.q_off(bi, h), int(a.ldq()));
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(s), int(a.d), int(s), softmax_scale, dscores.data(),
                  int(s), qh, int(a.ldq()), 1.0f, dk.data() + a.k_off(bi, h), int(a.ldk()));
    }
  }
}

}  // namespace megatron::cpu

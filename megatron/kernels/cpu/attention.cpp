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
// attention_forward_qkv / attention_backward_qkv (MHA) run the same code on the fused QKV buffer:
// only the row offsets and leading dimensions of q, k, v and their gradients change (AttnShape),
// so they equal the split, the attention and the merge without making the copies.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "megatron/kernels/cpu/cpu_common.h"
#include "megatron/kernels/cpu/cpu_ops.h"

namespace megatron::cpu {

namespace {

// Where the rows of one (batch, head) sit. Separate tensors: q/dq [s, b, nq, d], k/v/dk/dv
// [s, b, ng, d]. fused (MHA): q, k, v and their gradients in one [s, b, 3·nq·d] buffer, head h's
// q/k/v at h·3d, h·3d + d, h·3d + 2d of a token row. o and do are always [s, b, nq, d].
struct AttnShape {
  int64_t s = 0, b = 0, nq = 0, ng = 0, d = 0;
  bool fused = false;
  int64_t ldq() const { return fused ? 3 * b * nq * d : b * nq * d; }  // between sequence positions of q, dq
  int64_t ldk() const { return fused ? 3 * b * nq * d : b * ng * d; }  // of k, v, dk, dv
  int64_t ldo() const { return b * nq * d; }                           // of o, do
  int64_t o_off(int64_t bi, int64_t h) const { return (bi * nq + h) * d; }
  int64_t q_off(int64_t bi, int64_t h) const { return fused ? (bi * nq + h) * 3 * d : (bi * nq + h) * d; }
  int64_t k_off(int64_t bi, int64_t h) const {
    return fused ? (bi * nq + h) * 3 * d + d : (bi * ng + h / (nq / ng)) * d;
  }
  int64_t v_off(int64_t bi, int64_t h) const { return fused ? k_off(bi, h) + d : k_off(bi, h); }
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

// An MHA fused buffer qkv [s, b, 3·nq·d] with out [s, b, nq, d] (which gives nq and d).
AttnShape fused_attention_shape(const Tensor& qkv, const Tensor& out, float dropout_p) {
  assert_float(qkv, "qkv");
  MG_ASSERT(out.dim() == 4 && qkv.dim() >= 2 && qkv.size(0) == out.size(0) && qkv.size(1) == out.size(1) &&
                qkv.numel() == 3 * out.numel(),
            "attention on the fused QKV buffer expects qkv [s, b, 3·nq·d] and out [s, b, nq, d]; got {}, {}",
            qkv.str(), out.str());
  AttnShape a{out.size(0), out.size(1), out.size(2), out.size(2), out.size(3), true};
  MG_ASSERT(a.d > 0 && a.nq > 0, "attention heads and head dimension must be positive, out is {}", out.str());
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

// The forward on fp32 rows laid out as a says; q, k, v may be one buffer (fused).
void forward_rows(const AttnShape& a, const float* q, const float* k, const float* v, float softmax_scale,
                  float dropout_p, uint64_t seed, uint64_t offset, float* o, float* lse_out) {
  const int64_t s = a.s;
  if (s == 0) return;
  std::vector<float> probs(static_cast<size_t>(s * s)), uniform(static_cast<size_t>(s));
  for (int64_t bi = 0; bi < a.b; ++bi) {
    for (int64_t h = 0; h < a.nq; ++h) {
      scores(a, q + a.q_off(bi, h), k + a.k_off(bi, h), softmax_scale, probs.data());
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
                  v + a.v_off(bi, h), int(a.ldk()), 0.0f, o + a.o_off(bi, h), int(a.ldo()));
    }
  }
}

// The backward on fp32 rows laid out as a says. dq/dk/dv may be one buffer (fused); dk and dv must
// hold zeros (they are accumulated over the heads of a group), dq is overwritten.
void backward_rows(const AttnShape& a, const float* dout, const float* q, const float* k, const float* v,
                   const float* out, const float* lse_in, float softmax_scale, float dropout_p, uint64_t seed,
                   uint64_t offset, float* dq, float* dk, float* dv) {
  const int64_t s = a.s;
  if (s == 0) return;
  std::vector<float> probs(static_cast<size_t>(s * s)), dropped(dropout_p > 0.0f ? size_t(s * s) : 0),
      dscores(size_t(s * s));
  std::vector<float> uniform(static_cast<size_t>(s));
  float* pd = dropout_p > 0.0f ? dropped.data() : probs.data();  // P̃
  for (int64_t bi = 0; bi < a.b; ++bi) {
    for (int64_t h = 0; h < a.nq; ++h) {
      const float* qh = q + a.q_off(bi, h);
      const float* kh = k + a.k_off(bi, h);
      const float* vh = v + a.v_off(bi, h);
      const float* oh = out + a.o_off(bi, h);
      const float* doh = dout + a.o_off(bi, h);
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
                  int(a.ldo()), 1.0f, dv + a.v_off(bi, h), int(a.ldk()));
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(s), int(s), int(a.d), 1.0f, doh, int(a.ldo()), vh,
                  int(a.ldk()), 0.0f, dscores.data(), int(s));
      // dS = P̃∘dP̃ - P∘D, in place of dP̃.
      for (int64_t i = 0; i < s; ++i) {
        double di = 0.0;
        for (int64_t c = 0; c < a.d; ++c) di += double(doh[i * a.ldo() + c]) * oh[i * a.ldo() + c];
        float* ds = dscores.data() + i * s;
        const float* prow = probs.data() + i * s;
        const float* pdrow = pd + i * s;
        for (int64_t j = 0; j <= i; ++j) ds[j] = pdrow[j] * ds[j] - prow[j] * float(di);
        std::fill(ds + i + 1, ds + s, 0.0f);
      }
      // dQ = scale·dS·K; dK += scale·dSᵀ·Q.
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(s), int(a.d), int(s), softmax_scale, dscores.data(),
                  int(s), kh, int(a.ldk()), 0.0f, dq + a.q_off(bi, h), int(a.ldq()));
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(s), int(a.d), int(s), softmax_scale, dscores.data(),
                  int(s), qh, int(a.ldq()), 1.0f, dk + a.k_off(bi, h), int(a.ldk()));
    }
  }
}

}  // namespace

void attention_forward(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v, float softmax_scale,
                       float dropout_p, uint64_t seed, uint64_t offset, Tensor& out, Tensor& lse) {
  const AttnShape a = attention_shape(q, k, v, dropout_p);
  assert_numel(out, q.numel(), "out");
  check_lse(lse, a);
  FloatIn qin(q), kin(k), vin(v);
  FloatOut o(out);
  forward_rows(a, qin.data(), kin.data(), vin.data(), softmax_scale, dropout_p, seed, offset, o.data(),
               lse.data<float>());
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
  backward_rows(a, dout.data(), qin.data(), kin.data(), vin.data(), oin.data(), lse.data<float>(), softmax_scale,
                dropout_p, seed, offset, dq.data(), dk.data(), dv.data());
}

void attention_forward_qkv(Context& ctx, const Tensor& qkv, float softmax_scale, float dropout_p, uint64_t seed,
                           uint64_t offset, Tensor& out, Tensor& lse) {
  const AttnShape a = fused_attention_shape(qkv, out, dropout_p);
  assert_float(out, "out");
  check_lse(lse, a);
  FloatIn x(qkv);
  FloatOut o(out);
  forward_rows(a, x.data(), x.data(), x.data(), softmax_scale, dropout_p, seed, offset, o.data(), lse.data<float>());
}

void attention_backward_qkv(Context& ctx, const Tensor& grad_out, const Tensor& qkv, const Tensor& out,
                            const Tensor& lse, float softmax_scale, float dropout_p, uint64_t seed, uint64_t offset,
                            Tensor& grad_qkv) {
  const AttnShape a = fused_attention_shape(qkv, out, dropout_p);
  assert_float(out, "out");
  assert_numel(grad_out, out.numel(), "grad_out");
  assert_float(grad_qkv, "grad_qkv");
  assert_numel(grad_qkv, qkv.numel(), "grad_qkv");
  check_lse(lse, a);
  FloatIn x(qkv), oin(out), dout(grad_out);
  FloatOut dx(grad_qkv);
  std::fill(dx.data(), dx.data() + grad_qkv.numel(), 0.0f);  // dK, dV accumulate; dQ is overwritten
  backward_rows(a, dout.data(), x.data(), x.data(), x.data(), oin.data(), lse.data<float>(), softmax_scale, dropout_p,
                seed, offset, dx.data(), dx.data(), dx.data());
}

}  // namespace megatron::cpu

// Self-attention with grouped-query heads and a mask, CPU reference (flash-attention semantics).
//
// q [sq, b, nq, d]; k [sk, b, ng, d]; v [sk, b, ng, dv] (dv may differ from d, as multi-latent
// attention's heads do); query head h reads key/value group h / (nq/ng). For one
// (batch, head) the rows of Q, K, V, O are d contiguous floats a fixed stride apart (sequence-
// first), so they feed cblas_sgemm directly through the leading dimension, with no gathering:
//   S = scale·Q·Kᵀ [sq, sk]; P = softmax over the visible keys (fp32, lse saved); P̃ = P∘M; O = P̃·V
// where M = keep/(1-p) is the dropout mask, keep = philox_uniform(seed, offset, idx) >= p with
// idx = ((b·nq + h)·sq + i)·sk + j (dropout_p = 0 never touches the generator).
// The visible keys of query row i are one interval [begin, end) for every mask kind (VisibleKeys,
// Note [Attention masks] in op_list.inc): [0, i] causal, [0, i + q_offset - k_offset] clipped to
// [0, sk) with offsets, [start of i's document, i] with documents. Only that interval is
// exponentiated and draws dropout elements, so Causal is term for term what it was before masks.
// A row with no visible key (possible with offsets) is all zeros in P: its output is 0 and its lse
// -inf; the backward never exponentiates against that lse, so no NaN arises and the row passes
// no gradient (dO·O = 0 as well).
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
#include <vector>

#include "megatron/kernels/cpu/cpu_common.h"
#include "megatron/kernels/cpu/cpu_ops.h"

namespace megatron::cpu {

namespace {

// Where the rows of one (batch, head) sit. Separate tensors: q/dq [sq, b, nq, d], k/dk [sk, b, ng, d],
// v/dv [sk, b, ng, dv] (dv may differ from d: multi-latent attention's value heads). fused (MHA,
// sq == sk, dv == d): q, k, v and their gradients in one [s, b, 3·nq·d] buffer, head h's q/k/v at
// h·3d, h·3d + d, h·3d + 2d of a token row. o and do are always [sq, b, nq, dv].
struct AttnShape {
  int64_t sq = 0, sk = 0, b = 0, nq = 0, ng = 0, d = 0, dv = 0;
  bool fused = false;
  int64_t ldq() const { return fused ? 3 * b * nq * d : b * nq * d; }  // between sequence positions of q, dq
  int64_t ldk() const { return fused ? 3 * b * nq * d : b * ng * d; }  // of k, dk
  int64_t ldv() const { return fused ? 3 * b * nq * d : b * ng * dv; }  // of v, dv
  int64_t ldo() const { return b * nq * dv; }                          // of o, do
  int64_t o_off(int64_t bi, int64_t h) const { return (bi * nq + h) * dv; }
  int64_t q_off(int64_t bi, int64_t h) const { return fused ? (bi * nq + h) * 3 * d : (bi * nq + h) * d; }
  int64_t k_off(int64_t bi, int64_t h) const {
    return fused ? (bi * nq + h) * 3 * d + d : (bi * ng + h / (nq / ng)) * d;
  }
  int64_t v_off(int64_t bi, int64_t h) const { return fused ? k_off(bi, h) + d : (bi * ng + h / (nq / ng)) * dv; }
  // Row (bi, h, i) of lse; times sk plus the key position it is the dropout element.
  int64_t stat(int64_t bi, int64_t h, int64_t i) const { return (bi * nq + h) * sq + i; }
};

AttnShape attention_shape(const Tensor& q, const Tensor& k, const Tensor& v, float dropout_p) {
  assert_float(q, "q");
  assert_float(k, "k");
  assert_float(v, "v");
  MG_ASSERT(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && v.size(0) == k.size(0) && v.size(1) == k.size(1) &&
                v.size(2) == k.size(2),
            "attention expects q [sq, b, nq, d], k [sk, b, ng, d], v [sk, b, ng, dv]; got {}, {}, {}", q.str(), k.str(),
            v.str());
  AttnShape a{q.size(0), k.size(0), q.size(1), q.size(2), k.size(2), q.size(3), v.size(3)};
  MG_ASSERT(k.size(1) == a.b && k.size(3) == a.d && a.ng > 0 && a.nq % a.ng == 0,
            "q {} and k {} do not fit GQA attention", q.str(), k.str());
  MG_ASSERT(a.d > 0 && a.dv > 0, "attention head dimensions must be positive, q is {}, v {}", q.str(), v.str());
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
  AttnShape a{out.size(0), out.size(0), out.size(1), out.size(2), out.size(2), out.size(3), out.size(3), true};
  MG_ASSERT(a.d > 0 && a.nq > 0, "attention heads and head dimension must be positive, out is {}", out.str());
  MG_ASSERT(dropout_p >= 0.0f && dropout_p < 1.0f, "attention dropout_p {} must be in [0, 1)", dropout_p);
  return a;
}

// The keys [begin, end) query row i of batch row bi sees (Note [Attention masks]); begin >= end
// when it sees none.
struct KeyRange {
  int64_t begin = 0, end = 0;
};

class VisibleKeys {
 public:
  // Checks the mask against the shape and, for Documents, the values of cu_seqlens.
  VisibleKeys(const Context& ctx, const AttnMask& mask, const AttnShape& a)
      : kind_(mask.kind), sq_(a.sq), sk_(a.sk), shift_(mask.q_offset - mask.k_offset), window_(mask.window_left) {
    ops::check_attention_mask(mask, ctx.device(), a.b, a.sq, a.sk);
    if (kind_ != AttnMask::Kind::Documents) return;
    const Tensor& cu = mask.cu_seqlens;
    const int64_t rows = cu.dim() == 2 ? a.b : 1, n1 = cu.size(cu.dim() - 1);
    const int32_t* c = cu.data<int32_t>();
    per_row_ = cu.dim() == 2;
    doc_start_.resize(size_t(rows * a.sq));
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t* row = c + r * n1;
      MG_CHECK(row[0] == 0 && row[n1 - 1] == a.sq,
               "attention: cu_seqlens row {} must run from 0 to s = {}, got {} .. {}", r, a.sq, row[0], row[n1 - 1]);
      for (int64_t t = 0; t + 1 < n1; ++t) {
        MG_CHECK(row[t] <= row[t + 1], "attention: cu_seqlens row {} decreases at entry {} ({} > {})", r, t + 1, row[t],
                 row[t + 1]);
        for (int64_t i = row[t]; i < row[t + 1]; ++i) doc_start_[size_t(r * a.sq + i)] = row[t];
      }
    }
  }

  KeyRange row(int64_t bi, int64_t i) const {
    KeyRange r = kind_row(bi, i);
    // Note [Sliding-window attention]: keys j with j + k_offset >= i + q_offset - window.
    if (window_ >= 0) r.begin = std::max(r.begin, i + shift_ - window_);
    return r;
  }

 private:
  KeyRange kind_row(int64_t bi, int64_t i) const {
    switch (kind_) {
      case AttnMask::Kind::Causal:
        return {0, i + 1};
      case AttnMask::Kind::CausalWithOffset:
        return {0, std::clamp<int64_t>(i + shift_ + 1, 0, sk_)};
      case AttnMask::Kind::Documents:
        return {doc_start_[size_t((per_row_ ? bi : 0) * sq_ + i)], i + 1};
    }
    return {};
  }

  AttnMask::Kind kind_;
  int64_t sq_, sk_, shift_, window_;
  bool per_row_ = false;
  std::vector<int64_t> doc_start_;  // Documents: the first position of each position's document
};

void check_lse(const Tensor& lse, const AttnShape& a) {
  assert_fp32(lse, "lse");
  MG_ASSERT(lse.shape() == Shape({a.b, a.nq, a.sq}), "lse is {}, expected [{}, {}, {}]", lse.str(), a.b, a.nq, a.sq);
}

// Scores S = scale·Q·Kᵀ of one (batch, head) into scores [sq, sk].
void scores(const AttnShape& a, const float* q, const float* k, float scale, float* out) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(a.sq), int(a.sk), int(a.d), scale, q, int(a.ldq()), k,
              int(a.ldk()), 0.0f, out, int(a.sk));
}

// Keys r of row i of P̃ = P∘M from the same keys of row i of P, for the stream elements base + j.
void dropout_row(const float* p_row, KeyRange r, float p, uint64_t seed, uint64_t offset, uint64_t base, float* uniform,
                 float* out_row) {
  philox_uniforms(seed, offset, base + uint64_t(r.begin), r.end - r.begin, uniform);
  const float keep_scale = 1.0f / (1.0f - p);
  for (int64_t j = r.begin; j < r.end; ++j) out_row[j] = uniform[j - r.begin] >= p ? p_row[j] * keep_scale : 0.0f;
}

// Zeros row[0, r.begin) and row[r.end, n): the keys a row does not see.
void zero_outside(float* row, KeyRange r, int64_t n) {
  std::fill(row, row + std::clamp<int64_t>(r.begin, 0, n), 0.0f);
  std::fill(row + std::clamp<int64_t>(r.end, 0, n), row + n, 0.0f);
}

// The forward on fp32 rows laid out as a says; q, k, v may be one buffer (fused).
void forward_rows(const AttnShape& a, const VisibleKeys& keys, const float* q, const float* k, const float* v,
                  float softmax_scale, float dropout_p, uint64_t seed, uint64_t offset, float* o, float* lse_out) {
  const int64_t sq = a.sq, sk = a.sk;
  if (sq == 0) return;
  std::vector<float> probs(static_cast<size_t>(sq * sk)), uniform(static_cast<size_t>(sk));
  for (int64_t bi = 0; bi < a.b; ++bi) {
    for (int64_t h = 0; h < a.nq; ++h) {
      if (sk > 0) scores(a, q + a.q_off(bi, h), k + a.k_off(bi, h), softmax_scale, probs.data());
      for (int64_t i = 0; i < sq; ++i) {
        float* row = probs.data() + i * sk;
        const KeyRange r = keys.row(bi, i);
        if (r.begin >= r.end) {  // no visible key: P = 0, lse = -inf
          std::fill(row, row + sk, 0.0f);
          lse_out[a.stat(bi, h, i)] = -std::numeric_limits<float>::infinity();
          continue;
        }
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = r.begin; j < r.end; ++j) m = std::max(m, row[j]);
        double sum = 0.0;
        for (int64_t j = r.begin; j < r.end; ++j) {
          row[j] = std::exp(row[j] - m);
          sum += row[j];
        }
        const float inv = float(1.0 / sum);
        for (int64_t j = r.begin; j < r.end; ++j) row[j] *= inv;
        zero_outside(row, r, sk);
        lse_out[a.stat(bi, h, i)] = m + float(std::log(sum));
        if (dropout_p > 0.0f)
          dropout_row(row, r, dropout_p, seed, offset, uint64_t(a.stat(bi, h, i) * sk), uniform.data(), row);
      }
      if (sk == 0) {
        for (int64_t i = 0; i < sq; ++i) std::fill_n(o + a.o_off(bi, h) + i * a.ldo(), a.dv, 0.0f);
        continue;
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(sq), int(a.dv), int(sk), 1.0f, probs.data(), int(sk),
                  v + a.v_off(bi, h), int(a.ldv()), 0.0f, o + a.o_off(bi, h), int(a.ldo()));
    }
  }
}

// The backward on fp32 rows laid out as a says. dq/dk/dv may be one buffer (fused); dk and dv must
// hold zeros (they are accumulated over the heads of a group), dq is overwritten.
void backward_rows(const AttnShape& a, const VisibleKeys& keys, const float* dout, const float* q, const float* k,
                   const float* v, const float* out, const float* lse_in, float softmax_scale, float dropout_p,
                   uint64_t seed, uint64_t offset, float* dq, float* dk, float* dv) {
  const int64_t sq = a.sq, sk = a.sk;
  if (sq == 0) return;
  if (sk == 0) {  // nothing to attend to: dQ = 0
    for (int64_t bi = 0; bi < a.b; ++bi)
      for (int64_t h = 0; h < a.nq; ++h)
        for (int64_t i = 0; i < sq; ++i) std::fill_n(dq + a.q_off(bi, h) + i * a.ldq(), a.d, 0.0f);
    return;
  }
  std::vector<float> probs(static_cast<size_t>(sq * sk)), dropped(dropout_p > 0.0f ? size_t(sq * sk) : 0),
      dscores(size_t(sq * sk));
  std::vector<float> uniform(static_cast<size_t>(sk));
  float* pd = dropout_p > 0.0f ? dropped.data() : probs.data();  // P̃
  for (int64_t bi = 0; bi < a.b; ++bi) {
    for (int64_t h = 0; h < a.nq; ++h) {
      const float* qh = q + a.q_off(bi, h);
      const float* kh = k + a.k_off(bi, h);
      const float* vh = v + a.v_off(bi, h);
      const float* oh = out + a.o_off(bi, h);
      const float* doh = dout + a.o_off(bi, h);
      scores(a, qh, kh, softmax_scale, probs.data());
      for (int64_t i = 0; i < sq; ++i) {
        float* row = probs.data() + i * sk;
        const KeyRange r = keys.row(bi, i);
        const float l = lse_in[a.stat(bi, h, i)];
        for (int64_t j = r.begin; j < r.end; ++j) row[j] = std::exp(row[j] - l);
        zero_outside(row, r, sk);
        if (dropout_p > 0.0f) {
          float* drow = pd + i * sk;
          dropout_row(row, r, dropout_p, seed, offset, uint64_t(a.stat(bi, h, i) * sk), uniform.data(), drow);
          zero_outside(drow, r, sk);
        }
      }
      // dV += P̃ᵀ·dO; dP̃ = dO·Vᵀ.
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(sk), int(a.dv), int(sq), 1.0f, pd, int(sk), doh,
                  int(a.ldo()), 1.0f, dv + a.v_off(bi, h), int(a.ldv()));
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(sq), int(sk), int(a.dv), 1.0f, doh, int(a.ldo()), vh,
                  int(a.ldv()), 0.0f, dscores.data(), int(sk));
      // dS = P̃∘dP̃ - P∘D, in place of dP̃.
      for (int64_t i = 0; i < sq; ++i) {
        double di = 0.0;
        for (int64_t c = 0; c < a.dv; ++c) di += double(doh[i * a.ldo() + c]) * oh[i * a.ldo() + c];
        float* ds = dscores.data() + i * sk;
        const float* prow = probs.data() + i * sk;
        const float* pdrow = pd + i * sk;
        const KeyRange r = keys.row(bi, i);
        for (int64_t j = r.begin; j < r.end; ++j) ds[j] = pdrow[j] * ds[j] - prow[j] * float(di);
        zero_outside(ds, r, sk);
      }
      // dQ = scale·dS·K; dK += scale·dSᵀ·Q.
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(sq), int(a.d), int(sk), softmax_scale, dscores.data(),
                  int(sk), kh, int(a.ldk()), 0.0f, dq + a.q_off(bi, h), int(a.ldq()));
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(sk), int(a.d), int(sq), softmax_scale, dscores.data(),
                  int(sk), qh, int(a.ldq()), 1.0f, dk + a.k_off(bi, h), int(a.ldk()));
    }
  }
}

}  // namespace

void attention_forward(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const AttnMask& mask,
                       float softmax_scale, float dropout_p, uint64_t seed, uint64_t offset, Tensor& out, Tensor& lse) {
  const AttnShape a = attention_shape(q, k, v, dropout_p);
  const VisibleKeys keys(ctx, mask, a);
  assert_numel(out, a.sq * a.b * a.nq * a.dv, "out");
  check_lse(lse, a);
  FloatIn qin(q), kin(k), vin(v);
  FloatOut o(out);
  forward_rows(a, keys, qin.data(), kin.data(), vin.data(), softmax_scale, dropout_p, seed, offset, o.data(),
               lse.data<float>());
}

void attention_backward(Context& ctx, const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, const AttnMask& mask, float softmax_scale,
                        float dropout_p, uint64_t seed, uint64_t offset, Tensor& grad_q, Tensor& grad_k,
                        Tensor& grad_v) {
  const AttnShape a = attention_shape(q, k, v, dropout_p);
  const VisibleKeys keys(ctx, mask, a);
  assert_numel(grad_out, a.sq * a.b * a.nq * a.dv, "grad_out");
  assert_numel(out, a.sq * a.b * a.nq * a.dv, "out");
  assert_numel(grad_q, q.numel(), "grad_q");
  assert_numel(grad_k, k.numel(), "grad_k");
  assert_numel(grad_v, v.numel(), "grad_v");
  check_lse(lse, a);
  FloatIn qin(q), kin(k), vin(v), oin(out), dout(grad_out);
  FloatOut dq(grad_q), dk(grad_k), dv(grad_v);
  std::fill(dk.data(), dk.data() + k.numel(), 0.0f);
  std::fill(dv.data(), dv.data() + v.numel(), 0.0f);
  backward_rows(a, keys, dout.data(), qin.data(), kin.data(), vin.data(), oin.data(), lse.data<float>(), softmax_scale,
                dropout_p, seed, offset, dq.data(), dk.data(), dv.data());
}

void attention_forward_qkv(Context& ctx, const Tensor& qkv, const AttnMask& mask, float softmax_scale, float dropout_p,
                           uint64_t seed, uint64_t offset, Tensor& out, Tensor& lse) {
  const AttnShape a = fused_attention_shape(qkv, out, dropout_p);
  const VisibleKeys keys(ctx, mask, a);
  assert_float(out, "out");
  check_lse(lse, a);
  FloatIn x(qkv);
  FloatOut o(out);
  forward_rows(a, keys, x.data(), x.data(), x.data(), softmax_scale, dropout_p, seed, offset, o.data(),
               lse.data<float>());
}

void attention_backward_qkv(Context& ctx, const Tensor& grad_out, const Tensor& qkv, const Tensor& out,
                            const Tensor& lse, const AttnMask& mask, float softmax_scale, float dropout_p,
                            uint64_t seed, uint64_t offset, Tensor& grad_qkv) {
  const AttnShape a = fused_attention_shape(qkv, out, dropout_p);
  const VisibleKeys keys(ctx, mask, a);
  assert_float(out, "out");
  assert_numel(grad_out, out.numel(), "grad_out");
  assert_float(grad_qkv, "grad_qkv");
  assert_numel(grad_qkv, qkv.numel(), "grad_qkv");
  check_lse(lse, a);
  FloatIn x(qkv), oin(out), dout(grad_out);
  FloatOut dx(grad_qkv);
  std::fill(dx.data(), dx.data() + grad_qkv.numel(), 0.0f);  // dK, dV accumulate; dQ is overwritten
  backward_rows(a, keys, dout.data(), x.data(), x.data(), x.data(), oin.data(), lse.data<float>(), softmax_scale,
                dropout_p, seed, offset, dx.data(), dx.data(), dx.data());
}

}  // namespace megatron::cpu

// The routing math of one token row, shared by the CPU reference (kernels/cpu/moe.cpp, a loop over
// tokens) and the CUDA kernels (kernels/cuda/moe.cu, one thread per token): the same code, so the two
// backends choose the same experts and agree to rounding. It is megatron/core/transformer/moe/
// moe_utils.cpp's routing_forward/routing_backward per token, operation for operation (fp32 values,
// fp64 sums where that file sums in fp64), written without arrays of runtime length: what a row needs
// besides its inputs lives in a caller's scratch of E floats.
//
// Top-k order: value descending, ties to the lower index (std::stable_sort in moe_utils.cpp, and
// PyTorch's topk on distinct values). topk_each finds the k entries one after another, each the
// first in that order after the previous one: O(k·E), no marks.
#pragma once

#include <cmath>
#include <cstdint>

#include "megatron/kernels/ops.h"
#include "megatron/runtime/philox.h"

#if defined(__CUDACC__)
#define MG_HD __host__ __device__
#else
#define MG_HD
#endif

namespace megatron::moe_rows {

inline constexpr float kNormEps = 1e-20f;  // Megatron's denominator guard for normalised sigmoid scores
inline constexpr int kMaxGroups = 64;      // group-limited routing: the groups' scores live in registers

MG_HD inline bool before(float va, int ia, float vb, int ib) { return va > vb || (va == vb && ia < ib); }

// Calls emit(j, index, value) for the top k of score(i) over i in [0, n) with allowed(i), in order.
template <typename Score, typename Allowed, typename Emit>
MG_HD void topk_each(int n, int k, Score score, Allowed allowed, Emit emit) {
  float pv = 0.0f;
  int pi = -1;
  for (int j = 0; j < k; ++j) {
    int best = -1;
    float bv = 0.0f;
    for (int i = 0; i < n; ++i) {
      if (!allowed(i)) continue;
      const float v = score(i);
      if (pi >= 0 && !before(pv, pi, v, i)) continue;  // already taken
      if (best < 0 || before(v, i, bv, best)) best = i, bv = v;
    }
    if (best < 0) return;  // fewer than k allowed (params checked against it)
    emit(j, best, bv);
    pv = bv;
    pi = best;
  }
}

MG_HD inline float sigmoid(float x) { return float(1.0 / (1.0 + exp(-double(x)))); }

// out[i] = softmax(x)[i]: fp32 max, fp64 sum of exp (moe_utils.cpp's softmax_row).
MG_HD inline void softmax_row(const float* x, int n, float* out) {
  float m = -INFINITY;
  for (int i = 0; i < n; ++i) m = fmaxf(m, x[i]);
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += exp(double(x[i]) - m);
  for (int i = 0; i < n; ++i) out[i] = float(exp(double(x[i]) - m) / sum);
}

// logsumexp of a row in fp64 (the z loss).
MG_HD inline double logsumexp_row(const float* x, int n) {
  float m = -INFINITY;
  for (int i = 0; i < n; ++i) m = fmaxf(m, x[i]);
  double s = 0;
  for (int i = 0; i < n; ++i) s += exp(double(x[i]) - m);
  return m + log(s);
}

// The softmax over the chosen logits: p_j = exp(l[top_j] - m) / Σ, m the largest chosen logit.
MG_HD inline float selected_softmax_max(const float* l, const int32_t* top, int k) {
  float m = -INFINITY;
  for (int j = 0; j < k; ++j) m = fmaxf(m, l[top[j]]);
  return m;
}
MG_HD inline double selected_softmax_sum(const float* l, const int32_t* top, int k, float m) {
  double sum = 0;
  for (int j = 0; j < k; ++j) sum += exp(double(l[top[j]]) - m);
  return sum;
}

// Megatron's group_limited_topk (a group's score: the sum of its top topk / group_topk scores, or of
// its top group_score_topk, HF DeepSeek-V3's 2, when given), or the plain top-k: emit(j, index) for the chosen experts.
template <typename Score, typename Emit>
MG_HD void select_experts(const MoeRoutingParams& c, Score score, Emit emit) {
  const int e = c.num_experts, k = c.topk;
  if (c.group_topk <= 0) {
    topk_each(e, k, score, [](int) { return true; }, [&](int j, int i, float) { emit(j, i); });
    return;
  }
  const int per_group = e / c.num_groups;
  const int per_score = c.group_score_topk > 0 ? c.group_score_topk : k / c.group_topk;
  float group_score[kMaxGroups];
  for (int g = 0; g < c.num_groups; ++g) {
    float sum = 0;
    topk_each(
        per_group, per_score, [&](int i) { return score(g * per_group + i); }, [](int) { return true; },
        [&](int, int, float v) { sum += v; });
    group_score[g] = sum;
  }
  uint64_t groups = 0;
  topk_each(
      c.num_groups, c.group_topk, [&](int g) { return group_score[g]; }, [](int) { return true; },
      [&](int, int g, float) { groups |= uint64_t(1) << g; });
  topk_each(
      e, k, score, [&](int i) { return ((groups >> (i / per_group)) & 1) != 0; },
      [&](int j, int i, float) { emit(j, i); });
}

// One token's routing (before token dropping): top[k] the chosen experts in order, p_top[k] their
// probabilities (scaled). scratch: E floats. bias: E floats or null.
MG_HD inline void route_row(const MoeRoutingParams& c, const float* l, const float* bias, float* scratch,
                            int32_t* top, float* p_top) {
  const int e = c.num_experts, k = c.topk;
  auto keep = [&](int j, int i) { top[j] = int32_t(i); };
  if (!c.sigmoid && !c.pre_softmax) {  // top-k of the logits, softmax over them
    select_experts(c, [&](int i) { return l[i]; }, keep);
    const float m = selected_softmax_max(l, top, k);
    const double sum = selected_softmax_sum(l, top, k, m);
    for (int j = 0; j < k; ++j) p_top[j] = float(exp(double(l[top[j]]) - m) / sum);
  } else if (!c.sigmoid) {  // softmax over every expert, then top-k
    softmax_row(l, e, scratch);
    select_experts(c, [&](int i) { return scratch[i]; }, keep);
    for (int j = 0; j < k; ++j) p_top[j] = scratch[top[j]];
  } else {  // sigmoid; the bias steers the choice only
    for (int i = 0; i < e; ++i) scratch[i] = sigmoid(l[i]);
    if (bias) {
      select_experts(c, [&](int i) { return scratch[i] + bias[i]; }, keep);
    } else {
      select_experts(c, [&](int i) { return scratch[i]; }, keep);
    }
    float sum = 0;
    for (int j = 0; j < k; ++j) sum += scratch[top[j]];
    for (int j = 0; j < k; ++j) p_top[j] = k > 1 ? scratch[top[j]] / (sum + kNormEps) : scratch[top[j]];
  }
  if (c.topk_scaling_factor > 0)
    for (int j = 0; j < k; ++j) p_top[j] *= c.topk_scaling_factor;
}

// The load-balancing losses' scores of one token (compute_routing_scores_for_aux_loss) and their
// plain top-k as a 0/1 map row.
MG_HD inline void aux_scores_row(const MoeRoutingParams& c, const float* l, float* out, uint8_t* map) {
  const int e = c.num_experts;
  if (!c.sigmoid) {
    softmax_row(l, e, out);
  } else {
    double sum = 0;
    for (int i = 0; i < e; ++i) sum += out[i] = sigmoid(l[i]);
    for (int i = 0; i < e; ++i) out[i] = float(out[i] / (sum + kNormEps));
  }
  for (int i = 0; i < e; ++i) map[i] = 0;
  topk_each(
      e, c.topk, [&](int i) { return out[i]; }, [](int) { return true; }, [&](int, int i, float) { map[i] = 1; });
}

// The aux losses' scales: d(loss)/d(score[t, x]) = count · scale (Note [Router losses' gradients]).
MG_HD inline double aux_loss_scale_of(const MoeRoutingParams& c, int64_t t_count) {
  return double(c.num_experts) * c.aux_loss_coeff / (double(c.topk) * double(t_count) * double(t_count));
}
MG_HD inline double seq_aux_loss_scale_of(const MoeRoutingParams& c) {
  return double(c.num_experts) * c.seq_aux_loss_coeff /
         (double(c.topk) * double(c.seq_length) * double(c.seq_length)) / double(c.micro_batch);
}

// gt (E floats) += the gradient through one token's aux scores (the softmax, or the normalised
// sigmoid, over every expert of logits l) of d(loss)/d(score i) = gscore(i). scratch: E floats.
template <typename GradScore>
MG_HD void aux_scores_backward_row(const MoeRoutingParams& c, const float* l, const float* aux_scores, float* scratch,
                                   float* gt, GradScore gscore) {
  const int e = c.num_experts;
  if (!c.sigmoid) {
    double dot = 0;
    for (int i = 0; i < e; ++i) dot += gscore(i) * aux_scores[i];
    for (int i = 0; i < e; ++i) gt[i] += float(aux_scores[i] * (gscore(i) - dot));
  } else {  // scores = σ / (Σσ + eps)
    double sum = 0, dot = 0;
    for (int i = 0; i < e; ++i) sum += scratch[i] = sigmoid(l[i]);
    for (int i = 0; i < e; ++i) dot += gscore(i) * scratch[i];
    const double den = sum + kNormEps;
    for (int i = 0; i < e; ++i) {
      const double gsig = (gscore(i) * den - dot) / (den * den);
      gt[i] += float(gsig * scratch[i] * (1.0 - scratch[i]));
    }
  }
}

// One token's grad_logits row g_out (E floats, overwritten): the chosen probabilities' part, the z
// loss's and the aux losses'. g: grad_probs row; map: routing_map row; top: the chosen experts.
// counts / seq_counts: the aux map's column sums over every token / over this token's sequence
// (E doubles each; read only when the aux or seq-aux loss is on); aux_scores: the row's aux scores.
// scratch: E floats.
MG_HD inline void routing_backward_row(const MoeRoutingParams& c, int64_t t_count, const float* l, const int32_t* top,
                                       const uint8_t* map, const float* g, const float* aux_scores,
                                       const double* counts, const double* seq_counts, float aux_loss_scale,
                                       float* scratch, float* gt) {
  const int e = c.num_experts, k = c.topk;
  const float sf = c.topk_scaling_factor > 0 ? c.topk_scaling_factor : 1.0f;
  // The gradient of the kept probabilities (dropped and padded slots carry none), unscaled.
  auto gsel = [&](int j) { return map[top[j]] ? double(g[top[j]]) * sf : 0.0; };
  for (int i = 0; i < e; ++i) gt[i] = 0.0f;
  if (!c.sigmoid && !c.pre_softmax) {  // p = softmax(l[top])
    const float m = selected_softmax_max(l, top, k);
    const double sum = selected_softmax_sum(l, top, k, m);
    auto p = [&](int j) { return float(exp(double(l[top[j]]) - m) / sum); };
    double dot = 0;
    for (int j = 0; j < k; ++j) dot += gsel(j) * p(j);
    for (int j = 0; j < k; ++j) gt[top[j]] += float(p(j) * (gsel(j) - dot));
  } else if (!c.sigmoid) {  // p = softmax(l)[top]
    softmax_row(l, e, scratch);
    double dot = 0;
    for (int j = 0; j < k; ++j) dot += gsel(j) * scratch[top[j]];
    for (int i = 0; i < e; ++i) gt[i] = float(scratch[i] * (0.0 - dot));  // gt was 0: the same as +=
    for (int j = 0; j < k; ++j) gt[top[j]] = float(scratch[top[j]] * (gsel(j) - dot));
  } else {  // p = σ(l)[top] / (Σ σ(l)[top] + eps) (k > 1), σ(l)[top] (k = 1)
    double sum = 0, dot = 0;
    for (int j = 0; j < k; ++j) sum += double(sigmoid(l[top[j]]));
    for (int j = 0; j < k; ++j) dot += gsel(j) * double(sigmoid(l[top[j]]));
    const double den = sum + kNormEps;
    for (int j = 0; j < k; ++j) {
      const double s = sigmoid(l[top[j]]);
      const double gs = k > 1 ? (gsel(j) * den - dot) / (den * den) : gsel(j);
      gt[top[j]] += float(gs * s * (1.0 - s));
    }
  }
  // z loss: coeff · mean lse² -> 2 · coeff · lse / T · softmax(l).
  if (c.z_loss_coeff > 0) {
    softmax_row(l, e, scratch);
    const double f = 2.0 * c.z_loss_coeff * logsumexp_row(l, e) / double(t_count) * aux_loss_scale;
    for (int i = 0; i < e; ++i) gt[i] += float(f * scratch[i]);
  }
  if (!c.local_aux_on()) return;
  const double scale = aux_loss_scale_of(c, t_count), seq_scale = seq_aux_loss_scale_of(c);
  aux_scores_backward_row(c, l, aux_scores, scratch, gt, [&](int i) {
    double v = 0.0;
    if (c.aux_loss_coeff > 0) v += counts[i] * scale * aux_loss_scale;
    if (c.seq_aux_loss_coeff > 0) v += seq_counts[i] * seq_scale * aux_loss_scale;
    return v;
  });
}

// The global aux loss's scale (Note [Global aux loss], core/transformer/moe/router.h): E·coeff / (k·N²) with
// N = T · global_aux_group.
MG_HD inline double global_aux_loss_scale_of(const MoeRoutingParams& c, int64_t t_count) {
  const double n = double(t_count) * double(c.global_aux_group);
  return double(c.num_experts) * c.global_aux_loss_coeff / (double(c.topk) * n * n);
}

// Megatron's apply_input_jitter factor of stream element i (Note [Router input jitter],
// core/transformer/moe/router.h): U(1 - eps, 1 + eps) from Philox's 24-bit uniform, as
// (1 - eps) + (2·eps)·u with every operation rounded on its own. nvcc contracts a multiply followed
// by an add into one FMA (one rounding), which moved some factors by an ulp from the host's; on the
// device the intrinsics below are never contracted, so both sides give the same bits.
MG_HD inline float jitter_factor(float eps, uint64_t seed, uint64_t offset, uint64_t i) {
  const float u = philox_uniform(seed, offset, i);
#ifdef __CUDA_ARCH__
  return __fadd_rn(1.0f - eps, __fmul_rn(2.0f * eps, u));
#else
  return (1.0f - eps) + (2.0f * eps) * u;
#endif
}

}  // namespace megatron::moe_rows

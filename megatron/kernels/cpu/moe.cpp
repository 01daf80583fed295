// Mixture of experts, CPU reference: routing forward/backward (the per-token math of
// kernels/moe_routing_rows.h in a loop over tokens, the column sums and losses in fp64 as
// core/transformer/moe/moe_utils.cpp has them), token dropping to the expert capacity, the
// expert-bias update, the token permutation (Note [Permuted order]) and the row scaling by the
// probabilities. The grouped GEMM of the experts is in linear.cpp.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "megatron/kernels/cpu/cpu_common.h"
#include "megatron/kernels/cpu/cpu_ops.h"
#include "megatron/kernels/moe_routing_rows.h"

namespace megatron::cpu {

namespace {

void check_host(const Tensor& t, DType dtype, int64_t numel, const char* name) {
  MG_ASSERT(t.defined() && t.device().is_host() && t.dtype() == dtype && t.numel() == numel,
            "{} is {}, expected {} with {} elements on the host", name, t.defined() ? t.str() : "undefined",
            to_string(dtype), numel);
}

// Megatron's apply_router_token_dropping: each expert keeps its `capacity` tokens of highest
// probability (or its first routed tokens, by position); with padding, exactly `capacity` tokens.
void drop_tokens(const MoeRoutingParams& c, int64_t t_count, float* probs, uint8_t* map) {
  const int64_t e = c.num_experts;
  const int64_t capacity =
      int64_t(std::ceil(double(t_count * c.topk) / double(e) * double(c.capacity_factor)));  // get_capacity
  if (capacity > t_count) return;
  std::vector<uint8_t> keep(static_cast<size_t>(t_count * e), 0);
  std::vector<int64_t> idx(static_cast<size_t>(t_count));
  for (int64_t x = 0; x < e; ++x) {
    auto value = [&](int64_t t) { return c.drop_by_position ? float(map[t * e + x]) : probs[t * e + x]; };
    std::iota(idx.begin(), idx.end(), int64_t(0));
    std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return value(a) > value(b); });
    for (int64_t r = 0; r < capacity; ++r) keep[size_t(idx[size_t(r)] * e + x)] = 1;
  }
  for (int64_t i = 0; i < t_count * e; ++i) {
    map[i] = c.pad_to_capacity ? keep[size_t(i)] : uint8_t(map[i] & keep[size_t(i)]);
    if (!map[i]) probs[i] = 0.0f;
  }
}

// counts[b·E + x] = Σ over sequence b's tokens of v[t, x], fp64.
template <typename T>
std::vector<double> sequence_column_sums(const T* v, const MoeRoutingParams& c) {
  const int64_t e = c.num_experts, mb = c.micro_batch;
  std::vector<double> out(static_cast<size_t>(mb * e), 0.0);
  for (int64_t s = 0; s < c.seq_length; ++s)
    for (int64_t b = 0; b < mb; ++b)
      for (int64_t x = 0; x < e; ++x) out[size_t(b * e + x)] += double(v[(s * mb + b) * e + x]);
  return out;
}

}  // namespace

void moe_routing_forward(Context& ctx, const Tensor& logits, const Tensor& expert_bias, const MoeRoutingParams& c,
                         Tensor& probs, Tensor& routing_map, Tensor& topk_indices, Tensor& aux_scores, Tensor& aux_map,
                         Tensor& tokens_per_expert, Tensor& losses) {
  ops::check_moe_routing(c, logits, expert_bias);
  const int64_t t_count = logits.size(0), e = c.num_experts, k = c.topk;
  check_host(probs, DType::Float32, t_count * e, "probs");
  check_host(routing_map, DType::UInt8, t_count * e, "routing_map");
  check_host(topk_indices, DType::Int32, t_count * k, "topk_indices");
  check_host(tokens_per_expert, DType::Float32, e, "tokens_per_expert");
  check_host(losses, DType::Float32, 3, "losses");
  const float* l = logits.data<float>();
  const float* bias = expert_bias.defined() ? expert_bias.data<float>() : nullptr;
  float* p = probs.data<float>();
  uint8_t* map = routing_map.data<uint8_t>();
  int32_t* top = topk_indices.data<int32_t>();
  std::fill(p, p + t_count * e, 0.0f);
  std::fill(map, map + t_count * e, uint8_t(0));
  std::vector<float> scratch(static_cast<size_t>(e)), p_top(static_cast<size_t>(k));
  for (int64_t t = 0; t < t_count; ++t) {
    moe_rows::route_row(c, l + t * e, bias, scratch.data(), top + t * k, p_top.data());
    for (int64_t j = 0; j < k; ++j) {
      p[t * e + top[t * k + j]] = p_top[size_t(j)];
      map[t * e + top[t * k + j]] = 1;
    }
  }
  if (c.capacity_factor > 0) drop_tokens(c, t_count, p, map);

  float* tokens = tokens_per_expert.data<float>();
  std::fill(tokens, tokens + e, 0.0f);
  for (int64_t t = 0; t < t_count; ++t)
    for (int64_t x = 0; x < e; ++x) tokens[x] += float(map[t * e + x]);

  double z_loss = 0, aux_loss = 0, seq_aux_loss = 0;
  if (c.z_loss_coeff > 0) {  // z_loss_func: coeff · mean over tokens of logsumexp(logits)²
    double sum = 0;
    for (int64_t t = 0; t < t_count; ++t) {
      const double lse = moe_rows::logsumexp_row(l + t * e, int(e));
      sum += lse * lse;
    }
    z_loss = sum / double(t_count) * c.z_loss_coeff;
  }
  if (c.aux_on()) {  // switch_load_balancing_loss_func over the aux scores and their plain top-k
    check_host(aux_scores, DType::Float32, t_count * e, "aux_scores");
    check_host(aux_map, DType::UInt8, t_count * e, "aux_map");
    float* scores = aux_scores.data<float>();
    uint8_t* amap = aux_map.data<uint8_t>();
    for (int64_t t = 0; t < t_count; ++t) moe_rows::aux_scores_row(c, l + t * e, scores + t * e, amap + t * e);
    if (c.aux_loss_coeff > 0) {
      double loss = 0;
      for (int64_t x = 0; x < e; ++x) {
        double ps = 0, n = 0;
        for (int64_t t = 0; t < t_count; ++t) ps += scores[t * e + x], n += double(amap[t * e + x]);
        loss += ps * n;
      }
      aux_loss = loss * moe_rows::aux_loss_scale_of(c, t_count);
    }
    if (c.seq_aux_loss_coeff > 0) {  // per sequence b: its tokens' scores and counts, averaged over b
      const std::vector<double> ps = sequence_column_sums(scores, c), n = sequence_column_sums(amap, c);
      double loss = 0;
      for (size_t i = 0; i < ps.size(); ++i) loss += ps[i] * n[i];
      seq_aux_loss = loss * moe_rows::seq_aux_loss_scale_of(c);
    }
  }
  float* out = losses.data<float>();
  out[0] = float(aux_loss);
  out[1] = float(seq_aux_loss);
  out[2] = float(z_loss);
}

void moe_routing_backward(Context& ctx, const Tensor& grad_probs, const Tensor& logits, const Tensor& topk_indices,
                          const Tensor& routing_map, const Tensor& aux_scores, const Tensor& aux_map,
                          const MoeRoutingParams& c, float aux_loss_scale, Tensor& grad_logits) {
  ops::check_moe_routing(c, logits, Tensor());
  const int64_t t_count = logits.size(0), e = c.num_experts, k = c.topk, mb = c.micro_batch;
  check_host(grad_probs, DType::Float32, t_count * e, "grad_probs");
  check_host(topk_indices, DType::Int32, t_count * k, "topk_indices");
  check_host(routing_map, DType::UInt8, t_count * e, "routing_map");
  check_host(grad_logits, DType::Float32, t_count * e, "grad_logits");
  std::vector<double> counts, seq_counts;
  const float* scores = nullptr;
  if (c.local_aux_on()) {
    check_host(aux_scores, DType::Float32, t_count * e, "aux_scores");
    check_host(aux_map, DType::UInt8, t_count * e, "aux_map");
    scores = aux_scores.data<float>();
    seq_counts = sequence_column_sums(aux_map.data<uint8_t>(), c);
    counts.assign(size_t(e), 0.0);
    for (int64_t b = 0; b < mb; ++b)
      for (int64_t x = 0; x < e; ++x) counts[size_t(x)] += seq_counts[size_t(b * e + x)];
  }
  const float* l = logits.data<float>();
  const float* g = grad_probs.data<float>();
  const int32_t* top = topk_indices.data<int32_t>();
  const uint8_t* map = routing_map.data<uint8_t>();
  float* gl = grad_logits.data<float>();
  std::vector<float> scratch(static_cast<size_t>(e));
  for (int64_t t = 0; t < t_count; ++t) {
    moe_rows::routing_backward_row(c, t_count, l + t * e, top + t * k, map + t * e, g + t * e,
                                   scores ? scores + t * e : nullptr, counts.data(),
                                   seq_counts.empty() ? nullptr : seq_counts.data() + (t % mb) * e, aux_loss_scale,
                                   scratch.data(), gl + t * e);
  }
}

void moe_expert_bias_update(Context& ctx, const Tensor& tokens_per_expert, float update_rate, Tensor& expert_bias) {
  const int64_t e = expert_bias.numel();
  check_host(expert_bias, DType::Float32, e, "expert_bias");
  check_host(tokens_per_expert, DType::Float32, e, "tokens_per_expert");
  const float* n = tokens_per_expert.data<float>();
  float* b = expert_bias.data<float>();
  float mean = 0;
  for (int64_t i = 0; i < e; ++i) mean += n[i];
  mean /= float(e);
  for (int64_t i = 0; i < e; ++i) {
    const float off = mean - n[i];
    b[i] += (off > 0 ? 1.0f : off < 0 ? -1.0f : 0.0f) * update_rate;
  }
}

// ---- the global aux loss (Note [Global aux loss] in core/transformer/moe/router.h) -----------------

void moe_expert_counts(Context& ctx, const Tensor& map, Tensor& counts) {
  MG_CHECK(map.defined() && map.dim() == 2 && map.dtype() == DType::UInt8,
           "moe_expert_counts: the map must be uint8 [tokens, experts], got {}", map.defined() ? map.str() : "undefined");
  const int64_t t_count = map.size(0), e = map.size(1);
  check_host(counts, DType::Float32, e, "counts");
  const uint8_t* m = map.data<uint8_t>();
  float* n = counts.data<float>();
  std::fill(n, n + e, 0.0f);
  for (int64_t t = 0; t < t_count; ++t)
    for (int64_t x = 0; x < e; ++x) n[x] += float(m[t * e + x]);
}

void moe_global_aux_loss_forward(Context& ctx, const Tensor& aux_scores, const Tensor& tokens,
                                 const MoeRoutingParams& c, Tensor& loss) {
  ops::check_moe_routing(c, aux_scores, Tensor());
  const int64_t t_count = aux_scores.size(0), e = c.num_experts;
  check_host(tokens, DType::Float32, e, "tokens");
  check_host(loss, DType::Float32, 1, "loss");
  const float* s = aux_scores.data<float>();
  const float* n = tokens.data<float>();
  double sum = 0;
  for (int64_t x = 0; x < e; ++x) {  // the CUDA kernel's order: Σ_t per expert in fp64, then Σ_x
    double p = 0;
    for (int64_t t = 0; t < t_count; ++t) p += double(s[t * e + x]);
    sum += p * double(n[x]);
  }
  loss.data<float>()[0] = float(sum * moe_rows::global_aux_loss_scale_of(c, t_count));
}

void moe_global_aux_loss_backward(Context& ctx, const Tensor& logits, const Tensor& aux_scores, const Tensor& tokens,
                                  const MoeRoutingParams& c, float aux_loss_scale, Tensor& grad_logits) {
  ops::check_moe_routing(c, logits, Tensor());
  const int64_t t_count = logits.size(0), e = c.num_experts;
  check_host(aux_scores, DType::Float32, t_count * e, "aux_scores");
  check_host(tokens, DType::Float32, e, "tokens");
  check_host(grad_logits, DType::Float32, t_count * e, "grad_logits");
  const double scale = moe_rows::global_aux_loss_scale_of(c, t_count) * aux_loss_scale;
  const float* l = logits.data<float>();
  const float* s = aux_scores.data<float>();
  const float* n = tokens.data<float>();
  float* g = grad_logits.data<float>();
  std::vector<float> scratch(static_cast<size_t>(e));
  for (int64_t t = 0; t < t_count; ++t) {
    moe_rows::aux_scores_backward_row(c, l + t * e, s + t * e, scratch.data(), g + t * e,
                                      [&](int i) { return double(n[i]) * scale; });
  }
}

// ---- input jitter (Note [Router input jitter] in core/transformer/moe/router.h) --------------------

void moe_input_jitter(Context& ctx, const Tensor& x, float eps, uint64_t seed, uint64_t offset, int64_t micro_batch,
                      int64_t seq_offset, Tensor& out) {
  MG_CHECK(x.defined() && x.dim() == 2 && x.dtype() == DType::Float32 && micro_batch > 0 &&
               x.size(0) % micro_batch == 0 && seq_offset >= 0,
           "moe_input_jitter: x must be fp32 [tokens, hidden] of whole micro-batches of {}, got {}", micro_batch,
           x.defined() ? x.str() : "undefined");
  check_host(out, DType::Float32, x.numel(), "out");
  const int64_t t_count = x.size(0), h = x.size(1);
  const float* in = x.data<float>();
  float* o = out.data<float>();
  for (int64_t t = 0; t < t_count; ++t) {
    const int64_t row = (seq_offset + t / micro_batch) * micro_batch + t % micro_batch;
    for (int64_t j = 0; j < h; ++j)
      o[t * h + j] = in[t * h + j] * moe_rows::jitter_factor(eps, seed, offset, uint64_t(row * h + j));
  }
}

// ---- permutation (Note [Permuted order]) ----------------------------------------------------------

void moe_permutation(Context& ctx, const Tensor& routing_map, int64_t capacity, MoePermutation& perm) {
  MG_CHECK(routing_map.defined() && routing_map.dim() == 2 && routing_map.dtype() == DType::UInt8,
           "moe_permutation: the routing map must be uint8 [tokens, experts], got {}",
           routing_map.defined() ? routing_map.str() : "undefined");
  const int64_t t_count = routing_map.size(0), e = routing_map.size(1);
  MG_CHECK(capacity >= 0 && capacity <= t_count, "moe_permutation: expert capacity {} for {} tokens", capacity,
           t_count);
  const uint8_t* map = routing_map.data<uint8_t>();
  std::vector<int64_t> sorted, expert;
  std::vector<int64_t> token_rows(static_cast<size_t>(t_count * e), -1);
  perm.rows_per_expert.assign(size_t(e), 0);
  for (int64_t x = 0; x < e; ++x) {
    int64_t rows = 0;
    for (int pass = 0; pass < (capacity > 0 ? 2 : 1); ++pass) {  // routed tokens, then (padding) the others
      for (int64_t t = 0; t < t_count && (capacity == 0 || rows < capacity); ++t) {
        if ((map[t * e + x] != 0) != (pass == 0)) continue;
        token_rows[size_t(t * e + x)] = int64_t(sorted.size());
        sorted.push_back(t);
        expert.push_back(x);
        ++rows;
      }
    }
    perm.rows_per_expert[size_t(x)] = rows;
  }
  const int64_t n = int64_t(sorted.size());
  perm.sorted_indices = Tensor::from_ints(sorted, {n}, DType::Int32);
  perm.row_expert = Tensor::from_ints(expert, {n}, DType::Int32);
  perm.token_rows = Tensor::from_ints(token_rows, {t_count, e}, DType::Int32);
  perm.num_tokens = t_count;
  perm.num_experts = e;
}

namespace {

struct PermDims {
  int64_t n = 0, h = 0;
};

PermDims check_perm(const MoePermutation& perm, const Tensor& permuted, const Tensor& tokens) {
  const int64_t n = perm.rows();
  MG_ASSERT(perm.sorted_indices.defined() && perm.sorted_indices.numel() == n && perm.token_rows.defined() &&
                perm.token_rows.numel() == perm.num_tokens * perm.num_experts,
            "MoE permutation of {} rows is incomplete", n);
  assert_float(permuted, "permuted");
  assert_float(tokens, "tokens");
  MG_ASSERT(permuted.dim() == 2 && tokens.dim() == 2 && permuted.size(0) == n && tokens.size(0) == perm.num_tokens &&
                permuted.size(1) == tokens.size(1),
            "permuted {} and tokens {} for a permutation of {} tokens into {} rows", permuted.str(), tokens.str(),
            perm.num_tokens, n);
  return {n, tokens.size(1)};
}

// out[t] = Σ over t's rows r (in row order) of w[r] · rows[r] (w null: 1), fp32.
void gather_sum_rows(const MoePermutation& perm, const float* rows, const float* w, int64_t h, float* out) {
  const int64_t e = perm.num_experts;
  const int32_t* tr = perm.token_rows.data<int32_t>();
  std::fill(out, out + perm.num_tokens * h, 0.0f);
  for (int64_t t = 0; t < perm.num_tokens; ++t)
    for (int64_t x = 0; x < e; ++x) {
      const int32_t r = tr[t * e + x];
      if (r < 0) continue;
      const float wr = w ? w[r] : 1.0f;
      for (int64_t j = 0; j < h; ++j) out[t * h + j] += wr * rows[r * h + j];
    }
}

}  // namespace

void moe_permute_forward(Context& ctx, const Tensor& tokens, const MoePermutation& perm, Tensor& permuted) {
  const PermDims d = check_perm(perm, permuted, tokens);
  const int32_t* idx = perm.sorted_indices.data<int32_t>();
  const size_t row_bytes = size_t(d.h) * size_of(tokens.dtype());
  MG_ASSERT(permuted.dtype() == tokens.dtype(), "permuted {} and tokens {} differ in dtype", permuted.str(),
            tokens.str());
  for (int64_t r = 0; r < d.n; ++r)
    std::memcpy(static_cast<char*>(permuted.raw_data()) + r * row_bytes,
                static_cast<const char*>(tokens.raw_data()) + idx[r] * row_bytes, row_bytes);
}

void moe_permute_backward(Context& ctx, const Tensor& grad_permuted, const MoePermutation& perm,
                          Tensor& grad_tokens) {
  const PermDims d = check_perm(perm, grad_permuted, grad_tokens);
  FloatIn g(grad_permuted);
  FloatOut out(grad_tokens);
  gather_sum_rows(perm, g.data(), nullptr, d.h, out.data());
}

void moe_unpermute_forward(Context& ctx, const Tensor& permuted, const Tensor& probs_permuted,
                           const MoePermutation& perm, Tensor& out) {
  const PermDims d = check_perm(perm, permuted, out);
  if (probs_permuted.defined()) check_host(probs_permuted, DType::Float32, d.n, "probs_permuted");
  FloatIn x(permuted);
  FloatOut o(out);
  gather_sum_rows(perm, x.data(), probs_permuted.defined() ? probs_permuted.data<float>() : nullptr, d.h, o.data());
}

void moe_unpermute_backward(Context& ctx, const Tensor& grad_out, const Tensor& permuted, const Tensor& probs_permuted,
                            const MoePermutation& perm, Tensor& grad_permuted, Tensor& grad_probs_permuted) {
  const PermDims d = check_perm(perm, permuted, grad_out);
  const bool weighted = probs_permuted.defined();
  if (weighted) check_host(probs_permuted, DType::Float32, d.n, "probs_permuted");
  const int32_t* idx = perm.sorted_indices.data<int32_t>();
  FloatIn g(grad_out), x(permuted);
  if (grad_permuted.defined()) {
    assert_numel(grad_permuted, d.n * d.h, "grad_permuted");
    FloatOut gx(grad_permuted);
    for (int64_t r = 0; r < d.n; ++r) {
      const float w = weighted ? probs_permuted.data<float>()[r] : 1.0f;
      for (int64_t j = 0; j < d.h; ++j) gx[r * d.h + j] = w * g[idx[r] * d.h + j];
    }
  }
  if (weighted && grad_probs_permuted.defined()) {
    check_host(grad_probs_permuted, DType::Float32, d.n, "grad_probs_permuted");
    float* gp = grad_probs_permuted.data<float>();
    for (int64_t r = 0; r < d.n; ++r) {
      double dot = 0;
      for (int64_t j = 0; j < d.h; ++j) dot += double(g[idx[r] * d.h + j]) * x[r * d.h + j];
      gp[r] = float(dot);
    }
  }
}

void moe_permute_probs_forward(Context& ctx, const Tensor& probs, const MoePermutation& perm, Tensor& probs_permuted) {
  const int64_t n = perm.rows(), e = perm.num_experts;
  check_host(probs, DType::Float32, perm.num_tokens * e, "probs");
  check_host(probs_permuted, DType::Float32, n, "probs_permuted");
  const int32_t* idx = perm.sorted_indices.data<int32_t>();
  const int32_t* ex = perm.row_expert.data<int32_t>();
  for (int64_t r = 0; r < n; ++r) probs_permuted.data<float>()[r] = probs.data<float>()[int64_t(idx[r]) * e + ex[r]];
}

void moe_permute_probs_backward(Context& ctx, const Tensor& grad_probs_permuted, const MoePermutation& perm,
                                Tensor& grad_probs) {
  const int64_t n = perm.rows(), e = perm.num_experts;
  check_host(grad_probs_permuted, DType::Float32, n, "grad_probs_permuted");
  check_host(grad_probs, DType::Float32, perm.num_tokens * e, "grad_probs");
  const int32_t* tr = perm.token_rows.data<int32_t>();
  const float* g = grad_probs_permuted.data<float>();
  float* out = grad_probs.data<float>();
  for (int64_t i = 0; i < perm.num_tokens * e; ++i) out[i] = tr[i] < 0 ? 0.0f : g[tr[i]];
}

// ---- row scaling ------------------------------------------------------------------------------------

void moe_scale_rows_forward(Context& ctx, const Tensor& x, const Tensor& probs, Tensor& out) {
  assert_float(x, "x");
  const int64_t n = probs.numel(), c = n == 0 ? 0 : x.numel() / n;
  check_host(probs, DType::Float32, n, "probs");
  assert_numel(x, n * c, "x");
  assert_numel(out, n * c, "out");
  FloatIn xin(x);
  FloatOut o(out);
  const float* p = probs.data<float>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < c; ++j) o[r * c + j] = xin[r * c + j] * p[r];
}

void moe_scale_rows_backward(Context& ctx, const Tensor& grad_out, const Tensor& x, const Tensor& probs,
                             Tensor& grad_x, Tensor& grad_probs) {
  const int64_t n = probs.numel(), c = n == 0 ? 0 : x.numel() / n;
  check_host(probs, DType::Float32, n, "probs");
  assert_numel(grad_out, n * c, "grad_out");
  FloatIn g(grad_out);
  const float* p = probs.data<float>();
  if (grad_x.defined()) {
    assert_numel(grad_x, n * c, "grad_x");
    FloatOut gx(grad_x);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = 0; j < c; ++j) gx[r * c + j] = g[r * c + j] * p[r];
  }
  if (grad_probs.defined()) {
    check_host(grad_probs, DType::Float32, n, "grad_probs");
    FloatIn xin(x);
    for (int64_t r = 0; r < n; ++r) {
      double dot = 0;
      for (int64_t j = 0; j < c; ++j) dot += double(g[r * c + j]) * xin[r * c + j];
      grad_probs.data<float>()[r] = float(dot);
    }
  }
}

// ---- the grouped experts' biases ----------------------------------------------------------------------

namespace {
// Checks the shared arguments of moe_grouped_bias_*: rows of [N, c] in expert order, one [c] bias each.
int64_t check_grouped_bias(const Tensor& y, const std::vector<Tensor>& biases, const std::vector<int64_t>& rows,
                           const Tensor& probs) {
  MG_ASSERT(y.dim() == 2 && biases.size() == rows.size(), "moe_grouped_bias: y {} with {} biases for {} experts",
            y.str(), biases.size(), rows.size());
  const int64_t c = y.size(1);
  int64_t total = 0;
  for (size_t e = 0; e < rows.size(); ++e) {
    MG_ASSERT(rows[e] >= 0 && biases[e].defined() && biases[e].numel() == c && biases[e].dtype() == y.dtype(),
              "moe_grouped_bias: expert {}'s bias {} for rows of {}", e, biases[e].defined() ? biases[e].str() : "-",
              y.str());
    total += rows[e];
  }
  MG_ASSERT(total == y.size(0), "moe_grouped_bias: {} rows over the experts for {}", total, y.str());
  if (probs.defined()) check_host(probs, DType::Float32, total, "probs");
  return c;
}
}  // namespace

void moe_grouped_bias_forward(Context& ctx, Tensor& y, const std::vector<Tensor>& biases,
                              const std::vector<int64_t>& rows_per_expert, const Tensor& probs) {
  assert_float(y, "y");
  const int64_t c = check_grouped_bias(y, biases, rows_per_expert, probs);
  const float* p = probs.defined() ? probs.data<float>() : nullptr;
  FloatOut o(y, /*load=*/true);
  int64_t row = 0;
  for (size_t e = 0; e < biases.size(); ++e) {
    FloatIn b(biases[e]);
    for (int64_t r = row; r < row + rows_per_expert[e]; ++r) {
      const float s = p ? p[r] : 1.0f;
      for (int64_t j = 0; j < c; ++j) o[r * c + j] += s * b[j];
    }
    row += rows_per_expert[e];
  }
}

void moe_grouped_bias_backward(Context& ctx, const Tensor& grad_out, const std::vector<Tensor>& biases,
                               const std::vector<int64_t>& rows_per_expert, const Tensor& probs,
                               const std::vector<Tensor>& bias_grads, Tensor& grad_probs) {
  assert_float(grad_out, "grad_out");
  const int64_t c = check_grouped_bias(grad_out, biases, rows_per_expert, probs);
  MG_ASSERT(bias_grads.size() == biases.size(), "moe_grouped_bias_backward: {} gradients for {} biases",
            bias_grads.size(), biases.size());
  MG_ASSERT(!grad_probs.defined() || probs.defined(), "moe_grouped_bias_backward: grad_probs without probs");
  if (grad_probs.defined()) check_host(grad_probs, DType::Float32, grad_out.size(0), "grad_probs");
  const float* p = probs.defined() ? probs.data<float>() : nullptr;
  FloatIn g(grad_out);
  int64_t row = 0;
  for (size_t e = 0; e < biases.size(); ++e) {
    check_host(bias_grads[e], DType::Float32, c, "bias_grads");
    float* db = bias_grads[e].data<float>();
    FloatIn b(biases[e]);
    for (int64_t r = row; r < row + rows_per_expert[e]; ++r) {
      const float s = p ? p[r] : 1.0f;
      double dot = 0;
      for (int64_t j = 0; j < c; ++j) {
        db[j] += s * g[r * c + j];
        dot += double(g[r * c + j]) * b[j];
      }
      if (grad_probs.defined()) grad_probs.data<float>()[r] += float(dot);
    }
    row += rows_per_expert[e];
  }
}

}  // namespace megatron::cpu

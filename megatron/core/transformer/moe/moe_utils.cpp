#include "megatron/core/transformer/moe/moe_utils.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>

#include "megatron/kernels/moe_routing_rows.h"
#include "megatron/runtime/check.h"

namespace megatron::moe {

// The routing below is written once over the value type R: float for Megatron's fp32 router (the
// arithmetic the op library's kernels reproduce: fp32 values, fp64 sums), double for
// --moe-router-dtype fp64 (Note [fp64 router]).
namespace {
constexpr float kNormEps = 1e-20f;  // Megatron's denominator guard for normalised sigmoid scores

// Indices of the k largest of v (descending; ties to the lower index), over entries not masked.
template <typename R>
std::vector<int64_t> top_indices(const R* v, int64_t n, int k, const std::vector<bool>* allowed = nullptr) {
  std::vector<int64_t> idx;
  for (int64_t i = 0; i < n; ++i)
    if (!allowed || (*allowed)[size_t(i)]) idx.push_back(i);
  std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return v[a] > v[b]; });
  idx.resize(size_t(k));
  return idx;
}

// Megatron's group_limited_topk: the experts of the group_topk groups whose top (topk/group_topk)
// scores sum highest, then the top-k of those.
template <typename R>
std::vector<int64_t> select(const RouterConfig& c, const R* scores, int64_t e) {
  if (c.group_topk <= 0) return top_indices(scores, e, c.topk);
  const int64_t per_group = e / c.num_groups;
  std::vector<R> group_score(static_cast<size_t>(c.num_groups));
  for (int g = 0; g < c.num_groups; ++g) {
    std::vector<int64_t> best = top_indices(scores + g * per_group, per_group,
                                            c.group_score_topk > 0 ? c.group_score_topk : c.topk / c.group_topk);
    R sum = 0;
    for (int64_t i : best) sum += scores[g * per_group + i];
    group_score[size_t(g)] = sum;
  }
  std::vector<int64_t> groups = top_indices(group_score.data(), c.num_groups, c.group_topk);
  std::vector<bool> allowed(static_cast<size_t>(e), false);
  for (int64_t g : groups)
    for (int64_t i = 0; i < per_group; ++i) allowed[size_t(g * per_group + i)] = true;
  return top_indices(scores, e, c.topk, &allowed);
}

template <typename R>
void softmax_row(const R* x, int64_t n, R* out) {
  R m = -std::numeric_limits<R>::infinity();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(double(x[i]) - double(m));
  for (int64_t i = 0; i < n; ++i) out[i] = R(std::exp(double(x[i]) - double(m)) / sum);
}

template <typename R>
R sigmoid(R x) {
  return R(1.0 / (1.0 + std::exp(-double(x))));
}

// The load-balancing losses' scores of one token (compute_routing_scores_for_aux_loss).
template <typename R>
void aux_scores_row(const RouterConfig& c, const R* l, int64_t e, R* out) {
  if (c.score_function == "softmax") return softmax_row(l, e, out);
  double sum = 0;
  for (int64_t i = 0; i < e; ++i) sum += out[i] = sigmoid(l[i]);
  for (int64_t i = 0; i < e; ++i) out[i] = R(out[i] / (sum + kNormEps));
}

bool local_aux_on(const RouterConfig& c) { return c.aux_loss_coeff > 0 || c.seq_aux_loss_coeff > 0; }
bool aux_on(const RouterConfig& c) { return local_aux_on(c) || c.global_aux_loss_coeff > 0; }

// Megatron's moe_utils.sinkhorn on exp(logits) [T, E] (Note [Sinkhorn routing]).
template <typename R>
std::vector<R> sinkhorn(const std::vector<R>& logits, int64_t t_count, int64_t e, double tol = 1e-4) {
  std::vector<double> cost(logits.size());
  for (size_t i = 0; i < cost.size(); ++i) cost[i] = std::exp(double(logits[i]));
  std::vector<double> d0(static_cast<size_t>(t_count), 1.0), d1(static_cast<size_t>(e), 1.0), d1_old = d1;
  const double eps = 1e-8;
  for (int iter = 0; iter < 10000; ++iter) {
    for (int64_t t = 0; t < t_count; ++t) {
      double s = 0;
      for (int64_t x = 0; x < e; ++x) s += d1[size_t(x)] * cost[size_t(t * e + x)];
      d0[size_t(t)] = 1.0 / double(t_count) / (s + eps);
    }
    for (int64_t x = 0; x < e; ++x) {
      double s = 0;
      for (int64_t t = 0; t < t_count; ++t) s += d0[size_t(t)] * cost[size_t(t * e + x)];
      d1[size_t(x)] = 1.0 / double(e) / (s + eps);
    }
    double err = 0;
    for (int64_t x = 0; x < e; ++x) err += std::fabs(d1_old[size_t(x)] - d1[size_t(x)]);
    d1_old = d1;
    if (err / double(e) <= tol) break;
  }
  std::vector<R> out(logits.size());
  for (int64_t t = 0; t < t_count; ++t)
    for (int64_t x = 0; x < e; ++x) out[size_t(t * e + x)] = R(d1[size_t(x)] * cost[size_t(t * e + x)] * d0[size_t(t)]);
  return out;
}

// Sinkhorn's probabilities are those of another score function (Note [Sinkhorn routing]).
RouterConfig probability_config(const RouterConfig& c) {
  if (!c.sinkhorn) return c;
  RouterConfig p = c;
  p.score_function = c.topk > 1 ? "softmax" : "sigmoid";
  p.pre_softmax = c.topk > 1;
  return p;
}

// switch_load_balancing_loss_func's scale: coeff · E / (k · N²).
double switch_scale(int64_t e, int k, double total, float coeff) {
  return double(e) * coeff / (double(k) * total * total);
}

template <typename R>
RoutingOutput route(const RouterConfig& c, const std::vector<R>& l, const Tensor& expert_bias, int64_t t_count,
                    int64_t seq_length, int64_t micro_batch, RoutingSaved& saved, const CountReduction* counts,
                    bool training) {
  c.validate();
  const int64_t e = c.num_experts, k = c.topk;
  MG_CHECK(int64_t(l.size()) == t_count * e, "router logits of {} values for {} tokens x {} experts", l.size(), t_count,
           e);
  MG_CHECK(seq_length * micro_batch == t_count, "router logits of {} tokens for a sequence of {} × micro-batch {}",
           t_count, seq_length, micro_batch);
  MG_CHECK(!c.expert_bias || (expert_bias.defined() && expert_bias.numel() == e),
           "the expert bias must hold one value per expert ({})", e);
  const std::vector<float> bias = c.expert_bias ? expert_bias.to(Device::cpu()).to_floats() : std::vector<float>();
  std::vector<R> probs(static_cast<size_t>(t_count * e), R(0)), row(static_cast<size_t>(e)),
      routing(static_cast<size_t>(e));
  saved.top.assign(size_t(t_count * k), 0);
  const RouterConfig pc = probability_config(c);
  const std::vector<R> balanced = c.sinkhorn && training ? sinkhorn(l, t_count, e) : std::vector<R>();
  for (int64_t t = 0; t < t_count; ++t) {
    const R* lt = &l[size_t(t * e)];
    R* pt = &probs[size_t(t * e)];
    std::vector<int64_t> top;
    if (c.sinkhorn) {  // Note [Sinkhorn routing]
      if (pc.score_function == "softmax") {
        softmax_row(lt, e, row.data());
      } else {
        for (int64_t i = 0; i < e; ++i) row[size_t(i)] = sigmoid(lt[i]);
      }
      top = top_indices(training ? &balanced[size_t(t * e)] : row.data(), e, int(k));
      for (int64_t i : top) pt[i] = row[size_t(i)];
    } else if (c.score_function == "softmax" && !c.pre_softmax) {  // top-k of the logits, softmax over them
      top = select(c, lt, e);
      std::vector<R> sel(static_cast<size_t>(k)), p(static_cast<size_t>(k));
      for (int64_t j = 0; j < k; ++j) sel[size_t(j)] = lt[top[size_t(j)]];
      softmax_row(sel.data(), k, p.data());
      for (int64_t j = 0; j < k; ++j) pt[top[size_t(j)]] = p[size_t(j)];
    } else if (c.score_function == "softmax") {  // softmax over every expert, then top-k
      softmax_row(lt, e, row.data());
      top = select(c, row.data(), e);
      for (int64_t i : top) pt[i] = row[size_t(i)];
    } else {  // sigmoid; the bias steers the choice only
      for (int64_t i = 0; i < e; ++i) row[size_t(i)] = sigmoid(lt[i]);
      for (int64_t i = 0; i < e; ++i) routing[size_t(i)] = row[size_t(i)] + (bias.empty() ? R(0) : R(bias[size_t(i)]));
      top = select(c, bias.empty() ? row.data() : routing.data(), e);
      R sum = 0;
      for (int64_t i : top) sum += row[size_t(i)];
      for (int64_t i : top) pt[i] = k > 1 ? R(row[size_t(i)] / (sum + R(kNormEps))) : row[size_t(i)];
    }
    if (c.topk_scaling_factor > 0)
      for (int64_t i : top) pt[i] *= R(c.topk_scaling_factor);
    std::copy(top.begin(), top.end(), saved.top.begin() + t * k);
  }
  std::vector<uint8_t> map(static_cast<size_t>(t_count * e), 0);
  for (int64_t t = 0; t < t_count; ++t)
    for (int64_t j = 0; j < k; ++j) map[size_t(t * e + saved.top[size_t(t * k + j)])] = 1;

  // Token dropping (apply_router_token_dropping): each expert keeps its `capacity` tokens of highest
  // probability (or its first routed tokens, by position); with padding, exactly `capacity` tokens.
  if (c.capacity_factor) {
    const int64_t capacity = expert_capacity(t_count * k, int(e), *c.capacity_factor);
    if (capacity <= t_count) {
      std::vector<uint8_t> keep(static_cast<size_t>(t_count * e), 0);
      std::vector<R> column(static_cast<size_t>(t_count));
      for (int64_t x = 0; x < e; ++x) {
        for (int64_t t = 0; t < t_count; ++t)
          column[size_t(t)] = c.drop_policy == "probs" ? probs[size_t(t * e + x)] : R(map[size_t(t * e + x)]);
        for (int64_t t : top_indices(column.data(), t_count, int(capacity))) keep[size_t(t * e + x)] = 1;
      }
      for (size_t i = 0; i < map.size(); ++i) {
        map[i] = c.pad_to_capacity ? keep[i] : uint8_t(map[i] & keep[i]);
        if (!map[i]) probs[i] = R(0);
      }
    }
  }

  RoutingOutput out;
  std::vector<float> probs32(probs.begin(), probs.end());
  out.probs = Tensor::from_floats(probs32, {t_count, e});
  std::vector<int64_t> map_ints(map.begin(), map.end());
  out.routing_map = Tensor::from_ints(map_ints, {t_count, e}, DType::UInt8);
  std::vector<float> tokens(static_cast<size_t>(e), 0.0f);
  for (int64_t t = 0; t < t_count; ++t)
    for (int64_t x = 0; x < e; ++x) tokens[size_t(x)] += float(map[size_t(t * e + x)]);
  out.tokens_per_expert = Tensor::from_floats(tokens, {e});

  // z loss (z_loss_func): coeff · mean over tokens of logsumexp(logits)².
  if (c.z_loss_coeff > 0) {
    double sum = 0;
    for (int64_t t = 0; t < t_count; ++t) {
      const R* lt = &l[size_t(t * e)];
      const R m = *std::max_element(lt, lt + e);
      double s = 0;
      for (int64_t i = 0; i < e; ++i) s += std::exp(double(lt[i]) - double(m));
      const double lse = double(m) + std::log(s);
      sum += lse * lse;
    }
    out.z_loss = sum / double(t_count) * c.z_loss_coeff;
  }

  // Load balancing (switch_load_balancing_loss_func over the aux scores and their plain top-k).
  saved.aux_scores.clear();
  saved.aux_map.clear();
  saved.global_tokens.clear();
  if (aux_on(c)) {
    std::vector<R> scores(static_cast<size_t>(t_count * e));
    std::vector<uint8_t> amap(static_cast<size_t>(t_count * e), 0);
    for (int64_t t = 0; t < t_count; ++t) {
      aux_scores_row(c, &l[size_t(t * e)], e, &scores[size_t(t * e)]);
      for (int64_t i : top_indices(&scores[size_t(t * e)], e, int(k))) amap[size_t(t * e + i)] = 1;
    }
    saved.aux_scores.assign(scores.begin(), scores.end());
    saved.aux_map = amap;
    // The token counts are summed over the tokens' group (Megatron's tp × cp: the ranks that split
    // one sequence), the scores stay local: each rank's loss is its share of the group's loss.
    const int group = counts ? counts->group_size : 1;
    auto reduce = [&](std::vector<float> v) { return counts && counts->sum ? counts->sum(std::move(v)) : v; };
    if (c.aux_loss_coeff > 0) {
      std::vector<float> n(static_cast<size_t>(e), 0.0f);
      for (int64_t t = 0; t < t_count; ++t)
        for (int64_t x = 0; x < e; ++x) n[size_t(x)] += float(amap[size_t(t * e + x)]);
      saved.aux_counts = reduce(std::move(n));
      saved.aux_total_tokens = double(t_count) * group;
      const double scale = switch_scale(e, int(k), saved.aux_total_tokens, c.aux_loss_coeff);
      double loss = 0;
      for (int64_t x = 0; x < e; ++x) {
        double p = 0;
        for (int64_t t = 0; t < t_count; ++t) p += scores[size_t(t * e + x)];
        loss += p * saved.aux_counts[size_t(x)];
      }
      out.aux_loss = loss * scale;
    }
    if (c.seq_aux_loss_coeff > 0) {  // per sequence b: its tokens' scores and counts, averaged over b
      std::vector<float> n(static_cast<size_t>(micro_batch * e), 0.0f);
      for (int64_t s = 0; s < seq_length; ++s)
        for (int64_t b = 0; b < micro_batch; ++b)
          for (int64_t x = 0; x < e; ++x) n[size_t(b * e + x)] += float(amap[size_t((s * micro_batch + b) * e + x)]);
      saved.seq_aux_counts = reduce(std::move(n));
      saved.seq_aux_total_tokens = double(seq_length) * group;
      const double sl = saved.seq_aux_total_tokens;
      const double scale = switch_scale(e, int(k), sl, c.seq_aux_loss_coeff) / double(micro_batch);
      double loss = 0;
      for (int64_t b = 0; b < micro_batch; ++b)
        for (int64_t x = 0; x < e; ++x) {
          double p = 0;
          for (int64_t s = 0; s < seq_length; ++s) p += scores[size_t((s * micro_batch + b) * e + x)];
          loss += p * saved.seq_aux_counts[size_t(b * e + x)];
        }
      out.seq_aux_loss = loss * scale;
    }
    if (c.global_aux_loss_coeff > 0) {  // Note [Global aux loss] (router.h)
      std::vector<float> n(static_cast<size_t>(e), 0.0f);
      for (int64_t t = 0; t < t_count; ++t)
        for (int64_t x = 0; x < e; ++x) n[size_t(x)] += float(amap[size_t(t * e + x)]);
      saved.global_tokens = counts && counts->global_average ? counts->global_average(std::move(n)) : n;
      MG_CHECK(int64_t(saved.global_tokens.size()) == e, "global aux loss: {} token counts for {} experts",
               saved.global_tokens.size(), e);
      saved.global_total_tokens = double(t_count) * (counts ? counts->global_group_size : 1);
      out.global_aux_loss =
          global_aux_loss(saved.aux_scores, saved.global_tokens, saved.global_total_tokens, int(k), c.global_aux_loss_coeff);
    }
  }
  saved.logits.assign(l.begin(), l.end());
  saved.routing_map = map;
  saved.seq_length = seq_length;
  saved.micro_batch = micro_batch;
  saved.fp64 = std::is_same_v<R, double>;
  return out;
}

template <typename R>
std::vector<R> route_backward(const RouterConfig& config, const Tensor& grad_probs, const RoutingSaved& saved,
                              float aux_loss_scale) {
  const RouterConfig c = probability_config(config);
  const int64_t e = c.num_experts, k = c.topk;
  const int64_t t_count = int64_t(saved.logits.size()) / std::max<int64_t>(e, 1);
  MG_CHECK(grad_probs.numel() == t_count * e, "grad_probs {} for router logits [{}, {}]", shape_str(grad_probs.shape()),
           t_count, e);
  constexpr bool kFp64 = std::is_same_v<R, double>;
  MG_CHECK(saved.fp64 == kFp64, "router backward in {} of a forward in {}", kFp64 ? "fp64" : "fp32",
           saved.fp64 ? "fp64" : "fp32");
  const std::vector<R> l(saved.logits.begin(), saved.logits.end());  // exact: the forward's values
  const std::vector<float> g = grad_probs.to(Device::cpu()).to_floats();
  const std::vector<uint8_t>& map = saved.routing_map;
  std::vector<R> grad(static_cast<size_t>(t_count * e), R(0)), row(static_cast<size_t>(e));
  const R sf = c.topk_scaling_factor > 0 ? R(c.topk_scaling_factor) : R(1);
  for (int64_t t = 0; t < t_count; ++t) {
    const R* lt = &l[size_t(t * e)];
    R* gt = &grad[size_t(t * e)];
    const int64_t* top = &saved.top[size_t(t * k)];
    // The gradient of the kept probabilities (dropped and padded slots carry none), unscaled.
    std::vector<double> gsel(static_cast<size_t>(k));
    for (int64_t j = 0; j < k; ++j) {
      const size_t i = size_t(t * e + top[j]);
      gsel[size_t(j)] = map[i] ? double(g[i]) * double(sf) : 0.0;
    }
    if (c.score_function == "softmax" && !c.pre_softmax) {  // p = softmax(l[top])
      std::vector<R> sel(static_cast<size_t>(k)), p(static_cast<size_t>(k));
      for (int64_t j = 0; j < k; ++j) sel[size_t(j)] = lt[top[j]];
      softmax_row(sel.data(), k, p.data());
      double dot = 0;
      for (int64_t j = 0; j < k; ++j) dot += gsel[size_t(j)] * p[size_t(j)];
      for (int64_t j = 0; j < k; ++j) gt[top[j]] += R(p[size_t(j)] * (gsel[size_t(j)] - dot));
    } else if (c.score_function == "softmax") {  // p = softmax(l)[top]
      softmax_row(lt, e, row.data());
      double dot = 0;
      for (int64_t j = 0; j < k; ++j) dot += gsel[size_t(j)] * row[size_t(top[j])];
      std::vector<double> gs(static_cast<size_t>(e), 0.0);
      for (int64_t j = 0; j < k; ++j) gs[size_t(top[j])] = gsel[size_t(j)];
      for (int64_t i = 0; i < e; ++i) gt[i] += R(row[size_t(i)] * (gs[size_t(i)] - dot));
    } else {  // p = σ(l)[top] / (Σ σ(l)[top] + eps) (k > 1), σ(l)[top] (k = 1)
      std::vector<double> s(static_cast<size_t>(k)), gs(static_cast<size_t>(k));
      double sum = 0, dot = 0;
      for (int64_t j = 0; j < k; ++j) sum += s[size_t(j)] = sigmoid(lt[top[j]]);
      for (int64_t j = 0; j < k; ++j) dot += gsel[size_t(j)] * s[size_t(j)];
      const double den = sum + kNormEps;
      for (int64_t j = 0; j < k; ++j)
        gs[size_t(j)] = k > 1 ? (gsel[size_t(j)] * den - dot) / (den * den) : gsel[size_t(j)];
      for (int64_t j = 0; j < k; ++j) gt[top[j]] += R(gs[size_t(j)] * s[size_t(j)] * (1.0 - s[size_t(j)]));
    }
    // z loss: coeff · mean lse² -> 2 · coeff · lse / T · softmax(l).
    if (c.z_loss_coeff > 0) {
      softmax_row(lt, e, row.data());
      const R m = *std::max_element(lt, lt + e);
      double s = 0;
      for (int64_t i = 0; i < e; ++i) s += std::exp(double(lt[i]) - double(m));
      const double lse = double(m) + std::log(s), f = 2.0 * c.z_loss_coeff * lse / double(t_count) * aux_loss_scale;
      for (int64_t i = 0; i < e; ++i) gt[i] += R(f * row[size_t(i)]);
    }
  }
  if (aux_on(c)) {
    // d(loss)/d(aux score [t, x]) = count of expert x (over the batch, the token's sequence, or the
    // global count) · scale.
    const std::vector<R> scores(saved.aux_scores.begin(), saved.aux_scores.end());
    const int64_t sl = saved.seq_length, mb = saved.micro_batch;
    std::vector<double> gscore(static_cast<size_t>(t_count * e), 0.0);
    if (c.aux_loss_coeff > 0) {
      const double scale = switch_scale(e, int(k), saved.aux_total_tokens, c.aux_loss_coeff);
      for (int64_t x = 0; x < e; ++x) {
        const double n = saved.aux_counts[size_t(x)];
        for (int64_t t = 0; t < t_count; ++t) gscore[size_t(t * e + x)] += n * scale * aux_loss_scale;
      }
    }
    if (c.seq_aux_loss_coeff > 0) {
      const double scale = switch_scale(e, int(k), saved.seq_aux_total_tokens, c.seq_aux_loss_coeff) / double(mb);
      for (int64_t b = 0; b < mb; ++b)
        for (int64_t x = 0; x < e; ++x) {
          const double n = saved.seq_aux_counts[size_t(b * e + x)];
          for (int64_t s = 0; s < sl; ++s) gscore[size_t((s * mb + b) * e + x)] += n * scale * aux_loss_scale;
        }
    }
    if (c.global_aux_loss_coeff > 0 && !saved.global_tokens.empty()) {
      const double scale = switch_scale(e, int(k), saved.global_total_tokens, c.global_aux_loss_coeff);
      for (int64_t x = 0; x < e; ++x) {
        const double n = saved.global_tokens[size_t(x)];
        for (int64_t t = 0; t < t_count; ++t) gscore[size_t(t * e + x)] += n * scale * aux_loss_scale;
      }
    }
    for (int64_t t = 0; t < t_count; ++t) {
      const R* lt = &l[size_t(t * e)];
      const R* st = &scores[size_t(t * e)];
      const double* gst = &gscore[size_t(t * e)];
      R* gt = &grad[size_t(t * e)];
      if (c.score_function == "softmax") {
        double dot = 0;
        for (int64_t i = 0; i < e; ++i) dot += gst[i] * st[i];
        for (int64_t i = 0; i < e; ++i) gt[i] += R(st[i] * (gst[i] - dot));
      } else {  // st = σ / (Σσ + eps)
        double sum = 0, dot = 0;
        for (int64_t i = 0; i < e; ++i) sum += row[size_t(i)] = sigmoid(lt[i]);
        for (int64_t i = 0; i < e; ++i) dot += gst[i] * row[size_t(i)];
        const double den = sum + kNormEps;
        for (int64_t i = 0; i < e; ++i) {
          const double gsig = (gst[i] * den - dot) / (den * den);
          gt[i] += R(gsig * row[size_t(i)] * (1.0 - row[size_t(i)]));
        }
      }
    }
  }
  return grad;
}
}  // namespace

void RouterConfig::validate() const {
  MG_CHECK(num_experts > 0, "the router needs --num-experts > 0 (got {})", num_experts);
  MG_CHECK(topk >= 1 && topk <= num_experts, "--moe-router-topk {} must be between 1 and --num-experts {}", topk,
           num_experts);
  MG_CHECK(score_function == "softmax" || score_function == "sigmoid",
           "--moe-router-score-function must be softmax or sigmoid (got '{}')", score_function);
  MG_CHECK(!pre_softmax || score_function == "softmax", "--moe-router-pre-softmax needs the softmax score function");
  if (group_topk > 0) {
    MG_CHECK(num_groups > 0 && num_experts % num_groups == 0 && topk % group_topk == 0 && group_topk <= num_groups,
             "group-limited routing needs --moe-router-num-groups dividing --num-experts ({}) and "
             "--moe-router-group-topk ({}) dividing --moe-router-topk ({}) and at most the groups ({})",
             num_experts, group_topk, topk, num_groups);
    MG_CHECK(group_score_topk >= 0 && group_score_topk <= num_experts / num_groups,
             "--moe-router-group-score-topk {} must be at most the experts of a group ({})", group_score_topk,
             num_experts / num_groups);
  }
  MG_CHECK(!expert_bias || score_function == "sigmoid",
           "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (as Megatron)");
  MG_CHECK(drop_policy == "probs" || drop_policy == "position",
           "--moe-token-drop-policy must be probs or position (got '{}')", drop_policy);
  MG_CHECK(!pad_to_capacity || capacity_factor.has_value(),
           "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor");
  MG_CHECK(aux_loss_coeff >= 0 && seq_aux_loss_coeff >= 0 && global_aux_loss_coeff >= 0 && z_loss_coeff >= 0,
           "the MoE loss coefficients must be >= 0 (--moe-aux-loss-coeff, --moe-z-loss-coeff)");
  MG_CHECK(input_jitter_eps >= 0 && input_jitter_eps < 1,
           "--moe-input-jitter-eps must be in [0, 1) (got {}): the router input is scaled by U(1 - eps, 1 + eps)",
           input_jitter_eps);
  if (sinkhorn) {
    MG_CHECK(aux_loss_coeff == 0 && seq_aux_loss_coeff == 0 && global_aux_loss_coeff == 0,
             "sinkhorn routing takes no aux loss (as Megatron): leave --moe-aux-loss-coeff at 0");
    MG_CHECK(!pre_softmax && group_topk == 0 && topk_scaling_factor == 0 && !expert_bias,
             "sinkhorn routing chooses its own scores: drop --moe-router-pre-softmax, the group-limited routing, "
             "--moe-router-topk-scaling-factor and --moe-router-enable-expert-bias (Megatron ignores them)");
  }
}

int64_t expert_capacity(int64_t num_tokens, int num_experts, float capacity_factor) {
  return int64_t(std::ceil(double(num_tokens) / double(num_experts) * double(capacity_factor)));
}

Tensor pad_routing_map(const Tensor& routing_map, int64_t multiple) {
  MG_CHECK(routing_map.defined() && routing_map.dim() == 2 && routing_map.dtype() == DType::UInt8 && multiple > 0,
           "pad_routing_map: the map must be uint8 [tokens, experts], got {}",
           routing_map.defined() ? routing_map.str() : "undefined");
  Tensor map = routing_map.to(Device::cpu()).clone();
  const int64_t t_count = map.size(0), e = map.size(1);
  uint8_t* m = map.data<uint8_t>();
  for (int64_t x = 0; x < e; ++x) {
    int64_t count = 0;
    for (int64_t t = 0; t < t_count; ++t) count += m[t * e + x] != 0;
    int64_t to_pad = (multiple - count % multiple) % multiple;
    for (int64_t t = 0; t < t_count && to_pad > 0; ++t) {
      if (m[t * e + x] == 0) {
        m[t * e + x] = 1;
        --to_pad;
      }
    }
  }
  return map.to(routing_map.device());
}

RoutingOutput routing_forward(const RouterConfig& c, const Tensor& logits_in, const Tensor& expert_bias,
                              int64_t seq_length, int64_t micro_batch, RoutingSaved& saved,
                              const CountReduction* counts, bool training) {
  MG_CHECK(logits_in.dim() == 2 && logits_in.size(1) == c.num_experts, "router logits {} for {} experts",
           shape_str(logits_in.shape()), c.num_experts);
  const std::vector<float> l = logits_in.to(Device::cpu()).to(DType::Float32).to_floats();
  if (c.fp64) {
    return route(c, std::vector<double>(l.begin(), l.end()), expert_bias, logits_in.size(0), seq_length, micro_batch,
                 saved, counts, training);
  }
  return route(c, l, expert_bias, logits_in.size(0), seq_length, micro_batch, saved, counts, training);
}

RoutingOutput routing_forward_fp64(const RouterConfig& c, const std::vector<double>& logits, const Tensor& expert_bias,
                                   int64_t seq_length, int64_t micro_batch, RoutingSaved& saved,
                                   const CountReduction* counts, bool training) {
  return route(c, logits, expert_bias, seq_length * micro_batch, seq_length, micro_batch, saved, counts, training);
}

Tensor routing_backward(const RouterConfig& config, const Tensor& grad_probs, const RoutingSaved& saved,
                        float aux_loss_scale) {
  const int64_t e = config.num_experts, t_count = int64_t(saved.logits.size()) / std::max<int64_t>(e, 1);
  if (saved.fp64) {
    const std::vector<double> g = route_backward<double>(config, grad_probs, saved, aux_loss_scale);
    return Tensor::from_floats(std::vector<float>(g.begin(), g.end()), {t_count, e});
  }
  return Tensor::from_floats(route_backward<float>(config, grad_probs, saved, aux_loss_scale), {t_count, e});
}

std::vector<double> routing_backward_fp64(const RouterConfig& config, const Tensor& grad_probs,
                                          const RoutingSaved& saved, float aux_loss_scale) {
  return route_backward<double>(config, grad_probs, saved, aux_loss_scale);
}

double global_aux_loss(const std::vector<double>& aux_scores, const std::vector<float>& tokens, double total_tokens,
                       int topk, float coeff) {
  const int64_t e = int64_t(tokens.size());
  MG_CHECK(e > 0 && int64_t(aux_scores.size()) % e == 0, "global aux loss: {} scores for {} experts", aux_scores.size(),
           e);
  const int64_t t_count = int64_t(aux_scores.size()) / e;
  double loss = 0;
  for (int64_t x = 0; x < e; ++x) {
    double p = 0;
    for (int64_t t = 0; t < t_count; ++t) p += aux_scores[size_t(t * e + x)];
    loss += p * tokens[size_t(x)];
  }
  return loss * switch_scale(e, topk, total_tokens, coeff);
}

Tensor input_jitter(const Tensor& x, float eps, uint64_t seed, uint64_t offset, int64_t micro_batch,
                    int64_t seq_offset) {
  MG_CHECK(x.dim() == 2 && micro_batch > 0 && x.size(0) % micro_batch == 0,
           "input jitter: x {} for micro-batch {}", shape_str(x.shape()), micro_batch);
  const int64_t t_count = x.size(0), h = x.size(1);
  std::vector<float> v = x.to(Device::cpu()).to_floats();
  for (int64_t t = 0; t < t_count; ++t) {
    const int64_t row = (seq_offset + t / micro_batch) * micro_batch + t % micro_batch;
    for (int64_t j = 0; j < h; ++j) {
      v[size_t(t * h + j)] *= moe_rows::jitter_factor(eps, seed, offset, uint64_t(row * h + j));
    }
  }
  return Tensor::from_floats(v, {t_count, h});
}

Tensor updated_expert_bias(const Tensor& tokens_per_expert, const Tensor& expert_bias, float update_rate) {
  const std::vector<float> n = tokens_per_expert.to_floats(), b = expert_bias.to_floats();
  MG_CHECK(n.size() == b.size(), "tokens per expert ({}) and expert bias ({}) differ in length", n.size(), b.size());
  float mean = 0;
  for (float x : n) mean += x;
  mean /= float(n.size());
  std::vector<float> out(b.size());
  for (size_t i = 0; i < b.size(); ++i) {
    const float off = mean - n[i];
    out[i] = b[i] + (off > 0 ? 1.0f : off < 0 ? -1.0f : 0.0f) * update_rate;
  }
  return Tensor::from_floats(out, {int64_t(out.size())});
}

// ---- token permutation (Note [Permuted order]) ----------------------------------------------------

Permutation make_permutation(const Tensor& routing_map, int64_t capacity) {
  MG_CHECK(routing_map.dim() == 2, "routing map {} must be [tokens, experts]", shape_str(routing_map.shape()));
  const int64_t t_count = routing_map.size(0), e = routing_map.size(1);
  MG_CHECK(capacity >= 0 && capacity <= t_count, "expert capacity {} for {} tokens", capacity, t_count);
  const std::vector<int64_t> map = routing_map.to_ints();
  Permutation p;
  p.num_tokens = t_count;
  p.tokens_per_expert.assign(size_t(e), 0);
  for (int64_t x = 0; x < e; ++x) {
    int64_t rows = 0;
    for (int pass = 0; pass < (capacity > 0 ? 2 : 1); ++pass) {  // routed tokens, then (padding) the others
      for (int64_t t = 0; t < t_count && (capacity == 0 || rows < capacity); ++t) {
        if ((map[size_t(t * e + x)] != 0) != (pass == 0)) continue;
        p.sorted_indices.push_back(t);
        p.row_expert.push_back(x);
        ++rows;
      }
    }
    p.tokens_per_expert[size_t(x)] = rows;
  }
  return p;
}

Tensor permute_forward(const Tensor& tokens, const Permutation& perm) {
  MG_CHECK(tokens.dim() == 2 && tokens.size(0) == perm.num_tokens, "tokens {} for a permutation of {} tokens",
           shape_str(tokens.shape()), perm.num_tokens);
  const int64_t h = tokens.size(1), n = int64_t(perm.sorted_indices.size());
  const std::vector<float> x = tokens.to_floats();
  std::vector<float> out(size_t(n * h));
  for (int64_t r = 0; r < n; ++r)
    std::copy_n(x.begin() + perm.sorted_indices[size_t(r)] * h, h, out.begin() + r * h);
  return Tensor::from_floats(out, {n, h}, tokens.dtype());
}

Tensor permute_backward(const Tensor& grad_permuted, const Permutation& perm) {
  const int64_t h = grad_permuted.size(1), n = int64_t(perm.sorted_indices.size());
  MG_CHECK(grad_permuted.size(0) == n, "gradient of {} permuted rows for {}", grad_permuted.size(0), n);
  const std::vector<float> g = grad_permuted.to_floats();
  std::vector<float> out(size_t(perm.num_tokens * h), 0.0f);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < h; ++j) out[size_t(perm.sorted_indices[size_t(r)] * h + j)] += g[size_t(r * h + j)];
  return Tensor::from_floats(out, {perm.num_tokens, h}, grad_permuted.dtype());
}

Tensor permute_probs(const Tensor& probs, const Permutation& perm) {
  const int64_t e = probs.size(1), n = int64_t(perm.sorted_indices.size());
  const std::vector<float> p = probs.to_floats();
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r)
    out[size_t(r)] = p[size_t(perm.sorted_indices[size_t(r)] * e + perm.row_expert[size_t(r)])];
  return Tensor::from_floats(out, {n});
}

Tensor permute_probs_backward(const Tensor& grad_probs_permuted, const Permutation& perm, int64_t num_experts) {
  const std::vector<float> g = grad_probs_permuted.to_floats();
  std::vector<float> out(size_t(perm.num_tokens * num_experts), 0.0f);
  for (size_t r = 0; r < g.size(); ++r)
    out[size_t(perm.sorted_indices[r] * num_experts + perm.row_expert[r])] += g[r];
  return Tensor::from_floats(out, {perm.num_tokens, num_experts});
}

Tensor unpermute_forward(const Tensor& permuted, const Tensor& probs_permuted, const Permutation& perm) {
  const int64_t h = permuted.size(1), n = int64_t(perm.sorted_indices.size());
  MG_CHECK(permuted.size(0) == n, "{} permuted rows for a permutation of {}", permuted.size(0), n);
  const std::vector<float> x = permuted.to_floats();
  const std::vector<float> w = probs_permuted.defined() ? probs_permuted.to_floats() : std::vector<float>(size_t(n), 1.0f);
  std::vector<float> out(size_t(perm.num_tokens * h), 0.0f);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < h; ++j)
      out[size_t(perm.sorted_indices[size_t(r)] * h + j)] += w[size_t(r)] * x[size_t(r * h + j)];
  return Tensor::from_floats(out, {perm.num_tokens, h}, permuted.dtype());
}

void unpermute_backward(const Tensor& grad_out, const Tensor& permuted, const Tensor& probs_permuted,
                        const Permutation& perm, Tensor& grad_permuted, Tensor& grad_probs) {
  const int64_t h = grad_out.size(1), n = int64_t(perm.sorted_indices.size());
  const std::vector<float> g = grad_out.to_floats(), x = permuted.to_floats();
  const bool weighted = probs_permuted.defined();
  const std::vector<float> w = weighted ? probs_permuted.to_floats() : std::vector<float>(size_t(n), 1.0f);
  std::vector<float> gx(size_t(n * h)), gw(size_t(n), 0.0f);
  for (int64_t r = 0; r < n; ++r) {
    const float* gt = &g[size_t(perm.sorted_indices[size_t(r)] * h)];
    double dot = 0;
    for (int64_t j = 0; j < h; ++j) {
      gx[size_t(r * h + j)] = w[size_t(r)] * gt[j];
      dot += double(gt[j]) * x[size_t(r * h + j)];
    }
    gw[size_t(r)] = float(dot);
  }
  grad_permuted = Tensor::from_floats(gx, {n, h}, permuted.dtype());
  grad_probs = weighted ? Tensor::from_floats(gw, {n}) : Tensor();
}

}  // namespace megatron::moe

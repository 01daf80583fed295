#include "megatron/core/transformer/multi_latent_attention.h"

#include <cmath>

#include "megatron/core/models/common/embeddings/rotary_pos_embedding.h"
#include "megatron/core/tensor_parallel/mappings.h"
#include "megatron/core/tensor_parallel/random.h"
#include "megatron/kernels/column_ops.h"
#include "megatron/kernels/ops.h"

namespace megatron {

namespace {
NormKind norm_kind(const TransformerConfig& c) { return c.use_rmsnorm() ? NormKind::RMSNorm : NormKind::LayerNorm; }

// Megatron's MLA softmax scale: mscale(rotary_scaling_factor, mscale_all_dim)² / sqrt(qk + pe).
float mla_softmax_scale(const TransformerConfig& c) {
  const double m = yarn_get_mscale(c.yarn_rotary_scaling_factor, c.yarn_mscale_all_dim);
  return float(m * m / std::sqrt(double(c.qk_head_dim + c.qk_pos_emb_head_dim)));
}

// A duplicated (not tensor-parallel) linear layer of Note [MLA tensor parallelism]: the same weight on
// every rank, its gradient a partial sum over the sequence shards under --sequence-parallel.
Linear duplicated_linear(ParamAndGradBuffer& params, const std::string& name, int64_t in, int64_t out,
                         const TransformerConfig& c, const ProcessGroupCollection& pg) {
  Linear l(params, name, in, out, /*bias=*/false, ParamInit::Normal);
  Parameter* w = params.find(name + ".weight");
  MG_ASSERT(w, "{}.weight was not registered", name);
  const bool tp = group_size(pg.tp) > 1;
  w->tp_duplicate = tp;
  w->sequence_parallel = tp && c.sequence_parallel;
  return l;
}

AttnMask mask_of(const AttentionInputs& in) { return in.packed ? in.packed->mask() : AttnMask::causal(); }

// Rows [N, pe] (or [N·n, pe]) as the [s, b, heads, pe] the RoPE ops take.
Tensor as_heads(const Tensor& t, int64_t s, int64_t b, int64_t pe) { return t.view({s, b, -1, pe}); }
}  // namespace

MLASelfAttention::MLASelfAttention(const TransformerConfig& config, const MixerSpec& spec, ParamAndGradBuffer& params,
                                   const std::string& prefix, const ProcessGroupCollection& pg)
    : n_(config.num_attention_heads / group_size(pg.tp)),
      qk_(config.qk_head_dim),
      pe_(config.qk_pos_emb_head_dim),
      dv_(config.v_head_dim),
      q_lora_rank_(config.q_lora_rank),
      kv_lora_rank_(config.kv_lora_rank),
      softmax_scale_(mla_softmax_scale(config)),
      dropout_p_(config.attention_dropout),
      rope_scale_(rotary_attention_scale(config)),
      sequence_parallel_(group_size(pg.tp) > 1 && config.sequence_parallel),
      tp_(multi_rank(pg.tp)),
      linear_kv_down_proj_(duplicated_linear(params, prefix + ".linear_kv_down_proj", config.hidden_size,
                                             config.kv_lora_rank + config.qk_pos_emb_head_dim, config, pg)),
      linear_kv_up_proj_(params, prefix + ".linear_kv_up_proj", config.kv_lora_rank,
                         int64_t(config.num_attention_heads) * (config.qk_head_dim + config.v_head_dim),
                         /*bias=*/false, ParamInit::Normal, ParallelMode::Column, pg.tp, config.sequence_parallel),
      linear_proj_(params, prefix + ".linear_proj", int64_t(config.num_attention_heads) * config.v_head_dim,
                   config.hidden_size, config.add_bias_linear, ParamInit::ScaledNormal, ParallelMode::Row, pg.tp,
                   config.sequence_parallel) {
  MG_ASSERT(spec.kind == MixerKind::MLA, "MLASelfAttention built from a {} spec", mixer_kind_name(spec.kind));
  MG_ASSERT(config.multi_latent_attention, "MLASelfAttention without --multi-latent-attention");
  if (multi_rank(pg.cp))  // Note [MLA context parallelism]
    cp_.emplace(pg.cp, cp_comm_type_from_string(config.cp_comm_type), pg.hcp_a2a, pg.hcp_p2p, spec.window_left);
  const int64_t q_out = int64_t(config.num_attention_heads) * (qk_ + pe_);
  if (q_lora_rank_ > 0) {
    linear_q_down_proj_.emplace(
        duplicated_linear(params, prefix + ".linear_q_down_proj", config.hidden_size, q_lora_rank_, config, pg));
    if (config.qk_layernorm)
      q_layernorm_.emplace(Norm::of_size(config, norm_kind(config), params, prefix + ".q_layernorm", q_lora_rank_, pg));
    linear_q_up_proj_.emplace(params, prefix + ".linear_q_up_proj", q_lora_rank_, q_out, /*bias=*/false,
                              ParamInit::Normal, ParallelMode::Column, pg.tp, config.sequence_parallel);
  } else {
    linear_q_proj_.emplace(params, prefix + ".linear_q_proj", config.hidden_size, q_out, /*bias=*/false,
                           ParamInit::Normal, ParallelMode::Column, pg.tp, config.sequence_parallel);
  }
  if (config.qk_layernorm)
    kv_layernorm_.emplace(
        Norm::of_size(config, norm_kind(config), params, prefix + ".kv_layernorm", kv_lora_rank_, pg));
}

void MLASelfAttention::enable_fp8(const Fp8Config& config, Device device, std::vector<Linear*>& fp8_linears) {
  for (std::optional<Linear>* l : {&linear_q_down_proj_, &linear_q_up_proj_, &linear_q_proj_})
    if (l->has_value()) {
      (*l)->enable_fp8(config, device);
      fp8_linears.push_back(&**l);
    }
  for (Linear* l : {&linear_kv_down_proj_, &linear_kv_up_proj_, &linear_proj_}) {
    l->enable_fp8(config, device);
    fp8_linears.push_back(l);
  }
}

// Q [S·b·n, qk+pe], K [S·b·n, qk+pe], V [S·b·n, dv] from the kept projections (Note [Multi-latent
// attention]), then the core attention.
void MLASelfAttention::core_forward(Context& ctx, const AttentionInputs& in, Saved& saved) const {
  MG_ASSERT(in.freqs.defined(), "multi-latent attention without rotary angles");
  const int64_t b = saved.x.size(1), N = saved.q.size(0), s = N / b, rows = N * n_, dqk = qk_ + pe_;
  const DType dt = saved.x.dtype();
  const Device dev = ctx.device();
  const Tensor q = saved.q.view({rows, dqk}), kv = saved.kv.view({rows, qk_ + dv_});
  // Q: the query heads with their rope channels rotated.
  Tensor Q = Tensor::empty({rows, dqk}, dt, dev);
  ops::copy_columns(ctx, q, 0, Q, 0, qk_, false);
  Tensor q_pe = Tensor::empty({rows, pe_}, dt, dev);
  ops::copy_columns(ctx, q, qk_, q_pe, 0, pe_, false);
  Tensor q_pe_heads = as_heads(q_pe, s, b, pe_);
  ops::rope_forward(ctx, q_pe_heads, in.freqs, /*interleaved=*/false, rope_scale_, q_pe_heads);
  ops::copy_columns(ctx, q_pe, 0, Q, qk_, pe_, false);
  // K: each head's no-position key, then the rotated rope key shared by every head.
  Tensor k_pe = Tensor::empty({N, pe_}, dt, dev);
  Tensor k_pe_heads = as_heads(k_pe, s, b, pe_);
  ops::rope_forward(ctx, as_heads(saved.k_pe, s, b, pe_), in.freqs, /*interleaved=*/false, rope_scale_, k_pe_heads);
  Tensor K = Tensor::empty({rows, dqk}, dt, dev);
  ops::copy_columns(ctx, kv, 0, K, 0, qk_, false);
  Tensor K_tokens = K.view({N, n_ * dqk});
  for (int64_t h = 0; h < n_; ++h) ops::copy_columns(ctx, k_pe, 0, K_tokens, h * dqk + qk_, pe_, false);
  Tensor V = Tensor::empty({rows, dv_}, dt, dev);
  ops::copy_columns(ctx, kv, qk_, V, 0, dv_, false);
  saved.Q = Q.view({s, b, n_, dqk});
  saved.K = K.view({s, b, n_, dqk});
  saved.V = V.view({s, b, n_, dv_});
  saved.context = Tensor::empty({s, b, n_, dv_}, dt, dev);
  const uint64_t seed = tensor_parallel::region_seed(ctx, tp_, true);
  if (cp_) {
    cp_->forward(ctx, saved.Q, saved.K, saved.V, in.packed.get(), softmax_scale_, dropout_p_, seed,
                 saved.dropout_offset, /*sinks=*/Tensor(), saved.context, saved.cp);
    return;
  }
  saved.lse = Tensor::empty({b, n_, s}, DType::Float32, dev);
  ops::attention_forward(ctx, saved.Q, saved.K, saved.V, mask_of(in), softmax_scale_, dropout_p_, seed,
                         saved.dropout_offset, saved.context, saved.lse);
}

Tensor MLASelfAttention::forward(Context& ctx, const Tensor& x, const AttentionInputs& in, uint64_t dropout_offset,
                                 bool keep_core, Saved& saved) const {
  const int64_t b = x.size(1), h = x.size(2);
  const Tensor rows = x.view({-1, h});  // this rank's tokens (its sequence shard under --sequence-parallel)
  const int64_t local = rows.size(0);
  const DType dt = x.dtype();
  saved.x = x;
  saved.dropout_offset = dropout_offset;
  // Queries: the low-rank path with its norm, or one projection.
  if (linear_q_proj_) {
    saved.q = linear_q_proj_->forward(ctx, rows);
  } else {
    Tensor q_down = linear_q_down_proj_->forward(ctx, rows);
    saved.q_latent = q_layernorm_ ? q_layernorm_->forward(ctx, q_down, saved.q_norm) : q_down;
    saved.q = linear_q_up_proj_->forward(ctx, saved.q_latent);
  }
  // Keys and values: the compressed latent and the rope key, split out of one projection.
  Tensor kv_down = linear_kv_down_proj_.forward(ctx, rows);
  Tensor latent = Tensor::empty({local, kv_lora_rank_}, dt, ctx.device());
  Tensor k_pe = Tensor::empty({local, pe_}, dt, ctx.device());
  ops::copy_columns(ctx, kv_down, 0, latent, 0, kv_lora_rank_, false);
  ops::copy_columns(ctx, kv_down, kv_lora_rank_, k_pe, 0, pe_, false);
  saved.kv_latent = kv_layernorm_ ? kv_layernorm_->forward(ctx, latent, saved.kv_norm) : latent;
  saved.kv = linear_kv_up_proj_.forward(ctx, saved.kv_latent);
  saved.k_pe = sequence_parallel_ ? tensor_parallel::all_gather_sequence(ctx, *tp_, k_pe) : k_pe;
  core_forward(ctx, in, saved);
  const int64_t N = saved.q.size(0);
  Tensor out = linear_proj_.forward(ctx, saved.context.view({N, n_ * dv_})).view({-1, b, h});
  if (keep_core) {
    saved.q = saved.kv = saved.k_pe = Tensor();  // Q/K/V hold what backward needs
  } else {
    saved.Q = saved.K = saved.V = saved.context = saved.lse = Tensor();
    saved.cp = ContextParallelAttention::Saved();
  }
  return out;
}

Tensor MLASelfAttention::backward(Context& ctx, const Tensor& grad_out, const AttentionInputs& in,
                                  Saved& saved) const {
  if (!saved.context.defined()) core_forward(ctx, in, saved);  // Note [Selective recomputation]
  const int64_t b = saved.x.size(1), h = saved.x.size(2), s = saved.context.size(0), N = s * b, rows = N * n_;
  const int64_t dqk = qk_ + pe_;
  const DType dt = saved.x.dtype();
  const Device dev = ctx.device();
  const Tensor x_rows = saved.x.view({-1, h});
  Tensor grad_context = linear_proj_.backward(ctx, grad_out.view({-1, h}), saved.context.view({N, n_ * dv_}));
  Tensor gQ = Tensor::empty(saved.Q.shape(), dt, dev), gK = Tensor::empty(saved.K.shape(), dt, dev),
         gV = Tensor::empty(saved.V.shape(), dt, dev);
  const uint64_t seed = tensor_parallel::region_seed(ctx, tp_, true);
  if (cp_) {
    Tensor no_sinks_grad;
    cp_->backward(ctx, grad_context.view({s, b, n_, dv_}), saved.Q, saved.K, saved.V, saved.context, in.packed.get(),
                  softmax_scale_, dropout_p_, seed, saved.dropout_offset, /*sinks=*/Tensor(), no_sinks_grad, saved.cp,
                  gQ, gK, gV);
  } else {
    ops::attention_backward(ctx, grad_context.view({s, b, n_, dv_}), saved.Q, saved.K, saved.V, saved.context,
                            saved.lse, mask_of(in), softmax_scale_, dropout_p_, seed, saved.dropout_offset, gQ, gK, gV);
  }
  saved.Q = saved.K = saved.V = saved.context = saved.lse = Tensor();
  saved.cp = ContextParallelAttention::Saved();
  // Q -> q: the rope channels rotated back, in place.
  Tensor g_q = gQ.view({rows, dqk});
  Tensor g_q_pe = Tensor::empty({rows, pe_}, dt, dev);
  ops::copy_columns(ctx, g_q, qk_, g_q_pe, 0, pe_, false);
  Tensor g_q_pe_heads = as_heads(g_q_pe, s, b, pe_);
  ops::rope_backward(ctx, g_q_pe_heads, in.freqs, /*interleaved=*/false, rope_scale_, g_q_pe_heads);
  ops::copy_columns(ctx, g_q_pe, 0, g_q, qk_, pe_, false);
  // K, V -> kv (per head [key; value]) and the rope key, summed over this rank's heads.
  Tensor g_kv = Tensor::empty({rows, qk_ + dv_}, dt, dev);
  ops::copy_columns(ctx, gK.view({rows, dqk}), 0, g_kv, 0, qk_, false);
  ops::copy_columns(ctx, gV.view({rows, dv_}), 0, g_kv, qk_, dv_, false);
  Tensor g_k_pe = Tensor::empty({N, pe_}, dt, dev);
  const Tensor gK_tokens = gK.view({N, n_ * dqk});
  for (int64_t hd = 0; hd < n_; ++hd) ops::copy_columns(ctx, gK_tokens, hd * dqk + qk_, g_k_pe, 0, pe_, hd > 0);
  Tensor g_k_pe_heads = as_heads(g_k_pe, s, b, pe_);
  ops::rope_backward(ctx, g_k_pe_heads, in.freqs, /*interleaved=*/false, rope_scale_, g_k_pe_heads);
  // Note [MLA tensor parallelism]: the rope key's gradient over every rank's heads.
  if (sequence_parallel_) {
    g_k_pe = tensor_parallel::reduce_scatter_sequence(ctx, *tp_, g_k_pe);
  } else if (tp_) {
    tensor_parallel::all_reduce_(ctx, *tp_, g_k_pe);
  }
  Tensor g_latent = linear_kv_up_proj_.backward(ctx, g_kv.view({N, -1}), saved.kv_latent);
  if (kv_layernorm_) g_latent = kv_layernorm_->backward(ctx, g_latent, saved.kv_norm);
  const int64_t local = x_rows.size(0);
  Tensor g_kv_down = Tensor::empty({local, kv_lora_rank_ + pe_}, dt, dev);
  ops::copy_columns(ctx, g_latent, 0, g_kv_down, 0, kv_lora_rank_, false);
  ops::copy_columns(ctx, g_k_pe, 0, g_kv_down, kv_lora_rank_, pe_, false);
  Tensor grad_x = linear_kv_down_proj_.backward(ctx, g_kv_down, x_rows);
  Tensor g_q_in;
  if (linear_q_proj_) {
    g_q_in = linear_q_proj_->backward(ctx, g_q.view({N, -1}), x_rows);
  } else {
    Tensor g_q_latent = linear_q_up_proj_->backward(ctx, g_q.view({N, -1}), saved.q_latent);
    if (q_layernorm_) g_q_latent = q_layernorm_->backward(ctx, g_q_latent, saved.q_norm);
    g_q_in = linear_q_down_proj_->backward(ctx, g_q_latent, x_rows);
  }
  ops::add(ctx, grad_x, g_q_in, grad_x);
  saved.q = saved.kv = saved.k_pe = Tensor();
  return grad_x.view({-1, b, h});
}

// ---- inference ---------------------------------------------------------------------------------

Tensor MLASelfAttention::forward_inference(Context& ctx, const Tensor& x, const Tensor& freqs, const CacheRows& cache_rows,
                                           Tensor& latent_cache, Tensor& rope_cache) const {
  MG_CHECK(!tp_, "inference with multi-latent attention runs on one rank (no tensor parallelism)");
  MG_ASSERT(freqs.defined(), "multi-latent attention without rotary angles");
  const int64_t s = x.size(0), b = x.size(1), h = x.size(2), N = s * b, dqk = qk_ + pe_;
  const int64_t slot_len = latent_cache.size(1);
  MG_ASSERT(latent_cache.dim() == 4 && latent_cache.size(3) == kv_lora_rank_ && rope_cache.dim() == 4 &&
                rope_cache.size(3) == pe_ && rope_cache.size(1) == slot_len,
            "MLA caches {} and {} do not hold [slots, S, 1, {}] latents and [slots, S, 1, {}] rope keys",
            latent_cache.str(), rope_cache.str(), kv_lora_rank_, pe_);
  const DType dt = x.dtype();
  const Device dev = ctx.device();
  const Tensor rows = x.view({N, h});  // row j·b + i: sequence i's token j
  Norm::Saved unused;
  // The new tokens' queries (rope channels rotated at their own positions), latents and rope keys.
  Tensor q;
  if (linear_q_proj_) {
    q = linear_q_proj_->forward(ctx, rows);
  } else {
    Tensor q_down = linear_q_down_proj_->forward(ctx, rows);
    q = linear_q_up_proj_->forward(ctx, q_layernorm_ ? q_layernorm_->forward(ctx, q_down, unused) : q_down);
  }
  Tensor q_rows = q.view({N * n_, dqk}), q_pe = Tensor::empty({N * n_, pe_}, dt, dev);
  ops::copy_columns(ctx, q_rows, qk_, q_pe, 0, pe_, false);
  Tensor q_pe_rows = q_pe.view({N, 1, n_, pe_});
  ops::rope_forward(ctx, q_pe_rows, freqs, /*interleaved=*/false, rope_scale_, q_pe_rows);
  ops::copy_columns(ctx, q_pe, 0, q_rows, qk_, pe_, false);
  Tensor kv_down = linear_kv_down_proj_.forward(ctx, rows);
  Tensor latent = Tensor::empty({N, kv_lora_rank_}, dt, dev), k_pe = Tensor::empty({N, pe_}, dt, dev);
  ops::copy_columns(ctx, kv_down, 0, latent, 0, kv_lora_rank_, false);
  ops::copy_columns(ctx, kv_down, kv_lora_rank_, k_pe, 0, pe_, false);
  if (kv_layernorm_) latent = kv_layernorm_->forward(ctx, latent, unused);
  Tensor k_pe_rows = k_pe.view({N, 1, 1, pe_});
  ops::rope_forward(ctx, k_pe_rows, freqs, /*interleaved=*/false, rope_scale_, k_pe_rows);
  // Into the caches, then attention per sequence over its cached positions.
  const std::vector<int64_t>& slot_of = cache_rows.slot_ids;
  const std::vector<int64_t>& start_of = cache_rows.start_ids;
  Tensor latent_flat = latent_cache.view({-1, kv_lora_rank_}), rope_flat = rope_cache.view({-1, pe_});
  Tensor context = Tensor::empty({N, n_ * dv_}, dt, dev);
  for (int64_t i = 0; i < b; ++i) {
    const int64_t slot = slot_of[size_t(i)], start = start_of[size_t(i)], base = slot * slot_len, L = start + s;
    MG_CHECK(slot >= 0 && slot < latent_cache.size(0) && start >= 0 && L <= slot_len,
             "KV cache slot {} positions {}..{} are outside its {} slots of {} positions", slot, start, L - 1,
             latent_cache.size(0), slot_len);
    Tensor q_i = Tensor::empty({s, n_ * dqk}, dt, dev);
    for (int64_t j = 0; j < s; ++j) {
      ops::copy_rows(ctx, latent, j * b + i, latent_flat, base + start + j, 1);
      ops::copy_rows(ctx, k_pe, j * b + i, rope_flat, base + start + j, 1);
      ops::copy_rows(ctx, q, j * b + i, q_i, j, 1);
    }
    Tensor kv = linear_kv_up_proj_.forward(ctx, latent_flat.slice(base, base + L)).view({L * n_, qk_ + dv_});
    Tensor K = Tensor::empty({L * n_, dqk}, dt, dev), V = Tensor::empty({L * n_, dv_}, dt, dev);
    ops::copy_columns(ctx, kv, 0, K, 0, qk_, false);
    ops::copy_columns(ctx, kv, qk_, V, 0, dv_, false);
    const Tensor rope_keys = rope_flat.slice(base, base + L);
    Tensor K_tokens = K.view({L, n_ * dqk});
    for (int64_t hd = 0; hd < n_; ++hd) ops::copy_columns(ctx, rope_keys, 0, K_tokens, hd * dqk + qk_, pe_, false);
    Tensor out_i = Tensor::empty({s, 1, n_, dv_}, dt, dev), lse = Tensor::empty({1, n_, s}, DType::Float32, dev);
    ops::attention_forward(ctx, q_i.view({s, 1, n_, dqk}), K.view({L, 1, n_, dqk}), V.view({L, 1, n_, dv_}),
                           AttnMask::causal_with_offset(start, 0), softmax_scale_, 0.0f, 0, 0, out_i, lse);
    const Tensor out_rows = out_i.view({s, n_ * dv_});
    for (int64_t j = 0; j < s; ++j) ops::copy_rows(ctx, out_rows, j, context, j * b + i, 1);
  }
  return linear_proj_.forward(ctx, context).view({s, b, h});
}

}  // namespace megatron

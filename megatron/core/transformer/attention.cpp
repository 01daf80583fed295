#include "megatron/core/transformer/attention.h"

#include <cmath>

#include "megatron/core/models/common/embeddings/rotary_pos_embedding.h"
#include "megatron/core/tensor_parallel/random.h"
#include "megatron/kernels/ops.h"

namespace megatron {

namespace {
// Note [QK layernorm]: the per-head norm of queries or keys, with --qk-layernorm.
std::optional<Norm> qk_layernorm(const TransformerConfig& config, ParamAndGradBuffer& params, const std::string& name,
                                 const ProcessGroupCollection& pg) {
  if (!config.qk_layernorm) return std::nullopt;
  return Norm::per_head(config, params, name, pg);
}
}  // namespace

SelfAttention::SelfAttention(const TransformerConfig& config, const MixerSpec& spec, ParamAndGradBuffer& params,
                             const std::string& prefix, const ProcessGroupCollection& pg)
    : nq_(config.num_attention_heads / group_size(pg.tp)),
      ng_(config.num_query_groups / group_size(pg.tp)),
      d_(config.kv_channels),
      window_left_(spec.window_left),
      softmax_scale_(1.0f / std::sqrt(float(config.kv_channels))),
      dropout_p_(config.attention_dropout),
      rope_interleaved_(config.rotary_interleaved),
      rope_scale_(rotary_attention_scale(config)),
      tp_(multi_rank(pg.tp)),
      linear_qkv_(params, prefix + ".linear_qkv", config.hidden_size,
                  config.query_projection_size() + 2 * config.kv_projection_size(),
                  config.add_bias_linear || config.add_qkv_bias, ParamInit::Normal, ParallelMode::Column, pg.tp,
                  config.sequence_parallel),
      linear_proj_(params, prefix + ".linear_proj", config.query_projection_size(), config.hidden_size,
                   config.add_bias_linear, ParamInit::ScaledNormal, ParallelMode::Row, pg.tp,
                   config.sequence_parallel),
      q_layernorm_(qk_layernorm(config, params, prefix + ".q_layernorm", pg)),
      k_layernorm_(qk_layernorm(config, params, prefix + ".k_layernorm", pg)) {
  MG_ASSERT(spec.kind == MixerKind::SelfAttention, "SelfAttention built from a {} spec", mixer_kind_name(spec.kind));
  if (multi_rank(pg.cp)) {
    cp_.emplace(pg.cp, cp_comm_type_from_string(config.cp_comm_type), pg.hcp_a2a, pg.hcp_p2p, window_left_);
  }
  if (config.softmax_type == "learnable") {  // Note [Attention sinks]
    softmax_offset_ = params.add(prefix + ".core_attention.softmax_offset",
                                 tp_shard({config.num_attention_heads}, 0, pg.tp), /*no_weight_decay=*/true,
                                 ParamInit::Normal);
  } else if (config.softmax_type == "off-by-one") {
    fixed_sinks_ = Tensor::zeros({nq_}, DType::Float32, params.device());
  }
}

void SelfAttention::apply_sinks(Context& ctx, Saved& saved) const {
  if (const Tensor sinks = sinks_tensor(); sinks.defined())
    ops::attention_sink_forward(ctx, saved.context, saved.lse, sinks, saved.context, saved.lse);
}

AttnMask SelfAttention::mask_of(const AttentionInputs& in) const {
  const AttnMask mask = in.packed ? in.packed->mask() : AttnMask::causal();
  return mask.with_window(window_left_);
}

void SelfAttention::enable_fp8(const Fp8Config& config, Device device, std::vector<Linear*>& fp8_linears) {
  for (Linear* l : {&linear_qkv_, &linear_proj_}) {
    l->enable_fp8(config, device);
    fp8_linears.push_back(l);
  }
}

Tensor SelfAttention::head_norm_forward(Context& ctx, const Norm& norm, const Tensor& x, Norm::Saved& saved) {
  const int64_t d = x.size(x.dim() - 1);
  return norm.forward(ctx, x.view({-1, d}), saved).view(x.shape());
}

Tensor SelfAttention::head_norm_backward(Context& ctx, const Norm& norm, const Tensor& grad_out,
                                         const Norm::Saved& saved) {
  const int64_t d = grad_out.size(grad_out.dim() - 1);
  return norm.backward(ctx, grad_out.view({-1, d}), saved).view(grad_out.shape());
}

void SelfAttention::core_forward(Context& ctx, const AttentionInputs& in, Saved& saved) const {
  const Tensor& freqs = in.freqs;
  const int64_t s = saved.qkv.size(0), b = saved.qkv.size(1);
  const DType dt = saved.x.dtype();
  saved.context = Tensor::empty({s, b, nq_, d_}, dt, ctx.device());
  if (!cp_) saved.lse = Tensor::empty({b, nq_, s}, DType::Float32, ctx.device());  // else saved.cp's
  const uint64_t seed = tensor_parallel::region_seed(ctx, tp_, true);
  if (fused_qkv(in)) {
    ops::attention_forward_qkv(ctx, saved.qkv, mask_of(in), softmax_scale_, dropout_p_, seed,
                               saved.dropout_offset, saved.context, saved.lse);
    apply_sinks(ctx, saved);
    return;
  }
  Tensor q = Tensor::empty({s, b, nq_, d_}, dt, ctx.device());
  Tensor k = Tensor::empty({s, b, ng_, d_}, dt, ctx.device());
  Tensor v = Tensor::empty({s, b, ng_, d_}, dt, ctx.device());
  ops::qkv_split_forward(ctx, saved.qkv, q, k, v);
  if (q_layernorm_) {
    q = head_norm_forward(ctx, *q_layernorm_, q, saved.q_norm);
    k = head_norm_forward(ctx, *k_layernorm_, k, saved.k_norm);
  }
  if (freqs.defined()) {
    ops::rope_forward(ctx, q, freqs, rope_interleaved_, rope_scale_, q);
    ops::rope_forward(ctx, k, freqs, rope_interleaved_, rope_scale_, k);
  }
  if (cp_) {
    // The sinks fold in inside the exchange (Note [Context-parallel attention sinks]).
    cp_->forward(ctx, q, k, v, in.packed.get(), softmax_scale_, dropout_p_, seed, saved.dropout_offset, sinks_tensor(),
                 saved.context, saved.cp);
  } else {
    ops::attention_forward(ctx, q, k, v, mask_of(in), softmax_scale_, dropout_p_, seed, saved.dropout_offset,
                           saved.context, saved.lse);
    apply_sinks(ctx, saved);
  }
  saved.q = q, saved.k = k, saved.v = v;
}

Tensor SelfAttention::forward(Context& ctx, const Tensor& x, const AttentionInputs& in, uint64_t dropout_offset,
                              bool keep_core, Saved& saved) const {
  // Under sequence parallelism x is this rank's [s/tp, b, h] shard; the QKV projection gathers the
  // whole sequence and the output projection scatters it again.
  const int64_t b = x.size(1), h = x.size(2);
  saved.x = x;
  saved.dropout_offset = dropout_offset;
  saved.qkv = linear_qkv_.forward(ctx, x.view({-1, h})).view({-1, b, linear_qkv_.out_features()});
  const int64_t s = saved.qkv.size(0);
  core_forward(ctx, in, saved);
  Tensor out = linear_proj_.forward(ctx, saved.context.view({s * b, nq_ * d_})).view({-1, b, h});
  // The split path needs the QKV projection's output only to recompute the core attention; the
  // fused path reads it in backward (Note [Fused QKV attention]).
  if (keep_core) {
    if (!fused_qkv(in)) saved.qkv = Tensor();
  } else {
    saved.q = saved.k = saved.v = saved.context = saved.lse = Tensor();
    saved.q_norm = saved.k_norm = Norm::Saved();
    saved.cp = ContextParallelAttention::Saved();
  }
  return out;
}

Tensor SelfAttention::backward(Context& ctx, const Tensor& grad_out, const AttentionInputs& in, Saved& saved) const {
  const Tensor& freqs = in.freqs;
  const int64_t b = saved.x.size(1), h = saved.x.size(2);
  if (!saved.context.defined()) core_forward(ctx, in, saved);  // Note [Selective recomputation]
  const int64_t s = saved.context.size(0);
  Tensor grad_context = linear_proj_.backward(ctx, grad_out.view({-1, h}), saved.context.view({s * b, nq_ * d_}));
  const DType dt = saved.x.dtype();
  const uint64_t seed = tensor_parallel::region_seed(ctx, tp_, true);
  const Tensor sinks = sinks_tensor();
  Tensor none, &sinks_grad = softmax_offset_ ? softmax_offset_->main_grad : none;
  if (sinks.defined() && !cp_)  // Note [Attention sinks]; under CP inside the exchange's backward
    ops::attention_sink_backward(ctx, grad_context.view({s, b, nq_, d_}), saved.context, saved.lse, sinks, sinks_grad);
  Tensor grad_qkv;
  if (fused_qkv(in)) {
    grad_qkv = Tensor::empty(saved.qkv.shape(), dt, ctx.device());
    ops::attention_backward_qkv(ctx, grad_context.view({s, b, nq_, d_}), saved.qkv, saved.context, saved.lse,
                                mask_of(in), softmax_scale_, dropout_p_, seed, saved.dropout_offset, grad_qkv);
  } else {
    Tensor gq = Tensor::empty(saved.q.shape(), dt, ctx.device());
    Tensor gk = Tensor::empty(saved.k.shape(), dt, ctx.device());
    Tensor gv = Tensor::empty(saved.v.shape(), dt, ctx.device());
    if (cp_) {
      cp_->backward(ctx, grad_context.view({s, b, nq_, d_}), saved.q, saved.k, saved.v, saved.context,
                    in.packed.get(), softmax_scale_, dropout_p_, seed, saved.dropout_offset, sinks, sinks_grad,
                    saved.cp, gq, gk, gv);
    } else {
      ops::attention_backward(ctx, grad_context.view({s, b, nq_, d_}), saved.q, saved.k, saved.v, saved.context,
                              saved.lse, mask_of(in), softmax_scale_, dropout_p_, seed, saved.dropout_offset, gq, gk,
                              gv);
    }
    if (freqs.defined()) {
      ops::rope_backward(ctx, gq, freqs, rope_interleaved_, rope_scale_, gq);
      ops::rope_backward(ctx, gk, freqs, rope_interleaved_, rope_scale_, gk);
    }
    if (q_layernorm_) {  // this rank's partial sums over its heads (Note [QK layernorm])
      gq = head_norm_backward(ctx, *q_layernorm_, gq, saved.q_norm);
      gk = head_norm_backward(ctx, *k_layernorm_, gk, saved.k_norm);
    }
    grad_qkv = Tensor::empty({s, b, (nq_ + 2 * ng_) * d_}, dt, ctx.device());
    ops::qkv_split_backward(ctx, gq, gk, gv, grad_qkv);
  }
  notify_grad_accumulated(ctx, softmax_offset_);
  return linear_qkv_.backward(ctx, grad_qkv.view({s * b, -1}), saved.x.view({-1, h})).view({-1, b, h});
}

// ---- inference ---------------------------------------------------------------------------------

Tensor SelfAttention::forward_inference(Context& ctx, const Tensor& x, const Tensor& freqs, const CacheRows& rows,
                                        Tensor& k_cache, Tensor& v_cache) const {
  const int64_t s = x.size(0), b = x.size(1), h = x.size(2);
  const DType dt = x.dtype();
  Tensor qkv = linear_qkv_.forward(ctx, x.view({s * b, h})).view({s, b, -1});
  Tensor q = Tensor::empty({s, b, nq_, d_}, dt, ctx.device());
  Tensor k = Tensor::empty({s, b, ng_, d_}, dt, ctx.device());
  Tensor v = Tensor::empty({s, b, ng_, d_}, dt, ctx.device());
  ops::qkv_split_forward(ctx, qkv, q, k, v);
  if (q_layernorm_) {
    Norm::Saved unused;
    q = head_norm_forward(ctx, *q_layernorm_, q, unused);
    k = head_norm_forward(ctx, *k_layernorm_, k, unused);
  }
  if (freqs.defined()) {  // one angle row per (position, sequence): the sequences sit at different positions
    Tensor q_rows = q.view({s * b, 1, nq_, d_}), k_rows = k.view({s * b, 1, ng_, d_});
    ops::rope_forward(ctx, q_rows, freqs, rope_interleaved_, rope_scale_, q_rows);
    ops::rope_forward(ctx, k_rows, freqs, rope_interleaved_, rope_scale_, k_rows);
  }
  Tensor context = Tensor::empty({s, b, nq_, d_}, dt, ctx.device());
  if (s > 1 && rows.from_zero()) {
    // Note [Prefill attention]: when every sequence of the forward starts at position 0 (the
    // engine's prefill: prompts right-padded to one length), the cache holds nothing they may see
    // but their own new keys, so attention is the training's causal attention over [s, b] (cuDNN's
    // fused kernel on the GPU, the window and sinks included) and the cache only receives the keys
    // and values. A padded row's garbage positions lie after its prompt: its real queries never
    // see them (causal), and decoding overwrites them before any query can.
    ops::kv_cache_append(ctx, k, v, rows.slots, rows.starts, k_cache, v_cache);
    Tensor lse = Tensor::empty({b, nq_, s}, DType::Float32, ctx.device());
    ops::attention_forward(ctx, q, k, v, AttnMask::causal().with_window(window_left_), softmax_scale_, 0.0f, 0, 0,
                           context, lse);
    if (const Tensor sinks = sinks_tensor(); sinks.defined())
      ops::attention_sink_forward(ctx, context, lse, sinks, context, lse);
  } else if (sinks_tensor().defined() || window_left_ >= 0) {
    context = cached_attention_rows(ctx, q, k, v, rows, k_cache, v_cache);
  } else {
    ops::attention_kv_cache_forward(ctx, q, k, v, rows.slots, rows.starts, softmax_scale_, k_cache, v_cache, context);
  }
  return linear_proj_.forward(ctx, context.view({s * b, nq_ * d_})).view({s, b, h});
}

// Note [KV-cache attention with sinks or windows]: ops::attention_kv_cache_forward has neither, so
// these layers take each batch row on its own: its new keys and values go into its cache slot
// (ops::copy_rows), then the training ops run over the slot's first start + s positions — the
// CausalWithOffset mask (queries at start.., keys from 0) with the layer's window, then the sinks —
// so generation computes what the full forward does. One attention call per sequence of the batch.
Tensor SelfAttention::cached_attention_rows(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                                            const CacheRows& rows, Tensor& k_cache, Tensor& v_cache) const {
  const int64_t s = q.size(0), b = q.size(1), max_len = k_cache.size(1);
  const DType dt = q.dtype();
  const Device dev = ctx.device();
  const std::vector<int64_t>&slot = rows.slot_ids, &start = rows.start_ids;
  MG_CHECK(int64_t(slot.size()) == b && int64_t(start.size()) == b, "{} cache slots and {} starts for {} sequences",
           slot.size(), start.size(), b);
  auto batch_major = [&](const Tensor& t) {  // [s, b, n, d] -> [b, s, n, d]
    Tensor out = Tensor::empty({b, s, t.size(2), t.size(3)}, dt, dev);
    ops::transpose_01(ctx, t, out);
    return out;
  };
  const Tensor qb = batch_major(q), kb = batch_major(k), vb = batch_major(v);
  Tensor out_b = Tensor::empty({b, s, nq_, d_}, dt, dev);
  const Tensor sinks = sinks_tensor();
  for (int64_t i = 0; i < b; ++i) {
    const int64_t si = slot[size_t(i)], st = start[size_t(i)], len = st + s;
    MG_CHECK(si >= 0 && si < k_cache.size(0) && st >= 0 && len <= max_len,
             "cache slot {} at positions {}..{} does not fit a cache of {} slots of {} positions", si, st, len - 1,
             k_cache.size(0), max_len);
    Tensor kc = k_cache.slice(si, si + 1).view({max_len, ng_ * d_});
    Tensor vc = v_cache.slice(si, si + 1).view({max_len, ng_ * d_});
    ops::copy_rows(ctx, kb.slice(i, i + 1).view({s, ng_ * d_}), 0, kc, st, s);
    ops::copy_rows(ctx, vb.slice(i, i + 1).view({s, ng_ * d_}), 0, vc, st, s);
    const Tensor keys = kc.slice(0, len).view({len, 1, ng_, d_}), values = vc.slice(0, len).view({len, 1, ng_, d_});
    Tensor oi = out_b.slice(i, i + 1).view({s, 1, nq_, d_});
    Tensor lse = Tensor::empty({1, nq_, s}, DType::Float32, dev);
    ops::attention_forward(ctx, qb.slice(i, i + 1).view({s, 1, nq_, d_}), keys, values,
                           AttnMask::causal_with_offset(st, 0).with_window(window_left_), softmax_scale_, 0.0f, 0, 0,
                           oi, lse);
    if (sinks.defined()) ops::attention_sink_forward(ctx, oi, lse, sinks, oi, lse);
  }
  Tensor out = Tensor::empty({s, b, nq_, d_}, dt, dev);
  ops::transpose_01(ctx, out_b, out);
  return out;
}

}  // namespace megatron

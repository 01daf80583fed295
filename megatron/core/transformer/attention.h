// SelfAttention (Megatron-Core's SelfAttention with the local core attention): the fused QKV
// projection (grouped per query group), optionally the per-head norms of q and k, rotary embedding
// of q and k, causal softmax attention with GQA and attention dropout, and the output projection.
//
// Note [Fused QKV attention]: with MHA (nq == ng) and no RoPE the core attention reads q, k and v
// straight from the fused QKV projection (ops::attention_forward_qkv: on the GPU cuDNN takes them
// as strided views) and its backward writes the fused gradient, so there are no split and merge
// copies; Saved keeps the projection itself instead of q/k/v. GQA (one key/value head for several
// query heads is no single stride), RoPE (q and k are rotated out of place) and --qk-layernorm (q
// and k are normalised out of place) keep the split path.
//
// Note [QK layernorm]: with --qk-layernorm (Megatron's qk_layernorm; Qwen3, OLMo-2) each query and
// key head is normalised over its d channels after the QKV split and before RoPE, with the
// model's --normalization (RMSNorm or LayerNorm, --apply-layernorm-1p and the epsilon included)
// and one weight [d] (and bias, LayerNorm) for q and one for k, shared by every head:
// "<prefix>.q_layernorm.weight" and "<prefix>.k_layernorm.weight". They are the model's Norm in
// its per-head form (Norm::per_head), run over rows [s·b·heads, d]. Under tensor parallelism the weights are duplicated
// on the tensor-parallel ranks (tp_duplicate) while the heads are sharded, so each rank's weight
// gradient is a partial sum over its own heads: as Megatron, finalize_model_grads all-reduces the
// gradients of q_layernorm/k_layernorm over the tensor-parallel group once per step, with or
// without sequence parallelism (Parameter::tp_partial_grad; they are not marked sequence_parallel,
// which would reduce them a second time under --sequence-parallel).
//
// Context parallelism (pg.cp, --cp-comm-type): x holds this rank's rows of the sequence (Note
// [Load-balanced chunks]); the projections and RoPE work on them alone and the core attention is
// ContextParallelAttention's (Note [Context-parallel attention]), which brings the other ranks' keys
// and values. The fused QKV path is not taken (the exchange needs k and v split).
//
// Attention sinks (--softmax-type learnable / off-by-one; Note [Attention sinks] in
// kernels/op_list.inc): after the core attention, ops::attention_sink_forward folds each head's sink
// logit into the output and the log-sum-exp, in place; the backward first takes the sinks' gradient
// (ops::attention_sink_backward) and then runs the core attention's backward on the adjusted output
// and log-sum-exp, which gives the exact q/k/v gradients. learnable: the parameter
// "<prefix>.core_attention.softmax_offset" [heads] (Megatron's name), split with the heads under
// tensor parallelism; off-by-one: a fixed 0 per head. Under context parallelism the exchange folds
// them in (Note [Context-parallel attention sinks] in context_parallel.cpp): p2p and all_gather into
// the merged rows of this rank, a2a and a2a+p2p into the head-split whole rows before the output's
// all-to-all; each key block's backward with those is exact as without CP.
//
// Sliding-window attention (--window-size, --window-attn-skip-freq): the layer spec's window
// (MixerSpec::window_left) goes into every mask this layer builds (Note [Sliding-window attention]),
// context parallelism's blocks included (in global positions, every --cp-comm-type).
// Generation over the KV cache with sinks or a window runs the training ops row by row (Note [KV-cache
// attention with sinks or windows] in the .cpp).
//
// Note [Selective recomputation]: with --recompute-granularity selective the core attention's
// tensors (split q/k/v after RoPE where the split path runs, the attention output and its
// log-sum-exp) are dropped after forward and recomputed in backward from the kept QKV projection,
// as Megatron recomputes its core attention. The dropout stream offset is kept, so the
// recomputation is exact.
#pragma once

#include <optional>
#include <string>

#include "megatron/core/packed_seq_params.h"
#include "megatron/core/tensor_parallel/layers.h"
#include "megatron/core/transformer/context_parallel.h"
#include "megatron/core/transformer/kv_cache.h"
#include "megatron/core/transformer/norm.h"
#include "megatron/core/transformer/transformer_config.h"
#include "megatron/core/transformer/transformer_layer_spec.h"

namespace megatron {

class SelfAttention {
 public:
  /// With tensor parallelism (pg.tp) this rank holds num_attention_heads/tp heads and
  /// num_query_groups/tp groups: linear_qkv is column-parallel, linear_proj row-parallel.
  SelfAttention(const TransformerConfig& config, const MixerSpec& spec, ParamAndGradBuffer& params,
                const std::string& prefix, const ProcessGroupCollection& pg = {});

  struct Saved {
    Tensor x;                      // input [s, b, h]
    Tensor qkv;                    // fused projection [s, b, ng·(nq/ng+2)·d]; dropped once q/k/v are split out
    Tensor q, k, v, context, lse;  // core attention (dropped under selective recomputation); q/k/v
                                   // stay undefined on the fused path (Note [Fused QKV attention])
    Norm::Saved q_norm, k_norm;    // --qk-layernorm: the split q/k and their statistics (core tensors)
    ContextParallelAttention::Saved cp;  // context parallelism: what its backward needs (core tensors)
    uint64_t dropout_offset = 0;
  };
  /// x [s, b, h] -> [s, b, h] (output projection applied, its bias included). in: the rotary angles
  /// and the documents (AttentionInputs). dropout_offset: the attention-dropout stream.
  Tensor forward(Context& ctx, const Tensor& x, const AttentionInputs& in, uint64_t dropout_offset, bool keep_core,
                 Saved& saved) const;
  Tensor backward(Context& ctx, const Tensor& grad_out, const AttentionInputs& in, Saved& saved) const;

  // ---- inference (KV cache; no dropout, nothing saved) ----
  /// x [s, b, h] -> [s, b, h]. freqs: rotary angles per (position, sequence) row, [s·b, r/2]
  /// (undefined without RoPE). Appends the new keys/values (after RoPE) to k_cache/v_cache
  /// [slots, S, ng, d] at slot slots[i], positions starts[i].., and attends over the cache.
  Tensor forward_inference(Context& ctx, const Tensor& x, const Tensor& freqs, const CacheRows& rows,
                           Tensor& k_cache, Tensor& v_cache) const;

  /// Runs linear_qkv and linear_proj in FP8 (Note [FP8 layers]); appends them to `fp8_linears`.
  void enable_fp8(const Fp8Config& config, Device device, std::vector<Linear*>& fp8_linears);

 private:
  void core_forward(Context& ctx, const AttentionInputs& in, Saved& saved) const;
  /// Inference with sinks or a window (Note [KV-cache attention with sinks or windows]): q [s, b, nq, d],
  /// k/v [s, b, ng, d] after RoPE -> the core attention's output [s, b, nq, d]; writes k/v into the caches.
  Tensor cached_attention_rows(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const CacheRows& rows,
                               Tensor& k_cache, Tensor& v_cache) const;
  /// The sink logits [nq_] (learnable or off-by-one), undefined for the vanilla softmax.
  Tensor sinks_tensor() const { return softmax_offset_ ? softmax_offset_->data : fixed_sinks_; }
  /// Folds the sinks into saved.context and saved.lse in place (Note [Attention sinks]; without CP).
  void apply_sinks(Context& ctx, Saved& saved) const;
  /// Note [Fused QKV attention]: whether the core attention reads the QKV projection directly.
  bool fused_qkv(const AttentionInputs& in) const {
    return nq_ == ng_ && !in.freqs.defined() && !q_layernorm_ && !cp_;
  }
  /// x [s, b, n, d] normalised over d by a per-head norm (Note [QK layernorm]), and its gradient.
  static Tensor head_norm_forward(Context& ctx, const Norm& norm, const Tensor& x, Norm::Saved& saved);
  static Tensor head_norm_backward(Context& ctx, const Norm& norm, const Tensor& grad_out, const Norm::Saved& saved);

  /// The attention mask of this layer: causal or the documents, with the layer's window.
  AttnMask mask_of(const AttentionInputs& in) const;

  int64_t nq_, ng_, d_;
  int64_t window_left_;  // -1: full attention
  Parameter* softmax_offset_ = nullptr;  // --softmax-type learnable: the sinks [nq_]
  Tensor fixed_sinks_;                   // --softmax-type off-by-one: zeros [nq_] fp32
  float softmax_scale_;
  float dropout_p_;
  bool rope_interleaved_;
  float rope_scale_;  // YaRN's attention factor on cos and sin (1 without YaRN)
  Communicator* tp_;  // null: one rank
  Linear linear_qkv_;
  Linear linear_proj_;
  std::optional<Norm> q_layernorm_, k_layernorm_;  // Note [QK layernorm]
  std::optional<ContextParallelAttention> cp_;     // context parallelism (pg.cp has more than one rank)
};

}  // namespace megatron

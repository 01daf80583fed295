// MLASelfAttention (Megatron-Core's MLASelfAttention, --multi-latent-attention; DeepSeek-V2/V3):
// attention whose keys and values come from a low-rank latent of the hidden state, with RoPE on a
// separate ("decoupled") group of channels whose key is shared by every head.
//
// Note [Multi-latent attention]: with h the hidden size, n heads, qk = --qk-head-dim (the channels
// without position), pe = --qk-pos-emb-head-dim (the rotated channels), dv = --v-head-dim:
//   q      = linear_q_up_proj(q_layernorm(linear_q_down_proj(x)))    [s, b, n, qk + pe]
//            (or linear_q_proj(x) without --q-lora-rank)
//   c, kpe = split(linear_kv_down_proj(x))                            [s, b, kv_lora_rank], [s, b, pe]
//   k_nope, v = split per head(linear_kv_up_proj(kv_layernorm(c)))   [s, b, n, qk], [s, b, n, dv]
//   Q = [q_nope, rope(q_pe)],  K = [k_nope, rope(kpe) for every head],  V = v
//   out    = linear_proj(softmax(scale · Q Kᵀ) V)                     scale = mscale² / sqrt(qk + pe)
// where mscale = YaRN's mscale(--rotary-scaling-factor, --mscale-all-dim) (1 without scaling) and
// rope is the model's RoPE over pe channels (rotate-half; YaRN's concentration factor on cos/sin).
// q_layernorm and kv_layernorm (the model's --normalization over q_lora_rank / kv_lora_rank) exist
// with --qk-layernorm, as Megatron's spec builds them; DeepSeek-V3 has them. Megatron refuses
// --rotary-interleaved with MLA; DeepSeek's interleaved checkpoints are permuted on import instead
// (Note [Importing DeepSeek's interleaved RoPE] in models/gpt/hf_deepseek.h). The core attention is
// ops::attention_forward with query/key heads of qk + pe channels and value heads of dv.
//
// Note [MLA tensor parallelism]: the heads are sharded over the tensor-parallel group —
// linear_q_up_proj / linear_q_proj and linear_kv_up_proj column-parallel, linear_proj row-parallel —
// while the down projections and their norms are duplicated on every rank (Megatron's TE spec:
// TELinear parallel_mode "duplicated"). Without sequence parallelism every rank computes the whole
// latent from the whole x; the up projections' backward all-reduces the latents' gradients, and the
// shared rope key's gradient, a partial sum over this rank's heads, is all-reduced here, so the
// down projections see the full gradient and their weight gradients agree on every rank. With
// --sequence-parallel x is this rank's [s/tp, b, h] shard: the down projections and norms run on the
// shard (their weight gradients are partial sums, all-reduced over the group as the layer norms'
// are: Parameter::sequence_parallel), the up projections all-gather the latents along the sequence,
// and the rope key is all-gathered here (its gradient reduce-scattered).
//
// Note [MLA tensor layout]: Megatron's parameter layout — linear_q_up_proj's rows head by head, each
// [qk no-position rows; pe rope rows]; linear_kv_down_proj's rows [kv_lora_rank; pe];
// linear_kv_up_proj's rows head by head, each [qk key rows; dv value rows]. The splits and the
// broadcast of the rope key over the heads are column copies (ops::copy_columns, column_ops.h).
//
// Selective recomputation (--recompute-granularity selective) drops Q, K, V, the context and the
// log-sum-exp after forward and rebuilds them in backward from the kept projections, as
// SelfAttention does (Note [Selective recomputation] in attention.h).
//
// Note [MLA context parallelism]: under --context-parallel-size N, x holds this rank's rows of the
// sequence (Note [Load-balanced chunks]); every projection, norm and the tensor-parallel exchanges
// above work on those rows alone, the rope channels of the queries and of the shared rope key turn by
// the angles of the rows' global positions (the model gathers them: AttentionInputs::freqs), and the
// core attention is ContextParallelAttention's with every --cp-comm-type, which carries keys of
// qk + pe channels and values of dv (Note [Keys and values of two widths] in context_parallel.cpp).
// The rope key is broadcast over the heads before the exchange, as Megatron hands TE's CP attention
// whole per-head keys. Sinks and sliding windows are refused with MLA at all (TransformerConfig).
//
// Note [MLA KV cache]: inference caches what DeepSeek's inference caches — per position the
// compressed latent after kv_layernorm [kv_lora_rank] and the rope key after RoPE [pe], not the
// per-head keys and values (KVCache's keys and values of an MLA layer hold those two: [slots,
// max_length, 1, kv_lora_rank] and [slots, max_length, 1, pe]). Each forward writes the new tokens'
// latents and rope keys, then per sequence expands its cached positions through linear_kv_up_proj
// into keys and values and attends (CausalWithOffset: query j at position start + j sees keys
// 0 .. start + j). The up projection is not absorbed into the queries (Megatron's
// cache_mla_latents absorption), so the cache is small but each step re-expands the history.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "megatron/core/packed_seq_params.h"
#include "megatron/core/tensor_parallel/layers.h"
#include "megatron/core/transformer/context_parallel.h"
#include "megatron/core/transformer/kv_cache.h"
#include "megatron/core/transformer/norm.h"
#include "megatron/core/transformer/transformer_config.h"
#include "megatron/core/transformer/transformer_layer_spec.h"

namespace megatron {

struct Fp8Config;

class MLASelfAttention {
 public:
  /// Parameters under `prefix` ("decoder.layers.N.self_attention"): linear_q_down_proj,
  /// q_layernorm, linear_q_up_proj (or linear_q_proj), linear_kv_down_proj, kv_layernorm,
  /// linear_kv_up_proj, linear_proj. With tensor parallelism this rank holds n/tp heads.
  MLASelfAttention(const TransformerConfig& config, const MixerSpec& spec, ParamAndGradBuffer& params,
                   const std::string& prefix, const ProcessGroupCollection& pg = {});

  struct Saved {
    Tensor x;                  // input [s, b, h] (the sequence shard under --sequence-parallel)
    Norm::Saved q_norm;        // q_layernorm's input and statistics (its input is linear_q_down_proj's output)
    Tensor q_latent;           // linear_q_up_proj's input [s·b, q_lora_rank] (local rows)
    Norm::Saved kv_norm;       // kv_layernorm's
    Tensor kv_latent;          // linear_kv_up_proj's input [s·b, kv_lora_rank] (local rows)
    Tensor q, kv, k_pe;        // up projections [S·b, n·(qk+pe)], [S·b, n·(qk+dv)], rope key [S·b, pe]
                               // (S the whole sequence); dropped once Q/K/V are built unless recomputing
    Tensor Q, K, V, context, lse;  // core attention (dropped under selective recomputation); lse
                                   // without context parallelism, else in cp
    ContextParallelAttention::Saved cp;  // context parallelism: what its backward needs (core tensors)
    uint64_t dropout_offset = 0;
  };
  Tensor forward(Context& ctx, const Tensor& x, const AttentionInputs& in, uint64_t dropout_offset, bool keep_core,
                 Saved& saved) const;
  Tensor backward(Context& ctx, const Tensor& grad_out, const AttentionInputs& in, Saved& saved) const;

  // ---- inference (Note [MLA KV cache]; no dropout, one rank) ----
  /// x [s, b, h] -> [s, b, h]. freqs: rotary angles per (position, sequence) row, [s·b, pe/2].
  /// slots, starts [b]: sequence i uses cache slot slots[i], its tokens at positions starts[i]...
  /// latent_cache [slots, S, 1, kv_lora_rank], rope_cache [slots, S, 1, pe].
  Tensor forward_inference(Context& ctx, const Tensor& x, const Tensor& freqs, const CacheRows& rows,
                           Tensor& latent_cache, Tensor& rope_cache) const;

  /// Runs every linear layer in FP8 (Note [FP8 layers]); appends them to `fp8_linears`.
  void enable_fp8(const Fp8Config& config, Device device, std::vector<Linear*>& fp8_linears);

  int64_t local_heads() const { return n_; }
  float softmax_scale() const { return softmax_scale_; }

 private:
  void core_forward(Context& ctx, const AttentionInputs& in, Saved& saved) const;

  int64_t n_, qk_, pe_, dv_, q_lora_rank_, kv_lora_rank_;
  float softmax_scale_;
  float dropout_p_;
  float rope_scale_;  // YaRN's concentration factor on cos and sin (1 without YaRN)
  bool sequence_parallel_;
  Communicator* tp_;  // null: one rank
  std::optional<Linear> linear_q_down_proj_, linear_q_up_proj_, linear_q_proj_;
  std::optional<Norm> q_layernorm_;
  Linear linear_kv_down_proj_;
  std::optional<Norm> kv_layernorm_;
  Linear linear_kv_up_proj_;
  Linear linear_proj_;
  std::optional<ContextParallelAttention> cp_;  // Note [MLA context parallelism] (pg.cp has more than one rank)
};

}  // namespace megatron

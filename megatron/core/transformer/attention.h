// SelfAttention (Megatron-Core's SelfAttention with the local core attention): the fused QKV
// projection (grouped per query group), rotary embedding of q and k, causal softmax attention with
// GQA and attention dropout, and the output projection.
//
// Note [Fused QKV attention]: with MHA (nq == ng) and no RoPE the core attention reads q, k and v
// straight from the fused QKV projection (ops::attention_forward_qkv: on the GPU cuDNN takes them
// as strided views) and its backward writes the fused gradient, so there are no split and merge
// copies; Saved keeps the projection itself instead of q/k/v. GQA (one key/value head for several
// query heads is no single stride) and RoPE (q and k are rotated out of place) keep the split path.
//
// Note [Selective recomputation]: with --recompute-granularity selective the core attention's
// tensors (split q/k/v after RoPE where the split path runs, the attention output and its
// log-sum-exp) are dropped after forward and recomputed in backward from the kept QKV projection,
// as Megatron recomputes its core attention. The dropout stream offset is kept, so the
// recomputation is exact.
#pragma once

#include <string>

#include "megatron/core/tensor_parallel/layers.h"
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
    uint64_t dropout_offset = 0;
  };
  /// x [s, b, h] -> [s, b, h] (output projection applied, its bias included). freqs: rotary angles
  /// (undefined without RoPE). dropout_offset: the attention-dropout stream.
  Tensor forward(Context& ctx, const Tensor& x, const Tensor& freqs, uint64_t dropout_offset, bool keep_core,
                 Saved& saved) const;
  Tensor backward(Context& ctx, const Tensor& grad_out, const Tensor& freqs, Saved& saved) const;

  // ---- inference (KV cache; no dropout, nothing saved) ----
  /// x [s, b, h] -> [s, b, h]. freqs: rotary angles per (position, sequence) row, [s·b, r/2]
  /// (undefined without RoPE). Appends the new keys/values (after RoPE) to k_cache/v_cache
  /// [slots, S, ng, d] at slot slots[i], positions starts[i].., and attends over the cache.
  Tensor forward_inference(Context& ctx, const Tensor& x, const Tensor& freqs, const Tensor& slots,
                           const Tensor& starts, Tensor& k_cache, Tensor& v_cache) const;

 private:
  void core_forward(Context& ctx, const Tensor& freqs, Saved& saved) const;
  /// Note [Fused QKV attention]: whether the core attention reads the QKV projection directly.
  bool fused_qkv(const Tensor& freqs) const { return nq_ == ng_ && !freqs.defined(); }

  int64_t nq_, ng_, d_;
  float softmax_scale_;
  float dropout_p_;
  bool rope_interleaved_;
  Communicator* tp_;  // null: one rank
  Linear linear_qkv_;
  Linear linear_proj_;
};

}  // namespace megatron

// TransformerLayer (pre-norm, Megatron-Core's TransformerLayer), built from its layer spec:
//   h1 = input_layernorm(x);   x2 = x + dropout(mixer(h1))
//   h2 = pre_mlp_layernorm(x2); out = x2 + dropout(mlp(h2))
// The mixer and the MLP are alternatives (std::variant) of the kinds a spec can name, each with
// its own saved-activation struct held in a matching variant of Saved; forward picks the kind's
// Saved, backward reads it back. Adding a kind is its module plus one alternative here.
//
// Each layer draws three random streams per forward (the mixer's dropout, two hidden dropouts) at
// consecutive offsets from a base recorded in its Saved, so recomputation replays them exactly; an
// MoE router's input jitter draws from a stream of its own named by the same base (Note [Router
// input jitter] in moe/router.h).
// Under sequence parallelism x is this rank's sequence shard [s/tp, b, h]; the norms, dropouts and
// residuals work on the shard, the mixer and MLP gather and scatter the sequence.
#pragma once

#include <string>
#include <variant>
#include <vector>

#include "megatron/core/transformer/attention.h"
#include "megatron/core/transformer/mlp.h"
#include "megatron/core/transformer/multi_latent_attention.h"
#include "megatron/core/transformer/moe/moe_layer.h"
#include "megatron/core/transformer/norm.h"
#include "megatron/core/transformer/transformer_layer_spec.h"

namespace megatron {

class TransformerLayer {
 public:
  static constexpr uint64_t kRandomStreams = 3;

  /// The modules `spec` names, over the groups of `pg`. layer_number: the global decoder layer
  /// (0-based; the MoE router reports its losses under it).
  TransformerLayer(const TransformerConfig& config, const TransformerLayerSpec& spec, ParamAndGradBuffer& params,
                   const std::string& prefix, const ProcessGroupCollection& pg = {}, int layer_number = 0);

  /// The kinds a spec can name (TransformerLayerSpec), and their saved activations in the same order.
  using Mixer = std::variant<SelfAttention, MLASelfAttention>;
  using MixerSaved = std::variant<SelfAttention::Saved, MLASelfAttention::Saved>;
  using Mlp = std::variant<MLP, moe::MoELayer>;
  using MlpSaved = std::variant<MLP::Saved, moe::MoELayer::Saved>;

  struct Saved {
    Norm::Saved input_norm;
    MixerSaved mixer;
    Norm::Saved pre_mlp_norm;
    MlpSaved mlp;
    uint64_t rng_base = 0;
  };
  /// x [s, b, h] -> [s, b, h]. keep_core_attention=false drops the core attention tensors
  /// (Note [Selective recomputation]). An MoE layer reports its router's losses to `aux_losses`
  /// when `report_aux_losses` (not when recomputing) and takes their backward scale from it.
  Tensor forward(Context& ctx, const Tensor& x, const AttentionInputs& in, uint64_t rng_base, bool keep_core_attention,
                 Saved& saved, AuxLossTracker* aux_losses = nullptr, bool report_aux_losses = true) const;
  Tensor backward(Context& ctx, const Tensor& grad_out, const AttentionInputs& in, Saved& saved) const;

  /// Inference with a KV cache (SelfAttention::forward_inference, or MLASelfAttention's over its
  /// latent cache: Note [MLA KV cache]): x [s, b, h] -> [s, b, h], no dropout.
  Tensor forward_inference(Context& ctx, const Tensor& x, const Tensor& freqs, const CacheRows& rows,
                           Tensor& k_cache, Tensor& v_cache) const;

 private:
  Tensor mixer_forward(Context& ctx, const Tensor& x, const AttentionInputs& in, uint64_t offset, bool keep_core,
                       MixerSaved& saved) const;
  Tensor mixer_backward(Context& ctx, const Tensor& grad, const AttentionInputs& in, MixerSaved& saved) const;
  Tensor mlp_forward(Context& ctx, const Tensor& x, int64_t s, int64_t b, AuxLossTracker* aux_losses, bool report,
                     bool training, uint64_t rng_base, MlpSaved& saved) const;
  Tensor mlp_backward(Context& ctx, const Tensor& grad, MlpSaved& saved) const;

  float hidden_dropout_;
  bool sequence_parallel_;
  bool per_token_loss_;  // Note [Per-token loss]: the MoE losses' gradient times the layer's tokens
  Communicator* tp_;  // null: one rank
  Norm input_layernorm_;
  Mixer mixer_;
  Norm pre_mlp_layernorm_;
  Mlp mlp_;
  std::vector<Linear*> fp8_linears_;
  std::vector<Linear*> fp8_expert_linears_;

 public:
  /// The linear layers that run in FP8 (Note [FP8 layers]; empty when the spec says bf16): those
  /// replicated over tensor × context × data parallelism, and the routed experts' (replicated over
  /// expert tensor × expert data parallelism: Note [FP8 scaling under parallelism]).
  const std::vector<Linear*>& fp8_linears() const { return fp8_linears_; }
  const std::vector<Linear*>& fp8_expert_linears() const { return fp8_expert_linears_; }
  /// The MoE layer of this layer's MLP (null for a dense MLP).
  const moe::MoELayer* moe() const { return std::get_if<moe::MoELayer>(&mlp_); }
  moe::MoELayer* moe() { return std::get_if<moe::MoELayer>(&mlp_); }
};

}  // namespace megatron

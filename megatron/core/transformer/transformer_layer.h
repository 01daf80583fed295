// TransformerLayer (pre-norm, Megatron-Core's TransformerLayer):
//   h1 = input_layernorm(x);   x2 = x + dropout(self_attention(h1))
//   h2 = pre_mlp_layernorm(x2); out = x2 + dropout(mlp(h2))
// Each layer draws three random streams per forward (attention dropout, two hidden dropouts) at
// consecutive offsets from a base recorded in its Saved, so recomputation replays them exactly.
// Under sequence parallelism x is this rank's sequence shard [s/tp, b, h]; the norms, dropouts and
// residuals work on the shard, the attention and MLP gather and scatter the sequence.
#pragma once

#include <string>

#include "megatron/core/transformer/attention.h"
#include "megatron/core/transformer/mlp.h"
#include "megatron/core/transformer/norm.h"

namespace megatron {

class TransformerLayer {
 public:
  static constexpr uint64_t kRandomStreams = 3;

  TransformerLayer(const TransformerConfig& config, ParamAndGradBuffer& params, const std::string& prefix,
                   const ParallelState* ps = nullptr);

  struct Saved {
    Norm::Saved input_norm;
    SelfAttention::Saved attention;
    Norm::Saved pre_mlp_norm;
    MLP::Saved mlp;
    uint64_t rng_base = 0;
  };
  /// x [s, b, h] -> [s, b, h]. keep_core_attention=false drops the core attention tensors
  /// (Note [Selective recomputation]).
  Tensor forward(Context& ctx, const Tensor& x, const Tensor& freqs, uint64_t rng_base, bool keep_core_attention,
                 Saved& saved) const;
  Tensor backward(Context& ctx, const Tensor& grad_out, const Tensor& freqs, Saved& saved) const;

  /// Inference with a KV cache (SelfAttention::forward_inference): x [s, b, h] -> [s, b, h], no dropout.
  Tensor forward_inference(Context& ctx, const Tensor& x, const Tensor& freqs, const Tensor& slots,
                           const Tensor& starts, Tensor& k_cache, Tensor& v_cache) const;

 private:
  float hidden_dropout_;
  bool sequence_parallel_;
  const ParallelState* ps_;
  Norm input_layernorm_;
  SelfAttention self_attention_;
  Norm pre_mlp_layernorm_;
  MLP mlp_;
};

}  // namespace megatron

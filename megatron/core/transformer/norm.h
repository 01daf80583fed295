// Norm: LayerNorm or RMSNorm over the hidden dimension, as the layer spec says (Megatron's
// TENorm / FusedLayerNorm choice). Parameters "<prefix>.weight" (and "<prefix>.bias" for LayerNorm).
// Epsilon and zero-centered gamma (--apply-layernorm-1p) come from the config.
#pragma once

#include <string>

#include "megatron/core/distributed/param_and_grad_buffer.h"
#include "megatron/core/process_groups_config.h"
#include "megatron/core/transformer/transformer_config.h"
#include "megatron/core/transformer/transformer_layer_spec.h"
#include "megatron/runtime/context.h"

namespace megatron {

class Norm {
 public:
  /// With tensor parallelism (pg.tp) the weights are duplicated on every tensor-parallel rank; with
  /// sequence parallelism their gradients are partial sums (all-reduced over the group later).
  Norm(const TransformerConfig& config, NormKind kind, ParamAndGradBuffer& params, const std::string& prefix,
       const ProcessGroupCollection& pg = {});
  /// The per-head norm of queries or keys (--qk-layernorm, Note [QK layernorm] in attention.h): over
  /// kv_channels, one weight for every head. Under tensor parallelism the weights are whole on every
  /// rank but each rank's gradient is a partial sum over its heads (tp_partial_grad), never
  /// sequence parallel. Inputs are [rows, kv_channels].
  static Norm per_head(const TransformerConfig& config, ParamAndGradBuffer& params, const std::string& prefix,
                       const ProcessGroupCollection& pg = {});
  /// A norm over `size` channels (multi-latent attention's q_layernorm over q_lora_rank and
  /// kv_layernorm over kv_lora_rank), its weights duplicated on the tensor-parallel ranks and
  /// sequence parallel as the hidden-size norms are. Inputs are [rows, size].
  static Norm of_size(const TransformerConfig& config, NormKind kind, ParamAndGradBuffer& params,
                      const std::string& prefix, int64_t size, const ProcessGroupCollection& pg = {});

  struct Saved {
    Tensor x;     // input [N, h]
    Tensor mean;  // [N] fp32 (LayerNorm only)
    Tensor rstd;  // [N] fp32
  };
  /// x [N, h] -> [N, h]; fills `saved` for backward.
  Tensor forward(Context& ctx, const Tensor& x, Saved& saved) const;
  /// Returns the input gradient; accumulates the weight (and bias) gradients.
  Tensor backward(Context& ctx, const Tensor& grad_out, const Saved& saved) const;

 private:
  Norm(const TransformerConfig& config, NormKind kind, ParamAndGradBuffer& params, const std::string& prefix,
       const ProcessGroupCollection& pg, bool per_head, int64_t size);

  bool rms_;
  bool zero_centered_gamma_;
  float eps_;
  Parameter* weight_;
  Parameter* bias_ = nullptr;
};

}  // namespace megatron

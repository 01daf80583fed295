// MLP: linear_fc1 -> activation -> linear_fc2 (Megatron-Core's MLP, the dense MLP of a layer spec).
// With SwiGLU, fc1 produces [gate; up] (2·ffn rows) and the activation is silu(gate)·up; with GeLU,
// fc1 produces ffn rows. ffn is the spec's intermediate size (the config's unless the spec says).
// With --quick-geglu the gated activation is quick_gelu(min(gate, c))·(clamp(up, -c, c) + offset)
// (GPT-OSS; ops::quick_geglu_*), with --glu-linear-offset and --activation-func-clamp-value.
#pragma once

#include <optional>

#include <string>
#include <vector>

#include "megatron/core/tensor_parallel/layers.h"
#include "megatron/core/transformer/transformer_config.h"
#include "megatron/core/transformer/transformer_layer_spec.h"

namespace megatron {

/// The activation of an MLP's fc1 output (the dense MLP's and the experts'): GeLU on [N, ffn], or a
/// gated unit on [N, 2·ffn] = [gate | up] -> [N, ffn]: SwiGLU or the clamped quick-GeGLU.
struct MlpActivation {
  enum class Kind { Gelu, Swiglu, QuickGeglu };
  Kind kind = Kind::Gelu;
  float alpha = 1.702f;  // quick_gelu(x) = x·σ(1.702x), as Megatron's
  float limit = 0.0f;    // quick-GeGLU's clamp (+inf: none)
  float linear_offset = 0.0f;

  static MlpActivation from_config(const TransformerConfig& config);
  bool gated() const { return kind != Kind::Gelu; }
  /// out [N, ffn] from fc1 [N, ffn] or [N, 2·ffn].
  void forward(Context& ctx, const Tensor& fc1, Tensor& out) const;
  /// grad_fc1 (fc1's shape) from the gradient of out.
  void backward(Context& ctx, const Tensor& grad_out, const Tensor& fc1, Tensor& grad_fc1) const;
};

class MLP {
 public:
  /// With tensor parallelism (pg.tp) fc1 is column-parallel (SwiGLU: [gate; up] blocks split
  /// separately) and fc2 row-parallel; this rank holds ffn/tp of the intermediate features.
  MLP(const TransformerConfig& config, const MlpSpec& spec, ParamAndGradBuffer& params, const std::string& prefix,
      const ProcessGroupCollection& pg = {});

  struct Saved {
    Tensor x;    // input [N, h]
    Tensor fc1;  // [N, ffn] or [N, 2·ffn]; the activation is recomputed from it in backward
  };
  /// x [N, h] -> [N, h] (fc2 bias included).
  Tensor forward(Context& ctx, const Tensor& x, Saved& saved) const;
  Tensor backward(Context& ctx, const Tensor& grad_out, const Saved& saved) const;

  /// Runs fc1 and fc2 in FP8 (Note [FP8 layers]); appends them to `fp8_linears`.
  void enable_fp8(const Fp8Config& config, Device device, std::vector<Linear*>& fp8_linears);

 private:
  Tensor activation(Context& ctx, const Tensor& fc1) const;
  /// The activation when the linear layers take its tensors as produced ones (SwiGLU, GeLU).
  std::optional<Fp8Activation> produced_activation() const;
  /// fc2's input: act(fc1) as a produced tensor (Note [Produced tensors]), or computed.
  ProducedTensor fc2_input(Context& ctx, const Tensor& fc1) const;

  MlpActivation act_;
  bool swiglu_;  // gated (SwiGLU or quick-GeGLU)
  int64_t ffn_;
  Linear linear_fc1_;
  Linear linear_fc2_;
};

}  // namespace megatron

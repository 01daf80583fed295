#include "megatron/core/models/gpt/gpt_layer_specs.h"

#include <algorithm>

namespace megatron {

const char* mixer_kind_name(MixerKind k) {
  switch (k) {
    case MixerKind::SelfAttention:
      return "self_attention";
    case MixerKind::MLA:
      return "multi_latent_attention";
  }
  return "?";
}

const char* mlp_kind_name(MlpKind k) {
  switch (k) {
    case MlpKind::Dense:
      return "dense";
    case MlpKind::MoE:
      return "moe";
  }
  return "?";
}

TransformerLayerSpec get_gpt_layer_spec(const TransformerConfig& config, bool moe) {
  const NormKind norm = config.use_rmsnorm() ? NormKind::RMSNorm : NormKind::LayerNorm;
  TransformerLayerSpec spec;
  spec.input_layernorm = norm;
  spec.mixer.kind = config.multi_latent_attention ? MixerKind::MLA : MixerKind::SelfAttention;
  spec.pre_mlp_layernorm = norm;
  spec.mlp.kind = moe ? MlpKind::MoE : MlpKind::Dense;
  spec.mlp.ffn_hidden_size = moe ? (config.moe_ffn_hidden_size > 0 ? config.moe_ffn_hidden_size : config.ffn_hidden_size)
                                 : config.ffn_hidden_size;
  return spec;
}

TransformerBlockSpec get_gpt_decoder_block_spec(const TransformerConfig& config) {
  TransformerBlockSpec block;
  // --moe-layer-freq: the MoE layers of the pattern, dense ones elsewhere (Megatron's
  // get_gpt_decoder_block_spec with moe_layer_pattern).
  for (int i = 0; i < config.num_layers; ++i) {
    block.layers.push_back(get_gpt_layer_spec(config, config.is_moe_layer(i)));
    // --window-size with --window-attn-skip-freq (Megatron's is_layer_window_attention).
    block.layers.back().mixer.window_left = config.layer_window_left(i);
    // Note [FP8 layers]
    block.layers.back().fp8 = config.fp8.enabled() && !is_first_last_bf16_layer(config.fp8, config.num_layers, i);
  }
  block.final_layernorm = config.use_rmsnorm() ? NormKind::RMSNorm : NormKind::LayerNorm;
  return block;
}

}  // namespace megatron

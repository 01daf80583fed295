#include "megatron/core/models/gpt/gpt_layer_specs.h"

#include <algorithm>

namespace megatron {

const char* mixer_kind_name(MixerKind k) {
  switch (k) {
    case MixerKind::SelfAttention:
      return "self_attention";
  }
  return "?";
}

const char* mlp_kind_name(MlpKind k) {
  switch (k) {
    case MlpKind::Dense:
      return "dense";
  }
  return "?";
}

TransformerLayerSpec get_gpt_layer_spec(const TransformerConfig& config) {
  const NormKind norm = config.use_rmsnorm() ? NormKind::RMSNorm : NormKind::LayerNorm;
  TransformerLayerSpec spec;
  spec.input_layernorm = norm;
  spec.mixer.kind = MixerKind::SelfAttention;
  spec.pre_mlp_layernorm = norm;
  spec.mlp.kind = MlpKind::Dense;
  spec.mlp.ffn_hidden_size = config.ffn_hidden_size;
  return spec;
}

TransformerBlockSpec get_gpt_decoder_block_spec(const TransformerConfig& config) {
  TransformerBlockSpec block;
  block.layers.assign(size_t(std::max(config.num_layers, 0)), get_gpt_layer_spec(config));
  block.final_layernorm = config.use_rmsnorm() ? NormKind::RMSNorm : NormKind::LayerNorm;
  return block;
}

}  // namespace megatron

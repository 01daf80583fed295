// The GPT decoder's layer specs (Megatron-Core's gpt_layer_specs.py: get_gpt_layer_local_spec and
// get_gpt_decoder_block_spec): one TransformerLayerSpec per decoder layer, made from the config —
// the norms from --normalization, self-attention as the mixer, a dense MLP of --ffn-hidden-size or,
// on the layers --moe-layer-freq names (a finalized config's moe_layer_pattern), a mixture of
// experts of --moe-ffn-hidden-size. Hybrid patterns (when they exist) are cases here too.
#pragma once

#include "megatron/core/transformer/transformer_config.h"
#include "megatron/core/transformer/transformer_layer_spec.h"

namespace megatron {

/// The spec of a dense layer (moe: an MoE layer) of a model of this config.
TransformerLayerSpec get_gpt_layer_spec(const TransformerConfig& config, bool moe = false);
/// One spec per decoder layer, config.num_layers of them.
TransformerBlockSpec get_gpt_decoder_block_spec(const TransformerConfig& config);

}  // namespace megatron

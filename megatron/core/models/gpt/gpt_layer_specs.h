// The GPT decoder's layer specs (Megatron-Core's gpt_layer_specs.py: get_gpt_layer_local_spec and
// get_gpt_decoder_block_spec): one TransformerLayerSpec per decoder layer, made from the config —
// the norms from --normalization, self-attention as the mixer, a dense MLP of --ffn-hidden-size.
// This is where the layout flags become specs: --moe-layer-freq, dense first layers and hybrid
// patterns (when those exist) are cases here.
#pragma once

#include "megatron/core/transformer/transformer_config.h"
#include "megatron/core/transformer/transformer_layer_spec.h"

namespace megatron {

/// The spec of every layer of a model of this config (the config need not be finalized).
TransformerLayerSpec get_gpt_layer_spec(const TransformerConfig& config);
/// One spec per decoder layer, config.num_layers of them.
TransformerBlockSpec get_gpt_decoder_block_spec(const TransformerConfig& config);

}  // namespace megatron

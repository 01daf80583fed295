// Layer specs (Megatron-Core's ModuleSpec / TransformerLayerSubmodules, without the reflection):
// which implementation each part of a decoder layer has — its mixer (the token-mixing sublayer:
// self-attention or multi-latent attention; Mamba would be a further kind), its MLP (dense, or a
// mixture of experts) and its norms — and the per-layer values that differ from the config.
// A block spec holds one layer spec per decoder layer (by global layer index), so layouts such as
// an MoE layer every other layer, dense first layers or a hybrid pattern are data, not code paths.
//
// Specs are made in one place (models/gpt/gpt_layer_specs.h, Megatron's get_gpt_decoder_block_spec);
// TransformerLayer builds the modules a spec names. Adding a kind is its module, one alternative
// in TransformerLayer's Mixer/Mlp variants and one case where specs are made: the block, the model,
// the schedules and checkpointing do not change.
#pragma once

#include <vector>

namespace megatron {

enum class NormKind { LayerNorm, RMSNorm };
enum class MixerKind { SelfAttention, MLA };
enum class MlpKind { Dense, MoE };

struct MixerSpec {
  MixerKind kind = MixerKind::SelfAttention;
  int window_left = -1;  // Note [Sliding-window attention]: this layer's left window; -1: full attention
};

struct MlpSpec {
  MlpKind kind = MlpKind::Dense;
  int ffn_hidden_size = 0;  // intermediate size of this layer's MLP (each expert's for MoE); 0: the config's
};

// Note [FP8 layers]: with --fp8-format a layer's linear layers of attention and MLP (an MoE
// layer's routed experts, grouped or sequential, and shared experts included: Note [FP8 experts])
// run their GEMMs in FP8 — Megatron's choice: not the embedding, the output layer, the router or
// the attention core. --first-last-layers-bf16
// keeps the first --num-layers-at-start-in-bf16 and last --num-layers-at-end-in-bf16 layers in bf16
// (Megatron's is_first_last_bf16_layer). The spec carries the per-layer answer.
struct TransformerLayerSpec {
  NormKind input_layernorm = NormKind::LayerNorm;
  MixerSpec mixer;
  NormKind pre_mlp_layernorm = NormKind::LayerNorm;
  MlpSpec mlp;
  bool fp8 = false;  // Note [FP8 layers]
};

struct TransformerBlockSpec {
  std::vector<TransformerLayerSpec> layers;  // one per decoder layer, by global layer index
  NormKind final_layernorm = NormKind::LayerNorm;
};

const char* mixer_kind_name(MixerKind k);
const char* mlp_kind_name(MlpKind k);

}  // namespace megatron

// Helpers shared by the tests that build small models: the Llama-style layer choices.
#pragma once

#include "megatron/core/transformer/transformer_config.h"

namespace megatron::testing {

/// The layer choices of a Llama-style model on top of `c`: RMSNorm, SwiGLU, no linear biases, RoPE
/// and an output layer untied from the embedding. Sizes (query groups, FFN width) stay the caller's.
inline void use_llama_layers(TransformerConfig& c) {
  c.normalization = "RMSNorm";
  c.activation = "swiglu";
  c.add_bias_linear = false;
  c.position_embedding_type = "rope";
  c.share_embeddings_and_output_weights = false;
}

}  // namespace megatron::testing

// What the benchmarks share about the models they build.
#pragma once

#include "megatron/training/arguments.h"

namespace megatron::bench {

/// Llama-style model flags on top of a GPT shape: grouped-query attention with `groups` groups,
/// SwiGLU of width `ffn`, RMSNorm (eps 1e-5), RoPE with `rotary_base`, no biases.
inline void set_llama_style(Arguments& a, int groups, int ffn, float rotary_base) {
  a.swiglu = true;
  a.group_query_attention = true;
  a.num_query_groups = groups;
  a.ffn_hidden_size = ffn;
  a.normalization = "RMSNorm";
  a.norm_epsilon = 1e-5f;
  a.position_embedding_type = "rope";
  a.rotary_base = rotary_base;
  a.disable_bias_linear = true;
}

}  // namespace megatron::bench

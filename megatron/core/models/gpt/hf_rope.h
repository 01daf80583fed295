// The position and attention-window fields of a Llama-family HF config.json (llama, mistral, qwen2,
// qwen3 and their MoE relatives) <-> TransformerConfig: rope_theta, partial_rotary_factor, the RoPE
// scaling, and the sliding window that must not be active. hf_config.cpp's config_from_hf and
// hf_config_from_megatron call these (and the GPT-OSS and DeepSeek-V3 readers and writers).
//
// Note [HF RoPE scaling]
// transformers 4 writes `rope_theta` and `rope_scaling` ({"rope_type" (older files: "type"),
// "factor", ...}); transformers 5 writes `rope_parameters` (the same keys, rope_theta inside, rope_type
// "default" without scaling) and reads the older form too. Both are read here; when both are given,
// rope_scaling wins, as transformers 5 decides. Two types are supported:
//   llama3 (Llama 3.1/3.2) -> --use-rope-scaling --rope-scaling-factor <factor>. Megatron fixes
//          low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192 (every Llama 3.x
//          uses these); other values are refused.
//   yarn   (Qwen2/Qwen3, gpt-oss, ...) -> --position-embedding-type yarn with --rotary-scaling-factor
//          <factor>, --yarn-original-max-position-embeddings (rope's, else the top-level
//          original_max_position_embeddings, else max_position_embeddings, as transformers 5),
//          --yarn-beta-fast/--yarn-beta-slow (beta_fast/beta_slow, 0 or absent: 32/1),
//          --no-yarn-correction-range-round-to-int for truncate false. The attention factor: HF takes
//          attention_factor when given, else mscale(f, mscale)/mscale(f, mscale_all_dim) when both are
//          non-zero, else mscale(f, 1); Megatron always takes the ratio with --mscale (default 1) and
//          --mscale-all-dim (default 0), which gives the same values; an attention_factor that the
//          ratio does not give is refused. Export writes mscale/mscale_all_dim when not (1, 0) and
//          attention_factor when HF would not compute the ratio from them, so a round trip is exact.
// Every other type (linear, dynamic, longrope, ...) is refused with one line naming it.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "megatron/core/transformer/transformer_config.h"

namespace megatron {

/// position_embedding_type, rotary_base, rotary_percent and the RoPE scaling of `config` from an HF
/// Llama-family config.json (Note [HF RoPE scaling]); one line for what is not supported.
void rope_config_from_hf(const nlohmann::json& hf_config, TransformerConfig& config);

/// Refuses (one line) an HF config whose attention uses a sliding window on some layer and sequences
/// that reach it: Mistral/Mixtral's sliding_window, Qwen's with use_sliding_window true (on the layers
/// layer_types, or else max_window_layers, names). A window of at least max_position_embeddings never
/// applies and is accepted, as is one that use_sliding_window switches off.
void check_hf_attention_window(const nlohmann::json& hf_config, const std::string& model_type,
                               const TransformerConfig& config);

/// The RoPE fields of the HF config of a model trained here: rope_theta, partial_rotary_factor (when
/// not 1) and rope_scaling (llama3 or yarn; absent without scaling), as transformers 4 writes them; with
/// rope_parameters, transformers 5's form instead: rope_theta and the scaling inside rope_parameters,
/// whose rope_type is "default" without scaling (Note [HF RoPE scaling]).
void rope_config_to_hf(const TransformerConfig& config, nlohmann::json& hf_config, bool rope_parameters = false);

}  // namespace megatron

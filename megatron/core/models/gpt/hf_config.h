// HuggingFace config.json <-> TransformerConfig: which HF model a config is (HFFamily) and the
// Megatron-Core config it computes the same as, and the config.json of a model trained here. The
// tensors that go with it are hf_mapping.h's; the RoPE and window fields are hf_rope.h's, GPT-OSS's
// and DeepSeek-V3's own fields hf_gpt_oss.h's and hf_deepseek.h's. The mixture-of-experts fields
// (routing, dense layers, the aux loss) follow Note [HF mixture of experts] in hf_mapping.h.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "megatron/core/transformer/transformer_config.h"

namespace megatron {

enum class HFFamily { GPT2, Llama, GptOss, DeepSeek };  // GptOss: hf_gpt_oss.h, DeepSeek: hf_deepseek.h

struct HFModelInfo {
  HFFamily family = HFFamily::GPT2;
  std::string model_type;
  TransformerConfig config;  // finalized
  /// DeepSeek's rope_interleave (Note [Importing DeepSeek's interleaved RoPE] in hf_deepseek.h).
  bool rope_interleave = false;
};

/// Reads a HuggingFace config.json (GPT-2, Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE,
/// Qwen3-MoE, GPT-OSS: Note [HF GPT-OSS] in hf_gpt_oss.h, DeepSeek-V3: Note [HF DeepSeek-V3] in hf_deepseek.h),
/// with llama3 and yarn RoPE scaling (Note [HF RoPE scaling] in hf_rope.h). Unknown
/// model types and unsupported options (e.g. other rope scalings, active sliding windows, router
/// jitter) are refused with a clear message. make_vocab_size_divisible_by sets the padding
/// of the vocabulary.
HFModelInfo config_from_hf(const nlohmann::json& hf_config, int make_vocab_size_divisible_by = 128);

/// The HF config.json of a model trained here (a checkpoint without an HF config): gpt2 (GeLU MLP;
/// untied with --untie-embeddings-and-output-weights), llama, qwen2 (--add-qkv-bias), qwen3
/// (--qk-layernorm), mixtral (every layer MoE, no shared experts), qwen2_moe (a gated shared expert),
/// qwen3_moe (MoE with --qk-layernorm), gpt_oss (attention sinks, windows or --quick-geglu) or
/// deepseek_v3 (--multi-latent-attention). One line naming the flag when the model computes something
/// HF cannot (Note [Which HF model a checkpoint exports as] in the .cpp). config_from_hf of the
/// result, with megatron_to_hf's tensors (hf_mapping.h), gives a model that computes the same.
nlohmann::json hf_config_from_megatron(const TransformerConfig& config);

}  // namespace megatron

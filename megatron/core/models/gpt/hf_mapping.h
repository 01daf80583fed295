// HuggingFace <-> Megatron-Core names and layouts for the GPT-2 and Llama families (Llama, Mistral,
// Qwen2, Qwen3: the same tensor names; Qwen2 adds q/k/v biases, Qwen3 the per-head RMSNorms of
// queries and keys, self_attn.q_norm/k_norm <-> self_attention.q_layernorm/k_layernorm).
//
//   GPT-2: Conv1D weights are [in, out] (transposed here); c_attn packs q, k, v along `out`.
//   Llama: q_proj/k_proj/v_proj are separate; gate_proj and up_proj become linear_fc1 = [gate; up].
//   Both:  the fused QKV is regrouped per query group (Note in ops.h on the QKV layout); the word
//          embeddings (and an untied lm_head) are padded with zero rows to the padded vocabulary
//          and stripped on the way back.
// Everything goes through name -> Tensor maps, so checkpoints, converters and tests share it.
#pragma once

#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "megatron/core/models/gpt/gpt_model.h"

namespace megatron {

using TensorMap = std::map<std::string, Tensor>;

enum class HFFamily { GPT2, Llama };

struct HFModelInfo {
  HFFamily family = HFFamily::GPT2;
  std::string model_type;
  TransformerConfig config;  // finalized
};

/// Reads a HuggingFace config.json (GPT-2, Llama, Mistral, Qwen2, Qwen3). Unknown model types and
/// unsupported options (e.g. rope scaling, sliding windows) are refused with a clear message.
/// make_vocab_size_divisible_by sets the padding of the vocabulary.
HFModelInfo config_from_hf(const nlohmann::json& hf_config, int make_vocab_size_divisible_by = 128);

/// HF tensors -> Megatron-Core tensors (fp32 host). get_hf(name) returns the HF tensor or throws.
/// Shapes are checked against the config; a mismatch names the tensor and both shapes.
TensorMap hf_to_megatron(const HFModelInfo& info, const std::function<Tensor(const std::string&)>& get_hf);
/// Megatron-Core tensors -> HF tensors (fp32 host), the exact inverse of hf_to_megatron.
TensorMap megatron_to_hf(const HFModelInfo& info, const TensorMap& megatron);

/// The model's parameters (or their fp32 gradients) by Megatron-Core name, as host fp32 copies.
TensorMap model_state_dict(const GPTModel& model);
TensorMap model_grad_dict(const GPTModel& model);
/// Copies tensors into the model's parameters (converted to the model dtype). Every parameter must
/// be present with its exact shape; an extra tensor is an error too. Errors name the tensor.
void load_model_state_dict(GPTModel& model, const TensorMap& state, const std::string& source);

}  // namespace megatron

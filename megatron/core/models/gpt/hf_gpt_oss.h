// HuggingFace GPT-OSS (model_type "gpt_oss") <-> Megatron-Core, called by hf_config.cpp (the config)
// and hf_mapping.cpp (the tensors).
//
// Note [HF GPT-OSS]
// The config: every layer MoE (num_local_experts, num_experts_per_tok; the router is a linear with
// a bias, top-k of its logits, then softmax over the chosen: Megatron's default routing), RMSNorm,
// YaRN (hf_rope.h), q/k/v/o with biases (attention_bias; Megatron's --add-bias-linear, which also
// gives the router and the experts their biases, as GPT-OSS has them), attention sinks
// (--softmax-type learnable), sliding_window W on the layers layer_types calls "sliding_attention"
// (--window-size W-1,0 with --window-attn-skip-freq as the list pattern of layer_types; HF's default
// layer_types, sliding on even layers, is --window-attn-skip-freq 2), and the experts' clamped SwiGLU
// (swiglu_limit, alpha 1.702, (up + 1)·glu): --quick-geglu --glu-linear-offset 1
// --activation-func-clamp-value <swiglu_limit>.
// The tensors (per layer L, experts E):
//   self_attn.{q,k,v}_proj.{weight,bias} -> self_attention.linear_qkv.{weight,bias} (grouped per query group)
//   self_attn.o_proj.{weight,bias}       -> self_attention.linear_proj.{weight,bias}
//   self_attn.sinks [nq]                 -> self_attention.core_attention.softmax_offset
//   mlp.router.{weight,bias}             -> mlp.router.{weight,bias}
//   mlp.experts.gate_up_proj [E, h, 2f]  -> local_experts.e.linear_fc1.weight [2f, h] = [gate; up]: HF
//                                          interleaves gate (columns 0, 2, ...) and up (1, 3, ...)
//   mlp.experts.gate_up_proj_bias [E, 2f] -> local_experts.e.linear_fc1.bias, de-interleaved alike
//   mlp.experts.down_proj [E, f, h]      -> local_experts.e.linear_fc2.weight [h, f] (transposed)
//   mlp.experts.down_proj_bias [E, h]    -> local_experts.e.linear_fc2.bias
// The export is the exact inverse; hf_gpt_oss_config writes a config.json that reads back to the
// same TransformerConfig.
#pragma once

#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "megatron/core/models/gpt/hf_mapping.h"
#include "megatron/core/transformer/transformer_config.h"
#include "megatron/runtime/tensor.h"

namespace megatron {

/// The TransformerConfig fields of a gpt_oss config.json (before finalize()); one line for what is
/// not supported.
void gpt_oss_config_from_hf(const nlohmann::json& hf_config, TransformerConfig& config);

/// Whether a model trained here uses one of GPT-OSS's pieces (sinks, windows, quick-GeGLU), so that
/// its HF export is gpt_oss.
bool uses_gpt_oss_features(const TransformerConfig& config);

/// The gpt_oss config.json of a model trained here; one line naming the flag where the model computes
/// something GPT-OSS cannot.
nlohmann::json hf_gpt_oss_config(const TransformerConfig& config);

/// HF tensors (get_hf: by HF name, fp32 host) -> Megatron-Core tensors, into `out`.
void gpt_oss_to_megatron(const TransformerConfig& config, const std::function<Tensor(const std::string&)>& get_hf,
                         TensorSink& out);
/// The inverse: Megatron-Core tensors (get: by our name) -> HF tensors, into `out`.
void megatron_to_gpt_oss(const TransformerConfig& config, const std::function<Tensor(const std::string&)>& get,
                         TensorSink& out);

}  // namespace megatron

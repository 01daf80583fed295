// HuggingFace DeepSeek-V3 (model_type "deepseek_v3", DeepseekV3ForCausalLM) <-> Megatron-Core:
// multi-latent attention, YaRN, dense first layers then MoE with sigmoid group-limited routing, an
// expert bias and shared experts. hf_config.cpp's config_from_hf / hf_config_from_megatron and
// hf_mapping.cpp's hf_to_megatron / megatron_to_hf dispatch here for it.
//
// Note [HF DeepSeek-V3]
//   config: num_attention_heads -> --num-attention-heads (num_key_value_heads must equal it),
//     q_lora_rank (null: none) / kv_lora_rank / qk_nope_head_dim / qk_rope_head_dim / v_head_dim ->
//     --q-lora-rank / --kv-lora-rank / --qk-head-dim / --qk-pos-emb-head-dim / --v-head-dim with
//     --multi-latent-attention and --qk-layernorm (HF always has the latents' RMSNorms), RoPE as
//     Note [HF RoPE scaling] says (rope_type yarn -> --rope-type yarn), first_k_dense_replace ->
//     --moe-layer-freq [0]*k + [1]*(L-k), n_routed_experts / num_experts_per_tok /
//     moe_intermediate_size -> --num-experts / --moe-router-topk / --moe-ffn-hidden-size,
//     n_shared_experts · moe_intermediate_size -> --moe-shared-expert-intermediate-size, sigmoid
//     scores with the expert bias (--moe-router-score-function sigmoid
//     --moe-router-enable-expert-bias), n_group / topk_group -> --moe-router-num-groups /
//     --moe-router-group-topk, routed_scaling_factor -> --moe-router-topk-scaling-factor.
//     norm_topk_prob must be true (Megatron renormalises sigmoid top-k scores); attention_bias must
//     be false; rms_norm_eps must be 1e-6 (HF's latent norms always use 1e-6, Megatron's --norm-epsilon);
//     num_nextn_predict_layers <-> --mtp-num-layers (Note [HF DeepSeek-V3 MTP]).
//   tensors: self_attn.q_a_proj / q_a_layernorm / q_b_proj (or q_proj) / kv_a_proj_with_mqa /
//     kv_a_layernorm / kv_b_proj / o_proj -> self_attention.linear_q_down_proj / q_layernorm /
//     linear_q_up_proj (linear_q_proj) / linear_kv_down_proj / kv_layernorm / linear_kv_up_proj /
//     linear_proj; mlp.gate.weight -> mlp.router.weight; mlp.gate.e_score_correction_bias (a buffer)
//     -> mlp.router.expert_bias (a model buffer); mlp.experts.E.* and mlp.shared_experts.* as the
//     other MoE families.
//
// Note [HF DeepSeek-V3 MTP]: DeepSeek-V3 stores multi-token-prediction depth k (0-based) as the
// layer after the decoder's, L = num_hidden_layers + k: model.layers.{L}.enorm / hnorm / eh_proj
// [h, 2h] (the embedding half first, as Megatron's concatenation) -> mtp.layers.{k}.enorm / hnorm /
// eh_proj; shared_head.norm -> mtp.layers.{k}.final_layernorm; its decoder layer (self_attn.*, mlp.*,
// the norms) -> mtp.layers.{k}.transformer_layer.* exactly as a decoder layer's. Its embed_tokens and
// shared_head.head are copies of the model's embedding and output head, which Megatron's MTP layers
// share: the import requires them bit-equal to model.embed_tokens / lm_head (one line otherwise), the
// export writes the copies. HF makes every layer from first_k_dense_replace on MoE, the MTP layers
// included, and Megatron builds them from the decoder's last layer, so a model whose last decoder layer
// is dense is refused with MTP. transformers' DeepseekV3ForCausalLM neither loads nor saves these
// layers, so folders it wrote keep num_nextn_predict_layers without their weights: the folder form of
// config_from_hf imports those without MTP (hf_mapping.h).
//
// Note [Importing DeepSeek's interleaved RoPE]: with rope_interleave true (DeepSeek's checkpoints)
// HF rotates the rope channels of q and of the shared key in pairs (2j, 2j+1); Megatron's MLA rotates
// (j, j + pe/2) and refuses --rotary-interleaved. With P the permutation sending channel 2j to j and
// 2j+1 to j + pe/2, rotate_half(P x) = P interleaved(x), and the scores only see q_pe·k_pe, which P
// leaves unchanged when applied to both. So the import permutes the rope rows of each head of
// q_b_proj (q_proj) and the rope rows of kv_a_proj_with_mqa; the export permutes them back and writes
// rope_interleave true. Exact both ways.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>

#include "megatron/core/models/gpt/hf_mapping.h"

namespace megatron {

bool is_hf_deepseek(const std::string& model_type);
/// The fields of a deepseek_v3 config.json (Note [HF DeepSeek-V3]); one line for what is not supported.
void deepseek_config_from_hf(const nlohmann::json& hf_config, TransformerConfig& config);
void deepseek_to_megatron(const HFModelInfo& info, const std::function<Tensor(const std::string&)>& get_hf,
                          TensorSink& out);
void megatron_to_deepseek(const HFModelInfo& info, const TensorSource& megatron, TensorSink& out);
/// Note [HF DeepSeek-V3 MTP]: an MTP depth's copies of the embedding and output head must equal the
/// model's (one line naming the tensor otherwise). hf_to_megatron's map form checks them; a
/// streaming converter calls this before its passes.
void check_deepseek_mtp_copies(const HFModelInfo& info, const std::function<Tensor(const std::string&)>& get_hf);
/// The same from the tensors' shapes and a comparison of two tensors' bytes (a converter compares
/// them a chunk at a time: Note [Streaming conversion] in tools/convert_checkpoint.cpp).
void check_deepseek_mtp_copies(const HFModelInfo& info, const std::function<Shape(const std::string&)>& shape_of,
                               const std::function<bool(const std::string&, const std::string&)>& same);
nlohmann::json deepseek_config_to_hf(const TransformerConfig& config);

}  // namespace megatron

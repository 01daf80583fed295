// TransformerConfig: every hyperparameter of the model, with Megatron-Core's names and defaults.
// finalize() fills the derived values (ffn size, query groups, kv channels, padded vocabulary) and
// validates the shape rules with one clear error line each.
#pragma once

#include <string>
#include <vector>

#include "megatron/core/fp8_utils.h"
#include "megatron/runtime/dtype.h"

namespace megatron {

struct TransformerConfig {
  // ---- shape
  int num_layers = 0;
  int hidden_size = 0;
  int ffn_hidden_size = 0;  // 0: 4 * hidden_size
  int num_attention_heads = 0;
  int num_query_groups = 0;  // 0: num_attention_heads (MHA); fewer: GQA
  int kv_channels = 0;       // 0: hidden_size / num_attention_heads
  int max_position_embeddings = 0;
  int seq_length = 0;
  int vocab_size = 0;
  int make_vocab_size_divisible_by = 128;
  int padded_vocab_size = 0;  // derived: vocab padded to a multiple of divisible_by * tp

  // ---- architecture (the layer spec is derived from these)
  std::string normalization = "LayerNorm";     // LayerNorm | RMSNorm
  bool layernorm_zero_centered_gamma = false;  // --apply-layernorm-1p
  float layernorm_epsilon = 1e-5f;
  bool add_bias_linear = true;
  bool add_qkv_bias = false;  // Megatron: add_bias_linear also adds the qkv bias
  bool gated_linear_unit = false;
  std::string activation = "gelu";  // gelu | swiglu | quick_geglu (the last two imply gated_linear_unit)
  std::string position_embedding_type = "learned_absolute";  // learned_absolute | rope | yarn | none
  float rotary_base = 10000.0f;
  float rotary_percent = 1.0f;
  bool rotary_interleaved = false;
  // RoPE scaling (core/models/common/embeddings/rotary_pos_embedding.h): Llama 3's (Note [Llama 3
  // RoPE scaling]; Megatron's GPTModel rope_scaling / rope_scaling_factor) with rope, YaRN's (Note
  // [YaRN]; Megatron's config.yarn_*) with position_embedding_type yarn.
  bool rope_scaling = false;  // --use-rope-scaling
  float rope_scaling_factor = 8.0f;
  float yarn_rotary_scaling_factor = 1.0f;  // --rotary-scaling-factor
  int yarn_original_max_position_embeddings = 4096;
  float yarn_beta_fast = 32.0f;
  float yarn_beta_slow = 1.0f;
  float yarn_mscale = 1.0f;          // --mscale
  float yarn_mscale_all_dim = 0.0f;  // --mscale-all-dim
  bool yarn_correction_range_round_to_int = true;
  bool share_embeddings_and_output_weights = true;  // false with --untie-embeddings-and-output-weights
  bool qk_layernorm = false;  // per-head norm of queries and keys (`normalization`, over kv_channels)
  bool apply_residual_connection_post_layernorm = false;

  // ---- multi-token prediction (core/transformer/multi_token_prediction.h; Megatron's mtp_* fields)
  int mtp_num_layers = 0;                // --mtp-num-layers: MTP depths (0: none, Megatron's None)
  float mtp_loss_scaling_factor = 0.1f;  // --mtp-loss-scaling-factor
  bool calculate_per_token_loss = false;  // --calculate-per-token-loss (Note [Per-token loss], schedules.h)

  // ---- GPT-OSS's pieces (Megatron's names; docs/architecture.md, GPT-OSS)
  // The gated MLP's activation with --quick-geglu (activation "quick_geglu"): quick_gelu(min(gate, c))
  // · (clamp(up, -c, c) + glu_linear_offset), c = activation_func_clamp_value (0: Megatron's None).
  float glu_linear_offset = 0.0f;
  float activation_func_clamp_value = 0.0f;
  // Note [Attention sinks]: vanilla | off-by-one | learnable (the parameter
  // "<attention>.core_attention.softmax_offset" [heads], sharded with the heads under TP).
  std::string softmax_type = "vanilla";
  // Note [Sliding-window attention]: --window-size L,0 (Megatron's window_size tuple; right must be
  // 0), -1: none; --window-attn-skip-freq picks the layers that keep full attention.
  int window_size_left = -1;
  std::string window_attn_skip_freq;  // "" (every layer windowed), an int N or a pattern
  std::vector<int> window_attn_pattern;  // derived: per decoder layer, 1 = sliding window, 0 = full

  // ---- multi-latent attention (Megatron's MLATransformerConfig; --multi-latent-attention). The
  // heads' query/key channels are qk_head_dim (no position) + qk_pos_emb_head_dim (RoPE), their value
  // channels v_head_dim; kv_channels is not used by it (Note [Multi-latent attention]).
  bool multi_latent_attention = false;
  int q_lora_rank = 0;  // 0 (Megatron's None): one q projection, no low-rank query
  int kv_lora_rank = 32;
  int qk_head_dim = 128;
  int qk_pos_emb_head_dim = 64;
  int v_head_dim = 128;

  // ---- mixture of experts (Megatron's moe_* fields; num_moe_experts 0 is a dense model)
  int num_moe_experts = 0;                 // --num-experts
  std::string moe_layer_freq = "1";        // an int N (every N-th layer from layer 0) or a pattern "([0]+[1]*23)"
  std::vector<int> moe_layer_pattern;      // derived: per decoder layer, 1 = MoE, 0 = dense
  int moe_ffn_hidden_size = 0;             // 0: ffn_hidden_size
  int moe_shared_expert_intermediate_size = 0;  // 0: no shared experts
  bool moe_shared_expert_gate = false;     // the shared experts' sigmoid gate (Qwen2-MoE)
  bool moe_shared_expert_overlap = false;
  int moe_router_topk = 2;
  std::string moe_router_score_function = "softmax";  // softmax | sigmoid
  bool moe_router_pre_softmax = false;
  int moe_router_num_groups = 0, moe_router_group_topk = 0;  // 0: no group-limited routing
  // Experts of a group summed into its score: 0 is Megatron's topk / group_topk; HF DeepSeek-V3 always
  // sums the top 2 (the same for DeepSeek-V3's 8 / 4, not for other shapes).
  int moe_router_group_score_topk = 0;
  float moe_router_topk_scaling_factor = 0.0f;              // 0: none
  std::string moe_router_dtype = "fp32";                    // fp32 | fp64
  bool moe_router_enable_expert_bias = false;
  float moe_router_bias_update_rate = 1e-3f;
  std::vector<std::string> moe_router_load_balancing_type = {"aux_loss"};  // one per coefficient
  std::vector<float> moe_aux_loss_coeff = {0.0f};
  float moe_z_loss_coeff = 0.0f;
  float moe_input_jitter_eps = 0.0f;
  float moe_expert_capacity_factor = 0.0f;  // 0 (Megatron's None): dropless
  std::string moe_token_drop_policy = "probs";  // probs | position
  bool moe_pad_expert_input_to_capacity = false;
  std::string moe_token_dispatcher_type = "allgather";  // allgather | alltoall | flex
  bool moe_grouped_gemm = false;
  bool moe_permute_fusion = false;
  bool moe_router_padding_for_quantization = false;  // Note [Routing padding for FP8] (moe/moe_utils.h)

  // ---- regularisation and initialisation
  float hidden_dropout = 0.1f;
  float attention_dropout = 0.1f;
  float init_method_std = 0.02f;

  // ---- precision
  DType params_dtype = DType::Float32;  // bf16 with --bf16, fp16 with --fp16
  bool bf16 = false;
  bool fp16 = false;
  /// FP8 GEMMs (--fp8-format, --fp8-recipe, ...; core/fp8_utils.h): the linear layers of attention and
  /// the MLP, in the layers the block spec marks (Note [FP8 layers]).
  Fp8Config fp8;

  /// Ours: a model for inference only (generation, the text server): its parameters get no fp32
  /// gradient buffer (no main_grad), so it holds the weights alone; backward is refused.
  bool inference_only = false;

  // ---- activation recomputation
  std::string recompute_granularity;  // "" | full | selective
  std::string recompute_method;       // uniform | block (with full)
  int recompute_num_layers = 0;

  // ---- parallelism (the layout; the ranks come from ParallelState)
  int tensor_model_parallel_size = 1;
  bool sequence_parallel = false;
  int pipeline_model_parallel_size = 1;
  int virtual_pipeline_model_parallel_size = 1;  // model chunks per pipeline rank (interleaved 1F1B)
  int decoder_first_pipeline_num_layers = 0;     // 0: even split
  int decoder_last_pipeline_num_layers = 0;
  int expert_model_parallel_size = 1;
  int expert_tensor_parallel_size = 0;  // 0: tensor_model_parallel_size
  int context_parallel_size = 1;
  std::string cp_comm_type = "p2p";     // p2p | all_gather | a2a | a2a+p2p (core/transformer/context_parallel.h)

  /// Fills derived values and validates; throws megatron::Error naming the flag at fault.
  void finalize();
  void finalize_moe();  // finalize()'s MoE part
  void finalize_rope_scaling();  // finalize()'s RoPE-scaling part
  void finalize_mtp();  // finalize()'s multi-token-prediction part
  void finalize_gpt_oss();       // finalize()'s part for sinks, windows and the clamped quick-GeGLU
  /// The left window of decoder layer `layer` (global, 0-based): -1 for full attention.
  int layer_window_left(int layer) const {
    return window_size_left >= 0 && layer >= 0 && size_t(layer) < window_attn_pattern.size() &&
                   window_attn_pattern[size_t(layer)] != 0
               ? window_size_left
               : -1;
  }
  bool quick_geglu() const { return activation == "quick_geglu"; }
  bool has_attention_sinks() const { return softmax_type != "vanilla"; }
  void finalize_mla();  // finalize()'s multi-latent-attention part
  /// The channels RoPE rotates per head: qk_pos_emb_head_dim with multi-latent attention, else
  /// kv_channels · rotary_percent.
  int rotary_dim() const {
    return multi_latent_attention ? qk_pos_emb_head_dim : int(float(kv_channels) * rotary_percent);
  }
  int head_dim() const { return kv_channels; }
  int query_projection_size() const { return kv_channels * num_attention_heads; }
  int kv_projection_size() const { return kv_channels * num_query_groups; }
  /// Rotary positions: plain (possibly with Llama 3 scaling) or YaRN.
  bool use_rope() const { return position_embedding_type == "rope" || position_embedding_type == "yarn"; }
  bool use_yarn() const { return position_embedding_type == "yarn"; }
  bool use_learned_positions() const { return position_embedding_type == "learned_absolute"; }
  bool use_rmsnorm() const { return normalization == "RMSNorm"; }
  bool is_moe() const { return num_moe_experts > 0; }
  /// Whether decoder layer `layer` (global, 0-based) is an MoE layer (finalize() derives the pattern).
  bool is_moe_layer(int layer) const {
    return is_moe() && layer >= 0 && size_t(layer) < moe_layer_pattern.size() && moe_layer_pattern[size_t(layer)] != 0;
  }
};

/// The decoder layers [first, first + count) of pipeline rank `pp_rank`'s model chunk `vp_stage`
/// (Megatron's layer offsets: with V chunks per rank, chunk v of rank p holds the layers
/// v·L/V + p·L/(V·P) onward; uneven first/last stages take their --decoder-*-pipeline-num-layers and
/// the middle stages split the rest evenly).
struct LayerRange {
  int first = 0, count = 0;
};
LayerRange pipeline_layer_range(const TransformerConfig& config, int pp_rank, int vp_stage);

/// Megatron's --moe-layer-freq: an int N gives 1 for every layer i with i % N == 0; a pattern is
/// a Python list expression of 0/1 ("([0]+[1]*23)", "([1]*3+[0]*1)*3") and must have num_layers
/// entries. One clear line for anything else.
std::vector<int> moe_layer_pattern(const std::string& freq, int num_layers);

/// Megatron's --window-attn-skip-freq (is_layer_window_attention): "" gives 1 (window) for every
/// layer; an int N gives 0 (full attention) for every layer whose 1-based number is a multiple of N;
/// a pattern as --moe-layer-freq's (1: window, 0: full) must have num_layers entries.
std::vector<int> window_attn_pattern(const std::string& freq, int num_layers);

/// Megatron's _vocab_size_with_padding: the smallest multiple of divisible_by * tp >= vocab_size.
int padded_vocab_size(int vocab_size, int make_vocab_size_divisible_by, int tensor_model_parallel_size);

}  // namespace megatron

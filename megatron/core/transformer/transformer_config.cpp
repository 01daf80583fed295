#include "megatron/core/transformer/transformer_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <stdexcept>

#include "megatron/runtime/check.h"

namespace megatron {

int padded_vocab_size(int vocab_size, int divisible_by, int tp) {
  MG_CHECK(divisible_by > 0 && tp > 0,
           "--make-vocab-size-divisible-by ({}) and the tensor-parallel size ({}) must be "
           "positive",
           divisible_by, tp);
  int multiple = divisible_by * tp;
  return (vocab_size + multiple - 1) / multiple * multiple;
}

void TransformerConfig::finalize() {
  MG_CHECK(num_layers > 0, "--num-layers must be positive (got {})", num_layers);
  MG_CHECK(hidden_size > 0, "--hidden-size must be positive (got {})", hidden_size);
  MG_CHECK(num_attention_heads > 0, "--num-attention-heads must be positive (got {})", num_attention_heads);
  MG_CHECK(vocab_size > 0, "the vocabulary size must be positive (got {}): give a tokenizer or --vocab-size",
           vocab_size);
  if (num_query_groups == 0) num_query_groups = num_attention_heads;
  MG_CHECK(num_query_groups > 0 && num_attention_heads % num_query_groups == 0,
           "--num-attention-heads ({}) must be divisible by --num-query-groups ({})", num_attention_heads,
           num_query_groups);
  if (kv_channels == 0) {
    MG_CHECK(hidden_size % num_attention_heads == 0,
             "--hidden-size ({}) must be divisible by --num-attention-heads ({}), or give --kv-channels", hidden_size,
             num_attention_heads);
    kv_channels = hidden_size / num_attention_heads;
  }
  MG_CHECK(kv_channels > 0, "--kv-channels must be positive (got {})", kv_channels);
  MG_CHECK(num_attention_heads % tensor_model_parallel_size == 0 && num_query_groups % tensor_model_parallel_size == 0,
           "--num-attention-heads ({}) and --num-query-groups ({}) must be divisible by --tensor-model-parallel-size "
           "({})",
           num_attention_heads, num_query_groups, tensor_model_parallel_size);
  if (ffn_hidden_size == 0) ffn_hidden_size = 4 * hidden_size;
  MG_CHECK(ffn_hidden_size > 0, "--ffn-hidden-size must be positive (got {})", ffn_hidden_size);
  MG_CHECK(normalization == "LayerNorm" || normalization == "RMSNorm",
           "--normalization must be LayerNorm or RMSNorm (got '{}')", normalization);
  if (activation == "swiglu" || activation == "quick_geglu") gated_linear_unit = true;
  MG_CHECK(activation == "gelu" || activation == "swiglu" || activation == "quick_geglu",
           "the activation must be gelu, swiglu or quick_geglu (got '{}')", activation);
  MG_CHECK(!gated_linear_unit || activation == "swiglu" || activation == "quick_geglu",
           "a gated linear unit is only supported with swiglu or quick_geglu (use --swiglu or --quick-geglu)");
  MG_CHECK(position_embedding_type == "learned_absolute" || position_embedding_type == "rope" ||
               position_embedding_type == "yarn" || position_embedding_type == "none",
           "--position-embedding-type must be learned_absolute, rope, yarn or none (got '{}')",
           position_embedding_type);
  if (use_learned_positions()) {
    MG_CHECK(max_position_embeddings > 0, "--max-position-embeddings must be positive with learned positions");
  }
  if (use_rope() && !multi_latent_attention) {
    int rot = rotary_dim();
    MG_CHECK(rotary_percent > 0.0f && rotary_percent <= 1.0f && rot > 0 && rot % 2 == 0,
             "--rotary-percent ({}) must give an even, positive number of rotary channels of the {} per head",
             rotary_percent, kv_channels);
  }
  finalize_mla();
  finalize_rope_scaling();
  MG_CHECK(!(bf16 && fp16), "--bf16 and --fp16 cannot both be given");
  if (bf16) params_dtype = DType::BFloat16;
  if (fp16) params_dtype = DType::Float16;
  MG_CHECK(hidden_dropout >= 0.0f && hidden_dropout < 1.0f, "--hidden-dropout must be in [0, 1) (got {})",
           hidden_dropout);
  MG_CHECK(attention_dropout >= 0.0f && attention_dropout < 1.0f, "--attention-dropout must be in [0, 1) (got {})",
           attention_dropout);
  MG_CHECK(recompute_granularity.empty() || recompute_granularity == "full" || recompute_granularity == "selective",
           "--recompute-granularity must be full or selective (got '{}')", recompute_granularity);
  if (recompute_granularity == "full") {
    MG_CHECK(recompute_method == "uniform" || recompute_method == "block",
             "--recompute-granularity full needs --recompute-method uniform or block");
    if (recompute_num_layers == 0) recompute_num_layers = 1;
    MG_CHECK(recompute_num_layers >= 1 && recompute_num_layers <= num_layers,
             "--recompute-num-layers ({}) must be between 1 and --num-layers ({})", recompute_num_layers, num_layers);
  }
  const int tp = tensor_model_parallel_size, pp = pipeline_model_parallel_size,
            vpp = virtual_pipeline_model_parallel_size;
  MG_CHECK(ffn_hidden_size % tp == 0, "--ffn-hidden-size ({}) must be divisible by --tensor-model-parallel-size ({})",
           ffn_hidden_size, tp);
  MG_CHECK(pp >= 1 && vpp >= 1, "pipeline sizes must be positive");
  const int first = decoder_first_pipeline_num_layers, last = decoder_last_pipeline_num_layers;
  if (first > 0 || last > 0) {
    MG_CHECK(vpp == 1, "--decoder-first/last-pipeline-num-layers are not supported with virtual pipeline stages");
    MG_CHECK(pp > 1, "--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1");
    const int middle = num_layers - first - last;
    const int middle_stages = pp - (first > 0) - (last > 0);
    MG_CHECK(first >= 0 && last >= 0 && middle >= 0 && (middle_stages == 0 ? middle == 0 : middle % middle_stages == 0),
             "--num-layers ({}) minus --decoder-first-pipeline-num-layers ({}) and --decoder-last-pipeline-num-layers "
             "({}) must split evenly over the other {} pipeline stages",
             num_layers, first, last, middle_stages);
  } else {
    MG_CHECK(num_layers % (pp * vpp) == 0,
             "--num-layers ({}) must be divisible by --pipeline-model-parallel-size ({}){}", num_layers, pp,
             vpp > 1 ? fmt::format(" x the virtual pipeline size ({}; --num-layers-per-virtual-pipeline-stage)", vpp)
                     : std::string());
  }
  padded_vocab_size = megatron::padded_vocab_size(vocab_size, make_vocab_size_divisible_by, tensor_model_parallel_size);
  finalize_moe();
  finalize_mtp();
  finalize_gpt_oss();
}

// The multi-token-prediction rules (multi_token_prediction.h): what the MTP block does not support
// is refused here, one line naming the flag.
void TransformerConfig::finalize_mtp() {
  MG_CHECK(mtp_num_layers >= 0, "--mtp-num-layers must be a positive number of MTP depths, or 0 for none (got {})",
           mtp_num_layers);
  if (mtp_num_layers == 0) return;
  MG_CHECK(std::isfinite(mtp_loss_scaling_factor) && mtp_loss_scaling_factor >= 0.0f,
           "--mtp-loss-scaling-factor must be a finite number >= 0 (got {})", mtp_loss_scaling_factor);
  MG_CHECK(context_parallel_size == 1,
           "--mtp-num-layers with --context-parallel-size {} is not supported: the MTP block shifts tokens across "
           "the context-parallel chunks; train MTP without context parallelism",
           context_parallel_size);
  MG_CHECK(!fp8.enabled(), "--mtp-num-layers with --fp8-format is not supported: train MTP in bf16");
  MG_CHECK(!(use_learned_positions() && pipeline_model_parallel_size > 1),
           "--mtp-num-layers with learned absolute position embeddings and --pipeline-model-parallel-size {} is not "
           "supported (the last stage would hold an unsynchronised copy of the position table): use "
           "--position-embedding-type rope or none, or one pipeline stage",
           pipeline_model_parallel_size);
}

// Attention sinks, sliding windows and the clamped quick-GeGLU (Megatron's softmax_type, window_size,
// window_attn_skip_freq, glu_linear_offset, activation_func_clamp_value), one line each.
void TransformerConfig::finalize_gpt_oss() {
  MG_CHECK(softmax_type == "vanilla" || softmax_type == "off-by-one" || softmax_type == "learnable",
           "--softmax-type must be vanilla, off-by-one or learnable (got '{}')", softmax_type);
  MG_CHECK(window_size_left >= -1, "--window-size's left window must be >= 0 (got {})", window_size_left);
  MG_CHECK(window_size_left >= 0 || window_attn_skip_freq.empty(),
           "--window-attn-skip-freq '{}' needs --window-size", window_attn_skip_freq);
  window_attn_pattern.clear();
  if (window_size_left >= 0) {
    window_attn_pattern = megatron::window_attn_pattern(window_attn_skip_freq, num_layers);
  }
  MG_CHECK(std::isfinite(activation_func_clamp_value) && activation_func_clamp_value >= 0.0f,
           "--activation-func-clamp-value must be a positive number (got {})", activation_func_clamp_value);
  MG_CHECK(quick_geglu() || (glu_linear_offset == 0.0f && activation_func_clamp_value == 0.0f),
           "--glu-linear-offset and --activation-func-clamp-value apply to the quick-GeGLU MLP only: add --quick-geglu");
}

// The multi-latent attention rules (Note [Multi-latent attention] in multi_latent_attention.h), one
// line each.
void TransformerConfig::finalize_mla() {
  if (!multi_latent_attention) return;
  MG_CHECK(num_query_groups == num_attention_heads,
           "--group-query-attention is mutually exclusive with --multi-latent-attention (as in Megatron)");
  MG_CHECK(q_lora_rank >= 0, "--q-lora-rank must be positive, or absent for one q projection (got {})", q_lora_rank);
  MG_CHECK(kv_lora_rank > 0, "--kv-lora-rank must be positive (got {})", kv_lora_rank);
  MG_CHECK(qk_head_dim > 0, "--qk-head-dim must be positive (got {})", qk_head_dim);
  MG_CHECK(v_head_dim > 0, "--v-head-dim must be positive (got {})", v_head_dim);
  MG_CHECK(qk_pos_emb_head_dim > 0 && qk_pos_emb_head_dim % 2 == 0,
           "--qk-pos-emb-head-dim must be even and positive: RoPE rotates channel pairs (got {})", qk_pos_emb_head_dim);
  MG_CHECK(use_rope(),
           "--multi-latent-attention rotates its --qk-pos-emb-head-dim channels: give --rope-type rope or yarn (got "
           "--position-embedding-type {})",
           position_embedding_type);
  MG_CHECK(!rotary_interleaved, "--rotary-interleaved does not work with --multi-latent-attention (as in Megatron)");
  MG_CHECK(rotary_percent == 1.0f,
           "--rotary-percent {} does not apply to --multi-latent-attention: it rotates all --qk-pos-emb-head-dim "
           "channels",
           rotary_percent);
  MG_CHECK(!add_qkv_bias, "--add-qkv-bias does not apply to --multi-latent-attention (its projections have no bias)");
  MG_CHECK(!has_attention_sinks(),
           "--softmax-type {} (attention sinks) is not supported with --multi-latent-attention: use vanilla",
           softmax_type);
  MG_CHECK(window_size_left < 0, "--window-size is not supported with --multi-latent-attention (its attention is full)");
}

// The RoPE scaling rules (rotary_pos_embedding.h), one line each.
void TransformerConfig::finalize_rope_scaling() {
  if (rope_scaling) {
    MG_CHECK(position_embedding_type == "rope",
             "--use-rope-scaling (Llama 3's RoPE scaling) needs --position-embedding-type rope (got {})",
             position_embedding_type);
    MG_CHECK(std::isfinite(rope_scaling_factor) && rope_scaling_factor > 0.0f,
             "--rope-scaling-factor must be a positive number (got {})", rope_scaling_factor);
  }
  if (!use_yarn()) return;
  MG_CHECK(rotary_percent == 1.0f,
           "--position-embedding-type yarn rotates every channel of a head, as Megatron's YarnRotaryEmbedding: drop "
           "--rotary-percent {}",
           rotary_percent);
  MG_CHECK(!rotary_interleaved, "--position-embedding-type yarn does not support --rotary-interleaved (as Megatron)");
  MG_CHECK(std::isfinite(yarn_rotary_scaling_factor) && yarn_rotary_scaling_factor > 0.0f,
           "--rotary-scaling-factor must be a positive number (got {})", yarn_rotary_scaling_factor);
  MG_CHECK(yarn_original_max_position_embeddings > 0,
           "--yarn-original-max-position-embeddings must be a positive integer (got {})",
           yarn_original_max_position_embeddings);
  MG_CHECK(yarn_beta_fast > 0.0f && yarn_beta_slow > 0.0f,
           "--yarn-beta-fast ({}) and --yarn-beta-slow ({}) must be positive numbers of rotations", yarn_beta_fast,
           yarn_beta_slow);
  const double log_factor = std::log(std::max(1.0f, yarn_rotary_scaling_factor));  // mscale(f, a) = 0.1·a·ln f + 1
  MG_CHECK(0.1 * yarn_mscale * log_factor + 1.0 > 0.0 && 0.1 * yarn_mscale_all_dim * log_factor + 1.0 > 0.0,
           "--mscale ({}) and --mscale-all-dim ({}) must give YaRN a positive attention factor", yarn_mscale,
           yarn_mscale_all_dim);
}

// The MoE rules of Megatron's TransformerConfig.__post_init__ and validate_args, one line each.
void TransformerConfig::finalize_moe() {
  if (expert_tensor_parallel_size == 0) expert_tensor_parallel_size = tensor_model_parallel_size;
  MG_CHECK(num_moe_experts >= 0, "--num-experts must be positive (got {})", num_moe_experts);
  if (!is_moe()) {
    MG_CHECK(expert_model_parallel_size == 1, "--expert-model-parallel-size {} needs --num-experts",
             expert_model_parallel_size);
    moe_layer_pattern.clear();
    return;
  }
  moe_layer_pattern = megatron::moe_layer_pattern(moe_layer_freq, num_layers);
  if (moe_ffn_hidden_size == 0) moe_ffn_hidden_size = ffn_hidden_size;
  MG_CHECK(moe_ffn_hidden_size > 0, "--moe-ffn-hidden-size must be positive (got {})", moe_ffn_hidden_size);
  MG_CHECK(moe_router_topk >= 1 && moe_router_topk <= num_moe_experts,
           "--moe-router-topk ({}) must be between 1 and --num-experts ({})", moe_router_topk, num_moe_experts);
  MG_CHECK(expert_model_parallel_size >= 1 && num_moe_experts % expert_model_parallel_size == 0,
           "--num-experts ({}) must be divisible by --expert-model-parallel-size ({})", num_moe_experts,
           expert_model_parallel_size);
  MG_CHECK(moe_ffn_hidden_size % expert_tensor_parallel_size == 0,
           "--moe-ffn-hidden-size ({}) must be divisible by --expert-tensor-parallel-size ({})", moe_ffn_hidden_size,
           expert_tensor_parallel_size);
  MG_CHECK(tensor_model_parallel_size == 1 || sequence_parallel,
           "MoE with tensor parallelism needs --sequence-parallel (as in Megatron)");
  MG_CHECK(!add_bias_linear || expert_tensor_parallel_size == 1,
           "biases in MoE layers need --expert-tensor-parallel-size 1 (as in Megatron): add --disable-bias-linear");
  MG_CHECK(moe_token_dispatcher_type == "allgather" || moe_token_dispatcher_type == "alltoall" ||
               moe_token_dispatcher_type == "flex",
           "unknown --moe-token-dispatcher-type {}: use allgather, alltoall or flex", moe_token_dispatcher_type);
  MG_CHECK(moe_router_load_balancing_type.size() == moe_aux_loss_coeff.size() ||
               (moe_router_load_balancing_type.size() == 1 && moe_aux_loss_coeff.size() <= 1),
           "--moe-router-load-balancing-type names {} types but --moe-aux-loss-coeff gives {} coefficients: give one "
           "per type",
           moe_router_load_balancing_type.size(), moe_aux_loss_coeff.size());
  MG_CHECK(moe_shared_expert_intermediate_size >= 0, "--moe-shared-expert-intermediate-size must be positive");
  if (moe_router_padding_for_quantization) {  // Note [Routing padding for FP8]
    MG_CHECK(fp8.enabled(), "--moe-router-padding-for-quantization (--moe-router-padding-for-fp8) needs --fp8-format");
    MG_CHECK(moe_token_dispatcher_type != "allgather",
             "the allgather dispatcher does not support --moe-router-padding-for-quantization (as in Megatron): use "
             "--moe-token-dispatcher-type alltoall or flex");
    MG_CHECK(!moe_pad_expert_input_to_capacity,
             "--moe-router-padding-for-quantization with --moe-pad-expert-input-to-capacity is not supported: every "
             "expert already receives its capacity");
  }
  MG_CHECK(!moe_shared_expert_gate || moe_shared_expert_intermediate_size > 0,
           "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size");
}

namespace {
// Megatron evaluates the --moe-layer-freq pattern as Python; this reads the same expressions:
//   expr := term ('+' term)* ; term := atom ('*' int)* | int '*' atom ; atom := '[' ints ']' | '(' expr ')'
struct PatternParser {
  const std::string& s;
  size_t i = 0;
  const char* flag = "--moe-layer-freq";
  const char* example = "([0]+[1]*23)";
  void skip() {
    while (i < s.size() && s[i] == ' ') ++i;
  }
  [[noreturn]] void fail() const {
    MG_CHECK(false,
             "{} '{}' is neither an integer nor a list pattern such as {} (error at character {})", flag, s, example,
             i + 1);
    __builtin_unreachable();
  }
  bool eat(char c) {
    skip();
    if (i < s.size() && s[i] == c) return ++i, true;
    return false;
  }
  bool peek_digit() {
    skip();
    return i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]));
  }
  int64_t integer() {
    skip();
    size_t start = i;
    while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i;
    if (start == i || i - start > 6) fail();
    return std::stoll(s.substr(start, i - start));
  }
  std::vector<int> atom() {
    std::vector<int> v;
    if (eat('[')) {
      if (eat(']')) return v;
      do {
        const int64_t x = integer();
        if (x != 0 && x != 1) fail();
        v.push_back(int(x));
      } while (eat(','));
      if (!eat(']')) fail();
      return v;
    }
    if (eat('(')) {
      v = expr();
      if (!eat(')')) fail();
      return v;
    }
    fail();
  }
  static std::vector<int> repeat(const std::vector<int>& v, int64_t n) {
    std::vector<int> out;
    for (int64_t k = 0; k < n && out.size() < 1000000; ++k) out.insert(out.end(), v.begin(), v.end());
    return out;
  }
  std::vector<int> term() {
    std::vector<int> v;
    if (peek_digit()) {
      const int64_t n = integer();
      if (!eat('*')) fail();
      v = repeat(atom(), n);
    } else {
      v = atom();
    }
    while (eat('*')) v = repeat(v, integer());
    return v;
  }
  std::vector<int> expr() {
    std::vector<int> v = term();
    while (eat('+')) {
      std::vector<int> w = term();
      v.insert(v.end(), w.begin(), w.end());
    }
    return v;
  }
};
}  // namespace

namespace {
// A per-layer 0/1 pattern in Megatron's moe_freq_type: an int N (layer i gets of_int(i, N)) or a
// Python list expression with num_layers entries; `flag` and `example` word the errors.
std::vector<int> layer_pattern(const std::string& freq, int num_layers, const char* flag, const char* example,
                               int (*of_int)(int layer, int n)) {
  std::vector<int> pattern;
  if (freq.find('[') == std::string::npos) {
    size_t used = 0;
    int n = 0;
    try {
      n = std::stoi(freq, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    MG_CHECK(used == freq.size() && !freq.empty() && n >= 1,
             "{} '{}' is neither a positive integer nor a list pattern such as {}", flag, freq, example);
    for (int i = 0; i < num_layers; ++i) pattern.push_back(of_int(i, n));
    return pattern;
  }
  PatternParser p{freq};
  p.flag = flag;
  p.example = example;
  pattern = p.expr();
  p.skip();
  if (p.i != freq.size()) p.fail();
  MG_CHECK(int(pattern.size()) == num_layers, "{} '{}' gives {} layers for --num-layers {}", flag, freq,
           pattern.size(), num_layers);
  return pattern;
}
}  // namespace

std::vector<int> moe_layer_pattern(const std::string& freq, int num_layers) {
  return layer_pattern(freq, num_layers, "--moe-layer-freq", "([0]+[1]*23)",
                       [](int i, int n) { return i % n == 0 ? 1 : 0; });
}

std::vector<int> window_attn_pattern(const std::string& freq, int num_layers) {
  if (freq.empty()) return std::vector<int>(size_t(num_layers), 1);
  // Megatron's is_layer_window_attention counts layers from 1: layer_number % N != 0 is windowed.
  return layer_pattern(freq, num_layers, "--window-attn-skip-freq", "([1]*3+[0]*1)*3",
                       [](int i, int n) { return (i + 1) % n != 0 ? 1 : 0; });
}

LayerRange pipeline_layer_range(const TransformerConfig& c, int pp_rank, int vp_stage) {
  const int pp = c.pipeline_model_parallel_size, vpp = c.virtual_pipeline_model_parallel_size;
  const int first = c.decoder_first_pipeline_num_layers, last = c.decoder_last_pipeline_num_layers;
  if (first > 0 || last > 0) {
    const int middle_stages = pp - (first > 0) - (last > 0);
    const int per_middle = middle_stages ? (c.num_layers - first - last) / middle_stages : 0;
    auto count_of = [&](int r) {
      if (r == 0 && first > 0) return first;
      if (r == pp - 1 && last > 0) return last;
      return per_middle;
    };
    int offset = 0;
    for (int r = 0; r < pp_rank; ++r) offset += count_of(r);
    return {offset, count_of(pp_rank)};
  }
  const int per_chunk = c.num_layers / (pp * vpp);
  return {vp_stage * (c.num_layers / vpp) + pp_rank * per_chunk, per_chunk};
}

}  // namespace megatron

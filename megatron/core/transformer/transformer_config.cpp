#include "megatron/core/transformer/transformer_config.h"

#include <fmt/format.h>

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
  if (activation == "swiglu") gated_linear_unit = true;
  MG_CHECK(activation == "gelu" || activation == "swiglu", "the activation must be gelu or swiglu (got '{}')",
           activation);
  MG_CHECK(!gated_linear_unit || activation == "swiglu",
           "a gated linear unit is only supported with swiglu (use --swiglu)");
  MG_CHECK(position_embedding_type == "learned_absolute" || position_embedding_type == "rope" ||
               position_embedding_type == "none",
           "--position-embedding-type must be learned_absolute, rope or none (got '{}')", position_embedding_type);
  if (use_learned_positions()) {
    MG_CHECK(max_position_embeddings > 0, "--max-position-embeddings must be positive with learned positions");
  }
  if (use_rope()) {
    int rot = int(float(kv_channels) * rotary_percent);
    MG_CHECK(rotary_percent > 0.0f && rotary_percent <= 1.0f && rot > 0 && rot % 2 == 0,
             "--rotary-percent ({}) must give an even, positive number of rotary channels of the {} per head",
             rotary_percent, kv_channels);
  }
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

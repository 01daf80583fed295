#include "megatron/core/transformer/kv_cache.h"

#include "megatron/runtime/check.h"

namespace megatron {

KVCache::KVCache(const TransformerConfig& config, int64_t num_slots, int64_t max_length, Device device)
    : num_slots_(num_slots), max_length_(max_length) {
  MG_CHECK(num_slots > 0 && max_length > 0, "a KV cache needs at least one slot and one position (got {} x {})",
           num_slots, max_length);
  if (config.multi_latent_attention) {  // Note [MLA KV cache]: the latent and the rope key per position
    for (int i = 0; i < config.num_layers; ++i) {
      keys.push_back(Tensor::zeros({num_slots, max_length, 1, config.kv_lora_rank}, config.params_dtype, device));
      values.push_back(Tensor::zeros({num_slots, max_length, 1, config.qk_pos_emb_head_dim}, config.params_dtype, device));
    }
    return;
  }
  MG_CHECK(config.num_query_groups > 0 && config.kv_channels > 0, "the KV cache needs a finalized TransformerConfig");
  const Shape shape{num_slots, max_length, config.num_query_groups / config.tensor_model_parallel_size,
                    config.kv_channels};
  for (int i = 0; i < config.num_layers; ++i) {
    keys.push_back(Tensor::zeros(shape, config.params_dtype, device));
    values.push_back(Tensor::zeros(shape, config.params_dtype, device));
  }
}

void KVCache::copy_slots(const std::vector<std::pair<int64_t, int64_t>>& pairs) {
  for (const auto& [from, to] : pairs)
    MG_CHECK(from >= 0 && from < num_slots_ && to >= 0 && to < num_slots_, "cache slot copy {} -> {} outside {} slots",
             from, to, num_slots_);
  for (int64_t l = 0; l < num_layers(); ++l) {
    for (const auto& [from, to] : pairs) {
      keys[size_t(l)].slice(to, to + 1).copy_from(keys[size_t(l)].slice(from, from + 1));
      values[size_t(l)].slice(to, to + 1).copy_from(values[size_t(l)].slice(from, from + 1));
    }
  }
}

}  // namespace megatron

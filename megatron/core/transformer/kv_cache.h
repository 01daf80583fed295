// KVCache: the keys (after RoPE) and values of every layer for a fixed number of sequence slots,
// preallocated once: per layer [slots, max_length, num_query_groups / tp, kv_channels] in the model
// dtype on the model's device (under tensor parallelism a rank caches its own query groups). Slot-major, so one sequence's history is contiguous and a batch
// can be any subset of slots, each at its own position (ops::attention_kv_cache_forward).
// Multi-latent attention caches its compressed latent and rope key instead (Note [MLA KV cache] in
// multi_latent_attention.h): keys [slots, max_length, 1, kv_lora_rank], values [.., 1, qk_pos_emb_head_dim].
// Which positions of a slot are valid is the caller's bookkeeping (InferenceEngine): a forward
// writes positions starts[i] .. starts[i]+s-1 and reads 0 .. starts[i]+s-1.
#pragma once

#include <utility>
#include <vector>

#include "megatron/core/transformer/transformer_config.h"
#include "megatron/runtime/tensor.h"

namespace megatron {

/// The batch rows of one inference forward over a KVCache: row i uses cache slot slots[i] and its
/// new tokens sit at positions starts[i] .. starts[i]+s-1. Both forms travel: the host vectors
/// (for choices and checks, without reading the device) and int64 [b] tensors on the model's
/// device (for the kernels). GPTModel::forward_inference checks the values once per forward.
struct CacheRows {
  std::vector<int64_t> slot_ids, start_ids;
  Tensor slots, starts;

  /// Every row starts at position 0 (a prompt's first forward): attention needs only the new
  /// keys and values (Note [Prefill attention] in attention.cpp).
  bool from_zero() const {
    for (int64_t s : start_ids)
      if (s != 0) return false;
    return true;
  }
};

/// One inference forward's inputs on the model's device (GPTModel::inference_inputs).
struct InferenceInputs {
  Tensor tokens;        // [b, s] int64
  Tensor position_ids;  // [b, s] int64: starts[i] + j
  Tensor freqs;         // [s·b, rotary_dim/2] fp32: row j·b + i holds position starts[i] + j's angles (RoPE only)
  CacheRows rows;
};

struct KVCache {
  /// Allocates (zeroed) caches for config.num_layers layers.
  KVCache(const TransformerConfig& config, int64_t num_slots, int64_t max_length, Device device);

  int64_t num_layers() const { return int64_t(keys.size()); }
  int64_t num_slots() const { return num_slots_; }
  int64_t max_length() const { return max_length_; }

  /// Every layer's keys and values of slot `from` copied into slot `to`, for each (from, to) in order.
  void copy_slots(const std::vector<std::pair<int64_t, int64_t>>& pairs);

  std::vector<Tensor> keys, values;  // per layer [num_slots, max_length, ng, d]

 private:
  int64_t num_slots_, max_length_;
};

}  // namespace megatron

// Rotary position embedding (RoFormer; Megatron-Core's RotaryEmbedding): the angle of position p
// for channel pair j is p · base^(-2j/r), r = kv_channels · rotary_percent, computed in fp32 as
// Megatron and HuggingFace do. The op kernels (ops::rope_*) apply cos/sin of these angles.
#pragma once

#include "megatron/core/transformer/transformer_config.h"
#include "megatron/runtime/context.h"

namespace megatron {

class RotaryEmbedding {
 public:
  explicit RotaryEmbedding(const TransformerConfig& config);
  /// Angles [seq_len, r/2] fp32 for positions offset .. offset+seq_len-1, on the context's device
  /// (read-only: the last table is kept and handed out again, so a training step copies nothing
  /// from the host — and a captured CUDA graph reads the same table at every launch).
  Tensor freqs(Context& ctx, int64_t seq_len, int64_t offset = 0) const;
  int rotary_dim() const { return rotary_dim_; }
  bool interleaved() const { return interleaved_; }

 private:
  int rotary_dim_;
  bool interleaved_;
  std::vector<float> inv_freq_;
  struct Cached {
    Device device;
    int64_t seq_len = -1, offset = 0;
    Tensor table;
  };
  mutable Cached cached_;
};

}  // namespace megatron

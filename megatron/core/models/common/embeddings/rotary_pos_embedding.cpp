#include "megatron/core/models/common/embeddings/rotary_pos_embedding.h"

#include <cmath>

namespace megatron {

RotaryEmbedding::RotaryEmbedding(const TransformerConfig& config)
    : rotary_dim_(int(float(config.kv_channels) * config.rotary_percent)), interleaved_(config.rotary_interleaved) {
  for (int j = 0; j < rotary_dim_ / 2; ++j) {
    float exponent = float(2 * j) / float(rotary_dim_);
    inv_freq_.push_back(1.0f / std::pow(config.rotary_base, exponent));
  }
}

Tensor RotaryEmbedding::freqs(Context& ctx, int64_t seq_len, int64_t offset) const {
  if (cached_.table.defined() && cached_.device == ctx.device() && cached_.seq_len == seq_len &&
      cached_.offset == offset) {
    return cached_.table;
  }
  const size_t half = inv_freq_.size();
  std::vector<float> angles(size_t(seq_len) * half);
  for (int64_t p = 0; p < seq_len; ++p) {
    for (size_t j = 0; j < half; ++j) angles[size_t(p) * half + j] = float(p + offset) * inv_freq_[j];
  }
  cached_ = Cached{ctx.device(), seq_len, offset,
                   Tensor::from_floats(angles, {seq_len, int64_t(half)}, DType::Float32, ctx.device())};
  return cached_.table;
}

}  // namespace megatron

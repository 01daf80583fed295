#include "megatron/core/models/common/embeddings/rotary_pos_embedding.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace megatron {

namespace {

// base^(-2j/dim) for j < dim/2, in fp32 (Megatron: 1 / base ** (arange(0, dim, 2) / dim)).
std::vector<float> plain_inv_freq(int dim, float base) {
  std::vector<float> out;
  for (int j = 0; j < dim / 2; ++j) out.push_back(1.0f / std::pow(base, float(2 * j) / float(dim)));
  return out;
}

}  // namespace

// Note [Llama 3 RoPE scaling].
std::vector<float> llama3_scaled_inv_freq(const std::vector<float>& inv_freq, const Llama3RopeScaling& s) {
  const float two_pi = float(2.0 * std::numbers::pi);
  const float old_context_len = s.original_max_position_embeddings;
  const float low_freq_wavelen = float(double(old_context_len) / s.low_freq_factor);
  const float high_freq_wavelen = float(double(old_context_len) / s.high_freq_factor);
  const float band = float(double(s.high_freq_factor) - s.low_freq_factor);
  std::vector<float> out;
  for (const float f : inv_freq) {
    const float wavelen = (1.0f / f) * two_pi;
    float scaled = wavelen > low_freq_wavelen ? f / s.factor : f;
    const bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
    if (medium) {
      const float smooth = ((1.0f / wavelen) * old_context_len - s.low_freq_factor) / band;
      scaled = (1.0f - smooth) * scaled / s.factor + smooth * scaled;
    }
    out.push_back(scaled);
  }
  return out;
}

// Note [YaRN].
std::pair<double, double> yarn_correction_range(const YarnParams& p, int dim, double base) {
  auto correction_dim = [&](double num_rotations) {
    return (dim * std::log(p.original_max_position_embeddings / (num_rotations * 2 * std::numbers::pi))) /
           (2 * std::log(base));
  };
  double low = correction_dim(p.beta_fast), high = correction_dim(p.beta_slow);
  if (p.correction_range_round_to_int) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  return {std::max(low, 0.0), std::min(high, double(dim - 1))};
}

std::vector<float> yarn_linear_ramp_mask(double low, double high, int half) {
  if (low == high) high += 0.001;  // prevents a division by zero, as Megatron and HF
  std::vector<float> out;
  for (int j = 0; j < half; ++j) out.push_back(std::clamp((float(j) - float(low)) / float(high - low), 0.0f, 1.0f));
  return out;
}

std::vector<float> yarn_inv_freq(const YarnParams& p, int dim, float base) {
  const auto [low, high] = yarn_correction_range(p, dim, base);
  const std::vector<float> ramp = yarn_linear_ramp_mask(low, high, dim / 2);
  std::vector<float> out;
  for (int j = 0; j < dim / 2; ++j) {
    const float pos_freq = std::pow(base, float(2 * j) / float(dim));
    const float extrapolation = 1.0f / pos_freq, interpolation = 1.0f / (p.scaling_factor * pos_freq);
    const float mask = 1.0f - ramp[size_t(j)];
    out.push_back(interpolation * (1.0f - mask) + extrapolation * mask);
  }
  return out;
}

double yarn_get_mscale(double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

double yarn_concentration_factor(double scaling_factor, double mscale, double mscale_all_dim) {
  return yarn_get_mscale(scaling_factor, mscale) / yarn_get_mscale(scaling_factor, mscale_all_dim);
}

YarnParams yarn_params(const TransformerConfig& c) {
  return YarnParams{c.yarn_rotary_scaling_factor,
                    c.yarn_original_max_position_embeddings,
                    c.yarn_beta_fast,
                    c.yarn_beta_slow,
                    c.yarn_mscale,
                    c.yarn_mscale_all_dim,
                    c.yarn_correction_range_round_to_int};
}

float rotary_attention_scale(const TransformerConfig& c) {
  if (!c.use_yarn()) return 1.0f;
  return float(yarn_concentration_factor(c.yarn_rotary_scaling_factor, c.yarn_mscale, c.yarn_mscale_all_dim));
}

RotaryEmbedding::RotaryEmbedding(const TransformerConfig& config)
    : rotary_dim_(config.rotary_dim()), interleaved_(config.rotary_interleaved) {
  if (config.use_yarn()) {
    inv_freq_ = yarn_inv_freq(yarn_params(config), rotary_dim_, config.rotary_base);
    return;
  }
  inv_freq_ = plain_inv_freq(rotary_dim_, config.rotary_base);
  if (config.rope_scaling) inv_freq_ = llama3_scaled_inv_freq(inv_freq_, Llama3RopeScaling{config.rope_scaling_factor});
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

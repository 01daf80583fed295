// Rotary position embedding (RoFormer; Megatron-Core's RotaryEmbedding and YarnRotaryEmbedding): the
// angle of position p for channel pair j is p · inv_freq[j], computed in fp32 as Megatron and
// HuggingFace do. Plain RoPE has inv_freq[j] = base^(-2j/r), r = kv_channels · rotary_percent; the
// two scalings of long-context models change inv_freq (Note [Llama 3 RoPE scaling], Note [YaRN]),
// and YaRN also scales cos and sin (the op kernels, ops::rope_*, take that factor). Everything is in
// the angle table and its factor, so training, context parallelism and the KV-cache path share it.
#pragma once

#include <utility>
#include <vector>

#include "megatron/core/transformer/transformer_config.h"
#include "megatron/runtime/context.h"

namespace megatron {

// Note [Llama 3 RoPE scaling] (Megatron's RotaryEmbedding._apply_scaling, --use-rope-scaling; HF
// rope_type "llama3"): with wavelength λ_j = 2π / inv_freq_j and the original context L
// (original_max_position_embeddings), three bands:
//   λ < L / high_freq_factor   (high frequencies)  inv_freq unchanged
//   λ > L / low_freq_factor    (low frequencies)   inv_freq / factor
//   otherwise                  (medium)            (1 - s) · inv_freq / factor + s · inv_freq,
//                                                  s = (L / λ - low_freq_factor) / (high_freq_factor - low_freq_factor)
// Megatron fixes low_freq_factor 1, high_freq_factor 4 and L 8192 (Llama 3.1/3.2's values);
// --rope-scaling-factor is `factor` (default 8; Llama 3.2 uses 32). Computed in fp32 in torch's
// order of operations (2π / x is (1 / x) · 2π there).
struct Llama3RopeScaling {
  float factor = 8.0f;
  float low_freq_factor = 1.0f;
  float high_freq_factor = 4.0f;
  float original_max_position_embeddings = 8192.0f;
};
std::vector<float> llama3_scaled_inv_freq(const std::vector<float>& inv_freq, const Llama3RopeScaling& scaling);

// Note [YaRN] (Megatron's YarnRotaryEmbedding, --position-embedding-type yarn; HF rope_type "yarn"):
// with d = kv_channels, f = --rotary-scaling-factor, L = --yarn-original-max-position-embeddings,
//   extrapolation  e_j = base^(-2j/d)            interpolation  i_j = 1 / (f · base^(2j/d))
//   correction dim c(n) = d · ln(L / (2π n)) / (2 ln base)  (the pair that turns n times over L)
//   low = c(beta_fast), high = c(beta_slow), floored/ceiled with --yarn-correction-range-round-to-int
//   (HF truncate), clamped to [0, d - 1]; ramp_j = clamp((j - low) / (high - low), 0, 1) (high += 0.001
//   when equal); mask_j = 1 - ramp_j
//   inv_freq_j = i_j · (1 - mask_j) + e_j · mask_j    (fast pairs extrapolate, slow ones interpolate)
// and cos, sin are multiplied by the concentration factor (HF's attention_factor, Megatron's mscale)
//   m = mscale(f, --mscale) / mscale(f, --mscale-all-dim),  mscale(f, a) = 1 if f <= 1 else 0.1·a·ln f + 1
// so q·k grows by m² (Megatron applies it in the attention's rotary step, as here). YaRN rotates every
// channel (rotary_percent 1) in the rotate-half layout.
struct YarnParams {
  float scaling_factor = 1.0f;
  int original_max_position_embeddings = 4096;
  float beta_fast = 32.0f;
  float beta_slow = 1.0f;
  float mscale = 1.0f;
  float mscale_all_dim = 0.0f;
  bool correction_range_round_to_int = true;
};
/// Megatron's _yarn_find_correction_range: the (low, high) pair indices of the ramp.
std::pair<double, double> yarn_correction_range(const YarnParams& p, int dim, double base);
/// Megatron's _yarn_linear_ramp_mask: [dim/2] values clamp((j - low) / (high - low), 0, 1) in fp32.
std::vector<float> yarn_linear_ramp_mask(double low, double high, int half);
std::vector<float> yarn_inv_freq(const YarnParams& p, int dim, float base);
/// Megatron's _yarn_get_mscale.
double yarn_get_mscale(double scale, double mscale);
/// Megatron's _yarn_get_concentration_factor: the factor on cos and sin.
double yarn_concentration_factor(double scaling_factor, double mscale, double mscale_all_dim);
YarnParams yarn_params(const TransformerConfig& config);

/// The factor cos and sin are multiplied by: YaRN's concentration factor, else 1.
float rotary_attention_scale(const TransformerConfig& config);

class RotaryEmbedding {
 public:
  explicit RotaryEmbedding(const TransformerConfig& config);
  /// Angles [seq_len, r/2] fp32 for positions offset .. offset+seq_len-1, on the context's device
  /// (read-only: the last table is kept and handed out again, so a training step copies nothing
  /// from the host — and a captured CUDA graph reads the same table at every launch).
  Tensor freqs(Context& ctx, int64_t seq_len, int64_t offset = 0) const;
  int rotary_dim() const { return rotary_dim_; }
  bool interleaved() const { return interleaved_; }
  const std::vector<float>& inv_freq() const { return inv_freq_; }

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

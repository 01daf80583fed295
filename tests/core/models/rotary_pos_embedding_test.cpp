// The rotary angle tables with RoPE scaling, against values written here from the definitions
// (Note [Llama 3 RoPE scaling], Note [YaRN] in rotary_pos_embedding.h), computed in double: Llama 3's
// three frequency bands, YaRN's correction range, ramp, inverse frequencies and attention factor;
// and that the KV-cache path of a scaled model gives the logits of the full forward.
#include "megatron/core/models/common/embeddings/rotary_pos_embedding.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "megatron/core/models/gpt/gpt_model.h"
#include "megatron/core/transformer/kv_cache.h"
#include "tests/core/model_test_util.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

constexpr double kPi = std::numbers::pi;

TransformerConfig rope_config(int kv_channels, float base) {
  TransformerConfig c;
  c.num_layers = 2;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;
  c.kv_channels = kv_channels;
  c.vocab_size = 64;
  c.make_vocab_size_divisible_by = 1;
  testing::use_llama_layers(c);
  c.hidden_dropout = c.attention_dropout = 0.0f;
  c.rotary_base = base;
  return c;
}

void expect_rel_near(const std::vector<float>& got, const std::vector<double>& want, double tol, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t j = 0; j < want.size(); ++j)
    EXPECT_NEAR(got[j], want[j], tol * std::fabs(want[j])) << what << " pair " << j;
}

// ---- Llama 3 ------------------------------------------------------------------------------------------
// The definition, band by band, with Megatron's L 8192, low 1, high 4 unless given.
std::vector<double> llama3_expected(int dim, double base, double factor, double low = 1, double high = 4,
                                    double context = 8192, int* bands = nullptr) {
  std::vector<double> out;
  for (int j = 0; j < dim / 2; ++j) {
    const double inv = std::pow(base, -2.0 * j / dim), wavelen = 2 * kPi / inv;
    if (wavelen < context / high) {
      out.push_back(inv);  // high frequency: kept
      if (bands) ++bands[0];
    } else if (wavelen > context / low) {
      out.push_back(inv / factor);  // low frequency: interpolated by the factor
      if (bands) ++bands[2];
    } else {
      const double s = (context / wavelen - low) / (high - low);
      out.push_back((1 - s) * inv / factor + s * inv);  // medium: blended
      if (bands) ++bands[1];
    }
  }
  return out;
}

TEST(Llama3RopeScaling, ThreeFrequencyBands) {
  // Llama 3.1's base 500000 over 16 channels: pairs 0-3 high (wavelengths 6 to 862), pair 4 medium
  // (4443, between 8192/4 and 8192), pairs 5-7 low (from 22900).
  TransformerConfig c = rope_config(16, 500000.0f);
  c.rope_scaling = true;
  c.rope_scaling_factor = 8.0f;
  c.finalize();
  int bands[3] = {0, 0, 0};
  const std::vector<double> want = llama3_expected(16, 500000.0, 8.0, 1, 4, 8192, bands);
  EXPECT_EQ(bands[0], 4);
  EXPECT_EQ(bands[1], 1);
  EXPECT_EQ(bands[2], 3);
  RotaryEmbedding rope(c);
  expect_rel_near(rope.inv_freq(), want, 2e-6, "llama3 inv_freq");
  // The medium pair by hand: s = (8192 / (2π·500000^(1/2)) - 1) / 3.
  const double inv4 = std::pow(500000.0, -0.5), s = (8192 * inv4 / (2 * kPi) - 1) / 3;
  EXPECT_NEAR(rope.inv_freq()[4], (1 - s) * inv4 / 8 + s * inv4, 1e-6 * inv4);
  EXPECT_NEAR(rope.inv_freq()[0], 1.0, 1e-7);
  EXPECT_NEAR(rope.inv_freq()[7], std::pow(500000.0, -14.0 / 16) / 8, 1e-6 * std::pow(500000.0, -14.0 / 16));

  // The angle table is position · inv_freq, also at an offset (the KV-cache and CP paths).
  Context ctx;
  const std::vector<float> table = rope.freqs(ctx, 5, 1000).to_floats();
  for (int p = 0; p < 5; ++p)
    for (int j = 0; j < 8; ++j)
      EXPECT_NEAR(table[size_t(p * 8 + j)], (1000 + p) * want[size_t(j)], 2e-6 * (1000 + p) * want[size_t(j)] + 1e-6);

  // Llama 3.2's factor 32 and the band parameters Megatron fixes, set otherwise.
  std::vector<float> inv;
  for (int j = 0; j < 8; ++j) inv.push_back(float(std::pow(500000.0, -2.0 * j / 16)));
  expect_rel_near(llama3_scaled_inv_freq(inv, {32.0f, 1.0f, 4.0f, 8192.0f}), llama3_expected(16, 500000.0, 32.0), 2e-6,
                  "factor 32");
  int other[3] = {0, 0, 0};
  expect_rel_near(llama3_scaled_inv_freq(inv, {4.0f, 2.0f, 8.0f, 1024.0f}),
                  llama3_expected(16, 500000.0, 4.0, 2, 8, 1024, other), 2e-6, "low 2, high 8, L 1024");
  EXPECT_GT(other[1], 0);
}

TEST(Llama3RopeScaling, WithoutTheFlagNothingChanges) {
  TransformerConfig c = rope_config(16, 500000.0f);
  c.rope_scaling_factor = 8.0f;  // no --use-rope-scaling: ignored
  c.finalize();
  std::vector<double> want;
  for (int j = 0; j < 8; ++j) want.push_back(std::pow(500000.0, -2.0 * j / 16));
  expect_rel_near(RotaryEmbedding(c).inv_freq(), want, 2e-6, "plain inv_freq");
  EXPECT_EQ(rotary_attention_scale(c), 1.0f);
}

// ---- YaRN -----------------------------------------------------------------------------------------------
// The definition in double: correction dims, the ramp, the blend.
struct YarnExpected {
  double low, high;
  std::vector<double> ramp, inv;
};
YarnExpected yarn_expected(int dim, double base, double factor, double context, double beta_fast, double beta_slow,
                           bool round_to_int) {
  auto correction_dim = [&](double rotations) {
    return dim * std::log(context / (rotations * 2 * kPi)) / (2 * std::log(base));
  };
  YarnExpected e;
  e.low = correction_dim(beta_fast), e.high = correction_dim(beta_slow);
  if (round_to_int) e.low = std::floor(e.low), e.high = std::ceil(e.high);
  e.low = std::max(e.low, 0.0), e.high = std::min(e.high, double(dim - 1));
  const double width = e.high == e.low ? 0.001 : e.high - e.low;
  for (int j = 0; j < dim / 2; ++j) {
    const double ramp = std::clamp((j - e.low) / width, 0.0, 1.0), mask = 1 - ramp;
    const double extrapolation = std::pow(base, -2.0 * j / dim), interpolation = extrapolation / factor;
    e.ramp.push_back(ramp);
    e.inv.push_back(interpolation * (1 - mask) + extrapolation * mask);
  }
  return e;
}

TEST(YarnRotaryEmbedding, RampMaskAndInverseFrequencies) {
  // 16 channels, base 10000, factor 4 over an original context of 64: c(32) = 16·ln(64/(64π))/(2 ln 1e4)
  // = -0.99 -> floor -1 -> 0; c(1) = 16·ln(64/2π)/(2 ln 1e4) = 2.02 -> ceil 3. The ramp is j/3 up to
  // pair 3: pair 0 keeps its frequency, pairs 1-2 blend, pairs 3-7 are divided by 4.
  TransformerConfig c = rope_config(16, 10000.0f);
  c.position_embedding_type = "yarn";
  c.yarn_rotary_scaling_factor = 4.0f;
  c.yarn_original_max_position_embeddings = 64;
  c.finalize();
  const YarnExpected e = yarn_expected(16, 10000.0, 4.0, 64, 32, 1, true);
  EXPECT_EQ(e.low, 0.0);
  EXPECT_EQ(e.high, 3.0);
  const auto [low, high] = yarn_correction_range(yarn_params(c), 16, 10000.0);
  EXPECT_EQ(low, 0.0);
  EXPECT_EQ(high, 3.0);
  expect_rel_near(yarn_linear_ramp_mask(low, high, 8), {0, 1.0 / 3, 2.0 / 3, 1, 1, 1, 1, 1}, 1e-6, "ramp");
  RotaryEmbedding rope(c);
  expect_rel_near(rope.inv_freq(), e.inv, 2e-6, "yarn inv_freq");
  EXPECT_NEAR(rope.inv_freq()[0], 1.0, 1e-7);                                       // extrapolated
  EXPECT_NEAR(rope.inv_freq()[5], std::pow(10000.0, -10.0 / 16) / 4, 1e-6 * 1e-3);  // interpolated
  const double inv1 = std::pow(10000.0, -2.0 / 16);                                 // a third interpolated
  EXPECT_NEAR(rope.inv_freq()[1], inv1 / 4 / 3 + inv1 * 2 / 3, 1e-6 * inv1);

  // HF's truncate false: the exact dims, low = max(-0.99, 0) = 0, high = 2.02.
  c.yarn_correction_range_round_to_int = false;
  const YarnExpected f = yarn_expected(16, 10000.0, 4.0, 64, 32, 1, false);
  EXPECT_NEAR(f.high, 16 * std::log(64 / (2 * kPi)) / (2 * std::log(10000.0)), 1e-12);
  expect_rel_near(RotaryEmbedding(c).inv_freq(), f.inv, 2e-6, "yarn inv_freq, not rounded");

  // Other betas and a long original context (Qwen3's 32768, factor 4, base 1e6, 128 channels).
  TransformerConfig q = rope_config(128, 1000000.0f);
  q.hidden_size = 512;
  q.position_embedding_type = "yarn";
  q.yarn_rotary_scaling_factor = 4.0f;
  q.yarn_original_max_position_embeddings = 32768;
  q.yarn_beta_fast = 16.0f;
  q.yarn_beta_slow = 2.0f;
  q.finalize();
  const YarnExpected g = yarn_expected(128, 1e6, 4.0, 32768, 16, 2, true);
  EXPECT_GT(g.low, 0.0);
  EXPECT_LT(g.high, 63.0);
  expect_rel_near(RotaryEmbedding(q).inv_freq(), g.inv, 4e-6, "qwen3-like yarn inv_freq");
}

TEST(YarnRotaryEmbedding, AttentionFactor) {
  // mscale(f, a) = 0.1·a·ln f + 1 (1 for f <= 1); the factor is mscale(f, mscale) / mscale(f, mscale_all_dim).
  EXPECT_NEAR(yarn_concentration_factor(4.0, 1.0, 0.0), 0.1 * std::log(4.0) + 1, 1e-15);
  EXPECT_NEAR(yarn_concentration_factor(40.0, 1.0, 1.0), 1.0, 1e-15);  // DeepSeek-V3's values
  EXPECT_NEAR(yarn_concentration_factor(40.0, 0.707, 0.0), 0.0707 * std::log(40.0) + 1, 1e-15);
  EXPECT_NEAR(yarn_concentration_factor(32.0, 1.0, 0.707), (0.1 * std::log(32.0) + 1) / (0.0707 * std::log(32.0) + 1),
              1e-15);
  EXPECT_EQ(yarn_concentration_factor(1.0, 5.0, 0.0), 1.0);
  EXPECT_EQ(yarn_concentration_factor(0.5, 5.0, 0.0), 1.0);

  TransformerConfig c = rope_config(16, 10000.0f);
  c.position_embedding_type = "yarn";
  c.yarn_rotary_scaling_factor = 4.0f;
  c.finalize();
  EXPECT_FLOAT_EQ(rotary_attention_scale(c), float(0.1 * std::log(4.0) + 1));
  c.position_embedding_type = "rope";  // the same numbers without yarn: no factor
  EXPECT_EQ(rotary_attention_scale(c), 1.0f);
}

TEST(RopeScaling, ConfigRulesAreOneLineEach) {
  auto error = [](auto edit) {
    TransformerConfig c = rope_config(16, 10000.0f);
    edit(c);
    return testing::error_of([&] { c.finalize(); });
  };
  EXPECT_NE(error([](TransformerConfig& c) {
              c.position_embedding_type = "learned_absolute";
              c.max_position_embeddings = 8;
              c.rope_scaling = true;
            }).find("--use-rope-scaling (Llama 3's RoPE scaling) needs --position-embedding-type rope"),
            std::string::npos);
  EXPECT_NE(error([](TransformerConfig& c) {
              c.position_embedding_type = "yarn";
              c.rope_scaling = true;
            }).find("needs --position-embedding-type rope (got yarn)"),
            std::string::npos);
  EXPECT_NE(error([](TransformerConfig& c) {
              c.position_embedding_type = "yarn";
              c.rotary_percent = 0.5f;
            }).find("drop --rotary-percent 0.5"),
            std::string::npos);
  EXPECT_NE(error([](TransformerConfig& c) {
              c.position_embedding_type = "yarn";
              c.rotary_interleaved = true;
            }).find("does not support --rotary-interleaved"),
            std::string::npos);
  EXPECT_NE(error([](TransformerConfig& c) {
              c.position_embedding_type = "yarn";
              c.yarn_rotary_scaling_factor = 0.0f;
            }).find("--rotary-scaling-factor must be a positive number"),
            std::string::npos);
  EXPECT_NE(error([](TransformerConfig& c) {
              c.position_embedding_type = "alibi";
            }).find("--position-embedding-type must be learned_absolute, rope, yarn or none (got 'alibi')"),
            std::string::npos);
}

// ---- the model ------------------------------------------------------------------------------------------
// The KV-cache path (one angle row per position and sequence, YaRN's factor in the attention's rotary
// step) gives the full forward's logits, prompt then one token at a time.
class ScaledRopeKvCache : public ::testing::TestWithParam<std::string> {};

TEST_P(ScaledRopeKvCache, MatchesTheFullForward) {
  TransformerConfig c = rope_config(16, 10000.0f);
  if (GetParam() == "llama3") {
    c.rope_scaling = true;
    c.rope_scaling_factor = 8.0f;
    c.rotary_base = 500000.0f;
    c.init_method_std = 0.3f;  // sharp attention: Llama 3's scaled low frequencies turn little over 12 positions
  } else {
    c.position_embedding_type = "yarn";
    c.yarn_rotary_scaling_factor = 4.0f;
    c.yarn_original_max_position_embeddings = 8;
  }
  c.finalize();
  GPTModel model(c);
  model.init_weights(7);
  Context ctx;
  const int64_t s = 12, prompt = 5;
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < s; ++i) ids.push_back((i * 7 + 3) % c.vocab_size);
  const Tensor tokens = Tensor::from_ints(ids, {1, s}, DType::Int64);
  const std::vector<float> full = model.forward_logits(ctx, tokens, Tensor()).to_floats();  // [s, 1, V]

  KVCache cache(c, /*num_slots=*/1, /*max_length=*/s, ctx.device());
  std::vector<float> incremental;
  auto step = [&](int64_t start, int64_t n) {
    std::vector<int64_t> part(ids.begin() + start, ids.begin() + start + n);
    Tensor logits = model.forward_inference(ctx, Tensor::from_ints(part, {1, n}, DType::Int64), {0}, {start}, cache);
    const std::vector<float> l = logits.to_floats();
    incremental.insert(incremental.end(), l.begin(), l.end());
  };
  step(0, prompt);
  for (int64_t p = prompt; p < s; ++p) step(p, 1);
  ASSERT_EQ(incremental.size(), full.size());
  double worst = 0, scale = 0;
  for (size_t i = 0; i < full.size(); ++i) {
    worst = std::max(worst, std::fabs(double(incremental[i]) - full[i]));
    scale = std::max(scale, std::fabs(double(full[i])));
  }
  worst /= scale;
  EXPECT_LT(worst, 1e-5);

  // And the scaling matters: the same weights without it give other logits.
  TransformerConfig plain = c;
  plain.position_embedding_type = "rope";
  plain.rope_scaling = false;
  GPTModel unscaled(plain);
  unscaled.init_weights(7);
  const std::vector<float> other = unscaled.forward_logits(ctx, tokens, Tensor()).to_floats();
  double moved = 0;
  for (size_t i = 0; i < full.size(); ++i) moved = std::max(moved, std::fabs(double(other[i]) - full[i]) / scale);
  EXPECT_GT(moved, 1e-3);
}

INSTANTIATE_TEST_SUITE_P(Scalings, ScaledRopeKvCache, ::testing::Values("llama3", "yarn"));

}  // namespace
}  // namespace megatron

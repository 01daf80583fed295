#include "megatron/core/models/gpt/hf_rope.h"

#include <cmath>
#include <optional>

#include "megatron/core/models/common/embeddings/rotary_pos_embedding.h"
#include "megatron/core/models/gpt/hf_util.h"
#include "megatron/runtime/check.h"

namespace megatron {

namespace {

// d[key] when it is a number (null and absent: nothing).
std::optional<double> number(const nlohmann::json& d, const char* key) {
  if (!d.is_object() || !d.contains(key) || d[key].is_null()) return std::nullopt;
  MG_CHECK(d[key].is_number(), "config.json: {} is {}, expected a number", key, d[key].dump());
  return d[key].get<double>();
}

// The RoPE dict of Note [HF RoPE scaling] (null without one).
nlohmann::json rope_dict(const nlohmann::json& j) {
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    if (!j.contains(key) || j[key].is_null()) continue;
    MG_CHECK(j[key].is_object(), "config.json: {} is {}, expected an object", key, j[key].dump());
    if (j[key].empty()) continue;
    for (const auto& [k, v] : j[key].items())
      MG_CHECK(!v.is_object(), "config.json: {} per layer type ('{}') is not supported: only one RoPE for all layers",
               key, k);
    return j[key];
  }
  return nullptr;
}

// The ratio Megatron's YaRN applies to cos and sin (_yarn_get_concentration_factor).
double megatron_attention_factor(const TransformerConfig& c) {
  return yarn_concentration_factor(c.yarn_rotary_scaling_factor, c.yarn_mscale, c.yarn_mscale_all_dim);
}

void yarn_from_hf(const nlohmann::json& j, const nlohmann::json& rope, TransformerConfig& c) {
  MG_CHECK(c.rotary_percent == 1.0f,
           "rope_scaling yarn with partial_rotary_factor {}: YaRN is supported on every channel of a head only (as "
           "Megatron's YarnRotaryEmbedding)",
           c.rotary_percent);
  const std::optional<double> top_original = number(j, "original_max_position_embeddings");
  const double original =
      top_original ? *top_original
                   : number(rope, "original_max_position_embeddings").value_or(double(c.max_position_embeddings));
  MG_CHECK(original > 0, "rope_scaling yarn needs original_max_position_embeddings (or max_position_embeddings)");
  MG_CHECK(rope.contains("factor"), "rope_scaling yarn has no factor");  // null: the ratio below, as HF
  const double factor = number(rope, "factor").value_or(double(c.max_position_embeddings) / original);
  c.position_embedding_type = "yarn";
  c.yarn_rotary_scaling_factor = float(factor);
  c.yarn_original_max_position_embeddings = int(original);
  MG_CHECK(double(c.yarn_original_max_position_embeddings) == original,
           "rope_scaling original_max_position_embeddings {} is not an integer", original);
  const double beta_fast = number(rope, "beta_fast").value_or(0.0), beta_slow = number(rope, "beta_slow").value_or(0.0);
  c.yarn_beta_fast = beta_fast != 0.0 ? float(beta_fast) : 32.0f;  // HF: `or 32`, `or 1`
  c.yarn_beta_slow = beta_slow != 0.0 ? float(beta_slow) : 1.0f;
  if (rope.contains("truncate") && !rope["truncate"].is_null()) {
    MG_CHECK(rope["truncate"].is_boolean(), "rope_scaling truncate is {}, expected true or false",
             rope["truncate"].dump());
    c.yarn_correction_range_round_to_int = rope["truncate"].get<bool>();
  }
  const double mscale = number(rope, "mscale").value_or(0.0),
               mscale_all_dim = number(rope, "mscale_all_dim").value_or(0.0);
  const std::optional<double> attention_factor = number(rope, "attention_factor");
  if (attention_factor || (mscale != 0.0 && mscale_all_dim != 0.0)) {
    // Megatron's ratio with the file's values (absent: Megatron's defaults 1 and 0).
    c.yarn_mscale = rope.contains("mscale") && !rope["mscale"].is_null() ? float(mscale) : 1.0f;
    c.yarn_mscale_all_dim = float(mscale_all_dim);
  } else {
    c.yarn_mscale = 1.0f;  // HF's mscale(factor): Megatron's ratio with (1, 0)
    c.yarn_mscale_all_dim = 0.0f;
  }
  if (attention_factor) {
    const double ours = megatron_attention_factor(c);
    MG_CHECK(std::fabs(ours - *attention_factor) <= 1e-6 * std::fabs(*attention_factor),
             "rope_scaling yarn attention_factor {} is not YaRN's mscale(factor, mscale) / mscale(factor, "
             "mscale_all_dim) = {}: only the attention factor Megatron's --mscale/--mscale-all-dim give is supported",
             *attention_factor, ours);
  }
}

}  // namespace

// Note [HF RoPE scaling].
void rope_config_from_hf(const nlohmann::json& j, TransformerConfig& c) {
  c.position_embedding_type = "rope";
  const nlohmann::json rope = rope_dict(j);
  // The RoPE dict's value, else rope_parameters' (when rope_scaling is the dict), else the top level's.
  const nlohmann::json parameters = j.value("rope_parameters", nlohmann::json());
  auto value = [&](const char* key, double fallback) {
    return number(rope, key).value_or(number(parameters, key).value_or(number(j, key).value_or(fallback)));
  };
  c.rotary_base = float(value("rope_theta", 10000.0));
  c.rotary_percent = float(value("partial_rotary_factor", 1.0));
  if (rope.is_null()) return;
  std::string type = "default";
  for (const char* key : {"rope_type", "type"}) {
    if (rope.contains(key) && rope[key].is_string()) {
      type = rope[key].get<std::string>();
      break;
    }
  }
  if (type == "default") return;
  if (type == "llama3") {
    const std::optional<double> factor = number(rope, "factor");
    MG_CHECK(factor.has_value(), "rope_scaling llama3 has no factor");
    const std::optional<double> top_original = number(j, "original_max_position_embeddings");
    const double low = number(rope, "low_freq_factor").value_or(-1),
                 high = number(rope, "high_freq_factor").value_or(-1),
                 original =
                     top_original ? *top_original : number(rope, "original_max_position_embeddings").value_or(-1);
    const Llama3RopeScaling megatron;  // Megatron's fixed band parameters
    MG_CHECK(low == megatron.low_freq_factor && high == megatron.high_freq_factor &&
                 original == megatron.original_max_position_embeddings,
             "rope_scaling llama3 with low_freq_factor {}, high_freq_factor {}, original_max_position_embeddings {}: "
             "only Megatron's {}, {} and {} (every Llama 3.1/3.2) are supported",
             low, high, original, megatron.low_freq_factor, megatron.high_freq_factor,
             megatron.original_max_position_embeddings);
    c.rope_scaling = true;
    c.rope_scaling_factor = float(*factor);
    return;
  }
  if (type == "yarn") {
    yarn_from_hf(j, rope, c);
    return;
  }
  MG_CHECK(false,
           "rope_scaling type '{}' is not supported: only llama3 (Llama 3.1/3.2) and yarn, or no rope_scaling (linear, "
           "dynamic, longrope and the others are not)",
           type);
}

void check_hf_attention_window(const nlohmann::json& j, const std::string& model_type, const TransformerConfig& c) {
  const int layers = c.num_layers;
  std::vector<bool> sliding(size_t(layers), false);
  if (j.contains("layer_types") && j["layer_types"].is_array()) {
    const auto& types = j["layer_types"];
    MG_CHECK(int(types.size()) == layers, "config.json: layer_types has {} entries for {} layers", types.size(),
             layers);
    for (int i = 0; i < layers; ++i) {
      MG_CHECK(types[size_t(i)] == "full_attention" || types[size_t(i)] == "sliding_attention",
               "layer_types '{}' is not supported: only full_attention (and sliding_attention whose window never "
               "applies)",
               types[size_t(i)].dump());
      sliding[size_t(i)] = types[size_t(i)] == "sliding_attention";
    }
  }
  if (model_type == "llama") return;  // Llama has no window
  // Qwen models switch the window on with use_sliding_window; Mistral and Mixtral with a non-null one.
  const bool qwen = model_type.rfind("qwen", 0) == 0;
  if (qwen && !(j.contains("use_sliding_window") && j["use_sliding_window"] == true)) return;
  // An absent key is the config class's default: 4096 for Mistral and Qwen, none for Mixtral.
  const std::optional<double> window = j.contains("sliding_window")
                                           ? number(j, "sliding_window")
                                           : (model_type == "mixtral" ? std::nullopt : std::optional<double>(4096));
  if (!window || *window <= 0 || *window >= c.max_position_embeddings) return;  // no window, or one never reached
  if (!(j.contains("layer_types") && j["layer_types"].is_array())) {
    // transformers 5's layer_types when the file has none.
    const int max_window_layers = int(number(j, "max_window_layers").value_or(28));
    for (int i = 0; i < layers; ++i) {
      sliding[size_t(i)] = model_type == "qwen2" || model_type == "qwen3" ? i >= max_window_layers
                           : model_type == "qwen2_moe"                    ? (i + 1) % 2 == 1 && i < max_window_layers
                                                                          : true;
    }
  }
  int count = 0;
  for (bool s : sliding) count += s;
  MG_CHECK(count == 0,
           "{} config.json has sliding_window {}{} (below max_position_embeddings {}) on {} of its {} layers: "
           "sliding-window attention is not supported",
           model_type, *window, qwen ? " with use_sliding_window true" : "", c.max_position_embeddings, count, layers);
}

namespace {

// The rope_scaling dict of a model trained here (null without scaling).
nlohmann::json rope_scaling_to_hf(const TransformerConfig& c) {
  if (c.use_yarn()) {
    nlohmann::json r = {{"rope_type", "yarn"},
                        {"factor", c.yarn_rotary_scaling_factor},
                        {"original_max_position_embeddings", c.yarn_original_max_position_embeddings},
                        {"beta_fast", c.yarn_beta_fast},
                        {"beta_slow", c.yarn_beta_slow},
                        {"truncate", c.yarn_correction_range_round_to_int}};
    if (c.yarn_mscale != 1.0f || c.yarn_mscale_all_dim != 0.0f) {
      r["mscale"] = c.yarn_mscale;
      r["mscale_all_dim"] = c.yarn_mscale_all_dim;
      // HF computes the ratio itself only when both are non-zero; otherwise it needs the value.
      if (c.yarn_mscale == 0.0f || c.yarn_mscale_all_dim == 0.0f) r["attention_factor"] = megatron_attention_factor(c);
    }
    return r;
  }
  if (!c.rope_scaling) return nullptr;
  const Llama3RopeScaling s{c.rope_scaling_factor};
  return {{"rope_type", "llama3"},
          {"factor", s.factor},
          {"low_freq_factor", s.low_freq_factor},
          {"high_freq_factor", s.high_freq_factor},
          {"original_max_position_embeddings", int(s.original_max_position_embeddings)}};
}

}  // namespace

void rope_config_to_hf(const TransformerConfig& c, nlohmann::json& j, bool rope_parameters) {
  const double theta = hf_detail::shortest(c.rotary_base);
  if (c.rotary_percent != 1.0f) j["partial_rotary_factor"] = c.rotary_percent;
  nlohmann::json scaling = rope_scaling_to_hf(c);
  if (!rope_parameters) {
    j["rope_theta"] = theta;
    if (!scaling.is_null()) j["rope_scaling"] = scaling;
    return;
  }
  // transformers 5: rope_theta inside; a missing dict means a type's default scaling to some
  // configs (GptOssConfig takes it for YaRN with factor 32), so plain RoPE says "default".
  nlohmann::json r = scaling.is_null() ? nlohmann::json{{"rope_type", "default"}} : scaling;
  r["rope_theta"] = theta;
  j["rope_parameters"] = r;
}

}  // namespace megatron

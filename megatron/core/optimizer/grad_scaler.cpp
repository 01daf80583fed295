// Constant and dynamic loss scalers with Megatron-LM's update rule and checkpoint keys.
#include "megatron/core/optimizer/grad_scaler.h"

#include <algorithm>
#include <cmath>

#include "megatron/runtime/check.h"

namespace megatron {

ConstantGradScaler::ConstantGradScaler(float scale) : scale_(scale) {
  MG_CHECK(scale > 0.0f && std::isfinite(scale), "loss scale is {}: it must be a positive finite number", scale);
}

DynamicGradScaler::DynamicGradScaler(const DynamicGradScalerConfig& config)
    : config_(config), scale_(config.initial_scale), hysteresis_tracker_(config.hysteresis) {
  const auto& c = config_;
  MG_CHECK(c.initial_scale > 0.0f && std::isfinite(c.initial_scale), "initial loss scale is {}: it must be > 0",
           c.initial_scale);
  MG_CHECK(c.min_scale > 0.0f, "min loss scale is {}: it must be > 0", c.min_scale);
  MG_CHECK(c.min_scale <= c.initial_scale, "min loss scale {} is above the initial loss scale {}", c.min_scale,
           c.initial_scale);
  MG_CHECK(c.growth_factor > 1.0f, "loss scale growth factor is {}: it must be > 1", c.growth_factor);
  MG_CHECK(c.backoff_factor > 0.0f && c.backoff_factor < 1.0f, "loss scale backoff factor is {}: it must be in (0, 1)",
           c.backoff_factor);
  MG_CHECK(c.growth_interval > 0, "loss scale window is {}: it must be > 0", c.growth_interval);
  MG_CHECK(c.hysteresis > 0, "hysteresis is {}: it must be > 0", c.hysteresis);
}

void DynamicGradScaler::update(bool found_inf) {
  if (found_inf) {
    growth_tracker_ = 0;
    hysteresis_tracker_ -= 1;
    if (hysteresis_tracker_ <= 0) scale_ = std::max(scale_ * config_.backoff_factor, config_.min_scale);
    return;
  }
  growth_tracker_ += 1;
  if (growth_tracker_ == config_.growth_interval) {
    growth_tracker_ = 0;
    hysteresis_tracker_ = config_.hysteresis;
    scale_ = scale_ * config_.growth_factor;
  }
}

nlohmann::json DynamicGradScaler::state_dict() const {
  return {{"scale", scale_}, {"growth_tracker", growth_tracker_}, {"hysteresis_tracker", hysteresis_tracker_}};
}

void DynamicGradScaler::load_state_dict(const nlohmann::json& state) {
  for (const char* key : {"scale", "growth_tracker", "hysteresis_tracker"})
    MG_CHECK(state.contains(key), "dynamic grad scaler state has no '{}' entry", key);
  const float scale = state.at("scale").get<float>();
  MG_CHECK(scale > 0.0f && std::isfinite(scale), "dynamic grad scaler state has scale {}", scale);
  scale_ = scale;
  growth_tracker_ = state.at("growth_tracker").get<int64_t>();
  hysteresis_tracker_ = state.at("hysteresis_tracker").get<int64_t>();
}

}  // namespace megatron

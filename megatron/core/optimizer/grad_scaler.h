// Loss scaling for fp16 training, as Megatron-LM's grad_scaler.py: the loss is multiplied by
// scale() before backward, the optimizer unscales the gradients by inv_scale() and reports whether
// any was inf/nan through update(found_inf).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>

namespace megatron {

class GradScaler {
 public:
  virtual ~GradScaler() = default;
  /// The current loss scale (an fp32 value, as Megatron keeps it in a float tensor).
  virtual float scale() const = 0;
  /// 1 / scale, computed in double and rounded to fp32 (Megatron's inv_scale).
  float inv_scale() const { return float(1.0 / double(scale())); }
  /// Called once per optimizer step with whether any gradient was inf/nan.
  virtual void update(bool found_inf) = 0;
  virtual nlohmann::json state_dict() const = 0;
  virtual void load_state_dict(const nlohmann::json& state) = 0;
};

/// A fixed loss scale (--loss-scale). Has no state.
class ConstantGradScaler : public GradScaler {
 public:
  explicit ConstantGradScaler(float scale);
  float scale() const override { return scale_; }
  void update(bool) override {}
  nlohmann::json state_dict() const override { return nlohmann::json::object(); }
  void load_state_dict(const nlohmann::json&) override {}

 private:
  float scale_;
};

struct DynamicGradScalerConfig {
  float initial_scale = 4294967296.0f;  // --initial-loss-scale (2^32)
  float min_scale = 1.0f;               // --min-loss-scale
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  int64_t growth_interval = 1000;  // --loss-scale-window
  int64_t hysteresis = 2;          // --hysteresis
};

/// Megatron's DynamicGradScaler: after `hysteresis` inf/nan steps (not necessarily consecutive) the
/// scale is multiplied by backoff_factor (not below min_scale); after growth_interval consecutive
/// clean steps it is multiplied by growth_factor and the hysteresis budget is refilled.
class DynamicGradScaler : public GradScaler {
 public:
  explicit DynamicGradScaler(const DynamicGradScalerConfig& config);
  float scale() const override { return scale_; }
  void update(bool found_inf) override;
  /// {"scale", "growth_tracker", "hysteresis_tracker"} (Megatron's keys).
  nlohmann::json state_dict() const override;
  void load_state_dict(const nlohmann::json& state) override;

  int64_t growth_tracker() const { return growth_tracker_; }
  int64_t hysteresis_tracker() const { return hysteresis_tracker_; }
  const DynamicGradScalerConfig& config() const { return config_; }

 private:
  DynamicGradScalerConfig config_;
  float scale_;
  int64_t growth_tracker_ = 0;
  int64_t hysteresis_tracker_;
};

}  // namespace megatron

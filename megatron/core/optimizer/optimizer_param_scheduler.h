// The learning-rate and weight-decay schedule, as Megatron-LM's OptimizerParamScheduler.
//
// Steps count samples, not iterations: the training loop calls step(global_batch_size) after each
// optimizer step, and the values it returns are the ones the NEXT optimizer step uses (the first
// optimizer step runs with the values at num_steps = 0, set by the constructor). The formulas are
// Megatron's, evaluated in double in the same order; rounded to fp32 (the optimizer's lr) they match
// the learning rates Megatron printed digit for digit (optimizer_param_scheduler_test.cpp checks
// every row of megatron_schedules.json).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

namespace megatron {

enum class LrDecayStyle { Constant, Linear, Cosine, InverseSquareRoot, WSD };
enum class WsdDecayStyle { Linear, Cosine, Exponential, MinusSqrt };
enum class WdIncrStyle { Constant, Linear, Cosine };

/// Megatron's spellings: "constant", "linear", "cosine", "inverse-square-root", "WSD".
LrDecayStyle lr_decay_style_from_string(std::string_view s);
std::string_view to_string(LrDecayStyle s);
/// "linear", "cosine", "exponential", "minus_sqrt".
WsdDecayStyle wsd_decay_style_from_string(std::string_view s);
std::string_view to_string(WsdDecayStyle s);
/// "constant", "linear", "cosine".
WdIncrStyle wd_incr_style_from_string(std::string_view s);
std::string_view to_string(WdIncrStyle s);

/// The scheduler's arguments, in samples (Megatron's constructor arguments).
struct OptimizerParamSchedulerConfig {
  double init_lr = 0.0;  // --lr-warmup-init
  double max_lr = 0.0;   // --lr
  double min_lr = 0.0;
  double lr_warmup_steps = 0.0;  // fractional when derived from --lr-warmup-fraction
  int64_t lr_decay_steps = 0;
  LrDecayStyle lr_decay_style = LrDecayStyle::Linear;
  std::optional<int64_t> wsd_decay_steps;  // required by WSD
  WsdDecayStyle lr_wsd_decay_style = WsdDecayStyle::Exponential;
  double start_wd = 0.01;
  double end_wd = 0.01;
  int64_t wd_incr_steps = 0;
  WdIncrStyle wd_incr_style = WdIncrStyle::Constant;
  /// On load: take the checkpoint's values (true), or require them to equal this config's (false).
  bool use_checkpoint_opt_param_scheduler = true;
  /// On load: keep this config's values and ignore the checkpoint's (excludes the flag above).
  bool override_opt_param_scheduler = false;
};

/// Megatron's training arguments for an iteration-based run (--train-iters), Megatron's defaults.
struct IterationScheduleArgs {
  int64_t train_iters = 0;
  int64_t global_batch_size = 0;
  double lr = 0.0;
  double min_lr = 0.0;
  double lr_warmup_init = 0.0;
  LrDecayStyle lr_decay_style = LrDecayStyle::Linear;
  std::optional<int64_t> lr_decay_iters;  // default: train_iters
  int64_t lr_warmup_iters = 0;
  std::optional<double> lr_warmup_fraction;  // wins over lr_warmup_iters
  std::optional<int64_t> lr_wsd_decay_iters;
  WsdDecayStyle lr_wsd_decay_style = WsdDecayStyle::Exponential;
  double weight_decay = 0.01;
  std::optional<double> start_weight_decay;  // default: weight_decay
  std::optional<double> end_weight_decay;    // default: weight_decay
  WdIncrStyle weight_decay_incr_style = WdIncrStyle::Constant;
};

/// The scheduler config training.py's get_optimizer_param_scheduler derives from iteration flags:
/// every step count becomes samples (iterations · global batch size).
OptimizerParamSchedulerConfig scheduler_config_from_iterations(const IterationScheduleArgs& a);

/// The values the optimizer applies until the next step: lr, and weight decay before wd_mult.
struct ScheduledValues {
  double lr = 0.0;
  double wd = 0.0;
};

class OptimizerParamScheduler {
 public:
  /// Validates the config (Megatron's asserts, as megatron::Error) and sets num_steps = 0.
  explicit OptimizerParamScheduler(const OptimizerParamSchedulerConfig& config);

  /// Advances num_steps by `increment` samples and returns the new lr and weight decay.
  ScheduledValues step(int64_t increment);
  /// The learning rate at the current num_steps.
  double get_lr() const;
  /// The same schedule (warmup from init_lr, decay style and steps) between another max and min:
  /// Megatron's get_lr(param_group) for a group with its own max_lr/min_lr (--decoupled-lr).
  double get_lr(double max_lr, double min_lr) const;
  /// The weight decay at the current num_steps (multiply by the param group's wd_mult).
  double get_wd() const;
  ScheduledValues values() const { return {get_lr(), get_wd()}; }
  int64_t num_steps() const { return num_steps_; }
  const OptimizerParamSchedulerConfig& config() const { return config_; }

  /// Megatron's state_dict keys: max_lr, lr_warmup_steps, num_steps, lr_decay_style,
  /// lr_decay_steps, min_lr, start_wd, end_wd, wd_incr_style, wd_incr_steps.
  nlohmann::json state_dict() const;
  /// Restores a state_dict with Megatron's override / use-checkpoint rules (see the config flags).
  void load_state_dict(const nlohmann::json& state);

 private:
  OptimizerParamSchedulerConfig config_;
  int64_t num_steps_ = 0;
};

}  // namespace megatron

// Megatron-LM's learning-rate decay and weight-decay increment, evaluated exactly as the Python does
// (double precision, the same operation order, pow/cos from the same libm), so the schedules agree
// to the last printed digit.
#include "megatron/core/optimizer/optimizer_param_scheduler.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "megatron/runtime/check.h"

namespace megatron {

namespace {

template <typename Enum, size_t N>
Enum parse_style(std::string_view s, const std::pair<std::string_view, Enum> (&table)[N], const char* what) {
  std::string valid;
  for (const auto& [name, value] : table) {
    if (name == s) return value;
    valid += (valid.empty() ? "" : ", ") + std::string(name);
  }
  MG_CHECK(false, "unknown {} '{}': use one of {}", what, s, valid);
  return table[0].second;
}

template <typename Enum, size_t N>
std::string_view style_name(Enum e, const std::pair<std::string_view, Enum> (&table)[N]) {
  for (const auto& [name, value] : table)
    if (value == e) return name;
  return "?";
}

constexpr std::pair<std::string_view, LrDecayStyle> kLrDecayStyles[] = {
    {"constant", LrDecayStyle::Constant},
    {"linear", LrDecayStyle::Linear},
    {"cosine", LrDecayStyle::Cosine},
    {"inverse-square-root", LrDecayStyle::InverseSquareRoot},
    {"WSD", LrDecayStyle::WSD}};
constexpr std::pair<std::string_view, WsdDecayStyle> kWsdDecayStyles[] = {{"linear", WsdDecayStyle::Linear},
                                                                          {"cosine", WsdDecayStyle::Cosine},
                                                                          {"exponential", WsdDecayStyle::Exponential},
                                                                          {"minus_sqrt", WsdDecayStyle::MinusSqrt}};
constexpr std::pair<std::string_view, WdIncrStyle> kWdIncrStyles[] = {
    {"constant", WdIncrStyle::Constant}, {"linear", WdIncrStyle::Linear}, {"cosine", WdIncrStyle::Cosine}};

// Megatron's asserts in OptimizerParamScheduler.__init__ (and the ones get_wd/get_lr would hit later).
void validate(const OptimizerParamSchedulerConfig& c) {
  MG_CHECK(c.min_lr >= 0.0, "min_lr is {}: it must be >= 0", c.min_lr);
  MG_CHECK(c.max_lr >= c.min_lr, "lr {} is below min_lr {}: --lr must be >= --min-lr", c.max_lr, c.min_lr);
  MG_CHECK(c.init_lr <= c.max_lr, "lr_warmup_init {} is above lr {}: warmup must start at or below --lr", c.init_lr,
           c.max_lr);
  MG_CHECK(c.lr_decay_steps > 0, "lr_decay_steps is {}: it must be > 0 (set --train-iters or --lr-decay-iters)",
           c.lr_decay_steps);
  MG_CHECK(c.lr_warmup_steps >= 0.0, "lr_warmup_steps is {}: it must be >= 0", c.lr_warmup_steps);
  MG_CHECK(c.lr_warmup_steps < double(c.lr_decay_steps),
           "lr_warmup_steps {} must be smaller than lr_decay_steps {}: shorten the warmup or decay for longer",
           c.lr_warmup_steps, c.lr_decay_steps);
  if (c.lr_decay_style == LrDecayStyle::WSD) {
    MG_CHECK(c.wsd_decay_steps.has_value(), "lr decay style WSD needs wsd_decay_steps (--lr-wsd-decay-iters)");
    MG_CHECK(*c.wsd_decay_steps > 0 && *c.wsd_decay_steps <= c.lr_decay_steps,
             "wsd_decay_steps is {}: it must be in (0, lr_decay_steps = {}]", *c.wsd_decay_steps, c.lr_decay_steps);
  }
  MG_CHECK(c.start_wd >= 0.0, "start weight decay is {}: it must be >= 0", c.start_wd);
  MG_CHECK(c.end_wd >= c.start_wd, "end weight decay {} is below start weight decay {}", c.end_wd, c.start_wd);
  if (c.wd_incr_style == WdIncrStyle::Constant) {
    MG_CHECK(c.start_wd == c.end_wd,
             "weight decay increment style constant needs start weight decay ({}) == end weight decay ({}): "
             "use --weight-decay-incr-style linear or cosine",
             c.start_wd, c.end_wd);
  } else {
    MG_CHECK(c.wd_incr_steps > 0, "wd_incr_steps is {}: a {} weight decay increment needs it > 0", c.wd_incr_steps,
             to_string(c.wd_incr_style));
  }
  MG_CHECK(!(c.override_opt_param_scheduler && c.use_checkpoint_opt_param_scheduler),
           "both override_opt_param_scheduler and use_checkpoint_opt_param_scheduler are set: pick one");
}

// Megatron's _check_and_set: which of the config's and the checkpoint's value wins.
template <typename T>
T check_and_set(const OptimizerParamSchedulerConfig& c, const T& cls_value, const T& sd_value, const char* name) {
  if (c.override_opt_param_scheduler) return cls_value;
  if (!c.use_checkpoint_opt_param_scheduler) {
    MG_CHECK(cls_value == sd_value,
             "optimizer param scheduler: the configured {} differs from the checkpoint's: set "
             "use_checkpoint_opt_param_scheduler or override_opt_param_scheduler",
             name);
  }
  return sd_value;
}

// The first key present (Megatron reads older checkpoints' names too).
const nlohmann::json& field(const nlohmann::json& s, std::initializer_list<const char*> keys) {
  for (const char* k : keys)
    if (s.contains(k)) return s.at(k);
  MG_CHECK(false, "optimizer param scheduler state has no '{}' entry", *keys.begin());
  return s;
}

}  // namespace

LrDecayStyle lr_decay_style_from_string(std::string_view s) { return parse_style(s, kLrDecayStyles, "lr decay style"); }
std::string_view to_string(LrDecayStyle s) { return style_name(s, kLrDecayStyles); }
WsdDecayStyle wsd_decay_style_from_string(std::string_view s) {
  return parse_style(s, kWsdDecayStyles, "WSD lr decay style");
}
std::string_view to_string(WsdDecayStyle s) { return style_name(s, kWsdDecayStyles); }
WdIncrStyle wd_incr_style_from_string(std::string_view s) {
  return parse_style(s, kWdIncrStyles, "weight decay increment style");
}
std::string_view to_string(WdIncrStyle s) { return style_name(s, kWdIncrStyles); }

OptimizerParamSchedulerConfig scheduler_config_from_iterations(const IterationScheduleArgs& a) {
  MG_CHECK(a.train_iters > 0, "train_iters is {}: it must be > 0", a.train_iters);
  MG_CHECK(a.global_batch_size > 0, "global_batch_size is {}: it must be > 0", a.global_batch_size);
  OptimizerParamSchedulerConfig c;
  c.init_lr = a.lr_warmup_init;
  c.max_lr = a.lr;
  c.min_lr = a.min_lr;
  c.lr_decay_steps = a.lr_decay_iters.value_or(a.train_iters) * a.global_batch_size;
  c.lr_warmup_steps = a.lr_warmup_fraction ? *a.lr_warmup_fraction * double(c.lr_decay_steps)
                                           : double(a.lr_warmup_iters * a.global_batch_size);
  c.lr_decay_style = a.lr_decay_style;
  if (a.lr_wsd_decay_iters) c.wsd_decay_steps = *a.lr_wsd_decay_iters * a.global_batch_size;
  c.lr_wsd_decay_style = a.lr_wsd_decay_style;
  c.start_wd = a.start_weight_decay.value_or(a.weight_decay);
  c.end_wd = a.end_weight_decay.value_or(a.weight_decay);
  c.wd_incr_steps = a.train_iters * a.global_batch_size;
  c.wd_incr_style = a.weight_decay_incr_style;
  return c;
}

OptimizerParamScheduler::OptimizerParamScheduler(const OptimizerParamSchedulerConfig& config) : config_(config) {
  validate(config_);
}

ScheduledValues OptimizerParamScheduler::step(int64_t increment) {
  MG_CHECK(increment >= 0, "scheduler step increment is {}: it must be >= 0", increment);
  num_steps_ += increment;
  return values();
}

double OptimizerParamScheduler::get_wd() const {
  const auto& c = config_;
  if (num_steps_ > c.wd_incr_steps) return c.end_wd;
  if (c.wd_incr_style == WdIncrStyle::Constant) return c.end_wd;
  const double incr_ratio = double(num_steps_) / double(c.wd_incr_steps);
  const double delta_wd = c.end_wd - c.start_wd;
  const double coeff =
      c.wd_incr_style == WdIncrStyle::Linear ? incr_ratio : 0.5 * (std::cos(std::numbers::pi * (1 - incr_ratio)) + 1.0);
  return c.start_wd + coeff * delta_wd;
}

double OptimizerParamScheduler::get_lr() const { return get_lr(config_.max_lr, config_.min_lr); }

double OptimizerParamScheduler::get_lr(double max_lr, double min_lr) const {
  const auto& c = config_;
  const double num_steps = double(num_steps_);
  // Linear warmup from init_lr.
  if (c.lr_warmup_steps > 0 && num_steps <= c.lr_warmup_steps)
    return c.init_lr + (max_lr - c.init_lr) * num_steps / c.lr_warmup_steps;
  if (c.lr_decay_style == LrDecayStyle::Constant) return max_lr;
  if (num_steps_ > c.lr_decay_steps) return min_lr;
  if (c.lr_decay_style == LrDecayStyle::InverseSquareRoot) {
    const double warmup = std::max(c.lr_warmup_steps, 1.0);
    const double steps = std::max(num_steps, 1.0);
    const double lr = max_lr * std::pow(warmup, 0.5) / std::pow(steps, 0.5);
    return std::max(min_lr, lr);
  }
  const double decay_ratio = (num_steps - c.lr_warmup_steps) / (double(c.lr_decay_steps) - c.lr_warmup_steps);
  const double delta_lr = max_lr - min_lr;
  double coeff = 1.0;
  switch (c.lr_decay_style) {
    case LrDecayStyle::Linear:
      coeff = 1.0 - decay_ratio;
      break;
    case LrDecayStyle::Cosine:
      coeff = 0.5 * (std::cos(std::numbers::pi * decay_ratio) + 1.0);
      break;
    case LrDecayStyle::WSD: {
      const int64_t anneal_start = c.lr_decay_steps - *c.wsd_decay_steps;
      if (num_steps_ <= anneal_start) break;
      const double r = double(num_steps_ - anneal_start) / double(*c.wsd_decay_steps);
      switch (c.lr_wsd_decay_style) {
        case WsdDecayStyle::Linear:
          coeff = 1.0 - r;
          break;
        case WsdDecayStyle::Cosine:
          coeff = 0.5 * (std::cos(std::numbers::pi * r) + 1.0);
          break;
        case WsdDecayStyle::Exponential:
          coeff = 2.0 * std::pow(0.5, r) - 1.0;
          break;
        case WsdDecayStyle::MinusSqrt:
          coeff = 1.0 - std::sqrt(r);
          break;
      }
      break;
    }
    case LrDecayStyle::Constant:
    case LrDecayStyle::InverseSquareRoot:
      MG_ASSERT(false, "handled above");
  }
  return min_lr + coeff * delta_lr;
}

nlohmann::json OptimizerParamScheduler::state_dict() const {
  const auto& c = config_;
  return {{"max_lr", c.max_lr},
          {"lr_warmup_steps", c.lr_warmup_steps},
          {"num_steps", num_steps_},
          {"lr_decay_style", std::string(to_string(c.lr_decay_style))},
          {"lr_decay_steps", c.lr_decay_steps},
          {"min_lr", c.min_lr},
          {"start_wd", c.start_wd},
          {"end_wd", c.end_wd},
          {"wd_incr_style", std::string(to_string(c.wd_incr_style))},
          {"wd_incr_steps", c.wd_incr_steps}};
}

void OptimizerParamScheduler::load_state_dict(const nlohmann::json& s) {
  OptimizerParamSchedulerConfig c = config_;
  c.max_lr = check_and_set(c, c.max_lr, field(s, {"max_lr", "start_lr"}).get<double>(), "learning rate");
  c.min_lr = check_and_set(c, c.min_lr, field(s, {"min_lr"}).get<double>(), "minimum learning rate");
  c.lr_warmup_steps = check_and_set(
      c, c.lr_warmup_steps, field(s, {"lr_warmup_steps", "warmup_iter", "warmup_steps"}).get<double>(), "warmup steps");
  c.lr_decay_steps = check_and_set(
      c, c.lr_decay_steps, field(s, {"lr_decay_steps", "end_iter", "decay_steps"}).get<int64_t>(), "decay steps");
  c.lr_decay_style = check_and_set(
      c, c.lr_decay_style, lr_decay_style_from_string(field(s, {"lr_decay_style", "decay_style"}).get<std::string>()),
      "learning rate decay style");
  if (s.contains("start_wd")) {
    c.start_wd = check_and_set(c, c.start_wd, s.at("start_wd").get<double>(), "start weight decay");
    c.end_wd = check_and_set(c, c.end_wd, field(s, {"end_wd"}).get<double>(), "end weight decay");
    c.wd_incr_steps =
        check_and_set(c, c.wd_incr_steps, field(s, {"wd_incr_steps"}).get<int64_t>(), "weight decay steps");
    c.wd_incr_style =
        check_and_set(c, c.wd_incr_style, wd_incr_style_from_string(field(s, {"wd_incr_style"}).get<std::string>()),
                      "weight decay increment style");
  }
  const int64_t num_steps = field(s, {"num_steps", "num_iters"}).get<int64_t>();
  MG_CHECK(num_steps >= 0, "optimizer param scheduler state has num_steps {}", num_steps);
  validate(c);
  config_ = c;
  num_steps_ = num_steps;
}

}  // namespace megatron

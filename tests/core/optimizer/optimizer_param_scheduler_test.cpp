// OptimizerParamScheduler: every learning rate Megatron-LM printed for five schedules
// (megatron_schedules.json), the weight-decay increment, checkpoint state and bad configs.
#include "megatron/core/optimizer/optimizer_param_scheduler.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numbers>
#include <sstream>

#include "tests/test_util.h"

namespace megatron {
namespace {

// "--name value" pairs (a flag followed by another flag or nothing is a boolean, value "").
std::map<std::string, std::string> parse_flags(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> tokens;
  for (std::string t; in >> t;) tokens.push_back(t);
  std::map<std::string, std::string> flags;
  for (size_t i = 0; i < tokens.size(); ++i) {
    EXPECT_EQ(tokens[i].rfind("--", 0), 0u) << "unexpected token " << tokens[i];
    const bool has_value = i + 1 < tokens.size() && tokens[i + 1].rfind("--", 0) != 0;
    flags[tokens[i].substr(2)] = has_value ? tokens[i + 1] : "";
    if (has_value) ++i;
  }
  return flags;
}

// Megatron's arguments for the flags (its defaults for the ones not given).
IterationScheduleArgs schedule_args(const std::map<std::string, std::string>& f) {
  auto get = [&](const char* k) -> std::optional<std::string> {
    auto it = f.find(k);
    return it == f.end() ? std::nullopt : std::optional<std::string>(it->second);
  };
  IterationScheduleArgs a;
  a.train_iters = std::stoll(get("train-iters").value());
  a.global_batch_size = std::stoll(get("global-batch-size").value());
  a.lr = std::stod(get("lr").value());
  if (auto v = get("min-lr")) a.min_lr = std::stod(*v);
  if (auto v = get("lr-warmup-init")) a.lr_warmup_init = std::stod(*v);
  if (auto v = get("lr-decay-style")) a.lr_decay_style = lr_decay_style_from_string(*v);
  if (auto v = get("lr-decay-iters")) a.lr_decay_iters = std::stoll(*v);
  if (auto v = get("lr-warmup-iters")) a.lr_warmup_iters = std::stoll(*v);
  if (auto v = get("lr-warmup-fraction")) a.lr_warmup_fraction = std::stod(*v);
  if (auto v = get("lr-wsd-decay-iters")) a.lr_wsd_decay_iters = std::stoll(*v);
  if (auto v = get("lr-wsd-decay-style")) a.lr_wsd_decay_style = wsd_decay_style_from_string(*v);
  if (auto v = get("weight-decay")) a.weight_decay = std::stod(*v);
  if (auto v = get("start-weight-decay")) a.start_weight_decay = std::stod(*v);
  if (auto v = get("end-weight-decay")) a.end_weight_decay = std::stod(*v);
  if (auto v = get("weight-decay-incr-style")) a.weight_decay_incr_style = wd_incr_style_from_string(*v);
  return a;
}

nlohmann::json load_schedules() {
  const std::string path = testing::fixtures_dir() + "/megatron_schedules.json";
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  return nlohmann::json::parse(in);
}

TEST(OptimizerParamScheduler, MatchesMegatronPrintedLearningRates) {
  const nlohmann::json fixture = load_schedules();
  const std::string about = fixture.at("about").get<std::string>();
  const std::string common = about.substr(about.find("Common flags:") + std::string("Common flags:").size());
  ASSERT_EQ(fixture.at("configs").size(), 5u);
  for (const auto& [name, cfg] : fixture.at("configs").items()) {
    SCOPED_TRACE(name);
    auto flags = parse_flags(common);
    for (const auto& [k, v] : parse_flags(cfg.at("flags").get<std::string>())) flags[k] = v;
    const IterationScheduleArgs args = schedule_args(flags);
    OptimizerParamScheduler sched(scheduler_config_from_iterations(args));
    const auto& rows = cfg.at("rows");
    ASSERT_EQ(int64_t(rows.size()), args.train_iters);
    for (const auto& row : rows) {
      const int64_t iteration = row.at(0).get<int64_t>();
      const int64_t gbs = row.at(3).get<int64_t>();
      const ScheduledValues v = sched.step(gbs);
      ASSERT_EQ(sched.num_steps(), row.at(1).get<int64_t>()) << "iteration " << iteration;
      // Megatron's printed lr went through fp32 (as the optimizer's lr does here: AdamHyperParams::lr):
      // formatting the double directly differs in the last digit on a few rows.
      EXPECT_EQ(fmt::format("{:.6E}", float(v.lr)), row.at(2).get<std::string>()) << "iteration " << iteration;
    }
  }
}

OptimizerParamSchedulerConfig base_config() {
  OptimizerParamSchedulerConfig c;
  c.max_lr = 1e-3;
  c.min_lr = 1e-4;
  c.lr_warmup_steps = 10;
  c.lr_decay_steps = 100;
  c.lr_decay_style = LrDecayStyle::Cosine;
  c.start_wd = 0.01;
  c.end_wd = 0.1;
  c.wd_incr_steps = 200;
  c.wd_incr_style = WdIncrStyle::Cosine;
  return c;
}

// Megatron's get_lr(param_group) for --decoupled-lr: the same warmup (from --lr-warmup-init) and
// decay, between the group's own max and min; get_lr() is that with --lr and --min-lr.
TEST(OptimizerParamScheduler, GroupRatesFollowTheSameScheduleBetweenTheirOwnBounds) {
  for (LrDecayStyle style : {LrDecayStyle::Cosine, LrDecayStyle::Linear, LrDecayStyle::Constant,
                             LrDecayStyle::InverseSquareRoot}) {
    SCOPED_TRACE(std::string(to_string(style)));
    OptimizerParamSchedulerConfig c;
    c.init_lr = 1e-5;
    c.max_lr = 1e-3;
    c.min_lr = 1e-4;
    c.lr_warmup_steps = 40;
    c.lr_decay_steps = 200;
    c.lr_decay_style = style;
    OptimizerParamScheduler s(c);
    const double dmax = 5e-3, dmin = 2e-4;
    for (int step = 0; step <= 240; step += 8) {
      double want = 0;
      if (step <= 40) {
        want = 1e-5 + (dmax - 1e-5) * step / 40.0;
      } else if (style == LrDecayStyle::Constant) {
        want = dmax;
      } else if (step > 200) {
        want = dmin;
      } else if (style == LrDecayStyle::InverseSquareRoot) {
        want = std::max(dmin, dmax * std::sqrt(40.0) / std::sqrt(double(step)));
      } else {
        const double r = (step - 40) / 160.0;
        want = dmin + (dmax - dmin) * (style == LrDecayStyle::Linear ? 1 - r : 0.5 * (std::cos(std::numbers::pi * r) + 1));
      }
      EXPECT_NEAR(s.get_lr(dmax, dmin), want, 1e-12) << "step " << step;
      EXPECT_EQ(s.get_lr(), s.get_lr(1e-3, 1e-4)) << "step " << step;
      s.step(8);
    }
  }
}

TEST(OptimizerParamScheduler, WeightDecayIncrement) {
  for (WdIncrStyle style : {WdIncrStyle::Linear, WdIncrStyle::Cosine}) {
    OptimizerParamSchedulerConfig c = base_config();
    c.wd_incr_style = style;
    OptimizerParamScheduler sched(c);
    EXPECT_DOUBLE_EQ(sched.get_wd(), 0.01);  // num_steps 0: start_wd
    int64_t at = 0;
    for (int64_t target : {1, 50, 100, 150, 199, 200, 201, 1000}) {
      sched.step(target - at);
      at = target;
      const double r = std::min(double(target) / 200.0, 1.0);
      const double coeff = style == WdIncrStyle::Linear ? r : 0.5 * (std::cos(std::numbers::pi * (1 - r)) + 1.0);
      EXPECT_NEAR(sched.get_wd(), 0.01 + coeff * 0.09, 1e-15) << to_string(style) << " at " << target;
    }
    EXPECT_EQ(sched.get_wd(), 0.1);
  }
  OptimizerParamSchedulerConfig c = base_config();
  c.wd_incr_style = WdIncrStyle::Constant;
  c.start_wd = c.end_wd = 0.05;
  OptimizerParamScheduler constant(c);
  EXPECT_EQ(constant.step(70).wd, 0.05);
}

TEST(OptimizerParamScheduler, WsdDecayStyles) {
  // Decay over the last 40 of 100 steps; at the midpoint of the decay each style has a known value.
  const std::pair<WsdDecayStyle, double> expected[] = {{WsdDecayStyle::Linear, 0.5},
                                                       {WsdDecayStyle::Cosine, 0.5},
                                                       {WsdDecayStyle::Exponential, std::sqrt(2.0) - 1.0},
                                                       {WsdDecayStyle::MinusSqrt, 1.0 - std::sqrt(0.5)}};
  for (const auto& [style, coeff] : expected) {
    OptimizerParamSchedulerConfig c = base_config();
    c.lr_decay_style = LrDecayStyle::WSD;
    c.wsd_decay_steps = 40;
    c.lr_wsd_decay_style = style;
    OptimizerParamScheduler sched(c);
    EXPECT_DOUBLE_EQ(sched.step(60).lr, 1e-3) << to_string(style);  // end of the stable phase
    EXPECT_NEAR(sched.step(20).lr, 1e-4 + coeff * 9e-4, 1e-15) << to_string(style);
    EXPECT_NEAR(sched.step(20).lr, 1e-4, 1e-15) << to_string(style);
    EXPECT_EQ(sched.step(1).lr, 1e-4) << to_string(style);
  }
}

TEST(OptimizerParamScheduler, StateRoundTripAndCheckpointRules) {
  OptimizerParamScheduler a(base_config());
  a.step(37);
  const nlohmann::json state = a.state_dict();
  EXPECT_EQ(state.at("num_steps"), 37);
  EXPECT_EQ(state.at("lr_decay_style"), "cosine");

  // Default (use the checkpoint's values): a differently configured scheduler takes them.
  OptimizerParamSchedulerConfig other = base_config();
  other.max_lr = 5e-3;
  OptimizerParamScheduler b(other);
  b.load_state_dict(state);
  EXPECT_EQ(b.num_steps(), 37);
  EXPECT_EQ(b.get_lr(), a.get_lr());
  EXPECT_EQ(b.get_wd(), a.get_wd());

  // Override: keep the configured values, take only num_steps.
  other.use_checkpoint_opt_param_scheduler = false;
  other.override_opt_param_scheduler = true;
  OptimizerParamScheduler c(other);
  c.load_state_dict(state);
  EXPECT_EQ(c.num_steps(), 37);
  EXPECT_EQ(c.config().max_lr, 5e-3);

  // Neither: the values must match.
  other.override_opt_param_scheduler = false;
  OptimizerParamScheduler d(other);
  EXPECT_THROW(d.load_state_dict(state), Error);
  OptimizerParamSchedulerConfig same = base_config();
  same.use_checkpoint_opt_param_scheduler = false;
  OptimizerParamScheduler e(same);
  e.load_state_dict(state);
  EXPECT_EQ(e.get_lr(), a.get_lr());
}

TEST(OptimizerParamScheduler, BadConfigsThrow) {
  auto expect_bad = [](auto mutate) {
    OptimizerParamSchedulerConfig c = base_config();
    mutate(c);
    EXPECT_THROW(OptimizerParamScheduler{c}, Error);
  };
  expect_bad([](auto& c) { c.lr_warmup_steps = 100; });  // warmup >= decay
  expect_bad([](auto& c) { c.lr_decay_steps = 0; });
  expect_bad([](auto& c) { c.min_lr = -1e-5; });
  expect_bad([](auto& c) { c.min_lr = 2e-3; });  // above max_lr
  expect_bad([](auto& c) { c.init_lr = 2e-3; });
  expect_bad([](auto& c) { c.lr_decay_style = LrDecayStyle::WSD; });     // no wsd_decay_steps
  expect_bad([](auto& c) { c.end_wd = 0.001; });                         // below start_wd
  expect_bad([](auto& c) { c.wd_incr_style = WdIncrStyle::Constant; });  // start != end
  expect_bad([](auto& c) { c.override_opt_param_scheduler = true; });    // with use_checkpoint
  EXPECT_THROW(lr_decay_style_from_string("exp"), Error);
  EXPECT_THROW(wsd_decay_style_from_string("sqrt"), Error);
  EXPECT_THROW(wd_incr_style_from_string("cos"), Error);
  EXPECT_EQ(lr_decay_style_from_string("inverse-square-root"), LrDecayStyle::InverseSquareRoot);
}

}  // namespace
}  // namespace megatron

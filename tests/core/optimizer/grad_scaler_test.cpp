// Loss scalers: Megatron's dynamic update rule (backoff with hysteresis, growth after the window,
// the floor at min_scale), state round trip, bad configs.
#include "megatron/core/optimizer/grad_scaler.h"

#include <gtest/gtest.h>

#include "megatron/runtime/check.h"

namespace megatron {
namespace {

DynamicGradScalerConfig small_config() {
  DynamicGradScalerConfig c;
  c.initial_scale = 1024.0f;
  c.min_scale = 64.0f;
  c.growth_interval = 3;
  c.hysteresis = 2;
  return c;
}

TEST(GradScaler, ConstantNeverChanges) {
  ConstantGradScaler s(128.0f);
  s.update(true);
  s.update(false);
  EXPECT_EQ(s.scale(), 128.0f);
  EXPECT_EQ(s.inv_scale(), 1.0f / 128.0f);
  EXPECT_TRUE(s.state_dict().empty());
  EXPECT_THROW(ConstantGradScaler(0.0f), Error);
}

TEST(GradScaler, DynamicBacksOffAfterHysteresis) {
  DynamicGradScaler s(small_config());
  EXPECT_EQ(s.scale(), 1024.0f);
  s.update(true);  // first inf: hysteresis absorbs it
  EXPECT_EQ(s.scale(), 1024.0f);
  EXPECT_EQ(s.hysteresis_tracker(), 1);
  s.update(true);  // second: back off
  EXPECT_EQ(s.scale(), 512.0f);
  s.update(true);  // the tracker stays exhausted: every further inf backs off
  EXPECT_EQ(s.scale(), 256.0f);
  EXPECT_EQ(s.hysteresis_tracker(), -1);
  s.update(true);
  s.update(true);
  s.update(true);
  EXPECT_EQ(s.scale(), 64.0f);  // floored at min_scale
  EXPECT_EQ(s.inv_scale(), 1.0f / 64.0f);
}

TEST(GradScaler, DynamicGrowsAfterWindowAndRefillsHysteresis) {
  DynamicGradScaler s(small_config());
  s.update(true);  // hysteresis 2 -> 1, scale unchanged
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.growth_tracker(), 2);
  EXPECT_EQ(s.scale(), 1024.0f);
  s.update(true);  // an inf resets the growth tracker; hysteresis 1 -> 0 backs off
  EXPECT_EQ(s.growth_tracker(), 0);
  EXPECT_EQ(s.scale(), 512.0f);
  s.update(false);
  s.update(false);
  s.update(false);  // three clean steps in a row: grow, refill hysteresis
  EXPECT_EQ(s.scale(), 1024.0f);
  EXPECT_EQ(s.growth_tracker(), 0);
  EXPECT_EQ(s.hysteresis_tracker(), 2);
  s.update(true);  // absorbed again thanks to the refill
  EXPECT_EQ(s.scale(), 1024.0f);
}

TEST(GradScaler, DynamicStateRoundTrip) {
  DynamicGradScaler a(small_config());
  a.update(true);
  a.update(true);
  a.update(false);
  const nlohmann::json state = a.state_dict();
  EXPECT_EQ(state.at("scale").get<float>(), 512.0f);
  EXPECT_EQ(state.at("growth_tracker").get<int64_t>(), 1);
  EXPECT_EQ(state.at("hysteresis_tracker").get<int64_t>(), 0);
  DynamicGradScaler b(small_config());
  b.load_state_dict(state);
  EXPECT_EQ(b.scale(), 512.0f);
  EXPECT_EQ(b.growth_tracker(), 1);
  EXPECT_EQ(b.hysteresis_tracker(), 0);
  EXPECT_THROW(b.load_state_dict(nlohmann::json{{"scale", 2.0}}), Error);
}

TEST(GradScaler, DynamicBadConfigsThrow) {
  auto expect_bad = [](auto mutate) {
    DynamicGradScalerConfig c = small_config();
    mutate(c);
    EXPECT_THROW(DynamicGradScaler{c}, Error);
  };
  expect_bad([](auto& c) { c.min_scale = 0.0f; });
  expect_bad([](auto& c) { c.min_scale = 2048.0f; });
  expect_bad([](auto& c) { c.growth_factor = 1.0f; });
  expect_bad([](auto& c) { c.backoff_factor = 1.0f; });
  expect_bad([](auto& c) { c.growth_interval = 0; });
  expect_bad([](auto& c) { c.hysteresis = 0; });
}

}  // namespace
}  // namespace megatron

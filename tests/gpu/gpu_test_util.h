// Comparison helper shared by the GPU op tests (CUDA result against the CPU reference).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "megatron/runtime/tensor.h"

namespace megatron::testing {

inline constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

/// max |got - want| / max(max |want|, min_scale) <= tol; a non-finite value where the reference is
/// finite fails. min_scale guards tensors that are zero in exact arithmetic (rounding noise only).
inline void expect_close(const Tensor& got, const Tensor& want, double tol, const std::string& what,
                         double min_scale = 0.0) {
  const std::vector<float> g = got.to_floats(), w = want.to_floats();
  ASSERT_EQ(g.size(), w.size()) << what;
  double scale = 0, worst = 0;
  for (float v : w) scale = std::max(scale, std::fabs(double(v)));
  if (scale == 0) scale = 1;
  scale = std::max(scale, min_scale);
  for (size_t i = 0; i < g.size(); ++i) {
    if (!std::isfinite(g[i]) && std::isfinite(w[i])) {
      ADD_FAILURE() << what << ": element " << i << " is " << g[i] << ", expected " << w[i];
      return;
    }
    worst = std::max(worst, std::fabs(double(g[i]) - double(w[i])));
  }
  EXPECT_LE(worst / scale, tol) << what << " (max abs error " << worst << ", max |ref| " << scale << ")";
}

}  // namespace megatron::testing

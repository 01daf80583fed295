// Finite-difference gradient checks for the CPU ops.
//
// An op under test is wrapped as a forward function returning its differentiable outputs. The
// objective is L = Σ_k Σ out_k·R_k with fixed random R_k (GradCheck::upstream(k)): the test feeds
// R_k to the op's backward as grad_out, and check() compares the analytic gradient of each input
// or parameter with the central difference (L(x + ε) - L(x - ε)) / 2ε, element by element.
// Inputs are fp32 and perturbed in place; L is summed in fp64 so the only noise is the op's own
// fp32 rounding. An element passes when |fd - analytic| <= atol + rtol·max(|fd|, |analytic|).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "megatron/runtime/tensor.h"
#include "tests/test_util.h"

namespace megatron::testing {

struct GradTolerance {
  double eps = 1e-3;
  double rtol = 1e-2;
  double atol = 2e-3;
};

class GradCheck {
 public:
  using Forward = std::function<std::vector<Tensor>()>;

  /// Runs forward once to learn the outputs' shapes and draws R_k ~ N(0, 1) for each.
  explicit GradCheck(Forward forward, uint64_t seed = 4242) : forward_(std::move(forward)) {
    std::vector<Tensor> outs = forward_();
    for (size_t k = 0; k < outs.size(); ++k)
      upstream_.push_back(random_tensor(outs[k].shape(), seed + k, 1.0f, DType::Float32));
  }

  /// R_k: the grad_out to pass to the op's backward for output k.
  const Tensor& upstream(size_t k = 0) const { return upstream_.at(k); }

  /// L at the inputs' current values.
  double loss() const {
    std::vector<Tensor> outs = forward_();
    double l = 0.0;
    for (size_t k = 0; k < outs.size(); ++k) {
      std::vector<float> o = outs[k].to_floats(), r = upstream_[k].to_floats();
      for (size_t i = 0; i < o.size(); ++i) l += double(o[i]) * double(r[i]);
    }
    return l;
  }

  /// Compares `analytic` (dL/d input) with central differences over every element of `input`.
  void check(const std::string& name, Tensor& input, const Tensor& analytic, GradTolerance tol = {}) const {
    ASSERT_EQ(input.dtype(), DType::Float32) << name;
    ASSERT_EQ(input.numel(), analytic.numel()) << name;
    const std::vector<float> an = analytic.to_floats();
    float* x = input.data<float>();
    int failures = 0;
    for (int64_t i = 0; i < input.numel(); ++i) {
      const float saved = x[i];
      x[i] = saved + float(tol.eps);
      const double plus = loss();
      x[i] = saved - float(tol.eps);
      const double minus = loss();
      x[i] = saved;
      const double fd = (plus - minus) / (2.0 * tol.eps);
      const double a = an[size_t(i)];
      const double bound = tol.atol + tol.rtol * std::max(std::fabs(fd), std::fabs(a));
      if (std::fabs(fd - a) > bound && ++failures <= 5)
        ADD_FAILURE() << name << "[" << i << "]: analytic " << a << " vs finite difference " << fd;
    }
    EXPECT_EQ(failures, 0) << name << ": " << failures << " of " << input.numel() << " elements differ";
  }

 private:
  Forward forward_;
  std::vector<Tensor> upstream_;
};

/// A zero fp32 tensor shaped like t (an accumulation target for parameter gradients).
inline Tensor zeros_like(const Tensor& t) { return Tensor::zeros(t.shape(), DType::Float32); }

}  // namespace megatron::testing

// LayerNorm and RMSNorm on CUDA against the CPU reference: forward (out, mean, rstd) and backward
// (grad_in and the accumulated fp32 weight/bias grads), odd and vector-friendly widths, fp32/bf16/fp16,
// zero-centred gamma, fp32 weights under 16-bit activations, determinism of the parameter grads.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "megatron/kernels/cpu/cpu_ops.h"
#include "megatron/kernels/cuda/cuda_ops.h"
#include "megatron/runtime/allocator.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

using testing::random_tensor;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kEps = 1e-5f;

// max |got - want| / max |want| <= tol; a non-finite value where the reference is finite fails.
void expect_close(const Tensor& got, const Tensor& want, double tol, const std::string& what) {
  const std::vector<float> g = got.to_floats(), w = want.to_floats();
  ASSERT_EQ(g.size(), w.size()) << what;
  double scale = 0, worst = 0;
  for (float v : w) scale = std::max(scale, std::fabs(double(v)));
  // At least 0.5 (inputs are O(1)): with h = 1 a norm's output is constant, so its input gradient is zero in exact
  // arithmetic and both sides hold only rounding noise.
  scale = std::max(scale, 0.5);
  for (size_t i = 0; i < g.size(); ++i) {
    if (!std::isfinite(g[i]) && std::isfinite(w[i])) {
      ADD_FAILURE() << what << ": element " << i << " is " << g[i] << ", expected " << w[i];
      return;
    }
    worst = std::max(worst, std::fabs(double(g[i]) - double(w[i])));
  }
  EXPECT_LE(worst / scale, tol) << what << " (max abs error " << worst << ", max |ref| " << scale << ")";
}

double tolerance(DType t) { return t == DType::Float32 ? 1e-5 : 1e-2; }
double grad_tolerance(DType t) { return t == DType::Float32 ? 1e-4 : 1e-3; }

Tensor dev(const Tensor& t) { return t.to(Device::cuda(0)); }

Tensor poisoned(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype, Device::cuda(0));
  t.fill_(kNaN);
  return t;
}

struct NormCase {
  int64_t n, h;
  DType dtype;
  bool rms;
  bool zero_centered;
  DType weight_dtype;
};

std::string case_name(const ::testing::TestParamInfo<NormCase>& info) {
  const NormCase& c = info.param;
  return std::string(c.rms ? "rms" : "ln") + "_n" + std::to_string(c.n) + "_h" + std::to_string(c.h) + "_" +
         std::string(to_string(c.dtype)) + "_w" + std::string(to_string(c.weight_dtype)) +
         (c.zero_centered ? "_zc" : "");
}

class CudaNorm : public ::testing::TestWithParam<NormCase> {};

TEST_P(CudaNorm, ForwardAndBackwardMatchCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const NormCase c = GetParam();
  Context cpu;
  Context gpu(Device::cuda(0));
  const Tensor x = random_tensor({c.n, c.h}, 1, 2.0f, c.dtype);
  const Tensor weight = random_tensor({c.h}, 2, 0.5f, c.weight_dtype);
  const Tensor bias = random_tensor({c.h}, 3, 0.5f, c.weight_dtype);
  const Tensor dy = random_tensor({c.n, c.h}, 4, 1.0f, c.dtype);

  // Forward.
  Tensor out = Tensor::empty({c.n, c.h}, c.dtype), mean = Tensor::empty({c.n}, DType::Float32),
         rstd = Tensor::empty({c.n}, DType::Float32);
  Tensor d_out = poisoned({c.n, c.h}, c.dtype), d_mean = poisoned({c.n}, DType::Float32),
         d_rstd = poisoned({c.n}, DType::Float32);
  const Tensor d_x = dev(x), d_weight = dev(weight), d_bias = dev(bias), d_dy = dev(dy);
  if (c.rms) {
    cpu::rmsnorm_forward(cpu, x, weight, kEps, c.zero_centered, out, rstd);
    cuda::rmsnorm_forward(gpu, d_x, d_weight, kEps, c.zero_centered, d_out, d_rstd);
  } else {
    cpu::layernorm_forward(cpu, x, weight, bias, kEps, c.zero_centered, out, mean, rstd);
    cuda::layernorm_forward(gpu, d_x, d_weight, d_bias, kEps, c.zero_centered, d_out, d_mean, d_rstd);
    expect_close(d_mean, mean, 1e-5, "mean");
  }
  expect_close(d_out, out, tolerance(c.dtype), "out");
  expect_close(d_rstd, rstd, 1e-5, "rstd");

  // Backward from the CPU's statistics on both sides; the parameter grads start non-zero (accumulation).
  const Tensor wg0 = random_tensor({c.h}, 5, 1.0f), bg0 = random_tensor({c.h}, 6, 1.0f);
  Tensor grad_in = Tensor::empty({c.n, c.h}, c.dtype), wg = wg0.clone(), bg = bg0.clone();
  Tensor d_grad_in = poisoned({c.n, c.h}, c.dtype), d_wg = dev(wg0), d_bg = dev(bg0);
  const Tensor d_mean_ref = dev(mean), d_rstd_ref = dev(rstd);
  auto backward_gpu = [&](Tensor& gin, Tensor& wgrad, Tensor& bgrad) {
    if (c.rms) {
      cuda::rmsnorm_backward(gpu, d_dy, d_x, d_weight, d_rstd_ref, c.zero_centered, gin, wgrad);
    } else {
      cuda::layernorm_backward(gpu, d_dy, d_x, d_weight, d_mean_ref, d_rstd_ref, c.zero_centered, gin, wgrad, bgrad);
    }
  };
  if (c.rms) {
    cpu::rmsnorm_backward(cpu, dy, x, weight, rstd, c.zero_centered, grad_in, wg);
  } else {
    cpu::layernorm_backward(cpu, dy, x, weight, mean, rstd, c.zero_centered, grad_in, wg, bg);
  }
  backward_gpu(d_grad_in, d_wg, d_bg);
  expect_close(d_grad_in, grad_in, tolerance(c.dtype), "grad_in");
  expect_close(d_wg, wg, grad_tolerance(c.dtype), "weight_grad");
  if (!c.rms) expect_close(d_bg, bg, grad_tolerance(c.dtype), "bias_grad");

  // A second backward (grad_in undefined: parameter grads only) adds the same amount again, and a
  // fresh accumulation repeats the first one bit for bit (Note [Deterministic norm parameter grads]).
  Tensor no_grad_in;
  const std::vector<float> w1 = d_wg.to_floats(), b1 = d_bg.to_floats(), w0 = wg0.to_floats(), b0 = bg0.to_floats();
  backward_gpu(no_grad_in, d_wg, d_bg);
  const std::vector<float> w2 = d_wg.to_floats(), b2 = d_bg.to_floats();
  for (int64_t i = 0; i < c.h; ++i) {
    EXPECT_NEAR(w2[i] - w1[i], w1[i] - w0[i], 1e-5 * std::max(1.0f, std::fabs(w1[i]))) << "weight_grad " << i;
    if (!c.rms) {
      EXPECT_NEAR(b2[i] - b1[i], b1[i] - b0[i], 1e-5 * std::max(1.0f, std::fabs(b1[i]))) << "bias_grad " << i;
    }
  }
  Tensor d_wg_again = dev(wg0), d_bg_again = dev(bg0);
  backward_gpu(no_grad_in, d_wg_again, d_bg_again);
  EXPECT_EQ(d_wg_again.to_floats(), w1) << "weight_grad is not deterministic";
  if (!c.rms) {
    EXPECT_EQ(d_bg_again.to_floats(), b1) << "bias_grad is not deterministic";
  }
}

std::vector<NormCase> norm_cases() {
  std::vector<NormCase> cases;
  // Besides odd widths: the fused backward with one and two packs per thread ({4096, 2048}, {37, 8192},
  // {9, 1023}), capped partial rows ({5000, 64}), and the unfused fallback ({7, 4100}, {2, 16384}).
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 1},       {7, 3},     {7, 127},  {1, 1000},
                                                           {7, 4100},    {64, 1024}, {300, 96}, {2, 16384},
                                                           {4096, 2048}, {37, 8192}, {9, 1023}, {5000, 64}};
  for (bool rms : {false, true}) {
    for (DType dt : {DType::Float32, DType::BFloat16, DType::Float16}) {
      for (auto [n, h] : shapes) cases.push_back({n, h, dt, rms, false, dt});
    }
    cases.push_back({7, 1000, DType::Float32, rms, true, DType::Float32});
    cases.push_back({7, 128, DType::BFloat16, rms, true, DType::BFloat16});
    cases.push_back({64, 1024, DType::BFloat16, rms, false, DType::Float32});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaNorm, ::testing::ValuesIn(norm_cases()), case_name);

TEST(CudaNormStats, MeanAndRstdMayBeSkipped) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  Context cpu;
  Context gpu(Device::cuda(0));
  const Tensor x = random_tensor({5, 40}, 7), weight = random_tensor({40}, 8), bias = random_tensor({40}, 9);
  Tensor out = Tensor::empty({5, 40}, DType::Float32), mean = Tensor::empty({5}, DType::Float32),
         rstd = Tensor::empty({5}, DType::Float32);
  cpu::layernorm_forward(cpu, x, weight, bias, kEps, false, out, mean, rstd);
  Tensor d_out = poisoned({5, 40}, DType::Float32), none_mean, none_rstd;
  cuda::layernorm_forward(gpu, dev(x), dev(weight), dev(bias), kEps, false, d_out, none_mean, none_rstd);
  expect_close(d_out, out, 1e-5, "out without statistics");
}

}  // namespace
}  // namespace megatron

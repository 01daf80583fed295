// Pointwise ops on CUDA against the CPU reference: GeLU and SwiGLU forward/backward, RoPE (rotate-half
// and interleaved, partial rotary dimension, in place), dropout / dropout-add / add (masks bit-identical
// to the CPU's), fp32/bf16/fp16, odd sizes and unaligned views (the scalar paths).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "megatron/kernels/cpu/cpu_ops.h"
#include "megatron/kernels/cuda/cuda_ops.h"
#include "megatron/runtime/allocator.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

using testing::expect_close;
using testing::kNaN;
using testing::random_tensor;



// Bit-for-bit equality of the values (as floats).
void expect_equal(const Tensor& got, const Tensor& want, const std::string& what) {
  const std::vector<float> g = got.to_floats(), w = want.to_floats();
  ASSERT_EQ(g.size(), w.size()) << what;
  for (size_t i = 0; i < g.size(); ++i) ASSERT_EQ(g[i], w[i]) << what << " element " << i;
}

double tolerance(DType t) { return t == DType::Float32 ? 1e-5 : t == DType::Float16 ? 2e-3 : 1e-2; }

Tensor poisoned(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype, Device::cuda(0));
  t.fill_(kNaN);
  return t;
}

// A device copy; unaligned = true starts it one element into an allocation (the scalar paths).
Tensor dev(const Tensor& host, bool unaligned = false) {
  if (!unaligned) return host.to(Device::cuda(0));
  Tensor big = Tensor::empty({host.numel() + 1}, host.dtype(), Device::cuda(0));
  Tensor view = big.flat_slice(1, host.numel()).view(host.shape());
  view.copy_from(host);
  return view;
}

struct FlatCase {
  int64_t numel;
  DType dtype;
  bool unaligned;
};

std::string flat_name(const ::testing::TestParamInfo<FlatCase>& info) {
  return "n" + std::to_string(info.param.numel) + "_" + std::string(to_string(info.param.dtype)) +
         (info.param.unaligned ? "_unaligned" : "");
}

std::vector<FlatCase> flat_cases() {
  std::vector<FlatCase> cases;
  for (int64_t n : {1, 3, 127, 1000, 4100, 3 * 4096 + 5}) {
    for (DType dt : {DType::Float32, DType::BFloat16, DType::Float16}) cases.push_back({n, dt, false});
  }
  cases.push_back({1000, DType::Float32, true});
  cases.push_back({4100, DType::BFloat16, true});
  return cases;
}

class CudaFlat : public ::testing::TestWithParam<FlatCase> {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
    gpu = std::make_unique<Context>(Device::cuda(0));
  }
  Context cpu;
  std::unique_ptr<Context> gpu;
};

TEST_P(CudaFlat, Gelu) {
  const FlatCase c = GetParam();
  const Tensor x = random_tensor({c.numel}, 1, 2.0f, c.dtype), dy = random_tensor({c.numel}, 2, 1.0f, c.dtype);
  Tensor out = Tensor::empty({c.numel}, c.dtype), grad_in = Tensor::empty({c.numel}, c.dtype);
  cpu::gelu_forward(cpu, x, out);
  cpu::gelu_backward(cpu, dy, x, grad_in);
  const Tensor d_x = dev(x, c.unaligned), d_dy = dev(dy, c.unaligned);
  Tensor d_out = poisoned({c.numel}, c.dtype), d_grad_in = poisoned({c.numel}, c.dtype);
  cuda::gelu_forward(*gpu, d_x, d_out);
  cuda::gelu_backward(*gpu, d_dy, d_x, d_grad_in);
  expect_close(d_out, out, tolerance(c.dtype), "gelu");
  expect_close(d_grad_in, grad_in, tolerance(c.dtype), "gelu grad");
  // In place: grad_in aliasing grad_out.
  Tensor d_inplace = dev(dy, c.unaligned);
  cuda::gelu_backward(*gpu, d_inplace, d_x, d_inplace);
  expect_close(d_inplace, grad_in, tolerance(c.dtype), "gelu grad in place");
}

TEST_P(CudaFlat, DropoutMatchesCpuBitForBit) {
  const FlatCase c = GetParam();
  const Tensor x = random_tensor({c.numel}, 3, 1.0f, c.dtype), res = random_tensor({c.numel}, 4, 1.0f, c.dtype);
  const Tensor d_x = dev(x, c.unaligned), d_res = dev(res, c.unaligned);
  for (float p : {0.0f, 0.1f, 0.5f, 1.0f}) {
    const uint64_t seed = 0x1234567890abcdefull, offset = 77;
    const std::string tag = " p=" + std::to_string(p);
    Tensor out = Tensor::empty({c.numel}, c.dtype), d_out = poisoned({c.numel}, c.dtype);
    cpu::dropout_forward(cpu, x, p, seed, offset, out);
    cuda::dropout_forward(*gpu, d_x, p, seed, offset, d_out);
    expect_equal(d_out, out, "dropout" + tag);
    cpu::dropout_backward(cpu, x, p, seed, offset + 1, out);
    cuda::dropout_backward(*gpu, d_x, p, seed, offset + 1, d_out);
    expect_equal(d_out, out, "dropout backward" + tag);
    Tensor d_out2 = poisoned({c.numel}, c.dtype);
    cpu::dropout_add_forward(cpu, x, res, p, seed, offset, out);
    cuda::dropout_add_forward(*gpu, d_x, d_res, p, seed, offset, d_out2);
    expect_equal(d_out2, out, "dropout_add" + tag);
    // In place over the residual (out aliasing residual) and over x.
    Tensor d_res_copy = dev(res, c.unaligned), d_x_copy = dev(x, c.unaligned);
    cuda::dropout_add_forward(*gpu, d_x, d_res_copy, p, seed, offset, d_res_copy);
    expect_equal(d_res_copy, out, "dropout_add into residual" + tag);
    cuda::dropout_add_forward(*gpu, d_x_copy, d_res, p, seed, offset, d_x_copy);
    expect_equal(d_x_copy, out, "dropout_add into x" + tag);
  }
}

TEST_P(CudaFlat, Add) {
  const FlatCase c = GetParam();
  const Tensor a = random_tensor({c.numel}, 5, 1.0f, c.dtype), b = random_tensor({c.numel}, 6, 1.0f, c.dtype);
  Tensor out = Tensor::empty({c.numel}, c.dtype), d_out = poisoned({c.numel}, c.dtype);
  cpu::add(cpu, a, b, out);
  const Tensor d_a = dev(a, c.unaligned), d_b = dev(b, c.unaligned);
  cuda::add(*gpu, d_a, d_b, d_out);
  expect_equal(d_out, out, "add");
  Tensor d_a2 = dev(a, c.unaligned);
  cuda::add(*gpu, d_a2, d_b, d_a2);
  expect_equal(d_a2, out, "add in place");
}

INSTANTIATE_TEST_SUITE_P(Sizes, CudaFlat, ::testing::ValuesIn(flat_cases()), flat_name);

TEST(CudaDropout, KeepsAboutOneMinusP) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  Context gpu(Device::cuda(0));
  const int64_t n = 1 << 20;
  const Tensor ones = Tensor::from_floats(std::vector<float>(size_t(n), 1.0f), {n}, DType::Float32, Device::cuda(0));
  Tensor out = poisoned({n}, DType::Float32);
  cuda::dropout_forward(gpu, ones, 0.1f, 42, 3, out);
  const std::vector<float> v = out.to_floats();
  const double kept = double(std::count_if(v.begin(), v.end(), [](float f) { return f != 0.0f; })) / double(n);
  EXPECT_NEAR(kept, 0.9, 0.005);
  const float kept_value = 1.0f / (1.0f - 0.1f);
  for (float f : v) ASSERT_TRUE(f == 0.0f || f == kept_value) << f;
}

// ---- SwiGLU ----------------------------------------------------------------------------------------
struct SwigluCase {
  int64_t n, f;
  DType dtype;
  bool unaligned;
};

class CudaSwiglu : public ::testing::TestWithParam<SwigluCase> {};

TEST_P(CudaSwiglu, ForwardAndBackwardMatchCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const SwigluCase c = GetParam();
  Context cpu;
  Context gpu(Device::cuda(0));
  const Tensor x = random_tensor({c.n, 2 * c.f}, 1, 2.0f, c.dtype), dy = random_tensor({c.n, c.f}, 2, 1.0f, c.dtype);
  Tensor out = Tensor::empty({c.n, c.f}, c.dtype), grad_in = Tensor::empty({c.n, 2 * c.f}, c.dtype);
  cpu::swiglu_forward(cpu, x, out);
  cpu::swiglu_backward(cpu, dy, x, grad_in);
  Tensor d_out = poisoned({c.n, c.f}, c.dtype), d_grad_in = poisoned({c.n, 2 * c.f}, c.dtype);
  const Tensor d_x = dev(x, c.unaligned), d_dy = dev(dy, c.unaligned);
  cuda::swiglu_forward(gpu, d_x, d_out);
  cuda::swiglu_backward(gpu, d_dy, d_x, d_grad_in);
  expect_close(d_out, out, tolerance(c.dtype), "swiglu");
  expect_close(d_grad_in, grad_in, tolerance(c.dtype), "swiglu grad");
}

std::vector<SwigluCase> swiglu_cases() {
  std::vector<SwigluCase> cases;
  for (int64_t f : {1, 3, 127, 1000, 4100, 1024}) {
    for (int64_t n : {1, 7}) {
      for (DType dt : {DType::Float32, DType::BFloat16}) cases.push_back({n, f, dt, false});
    }
  }
  cases.push_back({7, 1024, DType::Float16, false});
  cases.push_back({3, 1024, DType::BFloat16, true});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaSwiglu, ::testing::ValuesIn(swiglu_cases()),
                         [](const ::testing::TestParamInfo<SwigluCase>& info) {
                           return "n" + std::to_string(info.param.n) + "_f" + std::to_string(info.param.f) + "_" +
                                  std::string(to_string(info.param.dtype)) + (info.param.unaligned ? "_unaligned" : "");
                         });

// ---- RoPE ------------------------------------------------------------------------------------------
struct RopeCase {
  int64_t s, b, heads, d, rotary;
  bool interleaved;
  DType dtype;
  float scale = 1.0f;  // YaRN's attention factor on cos and sin
};

class CudaRope : public ::testing::TestWithParam<RopeCase> {};

TEST_P(CudaRope, ForwardBackwardAndInPlaceMatchCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const RopeCase c = GetParam();
  Context cpu;
  Context gpu(Device::cuda(0));
  const Shape shape = {c.s, c.b, c.heads, c.d};
  const Tensor x = random_tensor(shape, 1, 1.0f, c.dtype), dy = random_tensor(shape, 2, 1.0f, c.dtype);
  // Angles position · inv_freq as the model builds them (positions up to s, so large angles too).
  std::vector<float> angles(size_t(c.s * (c.rotary / 2)));
  for (int64_t p = 0; p < c.s; ++p) {
    for (int64_t k = 0; k < c.rotary / 2; ++k)
      angles[size_t(p * (c.rotary / 2) + k)] = float(p) * std::pow(10000.0f, -2.0f * float(k) / float(c.rotary));
  }
  const Tensor freqs = Tensor::from_floats(angles, {c.s, c.rotary / 2});
  const Tensor d_freqs = dev(freqs), d_x = dev(x), d_dy = dev(dy);
  Tensor out = Tensor::empty(shape, c.dtype), grad_in = Tensor::empty(shape, c.dtype);
  cpu::rope_forward(cpu, x, freqs, c.interleaved, c.scale, out);
  cpu::rope_backward(cpu, dy, freqs, c.interleaved, c.scale, grad_in);
  Tensor d_out = poisoned(shape, c.dtype), d_grad_in = poisoned(shape, c.dtype);
  cuda::rope_forward(gpu, d_x, d_freqs, c.interleaved, c.scale, d_out);
  cuda::rope_backward(gpu, d_dy, d_freqs, c.interleaved, c.scale, d_grad_in);
  expect_close(d_out, out, tolerance(c.dtype), "rope");
  expect_close(d_grad_in, grad_in, tolerance(c.dtype), "rope grad");
  Tensor d_inplace = dev(x);
  cuda::rope_forward(gpu, d_inplace, d_freqs, c.interleaved, c.scale, d_inplace);
  expect_close(d_inplace, out, tolerance(c.dtype), "rope in place");
}

std::vector<RopeCase> rope_cases() {
  std::vector<RopeCase> cases;
  for (bool inter : {false, true}) {
    for (DType dt : {DType::Float32, DType::BFloat16}) {
      cases.push_back({5, 2, 3, 8, 8, inter, dt});
      cases.push_back({7, 1, 2, 10, 6, inter, dt});  // channels 6..9 pass through
      cases.push_back({64, 2, 4, 128, 128, inter, dt});
      cases.push_back({3, 2, 2, 64, 32, inter, dt});  // half the head rotated
      cases.push_back({1, 1, 1, 2, 0, inter, dt});    // nothing rotated
    }
  }
  cases.push_back({9, 2, 3, 64, 64, false, DType::Float16});
  cases.push_back({33, 2, 4, 64, 64, false, DType::Float32, 1.1386f});  // YaRN factor 4's attention factor
  cases.push_back({7, 1, 2, 10, 6, true, DType::BFloat16, 0.8f});       // scaled pairs, unscaled pass-through
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaRope, ::testing::ValuesIn(rope_cases()),
                         [](const ::testing::TestParamInfo<RopeCase>& info) {
                           const RopeCase& c = info.param;
                           return "s" + std::to_string(c.s) + "_b" + std::to_string(c.b) + "_n" +
                                  std::to_string(c.heads) + "_d" + std::to_string(c.d) + "_r" +
                                  std::to_string(c.rotary) + (c.interleaved ? "_inter_" : "_half_") +
                                  std::string(to_string(c.dtype)) + (c.scale != 1.0f ? "_scaled" : "");
                         });

}  // namespace
}  // namespace megatron

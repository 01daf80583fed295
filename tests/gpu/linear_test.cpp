// linear on CUDA (cuBLASLt) against the CPU reference: forward with and without bias, backward with
// fp32 parameter-gradient accumulation, odd shapes, unaligned views, fp32/bf16/fp16.
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
#include "tests/gpu/gpu_test_util.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

using testing::expect_close;
using testing::kNaN;
using testing::random_tensor;



double tolerance(DType t) { return t == DType::Float32 ? 1e-5 : 1e-2; }
// fp32 parameter gradients of 16-bit operands: exact products, fp32 sums in another order.
double grad_tolerance(DType t) { return t == DType::Float32 ? 1e-5 : 1e-3; }

Tensor poisoned(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype, Device::cuda(0));
  t.fill_(kNaN);
  return t;
}

// A device tensor whose data starts one element past an allocation's start (unaligned for cuBLASLt).
Tensor offset_copy(const Tensor& host) {
  Tensor big = Tensor::empty({host.numel() + 1}, host.dtype(), Device::cuda(0));
  Tensor view = big.flat_slice(1, host.numel()).view(host.shape());
  view.copy_from(host);
  return view;
}

struct LinearCase {
  Shape x_shape;  // [..., in]
  int64_t out;
  DType dtype;
  bool bias;
  bool unaligned = false;
  bool bias_fp32 = false;  // an fp32 bias with 16-bit activations (not fused into the GEMM)
};

std::string case_name(const LinearCase& c) {
  std::string s = std::string(to_string(c.dtype)) + " x" + shape_str(c.x_shape) + " out=" + std::to_string(c.out);
  return s + (c.bias ? (c.bias_fp32 ? " fp32-bias" : " bias") : " no-bias") + (c.unaligned ? " unaligned" : "");
}

void run_case(const LinearCase& c, uint64_t seed) {
  SCOPED_TRACE(case_name(c));
  Context cpu_ctx;
  Context gpu_ctx(Device::cuda(0));
  const int64_t in = c.x_shape.back();
  Shape y_shape = c.x_shape;
  y_shape.back() = c.out;

  Tensor x = random_tensor(c.x_shape, seed, 1.0f, c.dtype);
  Tensor w = random_tensor({c.out, in}, seed + 1, 0.5f, c.dtype);
  Tensor b = c.bias ? random_tensor({c.out}, seed + 2, 1.0f, c.bias_fp32 ? DType::Float32 : c.dtype) : Tensor();
  Tensor dy = random_tensor(y_shape, seed + 3, 1.0f, c.dtype);
  Tensor wg0 = random_tensor({c.out, in}, seed + 4, 1.0f);
  Tensor bg0 = random_tensor({c.out}, seed + 5, 1.0f);

  auto to_dev = [&](const Tensor& t) { return c.unaligned ? offset_copy(t) : t.to(Device::cuda(0)); };
  Tensor dx_ = to_dev(x), dw = to_dev(w), db = c.bias ? to_dev(b) : Tensor(), ddy = to_dev(dy);

  // forward
  Tensor y_ref = Tensor::empty(y_shape, c.dtype);
  cpu::linear_forward(cpu_ctx, x, w, b, y_ref);
  Tensor y = poisoned(y_shape, c.dtype);
  cuda::linear_forward(gpu_ctx, dx_, dw, db, y);
  gpu_ctx.synchronize();
  expect_close(y, y_ref, tolerance(c.dtype), "y");

  // backward twice: grad_in is overwritten, the fp32 parameter gradients accumulate
  Tensor gi_ref = Tensor::empty(c.x_shape, c.dtype);
  Tensor wg_ref = wg0.clone(), bg_ref = c.bias ? bg0.clone() : Tensor();
  Tensor gi = poisoned(c.x_shape, c.dtype);
  Tensor wg = wg0.to(Device::cuda(0)), bg = c.bias ? bg0.to(Device::cuda(0)) : Tensor();
  for (int rep = 0; rep < 2; ++rep) {
    cpu::linear_backward(cpu_ctx, dy, x, w, gi_ref, wg_ref, bg_ref);
    cuda::linear_backward(gpu_ctx, ddy, dx_, dw, gi, wg, bg);
  }
  gpu_ctx.synchronize();
  expect_close(gi, gi_ref, tolerance(c.dtype), "grad_in");
  expect_close(wg, wg_ref, grad_tolerance(c.dtype), "weight_grad");
  if (c.bias) expect_close(bg, bg_ref, grad_tolerance(c.dtype), "bias_grad");
}

class CudaLinear : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(CudaLinear, MatchesCpuAcrossShapesAndDtypes) {
  const std::vector<std::pair<Shape, int64_t>> shapes = {
      {{1, 3}, 5}, {{7, 3}, 5}, {{33, 17}, 9}, {{64, 128}, 96}, {{4, 5, 72}, 257}, {{130, 40}, 24}, {{4099, 16}, 40}};
  uint64_t seed = 100;
  for (DType dt : {DType::Float32, DType::BFloat16, DType::Float16}) {
    for (const auto& [x_shape, out] : shapes) {
      for (bool bias : {false, true}) run_case({x_shape, out, dt, bias}, seed += 10);
    }
  }
}

TEST_F(CudaLinear, LargeSquareBf16) { run_case({{512, 1024}, 768, DType::BFloat16, true}, 7); }

TEST_F(CudaLinear, UnalignedViews) {
  uint64_t seed = 900;
  for (DType dt : {DType::Float32, DType::BFloat16}) {
    run_case({{9, 11}, 13, dt, true, true}, seed += 10);
    run_case({{64, 64}, 64, dt, true, true}, seed += 10);
  }
}

TEST_F(CudaLinear, Fp32BiasWith16BitActivations) {
  run_case({{10, 24}, 12, DType::BFloat16, true, false, true}, 51);
  run_case({{3, 5, 8}, 7, DType::Float16, true, false, true}, 61);
}

TEST_F(CudaLinear, WeightGradDoublesOverTwoCalls) {
  Context ctx(Device::cuda(0));
  const int64_t n = 37, in = 24, out = 19;
  Tensor x = random_tensor({n, in}, 1, 1.0f, DType::BFloat16).to(Device::cuda(0));
  Tensor w = random_tensor({out, in}, 2, 1.0f, DType::BFloat16).to(Device::cuda(0));
  Tensor dy = random_tensor({n, out}, 3, 1.0f, DType::BFloat16).to(Device::cuda(0));
  Tensor wg = Tensor::zeros({out, in}, DType::Float32, Device::cuda(0));
  Tensor bg = Tensor::zeros({out}, DType::Float32, Device::cuda(0));
  Tensor none;
  cuda::linear_backward(ctx, dy, x, w, none, wg, bg);
  ctx.synchronize();
  const Tensor wg1 = wg.to(Device::cpu()), bg1 = bg.to(Device::cpu());
  cuda::linear_backward(ctx, dy, x, w, none, wg, bg);
  ctx.synchronize();
  std::vector<float> w2 = wg1.to_floats(), b2 = bg1.to_floats();
  for (float& v : w2) v *= 2;
  for (float& v : b2) v *= 2;
  expect_close(wg, Tensor::from_floats(w2, {out, in}), 1e-6, "weight_grad x2");
  expect_close(bg, Tensor::from_floats(b2, {out}), 1e-6, "bias_grad x2");
}

TEST_F(CudaLinear, OnlyInputGradWhenParameterGradsUndefined) {
  Context cpu_ctx;
  Context ctx(Device::cuda(0));
  Tensor x = random_tensor({6, 10}, 11), w = random_tensor({4, 10}, 12), dy = random_tensor({6, 4}, 13);
  Tensor gi_ref = Tensor::empty({6, 10}, DType::Float32), none;
  cpu::linear_backward(cpu_ctx, dy, x, w, gi_ref, none, none);
  Tensor gi = poisoned({6, 10}, DType::Float32);
  Tensor dnone;
  cuda::linear_backward(ctx, dy.to(Device::cuda(0)), x.to(Device::cuda(0)), w.to(Device::cuda(0)), gi, dnone, dnone);
  ctx.synchronize();
  expect_close(gi, gi_ref, 1e-5, "grad_in");
}

TEST_F(CudaLinear, ZeroInputFeaturesGiveTheBias) {
  Context ctx(Device::cuda(0));
  Tensor x = Tensor::empty({3, 0}, DType::Float32, Device::cuda(0));
  Tensor w = Tensor::empty({4, 0}, DType::Float32, Device::cuda(0));
  Tensor b = Tensor::from_floats({1, 2, 3, 4}, {4}, DType::Float32, Device::cuda(0));
  Tensor y = poisoned({3, 4}, DType::Float32);
  cuda::linear_forward(ctx, x, w, b, y);
  ctx.synchronize();
  expect_close(y, Tensor::from_floats({1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4}, {3, 4}), 0, "y");
}

// Note [GeLU in the GEMM epilogue]: fc1 + GeLU (GELU_AUX(_BIAS)) and fc2's input gradient through
// GeLU (DGELU) against the CPU's unfused reference; widths that are multiples of 8 take the fused
// epilogues in bf16/fp16, the rest (and fp32, and unaligned views) the unfused path.
TEST_F(CudaLinear, GeluEpiloguesMatchCpu) {
  Context cpu_ctx;
  Context ctx(Device::cuda(0));
  const std::vector<std::pair<Shape, int64_t>> shapes = {{{64, 128}, 96}, {{4, 5, 72}, 256}, {{4099, 16}, 40},
                                                          {{33, 17}, 9},  {{512, 1024}, 4096}};
  uint64_t seed = 900;
  for (DType dt : {DType::Float32, DType::BFloat16, DType::Float16}) {
    for (const auto& [x_shape, ffn] : shapes) {
      for (bool bias : {false, true}) {
        for (bool unaligned : {false, true}) {
          SCOPED_TRACE(std::string(to_string(dt)) + " x" + shape_str(x_shape) + " ffn=" + std::to_string(ffn) +
                       (bias ? " bias" : "") + (unaligned ? " unaligned" : ""));
          seed += 10;
          const int64_t in = x_shape.back();
          Shape h_shape = x_shape;
          h_shape.back() = ffn;
          Tensor x = random_tensor(x_shape, seed, 1.0f, dt);
          Tensor w1 = random_tensor({ffn, in}, seed + 1, 0.5f, dt);
          Tensor b1 = bias ? random_tensor({ffn}, seed + 2, 1.0f, dt) : Tensor();
          Tensor w2 = random_tensor({in, ffn}, seed + 3, 0.5f, dt);
          Tensor dy = random_tensor(x_shape, seed + 4, 1.0f, dt);
          auto to_dev = [&](const Tensor& t) { return unaligned ? offset_copy(t) : t.to(Device::cuda(0)); };

          Tensor pre_ref = Tensor::empty(h_shape, dt), out_ref = Tensor::empty(h_shape, dt);
          cpu::linear_gelu_forward(cpu_ctx, x, w1, b1, pre_ref, out_ref);
          Tensor pre = poisoned(h_shape, dt), out = poisoned(h_shape, dt);
          cuda::linear_gelu_forward(ctx, to_dev(x), to_dev(w1), bias ? to_dev(b1) : Tensor(), pre, out);
          ctx.synchronize();
          expect_close(pre, pre_ref, tolerance(dt), "pre");
          expect_close(out, out_ref, tolerance(dt), "gelu(pre)");

          // The backward from the CPU's pre, so both sides see the same input.
          Tensor gp_ref = Tensor::empty(h_shape, dt);
          cpu::linear_dgelu_backward(cpu_ctx, dy, w2, pre_ref, gp_ref);
          Tensor gp = poisoned(h_shape, dt);
          cuda::linear_dgelu_backward(ctx, to_dev(dy), to_dev(w2), to_dev(pre_ref), gp);
          ctx.synchronize();
          expect_close(gp, gp_ref, tolerance(dt), "grad_pre");
        }
      }
    }
  }
}

}  // namespace
}  // namespace megatron

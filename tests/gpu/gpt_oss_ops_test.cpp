// GPT-OSS's ops on CUDA against the CPU reference: the clamped quick-GeGLU (forward, backward; fp32,
// bf16, fp16; packed and scalar paths), attention sinks (forward in and out of place, the sinks'
// gradient; fp32 and bf16 outputs, fp32 and bf16 sinks), and sliding-window attention (Note
// [Sliding-window attention]) on the row-wise kernels (fp32: Causal, Documents, CausalWithOffset
// windows) and through the dispatch (bf16: cuDNN's left bound for Causal, the row-wise fallback for
// Documents), forward and backward, with the sinks folded in as SelfAttention runs them.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "megatron/kernels/cpu/cpu_ops.h"
#include "megatron/kernels/cuda/attention.h"
#include "megatron/kernels/cuda/cuda_ops.h"
#include "megatron/runtime/allocator.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

using testing::expect_close;
using testing::kNaN;
using testing::random_tensor;

#define SKIP_WITHOUT_GPU()                                                  \
  do {                                                                      \
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible"; \
  } while (0)

double tolerance(DType t) { return t == DType::Float32 ? 1e-5 : t == DType::Float16 ? 2e-3 : 1e-2; }

Tensor poisoned(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype, Device::cuda(0));
  t.fill_(kNaN);
  return t;
}

// ---- quick-GeGLU ---------------------------------------------------------------------------------
struct GegluCase {
  int64_t n, f;
  DType dtype;
  float limit;
};

class CudaQuickGeglu : public ::testing::TestWithParam<GegluCase> {};

TEST_P(CudaQuickGeglu, ForwardAndBackwardMatchCpu) {
  SKIP_WITHOUT_GPU();
  const GegluCase c = GetParam();
  Context cpu;
  Context gpu(Device::cuda(0));
  const Tensor x = random_tensor({c.n, 2 * c.f}, 1, 3.0f, c.dtype), dy = random_tensor({c.n, c.f}, 2, 1.0f, c.dtype);
  Tensor out = Tensor::empty({c.n, c.f}, c.dtype), grad_in = Tensor::empty({c.n, 2 * c.f}, c.dtype);
  cpu::quick_geglu_forward(cpu, x, 1.702f, c.limit, 1.0f, out);
  cpu::quick_geglu_backward(cpu, dy, x, 1.702f, c.limit, 1.0f, grad_in);
  Tensor d_out = poisoned({c.n, c.f}, c.dtype), d_grad_in = poisoned({c.n, 2 * c.f}, c.dtype);
  const Tensor d_x = x.to(Device::cuda(0)), d_dy = dy.to(Device::cuda(0));
  cuda::quick_geglu_forward(gpu, d_x, 1.702f, c.limit, 1.0f, d_out);
  cuda::quick_geglu_backward(gpu, d_dy, d_x, 1.702f, c.limit, 1.0f, d_grad_in);
  expect_close(d_out, out, tolerance(c.dtype), "quick_geglu");
  expect_close(d_grad_in, grad_in, tolerance(c.dtype), "quick_geglu grad");
}

std::vector<GegluCase> geglu_cases() {
  std::vector<GegluCase> cases;
  for (int64_t f : {3, 128, 1000})
    for (DType dt : {DType::Float32, DType::BFloat16})
      for (float limit : {7.0f, 1.0f, std::numeric_limits<float>::infinity()}) cases.push_back({5, f, dt, limit});
  cases.push_back({4, 256, DType::Float16, 7.0f});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaQuickGeglu, ::testing::ValuesIn(geglu_cases()),
                         [](const ::testing::TestParamInfo<GegluCase>& info) {
                           const GegluCase& c = info.param;
                           return "f" + std::to_string(c.f) + "_" + std::string(to_string(c.dtype)) + "_limit" +
                                  (std::isinf(c.limit) ? std::string("none") : std::to_string(int(c.limit)));
                         });

// ---- attention sinks -------------------------------------------------------------------------------
struct SinkCase {
  DType dtype, sink_dtype;
};

class CudaAttentionSinks : public ::testing::TestWithParam<SinkCase> {};

TEST_P(CudaAttentionSinks, ForwardAndBackwardMatchCpu) {
  SKIP_WITHOUT_GPU();
  const SinkCase c = GetParam();
  const int64_t s = 37, b = 2, nq = 6, d = 40;
  Context cpu;
  Context gpu(Device::cuda(0));
  const Tensor out0 = random_tensor({s, b, nq, d}, 3, 1.0f, c.dtype), dy = random_tensor({s, b, nq, d}, 4, 1.0f, c.dtype);
  Tensor lse0 = random_tensor({b, nq, s}, 5, 2.0f);
  lse0.data<float>()[3] = -std::numeric_limits<float>::infinity();  // a row without keys
  const Tensor sinks = random_tensor({nq}, 6, 1.0f, c.sink_dtype);
  Tensor out = Tensor::empty(out0.shape(), c.dtype), lse = Tensor::empty(lse0.shape(), DType::Float32);
  cpu::attention_sink_forward(cpu, out0, lse0, sinks, out, lse);
  Tensor grad = Tensor::from_floats(std::vector<float>(size_t(nq), 0.5f), {nq});
  cpu::attention_sink_backward(cpu, dy, out, lse, sinks, grad);

  const Device dev = Device::cuda(0);
  Tensor d_out = poisoned(out0.shape(), c.dtype), d_lse = poisoned(lse0.shape(), DType::Float32);
  const Tensor d_out0 = out0.to(dev), d_lse0 = lse0.to(dev), d_sinks = sinks.to(dev), d_dy = dy.to(dev);
  cuda::attention_sink_forward(gpu, d_out0, d_lse0, d_sinks, d_out, d_lse);
  expect_close(d_out, out, tolerance(c.dtype), "out");
  expect_close(d_lse, lse, 1e-6, "lse");
  Tensor in_out = out0.to(dev), in_lse = lse0.to(dev);  // in place, as SelfAttention runs it
  cuda::attention_sink_forward(gpu, in_out, in_lse, d_sinks, in_out, in_lse);
  expect_close(in_out, out, tolerance(c.dtype), "out in place");
  expect_close(in_lse, lse, 1e-6, "lse in place");
  Tensor d_grad = Tensor::from_floats(std::vector<float>(size_t(nq), 0.5f), {nq}).to(dev);
  cuda::attention_sink_backward(gpu, d_dy, out.to(dev), lse.to(dev), d_sinks, d_grad);
  expect_close(d_grad, grad, 1e-4, "sinks grad");
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaAttentionSinks,
                         ::testing::Values(SinkCase{DType::Float32, DType::Float32},
                                           SinkCase{DType::BFloat16, DType::Float32},
                                           SinkCase{DType::BFloat16, DType::BFloat16}),
                         [](const ::testing::TestParamInfo<SinkCase>& info) {
                           return std::string(to_string(info.param.dtype)) + "_sinks_" +
                                  std::string(to_string(info.param.sink_dtype));
                         });

// ---- sliding-window attention (with sinks) -----------------------------------------------------------
struct WindowCase {
  std::string name;
  int64_t sq, sk;
  AttnMask mask;  // cu_seqlens on the host
  DType dtype;
  bool rowwise;  // the row-wise kernels directly, else the dispatch (cuDNN where it takes the mask)
};

struct AttnResults {
  Tensor out, lse, grad_q, grad_k, grad_v, grad_sinks;
};

AttnResults run(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dy, const Tensor& sinks,
                const AttnMask& mask, bool rowwise) {
  const bool gpu = ctx.device().is_cuda();
  const DType dt = gpu ? q.dtype() : DType::Float32;
  auto make = [&](const Shape& shape, DType dtype) {
    return gpu ? poisoned(shape, dtype) : Tensor::empty(shape, dtype);
  };
  const Shape& qs = q.shape();
  AttnResults r{make(qs, dt), make({qs[1], qs[2], qs[0]}, DType::Float32), make(qs, dt), make(k.shape(), dt),
                make(k.shape(), dt), Tensor::zeros({qs[2]}, DType::Float32, ctx.device())};
  const float scale = 0.125f;
  if (!gpu) {
    cpu::attention_forward(ctx, q, k, v, mask, scale, 0.0f, 0, 0, r.out, r.lse);
    cpu::attention_sink_forward(ctx, r.out, r.lse, sinks, r.out, r.lse);
    cpu::attention_sink_backward(ctx, dy, r.out, r.lse, sinks, r.grad_sinks);
    cpu::attention_backward(ctx, dy, q, k, v, r.out, r.lse, mask, scale, 0.0f, 0, 0, r.grad_q, r.grad_k, r.grad_v);
    return r;
  }
  if (rowwise) {
    cuda::attention_forward_rowwise(ctx, q, k, v, mask, scale, 0.0f, 0, 0, r.out, r.lse);
  } else {
    cuda::attention_forward(ctx, q, k, v, mask, scale, 0.0f, 0, 0, r.out, r.lse);
  }
  cuda::attention_sink_forward(ctx, r.out, r.lse, sinks, r.out, r.lse);
  cuda::attention_sink_backward(ctx, dy, r.out, r.lse, sinks, r.grad_sinks);
  if (rowwise) {
    cuda::attention_backward_rowwise(ctx, dy, q, k, v, r.out, r.lse, mask, scale, 0.0f, 0, 0, r.grad_q, r.grad_k,
                                     r.grad_v);
  } else {
    cuda::attention_backward(ctx, dy, q, k, v, r.out, r.lse, mask, scale, 0.0f, 0, 0, r.grad_q, r.grad_k, r.grad_v);
  }
  ctx.synchronize();
  return r;
}

class CudaWindowAttention : public ::testing::TestWithParam<WindowCase> {};

TEST_P(CudaWindowAttention, MatchesCpu) {
  SKIP_WITHOUT_GPU();
  const WindowCase& c = GetParam();
  const int64_t b = 2, nq = 4, ng = 2, d = 64;
  const Tensor q = random_tensor({c.sq, b, nq, d}, 7, 1.0f, c.dtype), k = random_tensor({c.sk, b, ng, d}, 8, 1.0f, c.dtype),
               v = random_tensor({c.sk, b, ng, d}, 9, 1.0f, c.dtype), dy = random_tensor({c.sq, b, nq, d}, 10, 1.0f, c.dtype),
               sinks = random_tensor({nq}, 11);
  Context cpu;
  const AttnResults want = run(cpu, q, k, v, dy, sinks, c.mask, false);
  Context gpu(Device::cuda(0));
  const Device dev = Device::cuda(0);
  AttnMask mask = c.mask;
  if (mask.cu_seqlens.defined()) mask.cu_seqlens = mask.cu_seqlens.to(dev);
  const AttnResults got = run(gpu, q.to(dev), k.to(dev), v.to(dev), dy.to(dev), sinks.to(dev), mask, c.rowwise);
  const double tol = c.dtype == DType::Float32 ? 1e-4 : 3e-2;
  expect_close(got.out, want.out, tol, "out", 0.05);
  expect_close(got.lse, want.lse, c.dtype == DType::Float32 ? 1e-5 : 1e-2, "lse");
  expect_close(got.grad_q, want.grad_q, tol, "grad_q", 0.05);
  expect_close(got.grad_k, want.grad_k, tol, "grad_k", 0.05);
  expect_close(got.grad_v, want.grad_v, tol, "grad_v", 0.05);
  expect_close(got.grad_sinks, want.grad_sinks, tol, "grad_sinks", 0.05);
}

std::vector<WindowCase> window_cases() {
  const Tensor docs = Tensor::from_ints({0, 40, 41, 100}, {4}, DType::Int32);
  std::vector<WindowCase> cases;
  for (int64_t w : {0, 7, 63}) {
    const std::string ws = std::to_string(w);
    cases.push_back({"CausalRowwiseFp32_w" + ws, 100, 100, AttnMask::causal().with_window(w), DType::Float32, true});
    cases.push_back({"DocumentsRowwiseFp32_w" + ws, 100, 100, AttnMask::documents(docs).with_window(w), DType::Float32,
                     true});
    cases.push_back({"OffsetRowwiseFp32_w" + ws, 30, 100, AttnMask::causal_with_offset(70, 0).with_window(w),
                     DType::Float32, true});
    cases.push_back({"CausalCudnnBf16_w" + ws, 100, 100, AttnMask::causal().with_window(w), DType::BFloat16, false});
    cases.push_back({"DocumentsDispatchBf16_w" + ws, 100, 100, AttnMask::documents(docs).with_window(w),
                     DType::BFloat16, false});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Masks, CudaWindowAttention, ::testing::ValuesIn(window_cases()),
                         [](const ::testing::TestParamInfo<WindowCase>& info) { return info.param.name; });

}  // namespace
}  // namespace megatron

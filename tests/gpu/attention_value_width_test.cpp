// Attention with value heads of another width than the query/key heads (dv != d, multi-latent
// attention: DeepSeek-V3's 192 and 128, the fixture's 24 and 16) on CUDA against the CPU reference:
// cuDNN's fused attention (bf16, fp16) takes it (Note [Value heads of another width on the GPU]),
// and so do the row-wise kernels (fp32; packed documents), dropout mask included.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "megatron/kernels/cpu/cpu_ops.h"
#include "megatron/kernels/cuda/attention.h"
#include "megatron/kernels/cuda/cuda_ops.h"
#include "megatron/runtime/allocator.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

using testing::expect_close;
using testing::random_tensor;

constexpr uint64_t kSeed = 5, kOffset = 9;

struct WidthCase {
  int64_t s, b, nq, ng, d, dv;
};

struct Results {
  Tensor out, lse, gq, gk, gv;
};

Results run(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& grad_out, float scale,
            DType out_dtype) {
  const Device dev = ctx.device();
  const int64_t s = q.size(0), b = q.size(1), nq = q.size(2), dv = v.size(3);
  Results r{Tensor::empty({s, b, nq, dv}, out_dtype, dev), Tensor::empty({b, nq, s}, DType::Float32, dev),
            Tensor::empty(q.shape(), out_dtype, dev), Tensor::empty(k.shape(), out_dtype, dev),
            Tensor::empty(v.shape(), out_dtype, dev)};
  ops::attention_forward(ctx, q, k, v, AttnMask::causal(), scale, 0.0f, kSeed, kOffset, r.out, r.lse);
  ops::attention_backward(ctx, grad_out, q, k, v, r.out, r.lse, AttnMask::causal(), scale, 0.0f, kSeed, kOffset, r.gq,
                          r.gk, r.gv);
  return r;
}

class AttentionValueWidthGpu : public ::testing::TestWithParam<WidthCase> {};

TEST_P(AttentionValueWidthGpu, CudnnMatchesCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible";
  const WidthCase c = GetParam();
  const float scale = 1.0f / std::sqrt(float(c.d));
  for (DType dt : {DType::BFloat16, DType::Float16}) {
    Tensor q = random_tensor({c.s, c.b, c.nq, c.d}, 1, 1.0f, dt), k = random_tensor({c.s, c.b, c.ng, c.d}, 2, 1.0f, dt);
    Tensor v = random_tensor({c.s, c.b, c.ng, c.dv}, 3, 1.0f, dt);
    Tensor grad_out = random_tensor({c.s, c.b, c.nq, c.dv}, 4, 1.0f, dt);
    Context cpu;
    Results want = run(cpu, q, k, v, grad_out, scale, DType::Float32);
    Context gpu(Device::cuda(0));
    const Device dev = gpu.device();
    Tensor qd = q.to(dev), kd = k.to(dev), vd = v.to(dev), god = grad_out.to(dev);
    Tensor probe_out = Tensor::empty({c.s, c.b, c.nq, c.dv}, dt, dev);
    Tensor probe_lse = Tensor::empty({c.b, c.nq, c.s}, DType::Float32, dev);
    ASSERT_TRUE(cuda::cudnn_attention_forward(gpu, qd, kd, vd, AttnMask::causal(), scale, 0.0f, kSeed, kOffset,
                                              probe_out, probe_lse))
        << "cuDNN declined d = " << c.d << ", dv = " << c.dv;
    Results got = run(gpu, qd, kd, vd, god, scale, dt);
    gpu.synchronize();
    const std::string what = std::string(to_string(dt)) + " ";
    expect_close(got.out.to(Device::cpu()), want.out, 2e-2, what + "out");
    expect_close(got.lse.to(Device::cpu()), want.lse, 1e-2, what + "lse");
    expect_close(got.gq.to(Device::cpu()), want.gq, 3e-2, what + "grad_q", 0.05);
    expect_close(got.gk.to(Device::cpu()), want.gk, 3e-2, what + "grad_k", 0.05);
    expect_close(got.gv.to(Device::cpu()), want.gv, 3e-2, what + "grad_v", 0.05);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionValueWidthGpu,
                         ::testing::Values(WidthCase{16, 2, 4, 4, 24, 16}, WidthCase{64, 1, 8, 8, 192, 128},
                                           WidthCase{33, 2, 4, 2, 64, 32}),
                         [](const auto& info) {
                           return "D" + std::to_string(info.param.d) + "Dv" + std::to_string(info.param.dv) + "S" +
                                  std::to_string(info.param.s);
                         });

// The row-wise kernels (fp32, and the fallback for packed documents) with both widths: the CPU's
// result, dropout mask included.
TEST(AttentionValueWidthGpuRowwise, MatchesCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible";
  Context gpu(Device::cuda(0));
  const Device dev = gpu.device();
  const int64_t s = 24, b = 2, nq = 4, ng = 2, d = 24, dv = 16;
  const Tensor cu = Tensor::from_floats({0, 10, 24}, {3}, DType::Int32);
  for (float p : {0.0f, 0.2f}) {
    for (const AttnMask& host_mask : {AttnMask::causal(), AttnMask::documents(cu)}) {
      AttnMask mask = host_mask;
      if (mask.cu_seqlens.defined()) mask.cu_seqlens = mask.cu_seqlens.to(dev);
      Tensor q = random_tensor({s, b, nq, d}, 1), k = random_tensor({s, b, ng, d}, 2);
      Tensor v = random_tensor({s, b, ng, dv}, 3), go = random_tensor({s, b, nq, dv}, 4);
      Context cpu;
      Tensor out = Tensor::empty({s, b, nq, dv}, DType::Float32), lse = Tensor::empty({b, nq, s}, DType::Float32);
      Tensor gq = Tensor::empty(q.shape(), DType::Float32), gk = Tensor::empty(k.shape(), DType::Float32),
             gv = Tensor::empty(v.shape(), DType::Float32);
      ops::attention_forward(cpu, q, k, v, host_mask, 0.3f, p, kSeed, kOffset, out, lse);
      ops::attention_backward(cpu, go, q, k, v, out, lse, host_mask, 0.3f, p, kSeed, kOffset, gq, gk, gv);
      Tensor qd = q.to(dev), kd = k.to(dev), vd = v.to(dev), god = go.to(dev);
      Tensor out_d = Tensor::empty(out.shape(), DType::Float32, dev), lse_d = Tensor::empty(lse.shape(), DType::Float32, dev);
      Tensor gq_d = Tensor::empty(q.shape(), DType::Float32, dev), gk_d = Tensor::empty(k.shape(), DType::Float32, dev),
             gv_d = Tensor::empty(v.shape(), DType::Float32, dev);
      cuda::attention_forward_rowwise(gpu, qd, kd, vd, mask, 0.3f, p, kSeed, kOffset, out_d, lse_d);
      cuda::attention_backward_rowwise(gpu, god, qd, kd, vd, out_d, lse_d, mask, 0.3f, p, kSeed, kOffset, gq_d, gk_d,
                                       gv_d);
      gpu.synchronize();
      const std::string what = std::string(p > 0 ? "dropout " : "") + (mask.cu_seqlens.defined() ? "documents " : "");
      expect_close(out_d.to(Device::cpu()), out, 1e-5, what + "out");
      expect_close(lse_d.to(Device::cpu()), lse, 1e-5, what + "lse");
      expect_close(gq_d.to(Device::cpu()), gq, 1e-5, what + "grad_q");
      expect_close(gk_d.to(Device::cpu()), gk, 1e-5, what + "grad_k");
      expect_close(gv_d.to(Device::cpu()), gv, 1e-5, what + "grad_v");
    }
  }
}

}  // namespace
}  // namespace megatron

// Context-parallel attention's helpers on CUDA against the CPU reference: attention_merge (fp32 and
// bf16, a row offset, rows without keys), lse_copy_rows and copy_rows byte for byte, and a query
// chunk's attention merged over key blocks on the GPU (cuDNN) against the CPU's whole attention.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "megatron/kernels/cpu/cpu_ops.h"
#include "megatron/kernels/cuda/cuda_ops.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

using testing::random_tensor;

const Device kGpu = Device::cuda(0);

Tensor lse_with_holes(const Shape& shape, uint64_t seed) {
  std::vector<float> v = random_tensor(shape, seed).to_floats();
  for (size_t i = 0; i < v.size(); i += 7) v[i] = -std::numeric_limits<float>::infinity();
  return Tensor::from_floats(v, shape);
}

TEST(AttentionMergeGpu, MergeEqualsCpu) {
  for (DType dt : {DType::Float32, DType::BFloat16}) {
    Context cpu_ctx(Device::cpu()), gpu_ctx(kGpu);
    const int64_t r = 6, R = 10, b = 2, nq = 3, d = 40, off = 3;
    Tensor blk = random_tensor({r, b, nq, d}, 1, 1.0f, dt), acc = random_tensor({R, b, nq, d}, 2, 1.0f, dt);
    Tensor lb = lse_with_holes({b, nq, r}, 3), la = lse_with_holes({b, nq, R}, 4);
    Tensor acc_gpu = acc.to(kGpu), la_gpu = la.to(kGpu);
    cpu::attention_merge(cpu_ctx, blk, lb, off, acc, la);
    cuda::attention_merge(gpu_ctx, blk.to(kGpu), lb.to(kGpu), off, acc_gpu, la_gpu);
    gpu_ctx.synchronize();
    testing::expect_close(acc_gpu, acc, dt == DType::Float32 ? 1e-6 : 8e-3, "out");
    const std::vector<float> g = la_gpu.to_floats(), c = la.to_floats();
    for (size_t i = 0; i < c.size(); ++i) {
      if (std::isinf(c[i])) {
        EXPECT_TRUE(std::isinf(g[i])) << i;
      } else {
        EXPECT_NEAR(g[i], c[i], 1e-5) << i;
      }
    }
  }
}

TEST(AttentionMergeGpu, RowCopiesEqualCpu) {
  Context cpu_ctx(Device::cpu()), gpu_ctx(kGpu);
  Tensor src = random_tensor({2, 3, 9}, 5), dst = random_tensor({2, 3, 7}, 6);
  Tensor dst_gpu = dst.to(kGpu);
  cpu::lse_copy_rows(cpu_ctx, src, 2, dst, 1, 5);
  cuda::lse_copy_rows(gpu_ctx, src.to(kGpu), 2, dst_gpu, 1, 5);
  gpu_ctx.synchronize();
  EXPECT_EQ(dst_gpu.to_floats(), dst.to_floats());
  Tensor a = random_tensor({5, 2, 3}, 7, 1.0f, DType::BFloat16), c = random_tensor({6, 2, 3}, 8, 1.0f, DType::BFloat16);
  Tensor c_gpu = c.to(kGpu);
  cpu::copy_rows(cpu_ctx, a, 1, c, 2, 3);
  cuda::copy_rows(gpu_ctx, a.to(kGpu), 1, c_gpu, 2, 3);
  gpu_ctx.synchronize();
  EXPECT_EQ(c_gpu.to_floats(), c.to_floats());
}

// A context-parallel rank's query chunk (positions 24..31 of 32) over four key blocks of 8, each on
// cuDNN and merged on the GPU, against the CPU's whole attention over keys 0..31 (bf16).
TEST(AttentionMergeGpu, BlocksOnTheGpuEqualTheWholeAttention) {
  Context cpu_ctx(Device::cpu()), gpu_ctx(kGpu);
  const int64_t c = 8, b = 2, nq = 4, ng = 2, d = 64;
  const float scale = 1.0f / std::sqrt(float(d));
  Tensor q = random_tensor({c, b, nq, d}, 11, 1.0f, DType::BFloat16);
  Tensor k = random_tensor({4 * c, b, ng, d}, 12, 1.0f, DType::BFloat16), v = random_tensor({4 * c, b, ng, d}, 13, 1.0f, DType::BFloat16);
  Tensor out = Tensor::empty(q.shape(), DType::Float32), lse = Tensor::empty({b, nq, c}, DType::Float32);
  cpu::attention_forward(cpu_ctx, q.to(DType::Float32), k.to(DType::Float32), v.to(DType::Float32),
                         AttnMask::causal_with_offset(3 * c, 0), scale, 0.0f, 0, 0, out, lse);
  Tensor qg = q.to(kGpu), kg = k.to(kGpu), vg = v.to(kGpu);
  Tensor acc = Tensor::empty(q.shape(), DType::BFloat16, kGpu), acc_lse = Tensor::empty({b, nq, c}, DType::Float32, kGpu);
  // The diagonal first, written directly; then the full blocks merged in.
  cuda::attention_forward(gpu_ctx, qg, kg.slice(3 * c, 4 * c), vg.slice(3 * c, 4 * c), AttnMask::causal(), scale, 0.0f,
                          0, 0, acc, acc_lse);
  for (int64_t blk = 0; blk < 3; ++blk) {
    Tensor ob = Tensor::empty(q.shape(), DType::BFloat16, kGpu), lb = Tensor::empty({b, nq, c}, DType::Float32, kGpu);
    cuda::attention_forward(gpu_ctx, qg, kg.slice(blk * c, blk * c + c), vg.slice(blk * c, blk * c + c),
                            AttnMask::causal_with_offset(c, 0), scale, 0.0f, 0, 0, ob, lb);
    cuda::attention_merge(gpu_ctx, ob, lb, 0, acc, acc_lse);
  }
  gpu_ctx.synchronize();
  testing::expect_close(acc, out, 2e-2, "merged out (bf16)");
  testing::expect_close(acc_lse, lse, 1e-2, "merged lse");
}

}  // namespace
}  // namespace megatron

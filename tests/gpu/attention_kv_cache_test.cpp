// attention_kv_cache_forward on CUDA against the CPU reference: the caches after the write and the
// attention output, for prefill (starts 0) and decode (one new token at different positions).
#include <gtest/gtest.h>

#include <cmath>

#include "megatron/kernels/cpu/cpu_ops.h"
#include "megatron/kernels/cuda/cuda_ops.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

double scaled_error(const Tensor& got, const Tensor& want) {
  std::vector<float> g = got.to_floats(), w = want.to_floats();
  double diff = 0, scale = 1e-3;
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::isnan(g[i]) && !std::isnan(w[i])) return INFINITY;
    diff = std::max(diff, std::fabs(double(g[i]) - double(w[i])));
    scale = std::max(scale, std::fabs(double(w[i])));
  }
  return diff / scale;
}

struct Case {
  int64_t s, b, nq, ng, d, slots, max_len;
  std::vector<int64_t> slot, start;
  DType dtype;
};

class CudaKvCache : public ::testing::TestWithParam<Case> {};

TEST_P(CudaKvCache, MatchesCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU";
  const Case c = GetParam();
  Context cpu_ctx, gpu_ctx(Device::cuda(0));
  Tensor q = testing::random_tensor({c.s, c.b, c.nq, c.d}, 1, 1.0f, c.dtype);
  Tensor k = testing::random_tensor({c.s, c.b, c.ng, c.d}, 2, 1.0f, c.dtype);
  Tensor v = testing::random_tensor({c.s, c.b, c.ng, c.d}, 3, 1.0f, c.dtype);
  Tensor kc = testing::random_tensor({c.slots, c.max_len, c.ng, c.d}, 4, 1.0f, c.dtype);
  Tensor vc = testing::random_tensor({c.slots, c.max_len, c.ng, c.d}, 5, 1.0f, c.dtype);
  Tensor slots = Tensor::from_ints(c.slot, {c.b}), starts = Tensor::from_ints(c.start, {c.b});
  const float scale = 1.0f / std::sqrt(float(c.d));

  Tensor kc_cpu = kc.clone(), vc_cpu = vc.clone(), out_cpu = Tensor::empty(q.shape(), c.dtype);
  cpu::attention_kv_cache_forward(cpu_ctx, q, k, v, slots, starts, scale, kc_cpu, vc_cpu, out_cpu);

  Tensor kc_gpu = kc.to(gpu_ctx.device()), vc_gpu = vc.to(gpu_ctx.device());
  Tensor out_gpu = Tensor::from_floats(std::vector<float>(size_t(q.numel()), NAN), q.shape(), c.dtype, gpu_ctx.device());
  cuda::attention_kv_cache_forward(gpu_ctx, q.to(gpu_ctx.device()), k.to(gpu_ctx.device()), v.to(gpu_ctx.device()),
                                   slots, starts, scale, kc_gpu, vc_gpu, out_gpu);
  gpu_ctx.synchronize();
  const double tol = c.dtype == DType::Float32 ? 1e-5 : 2e-2;
  EXPECT_EQ(kc_gpu.to_floats(), kc_cpu.to_floats()) << "the key cache after the write";
  EXPECT_EQ(vc_gpu.to_floats(), vc_cpu.to_floats()) << "the value cache after the write";
  EXPECT_LE(scaled_error(out_gpu, out_cpu), tol);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaKvCache,
    ::testing::Values(Case{7, 2, 4, 2, 16, 3, 32, {2, 0}, {0, 0}, DType::Float32},        // prefill
                      Case{1, 3, 8, 2, 64, 4, 128, {1, 3, 0}, {5, 90, 0}, DType::Float32},  // decode
                      Case{1, 3, 8, 2, 64, 4, 128, {1, 3, 0}, {5, 90, 0}, DType::BFloat16},
                      Case{5, 1, 4, 4, 32, 1, 64, {0}, {17}, DType::Float32}));

}  // namespace
}  // namespace megatron

// attention_kv_cache_forward on CUDA against the CPU reference: the caches after the write and the
// attention output, for prefill (starts 0) and decode (one new token at different positions).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <tuple>

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
                      Case{5, 1, 4, 4, 32, 1, 64, {0}, {17}, DType::Float32},
                      // the generation benchmark's shapes: head dim 128, ~600 cached positions, GQA
                      Case{1, 4, 16, 16, 128, 6, 700, {5, 0, 2, 3}, {511, 600, 3, 698}, DType::BFloat16},
                      Case{1, 2, 32, 8, 64, 2, 640, {1, 0}, {639, 100}, DType::BFloat16},
                      Case{1, 2, 6, 2, 80, 2, 96, {1, 0}, {40, 95}, DType::Float32}));  // d not a multiple of 32

TEST(CudaKvCacheAppend, MatchesCpuWithDeviceIndices) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU";
  Context cpu_ctx, gpu_ctx(Device::cuda(0));
  const int64_t s = 3, b = 2, ng = 2, d = 16, slots = 3, max_len = 12;
  Tensor k = testing::random_tensor({s, b, ng, d}, 2, 1.0f, DType::BFloat16);
  Tensor v = testing::random_tensor({s, b, ng, d}, 3, 1.0f, DType::BFloat16);
  Tensor kc = testing::random_tensor({slots, max_len, ng, d}, 4, 1.0f, DType::BFloat16);
  Tensor vc = testing::random_tensor({slots, max_len, ng, d}, 5, 1.0f, DType::BFloat16);
  Tensor slot = Tensor::from_ints({2, 0}, {b}), start = Tensor::from_ints({4, 9}, {b});
  Tensor kc_cpu = kc.clone(), vc_cpu = vc.clone();
  cpu::kv_cache_append(cpu_ctx, k, v, slot, start, kc_cpu, vc_cpu);
  Tensor kc_gpu = kc.to(gpu_ctx.device()), vc_gpu = vc.to(gpu_ctx.device());
  cuda::kv_cache_append(gpu_ctx, k.to(gpu_ctx.device()), v.to(gpu_ctx.device()), slot.to(gpu_ctx.device()),
                        start.to(gpu_ctx.device()), kc_gpu, vc_gpu);
  EXPECT_EQ(kc_gpu.to_floats(), kc_cpu.to_floats());
  EXPECT_EQ(vc_gpu.to_floats(), vc_cpu.to_floats());
}

TEST(CudaLogitsSummary, MatchesCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU";
  Context cpu_ctx, gpu_ctx(Device::cuda(0));
  for (DType dt : {DType::Float32, DType::BFloat16}) {
    const int64_t n = 5, cols = 50304, vocab = 50257;
    Tensor logits = testing::random_tensor({n, cols}, 7, 4.0f, dt);
    std::vector<float> host = logits.to_floats();
    host[size_t(2 * cols + 50300)] = 1e4f;  // a maximum in the padding: ignored
    host[size_t(3 * cols + 11)] = host[size_t(3 * cols + 4000)] = 100.0f;  // a tie: the first column wins
    logits = Tensor::from_floats(host, {n, cols}, dt);
    auto run = [&](Context& ctx) {
      Tensor x = logits.to(ctx.device());
      Tensor am = Tensor::empty({n}, DType::Int64, ctx.device()), mx = Tensor::empty({n}, DType::Float32, ctx.device());
      Tensor ln = Tensor::empty({n}, DType::Int64, ctx.device());
      (ctx.device().is_cuda() ? cuda::logits_summary : cpu::logits_summary)(ctx, x, vocab, am, mx, ln);
      std::vector<double> norms;
      for (int64_t bits : ln.to_ints()) norms.push_back(std::bit_cast<double>(bits));
      return std::tuple{am.to_ints(), mx.to_floats(), norms};
    };
    const auto [am_c, mx_c, ln_c] = run(cpu_ctx);
    const auto [am_g, mx_g, ln_g] = run(gpu_ctx);
    EXPECT_EQ(am_g, am_c) << to_string(dt);
    EXPECT_EQ(am_c[3], 11);
    EXPECT_EQ(mx_g, mx_c);
    for (int64_t r = 0; r < n; ++r) EXPECT_NEAR(ln_g[size_t(r)], ln_c[size_t(r)], 1e-12) << "row " << r;
  }
}

}  // namespace
}  // namespace megatron

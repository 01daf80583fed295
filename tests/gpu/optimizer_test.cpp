// Optimizer ops on CUDA against the CPU reference: AdamW (with each model-param dtype, grad scaling,
// weight decay, bias correction on and off, aligned and unaligned views), grad_stats (sum of
// squares, zero count, inf/nan), scale_ in each float dtype.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <limits>
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



// A device copy, optionally starting one element into its allocation (no 16-byte alignment).
Tensor device_copy(const Tensor& host, bool unaligned) {
  if (!unaligned) return host.to(Device::cuda(0));
  Tensor big = Tensor::empty({host.numel() + 1}, host.dtype(), Device::cuda(0));
  Tensor view = big.flat_slice(1, host.numel()).view(host.shape());
  view.copy_from(host);
  return view;
}

class CudaOptimizer : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

struct AdamCase {
  int64_t n;
  bool has_model;
  DType model_dtype;
  bool unaligned;
  bool bias_correction;
};

void run_adam(const AdamCase& c, uint64_t seed) {
  SCOPED_TRACE("n=" + std::to_string(c.n) + " model=" + (c.has_model ? std::string(to_string(c.model_dtype)) : "none") +
               (c.unaligned ? " unaligned" : "") + (c.bias_correction ? "" : " no-bias-correction"));
  Context cpu_ctx;
  Context ctx(Device::cuda(0));
  Tensor p = random_tensor({c.n}, seed), m = random_tensor({c.n}, seed + 1, 0.1f);
  Tensor v = random_tensor({c.n}, seed + 2, 0.1f);
  {  // exp_avg_sq must be non-negative
    std::vector<float> vv = v.to_floats();
    for (float& x : vv) x = x * x;
    v = Tensor::from_floats(vv, {c.n});
  }
  Tensor dp = device_copy(p, c.unaligned), dm = device_copy(m, c.unaligned), dv = device_copy(v, c.unaligned);
  Tensor model_ref = c.has_model ? Tensor::empty({c.n}, c.model_dtype) : Tensor();
  Tensor model;
  if (c.has_model) {
    model = device_copy(Tensor::empty({c.n}, c.model_dtype), c.unaligned);
    model.fill_(kNaN);
  }
  AdamHyperParams hp;
  hp.lr = 1e-2f;
  hp.weight_decay = 0.1f;
  hp.grad_scale = 0.5f;
  hp.bias_correction = c.bias_correction;
  for (int64_t step = 1; step <= 3; ++step) {
    hp.step = step;
    Tensor g = random_tensor({c.n}, seed + 10 * uint64_t(step));
    Tensor dg = device_copy(g, c.unaligned);
    cpu::adamw_step(cpu_ctx, p, g, m, v, hp, model_ref);
    cuda::adamw_step(ctx, dp, dg, dm, dv, hp, model);
  }
  ctx.synchronize();
  // Same operations in the same order, each rounded: expected to agree to the last bit.
  expect_close(dp, p, 1e-6, "main_param");
  expect_close(dm, m, 1e-6, "exp_avg");
  expect_close(dv, v, 1e-6, "exp_avg_sq");
  if (c.has_model) expect_close(model, model_ref, c.model_dtype == DType::Float32 ? 1e-6 : 1e-2, "model_param");
}

TEST_F(CudaOptimizer, AdamMatchesCpu) {
  uint64_t seed = 1;
  for (int64_t n : {1, 3, 4, 1001, 4099}) {
    for (bool unaligned : {false, true}) {
      run_adam({n, false, DType::Float32, unaligned, true}, seed += 100);
      for (DType dt : {DType::Float32, DType::BFloat16, DType::Float16}) {
        run_adam({n, true, dt, unaligned, true}, seed += 100);
      }
    }
  }
  run_adam({257, true, DType::BFloat16, false, false}, seed += 100);
  run_adam({1 << 20, true, DType::BFloat16, false, true}, seed += 100);
}

TEST_F(CudaOptimizer, AdamWithModelParamAliasingMain) {
  Context cpu_ctx;
  Context ctx(Device::cuda(0));
  const int64_t n = 515;
  Tensor p = random_tensor({n}, 5), g = random_tensor({n}, 6);
  Tensor m = Tensor::zeros({n}, DType::Float32), v = Tensor::zeros({n}, DType::Float32);
  Tensor dp = p.to(Device::cuda(0)), dg = g.to(Device::cuda(0));
  Tensor dm = m.to(Device::cuda(0)), dv = v.to(Device::cuda(0));
  AdamHyperParams hp;
  cpu::adamw_step(cpu_ctx, p, g, m, v, hp, p);
  cuda::adamw_step(ctx, dp, dg, dm, dv, hp, dp);
  ctx.synchronize();
  expect_close(dp, p, 1e-6, "main_param");
}

TEST_F(CudaOptimizer, GradStatsMatchesCpu) {
  Context cpu_ctx;
  Context ctx(Device::cuda(0));
  for (int64_t n : {1, 5, 1000, 4097, (1 << 20) + 3}) {
    for (bool unaligned : {false, true}) {
      SCOPED_TRACE("n=" + std::to_string(n) + (unaligned ? " unaligned" : ""));
      std::vector<float> vals = random_tensor({n}, uint64_t(n)).to_floats();
      for (int64_t i = 0; i < n; i += 7) vals[size_t(i)] = (i % 14 == 0) ? 0.0f : -0.0f;
      Tensor g = Tensor::from_floats(vals, {n});
      const GradStats want = cpu::grad_stats(cpu_ctx, g);
      const GradStats got = cuda::grad_stats(ctx, device_copy(g, unaligned));
      EXPECT_NEAR(got.sum_sq, want.sum_sq, 1e-12 * std::max(1.0, want.sum_sq));
      EXPECT_EQ(got.num_zeros, want.num_zeros);
      EXPECT_FALSE(got.found_inf_or_nan);
    }
  }
}

TEST_F(CudaOptimizer, GradStatsFindsInfAndNan) {
  Context ctx(Device::cuda(0));
  const int64_t n = 3001;
  for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(), kNaN}) {
    std::vector<float> vals = random_tensor({n}, 77).to_floats();
    vals[size_t(n - 2)] = bad;
    const GradStats got = cuda::grad_stats(ctx, Tensor::from_floats(vals, {n}).to(Device::cuda(0)));
    EXPECT_TRUE(got.found_inf_or_nan) << bad;
    EXPECT_FALSE(std::isfinite(got.sum_sq)) << bad;
  }
  const GradStats clean = cuda::grad_stats(ctx, random_tensor({n}, 78).to(Device::cuda(0)));
  EXPECT_FALSE(clean.found_inf_or_nan);
  EXPECT_TRUE(std::isfinite(clean.sum_sq));
}

TEST_F(CudaOptimizer, ScaleMatchesCpu) {
  Context cpu_ctx;
  Context ctx(Device::cuda(0));
  for (DType dt : {DType::Float32, DType::BFloat16, DType::Float16}) {
    for (int64_t n : {1, 7, 8, 1003, 65536}) {
      for (bool unaligned : {false, true}) {
        SCOPED_TRACE(std::string(to_string(dt)) + " n=" + std::to_string(n) + (unaligned ? " unaligned" : ""));
        Tensor x = random_tensor({n}, uint64_t(n) + 3, 1.0f, dt);
        Tensor dx = device_copy(x, unaligned);
        cpu::scale_(cpu_ctx, x, 0.37f);
        cuda::scale_(ctx, dx, 0.37f);
        ctx.synchronize();
        expect_close(dx, x, 0.0, "x");  // one multiply and one rounding: exact
      }
    }
  }
}

// Note [Multi-tensor AdamW]: adamw_step_multi equals adamw_step on each tensor bit for bit — over
// empty, tiny, odd-sized and unaligned tensors, more tensors and more chunks than one launch holds
// (a tensor split across launches), per-tensor weight decay, an fp32 parameter updated in place,
// and a copy-back dtype other than the first's (its own launch).
TEST_F(CudaOptimizer, MultiTensorEqualsPerTensorBitwise) {
  Context ctx(Device::cuda(0));
  struct Spec {
    int64_t n;
    DType model;  // Float32: the master is the parameter (no copy-back)
    bool unaligned;
  };
  std::vector<Spec> specs = {{0, DType::BFloat16, false}, {3, DType::BFloat16, false}, {5, DType::BFloat16, true},
                             {65536 + 7, DType::BFloat16, false}, {300001, DType::BFloat16, true},
                             {1000, DType::Float32, false}, {4096, DType::Float16, false}};
  for (int i = 0; i < 150; ++i) specs.push_back({17 + i, DType::BFloat16, i % 7 == 0});  // > one launch's tensors
  for (int i = 0; i < 36; ++i) specs.push_back({4 << 20, DType::BFloat16, false});      // > one launch's chunks
  AdamHyperParams hp;
  hp.lr = 3e-3f;
  hp.step = 7;
  hp.grad_scale = 0.5f;
  std::vector<AdamTensors> multi, single;
  uint64_t seed = 500;
  std::map<int64_t, std::vector<Tensor>> host;  // the big tensors share their values (drawn once)
  for (size_t k = 0; k < specs.size(); ++k) {
    const Spec& sp = specs[k];
    if (!host.count(sp.n) || sp.n < 100000) {
      Tensor v = random_tensor({sp.n}, seed + 3, 0.1f);
      std::vector<float> vv = v.to_floats();
      for (float& x : vv) x = x * x;
      host[sp.n] = {random_tensor({sp.n}, seed), random_tensor({sp.n}, seed + 1),
                    random_tensor({sp.n}, seed + 2, 0.1f), Tensor::from_floats(vv, {sp.n})};
      seed += 4;
    }
    const Tensor &p = host[sp.n][0], &g = host[sp.n][1], &m = host[sp.n][2], &v = host[sp.n][3];
    for (auto* list : {&multi, &single}) {
      AdamTensors t;
      t.main_param = device_copy(p, sp.unaligned);
      t.grad = device_copy(g, sp.unaligned);
      t.exp_avg = device_copy(m, sp.unaligned);
      t.exp_avg_sq = device_copy(v, sp.unaligned);
      t.model_param = sp.model == DType::Float32 ? t.main_param : device_copy(p.to(sp.model), sp.unaligned);
      t.weight_decay = k % 3 == 0 ? 0.0f : 0.1f;
      list->push_back(t);
    }
  }
  cuda::adamw_step_multi(ctx, multi, hp);
  for (AdamTensors& t : single) {
    AdamHyperParams h = hp;
    h.weight_decay = t.weight_decay;
    cuda::adamw_step(ctx, t.main_param, t.grad, t.exp_avg, t.exp_avg_sq, h, t.model_param);
  }
  ctx.synchronize();
  auto same = [](const Tensor& a, const Tensor& b) {
    const Tensor ha = a.to(Device::cpu()), hb = b.to(Device::cpu());
    return std::memcmp(ha.raw_data(), hb.raw_data(), ha.nbytes()) == 0;
  };
  for (size_t k = 0; k < specs.size(); ++k) {
    SCOPED_TRACE("tensor " + std::to_string(k) + " of " + std::to_string(specs[k].n));
    EXPECT_TRUE(same(multi[k].main_param, single[k].main_param));
    EXPECT_TRUE(same(multi[k].exp_avg, single[k].exp_avg));
    EXPECT_TRUE(same(multi[k].exp_avg_sq, single[k].exp_avg_sq));
    EXPECT_TRUE(same(multi[k].model_param, single[k].model_param));
  }
}

}  // namespace
}  // namespace megatron

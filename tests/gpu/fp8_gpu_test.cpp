// The FP8 ops on CUDA against the CPU reference: quantise (with transpose and amax), dequantise,
// current scaling, the delayed recipe over 20 steps and block quantisation bit for bit; the FP8
// GEMM (per-tensor and block scales, the linear layer's three forms) within fp32-accumulation
// tolerance of the CPU product of the same quantised operands.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "megatron/core/fp8_utils.h"
#include "megatron/core/tensor_parallel/fp8_linear.h"
#include "megatron/kernels/cpu/cpu_ops.h"
#include "megatron/kernels/cuda/cuda_ops.h"
#include "megatron/kernels/fp8_ops.h"
#include "megatron/runtime/allocator.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

using testing::expect_close;
using testing::random_tensor;

const Device kGpu = Device::cuda(0);

class CudaFp8 : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

bool is_nan_code(uint8_t b, DType t) {
  return t == DType::Float8E4M3 ? (b & 0x7f) == 0x7f : (b & 0x7f) > 0x7c;
}

// Byte-equal fp8 tensors; two NaN codes count as equal (the NaN's payload is not pinned).
void expect_same_codes(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  const Tensor g = got.to(Device::cpu());
  const uint8_t* a = static_cast<const uint8_t*>(g.raw_data());
  const uint8_t* b = static_cast<const uint8_t*>(want.raw_data());
  int64_t bad = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    if (a[i] == b[i] || (is_nan_code(a[i], got.dtype()) && is_nan_code(b[i], got.dtype()))) continue;
    if (bad++ < 5) ADD_FAILURE() << what << ": element " << i << " is 0x" << std::hex << int(a[i]) << ", CPU 0x" << int(b[i]);
  }
  EXPECT_EQ(bad, 0) << what;
}

// Bit-equal fp32 tensors (NaN equals NaN).
void expect_same_floats(const Tensor& got, const Tensor& want, const std::string& what) {
  const std::vector<float> g = got.to_floats(), w = want.to_floats();
  ASSERT_EQ(g.size(), w.size()) << what;
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::isnan(g[i]) && std::isnan(w[i])) continue;
    ASSERT_EQ(float_to_bits(g[i]), float_to_bits(w[i])) << what << " element " << i << ": " << g[i] << " vs " << w[i];
  }
}

// Random values over many binades, with the special values the formats treat specially.
Tensor hard_values(const Shape& shape, uint64_t seed, DType dtype) {
  Tensor r = random_tensor(shape, seed, 1.0f);
  std::vector<float> v = r.to_floats();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> special = {0.0f, -0.0f, 448.0f, 464.0f, 465.0f, -1e9f, inf, -inf, 57344.0f, 61440.0f,
                                      std::ldexp(1.0f, -10), std::ldexp(1.0f, -17), std::ldexp(3.0f, -11), 1.0625f,
                                      17.0f, std::numeric_limits<float>::quiet_NaN()};
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] = std::ldexp(v[i], int(i % 29) - 14);
    if (i % 53 == 7) v[i] = special[(i / 53) % special.size()];
  }
  return Tensor::from_floats(v, shape, dtype);
}

Tensor scalar(float v, Device d = Device::cpu()) { return Tensor::from_floats({v}, {1}, DType::Float32, d); }

TEST_F(CudaFp8, QuantizeTransposeAmaxBitEqualToCpu) {
  Context cpu, gpu(kGpu);
  const std::vector<Shape> shapes = {{37, 45}, {1, 7}, {256, 768}, {3, 5, 64}, {4099, 16}, {130, 200}};
  uint64_t seed = 1;
  for (DType xt : {DType::Float32, DType::BFloat16, DType::Float16}) {
    for (DType qt : {DType::Float8E4M3, DType::Float8E5M2}) {
      for (const Shape& shape : shapes) {
        SCOPED_TRACE(std::string(to_string(xt)) + " -> " + std::string(to_string(qt)) + " " + shape_str(shape));
        Tensor x = hard_values(shape, ++seed, xt);
        const int64_t k = shape.back(), m = x.numel() / k;
        for (float s : {1.0f, 3.7f, 1e-3f, 4096.0f}) {
          Tensor q = Tensor::empty(shape, qt), q_t = Tensor::empty({k, m}, qt);
          Tensor amax = scalar(0.25f), si = scalar(0.0f);
          cpu::fp8_quantize(cpu, x, scalar(s), q, q_t, amax, si);
          Tensor dq = Tensor::empty(shape, qt, kGpu), dq_t = Tensor::empty({k, m}, qt, kGpu);
          Tensor damax = scalar(0.25f, kGpu), dsi = scalar(0.0f, kGpu);
          Tensor dx = x.to(kGpu), ds = scalar(s, kGpu);
          cuda::fp8_quantize(gpu, dx, ds, dq, dq_t, damax, dsi);
          Tensor dq2 = Tensor::empty(shape, qt, kGpu), none;  // the flat kernel (no transpose)
          Tensor damax2 = scalar(0.25f, kGpu);  // accumulates into the same start as the CPU's
          cuda::fp8_quantize(gpu, dx, ds, dq2, none, damax2, none);
          Tensor dq_t2 = Tensor::empty({k, m}, qt, kGpu);  // the transposed copy alone
          cuda::fp8_quantize(gpu, dx, ds, none, dq_t2, none, none);
          gpu.synchronize();
          expect_same_codes(dq, q, "q");
          expect_same_codes(dq_t, q_t, "q_t");
          expect_same_codes(dq_t2, q_t, "q_t (alone)");
          expect_same_codes(dq2, q, "q (flat)");
          expect_same_floats(damax, amax, "amax");
          expect_same_floats(damax2, amax, "amax (flat)");
          expect_same_floats(dsi, si, "scale_inv");
          // dequantise, and amax alone
          Tensor out = Tensor::empty(shape, xt), dout = Tensor::empty(shape, xt, kGpu);
          cpu::fp8_dequantize(cpu, q, si, out);
          cuda::fp8_dequantize(gpu, dq, dsi, dout);
          Tensor a3 = scalar(9.0f), da3 = scalar(9.0f, kGpu);
          cpu::fp8_amax(cpu, x, a3);
          cuda::fp8_amax(gpu, dx, da3);
          gpu.synchronize();
          expect_same_floats(dout, out, "dequantised");
          expect_same_floats(da3, a3, "fp8_amax");
        }
      }
    }
  }
}

// The output gradient's pass (fp8_quantize_dbias): the codes, amax and scale inverse bit for bit,
// the column sums within fp32 rounding of the CPU's (row tiles, then the tiles in order), added to
// what dbias held; shapes the vector pass takes and ones it leaves to the fallback.
TEST_F(CudaFp8, QuantizeDbiasEqualsCpu) {
  Context cpu, gpu(kGpu);
  const std::vector<Shape> shapes = {{37, 45}, {256, 768}, {4099, 16}, {130, 200}, {2048, 1024}};
  uint64_t seed = 500;
  for (DType xt : {DType::Float32, DType::BFloat16}) {
    for (const Shape& shape : shapes) {
      SCOPED_TRACE(std::string(to_string(xt)) + " " + shape_str(shape));
      const int64_t m = shape[0], k = shape[1];
      const Tensor x = random_tensor(shape, ++seed, 2.0f, xt), dx = x.to(kGpu);
      const Tensor start = random_tensor({k}, ++seed, 1.0f);
      Tensor q = Tensor::empty(shape, DType::Float8E5M2), q_t = Tensor::empty({k, m}, DType::Float8E5M2);
      Tensor amax = scalar(0.0f), si = scalar(0.0f), db = start.clone();
      cpu::fp8_quantize_dbias(cpu, x, scalar(24.0f), q, q_t, amax, si, db);
      Tensor dq = Tensor::empty(shape, DType::Float8E5M2, kGpu), dq_t = Tensor::empty({k, m}, DType::Float8E5M2, kGpu);
      Tensor damax = scalar(0.0f, kGpu), dsi = scalar(0.0f, kGpu), ddb = start.to(kGpu);
      cuda::fp8_quantize_dbias(gpu, dx, scalar(24.0f, kGpu), dq, dq_t, damax, dsi, ddb);
      gpu.synchronize();
      expect_same_codes(dq, q, "q");
      expect_same_codes(dq_t, q_t, "q_t");
      expect_same_floats(damax, amax, "amax");
      expect_same_floats(dsi, si, "scale_inv");
      const std::vector<float> got = ddb.to(Device::cpu()).to_floats(), want = db.to_floats();
      const std::vector<float> xv = x.to_floats();
      for (int64_t c = 0; c < k; ++c) {
        double abs_sum = std::fabs(start.to_floats()[size_t(c)]);
        for (int64_t r = 0; r < m; ++r) abs_sum += std::fabs(xv[size_t(r * k + c)]);
        ASSERT_NEAR(got[size_t(c)], want[size_t(c)], 1e-6 * abs_sum + 1e-6) << "column " << c;
      }
    }
  }
}

// Note [Quantising inside the activation]: the fused pass equals the activation's kernel and then
// the quantisation on the GPU bit for bit — codes, transposed codes, amax, scale_inv and the column
// sums — for SwiGLU and GeLU, the vector passes and the shapes that fall back (bf16 with a width
// not a multiple of 8).
TEST_F(CudaFp8, QuantizeActivationBitEqualToTheUnfusedOps) {
  Context gpu(kGpu);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{37, 24}, {256, 768}, {130, 100}, {4096, 1792}};
  uint64_t seed = 900;
  for (Fp8Activation act : {Fp8Activation::Swiglu, Fp8Activation::Gelu}) {
    const bool swiglu = act == Fp8Activation::Swiglu;
    for (DType xt : {DType::Float32, DType::BFloat16}) {
      for (const auto& [m, f] : shapes) {
        for (bool gradient : {false, true}) {
          SCOPED_TRACE(std::string(swiglu ? "swiglu " : "gelu ") + std::string(to_string(xt)) + " m=" +
                       std::to_string(m) + " f=" + std::to_string(f) + (gradient ? " gradient" : " activation"));
          const int64_t width = swiglu ? 2 * f : f;
          const Tensor pre = random_tensor({m, width}, ++seed, 3.0f, xt).to(kGpu);
          const Tensor grad = gradient ? random_tensor({m, f}, ++seed, 0.5f, xt).to(kGpu) : Tensor();
          const int64_t k = gradient ? width : f;
          Tensor x = Tensor::empty({m, k}, xt, kGpu);
          if (swiglu && gradient) cuda::swiglu_backward(gpu, grad, pre, x);
          if (swiglu && !gradient) cuda::swiglu_forward(gpu, pre, x);
          if (!swiglu && gradient) cuda::gelu_backward(gpu, grad, pre, x);
          if (!swiglu && !gradient) cuda::gelu_forward(gpu, pre, x);
          const DType t = gradient ? DType::Float8E5M2 : DType::Float8E4M3;
          const Tensor start = random_tensor({k}, ++seed, 1.0f).to(kGpu);
          for (int outputs = 0; outputs < 3; ++outputs) {  // q and q_t (and dbias); q only; amax only
            Tensor q = outputs < 2 ? Tensor::empty({m, k}, t, kGpu) : Tensor();
            Tensor q_t = outputs == 0 ? Tensor::empty({k, m}, t, kGpu) : Tensor();
            Tensor q_ref = q.defined() ? Tensor::empty({m, k}, t, kGpu) : Tensor();
            Tensor q_t_ref = q_t.defined() ? Tensor::empty({k, m}, t, kGpu) : Tensor();
            Tensor amax = scalar(0.0f, kGpu), amax_ref = scalar(0.0f, kGpu), si = scalar(0.0f, kGpu),
                   si_ref = scalar(0.0f, kGpu);
            const bool sums = gradient && outputs == 0;
            Tensor db = sums ? start.clone() : Tensor(), db_ref = sums ? start.clone() : Tensor();
            const Tensor sc = scalar(16.0f, kGpu);
            cuda::fp8_quantize_activation(gpu, act, pre, grad, sc, q, q_t, amax, si, db);
            if (sums) {
              cuda::fp8_quantize_dbias(gpu, x, sc, q_ref, q_t_ref, amax_ref, si_ref, db_ref);
            } else {
              cuda::fp8_quantize(gpu, x, sc, q_ref, q_t_ref, amax_ref, si_ref);
            }
            gpu.synchronize();
            if (q.defined()) expect_same_codes(q, q_ref.to(Device::cpu()), "q");
            if (q_t.defined()) expect_same_codes(q_t, q_t_ref.to(Device::cpu()), "q_t");
            expect_same_floats(amax, amax_ref.to(Device::cpu()), "amax");
            expect_same_floats(si, si_ref.to(Device::cpu()), "scale_inv");
            if (sums) expect_same_floats(db, db_ref.to(Device::cpu()), "dbias");
          }
        }
      }
    }
  }
}

// Note [Grouped quantisation]: the grouped pass against the CPU reference (the loop of the single
// ops) bit for bit — codes, padded transposed copies, amaxes, scales and scale inverses — with given
// scales (recording the amax, or "again": recording nothing) and current scaling; 41 members (two
// launches of the table), one of a width the tile pass does not take (the single ops' fallback).
TEST_F(CudaFp8, QuantizeGroupedBitEqualToCpu) {
  Context cpu, gpu(kGpu);
  std::vector<std::pair<int64_t, int64_t>> shapes = {{37, 128}, {64, 256}, {5, 64}, {130, 40}, {3, 45}, {300, 2048}};
  for (int i = 0; i < 35; ++i) shapes.push_back({1 + 7 * i % 50, 16 * (1 + i % 5)});
  for (DType xt : {DType::Float32, DType::BFloat16}) {
    for (int mode = 0; mode < 3; ++mode) {  // 0 given scales with amax, 1 again, 2 current scaling
      for (int outputs = 0; outputs < 3; ++outputs) {  // q and q_t, q alone, q_t alone
        const DType qt = mode == 1 ? DType::Float8E5M2 : DType::Float8E4M3;
        SCOPED_TRACE(std::string(to_string(xt)) + " mode " + std::to_string(mode) + " outputs " + std::to_string(outputs));
        std::vector<Tensor> x, s, q, q_t, amax, si, dx, ds, dq, dq_t, damax, dsi;
        for (size_t i = 0; i < shapes.size(); ++i) {
          const auto [m, k] = shapes[i];
          const int64_t p = (m + 15) / 16 * 16 + (i % 3 == 0 ? 16 : 0);
          x.push_back(hard_values({m, k}, 500 + i, xt));
          dx.push_back(x.back().to(kGpu));
          s.push_back(scalar(0.25f * float(1 + i % 7)));
          ds.push_back(s.back().to(kGpu));
          if (outputs != 2) {
            q.push_back(Tensor::empty({m, k}, qt));
            dq.push_back(Tensor::empty({m, k}, qt, kGpu));
          }
          if (outputs != 1) {
            q_t.push_back(Tensor::empty({k, p}, qt));
            dq_t.push_back(Tensor::empty({k, p}, qt, kGpu));
          }
          if (mode != 1) {
            amax.push_back(scalar(0.5f));
            damax.push_back(scalar(0.5f, kGpu));
            si.push_back(scalar(0.0f));
            dsi.push_back(scalar(0.0f, kGpu));
          }
        }
        cpu::fp8_quantize_grouped(cpu, x, s, q, q_t, amax, si, mode == 2, fp8_max_of(qt));
        cuda::fp8_quantize_grouped(gpu, dx, ds, dq, dq_t, damax, dsi, mode == 2, fp8_max_of(qt));
        gpu.synchronize();
        for (size_t i = 0; i < shapes.size(); ++i) {
          const std::string at = "member " + std::to_string(i);
          if (!q.empty()) expect_same_codes(dq[i], q[i], at + " q");
          if (!q_t.empty()) expect_same_codes(dq_t[i], q_t[i], at + " q_t");
          if (!amax.empty()) expect_same_floats(damax[i], amax[i], at + " amax");
          if (!si.empty()) expect_same_floats(dsi[i], si[i], at + " scale_inv");
          expect_same_floats(ds[i], s[i], at + " scale");
        }
      }
    }
  }
}

// fp8_delayed_scale_update_grouped on CUDA: 130 states (two launches) of 1 to 3 tensors each, some
// tensors unseen, equal to the CPU's update of each.
TEST_F(CudaFp8, GroupedDelayedUpdateEqualToCpu) {
  Context cpu, gpu(kGpu);
  for (bool use_max : {false, true}) {
    std::vector<Tensor> h, s, dh, ds;
    for (int i = 0; i < 130; ++i) {
      const int64_t n = 1 + i % 3, len = 1 + i % 4;
      std::vector<float> hv = random_tensor({len, n}, 700 + i, 100.0f).to_floats();
      for (size_t j = 0; j < hv.size(); ++j) hv[j] = (i + int(j)) % 5 == 0 ? 0.0f : std::fabs(hv[j]);
      h.push_back(Tensor::from_floats(hv, {len, n}));
      s.push_back(random_tensor({n}, 900 + i, 3.0f));
      dh.push_back(h.back().to(kGpu));
      ds.push_back(s.back().to(kGpu));
    }
    Fp8DelayedParams p;
    p.fp8_max = 57344.0f;
    p.margin = 1;
    p.use_max = use_max;
    cpu::fp8_delayed_scale_update_grouped(cpu, h, s, p);
    cuda::fp8_delayed_scale_update_grouped(gpu, dh, ds, p);
    gpu.synchronize();
    for (size_t i = 0; i < h.size(); ++i) {
      expect_same_floats(dh[i], h[i], "history " + std::to_string(i));
      expect_same_floats(ds[i], s[i], "scale " + std::to_string(i));
    }
  }
}

TEST_F(CudaFp8, ScaleFromAmaxBitEqualToCpu) {
  Context cpu, gpu(kGpu);
  const float inf = std::numeric_limits<float>::infinity();
  Tensor amax = Tensor::from_floats({0.0f, inf, std::nanf(""), 1e-39f, 3.0f, 448.0f, 1000.0f, 7.3e-5f, 1.1f}, {9});
  for (float fp8_max : {448.0f, 57344.0f}) {
    for (bool pow2 : {false, true}) {
      Tensor s = Tensor::empty({9}, DType::Float32), si = Tensor::empty({9}, DType::Float32);
      Tensor ds = Tensor::empty({9}, DType::Float32, kGpu), dsi = Tensor::empty({9}, DType::Float32, kGpu);
      cpu::fp8_scale_from_amax(cpu, amax, fp8_max, pow2, s, si);
      Tensor damax = amax.to(kGpu);
      cuda::fp8_scale_from_amax(gpu, damax, fp8_max, pow2, ds, dsi);
      gpu.synchronize();
      expect_same_floats(ds, s, "scale");
      expect_same_floats(dsi, si, "scale_inv");
    }
  }
}

// 20 steps of a recipe on both backends from the same tensors: every step's history, scales,
// scale inverses and codes equal.
void run_recipe(Fp8Recipe recipe, int len, bool use_max, int margin, DType dtype) {
  SCOPED_TRACE(to_string(recipe) + " L=" + std::to_string(len) + (use_max ? " max" : " most_recent"));
  Context cpu, gpu(kGpu);
  Fp8Config c;
  c.format = "hybrid";
  c.recipe = recipe;
  c.amax_history_len = len;
  c.amax_compute_max = use_max;
  c.margin = margin;
  const int64_t n = 3;
  Fp8TensorScaling on_cpu(c, n, dtype, Device::cpu()), on_gpu(c, n, dtype, kGpu);
  for (int step = 0; step < 20; ++step) {
    for (int64_t i = 0; i < n; ++i) {
      // ranges that drift, jump and (for tensor 2 at some steps) vanish
      float range = std::ldexp(1.0f, int((step * (i + 1)) % 11) - 5);
      Tensor x = random_tensor({48, 64}, uint64_t(1000 + step * 10 + i), range, DType::BFloat16);
      if (i == 2 && step % 7 == 3) x = Tensor::zeros({48, 64}, DType::BFloat16);
      Tensor q = Tensor::empty({48, 64}, dtype), q_t = Tensor::empty({64, 48}, dtype);
      Tensor dq = Tensor::empty({48, 64}, dtype, kGpu), dq_t = Tensor::empty({64, 48}, dtype, kGpu);
      on_cpu.quantize(cpu, i, x, q, q_t);
      Tensor dx = x.to(kGpu);
      on_gpu.quantize(gpu, i, dx, dq, dq_t);
      gpu.synchronize();
      const std::string at = "step " + std::to_string(step) + " tensor " + std::to_string(i);
      expect_same_codes(dq, q, at + " q");
      expect_same_codes(dq_t, q_t, at + " q_t");
    }
    on_cpu.update(cpu);
    on_gpu.update(gpu);
    gpu.synchronize();
    const std::string at = "after step " + std::to_string(step);
    expect_same_floats(on_gpu.scales(), on_cpu.scales(), at + " scales");
    if (recipe == Fp8Recipe::Delayed) expect_same_floats(on_gpu.amax_history(), on_cpu.amax_history(), at + " history");
    for (int64_t i = 0; i < n; ++i) expect_same_floats(on_gpu.scale_inv(i), on_cpu.scale_inv(i), at + " scale_inv");
  }
}

TEST_F(CudaFp8, DelayedRecipeTwentyStepsEqualToCpu) {
  run_recipe(Fp8Recipe::Delayed, 1, false, 0, DType::Float8E4M3);
  run_recipe(Fp8Recipe::Delayed, 16, true, 0, DType::Float8E4M3);
  run_recipe(Fp8Recipe::Delayed, 8, false, 1, DType::Float8E5M2);
  run_recipe(Fp8Recipe::Delayed, 1024, true, 2, DType::Float8E5M2);
}

TEST_F(CudaFp8, CurrentScalingTwentyStepsEqualToCpu) {
  run_recipe(Fp8Recipe::Tensorwise, 1, false, 0, DType::Float8E4M3);
  run_recipe(Fp8Recipe::Tensorwise, 1, false, 0, DType::Float8E5M2);
}

TEST_F(CudaFp8, BlockQuantizeBitEqualToCpu) {
  Context cpu, gpu(kGpu);
  const std::vector<Shape> shapes = {{130, 300}, {128, 128}, {256, 1024}, {1, 5}, {515, 130}};
  uint64_t seed = 50;
  for (DType xt : {DType::BFloat16, DType::Float32}) {
    for (DType qt : {DType::Float8E4M3, DType::Float8E5M2}) {
      for (const Shape& shape : shapes) {
        for (bool tile_2d : {false, true}) {
          for (bool pow2 : {true, false}) {
            SCOPED_TRACE(shape_str(shape) + (tile_2d ? " 128x128" : " 1x128") + (pow2 ? " pow2 " : " fp32 ") +
                         std::string(to_string(xt)) + " -> " + std::string(to_string(qt)));
            Tensor x = hard_values(shape, ++seed, xt);
            const Shape ss = fp8_block_scale_shape(shape[0], shape[1], tile_2d);
            Tensor q = Tensor::empty(shape, qt), si = Tensor::zeros(ss, DType::Float32);
            Tensor dq = Tensor::empty(shape, qt, kGpu), dsi = Tensor::zeros(ss, DType::Float32, kGpu);
            cpu::fp8_block_quantize(cpu, x, tile_2d, pow2, q, si);
            Tensor dx = x.to(kGpu);
            cuda::fp8_block_quantize(gpu, dx, tile_2d, pow2, dq, dsi);
            gpu.synchronize();
            expect_same_codes(dq, q, "q");
            expect_same_floats(dsi, si, "scale_inv");
          }
        }
      }
    }
  }
}

// The transposing 1x128 quantisation (the weight gradient's operands) against the CPU's transpose
// and block quantisation: partial tiles both ways, the wide and the byte stores of q_t.
TEST_F(CudaFp8, BlockQuantizeTransposedBitEqualToCpu) {
  Context cpu, gpu(kGpu);
  const std::vector<Shape> shapes = {{130, 300}, {128, 128}, {4096, 1024}, {1, 5}, {515, 130}, {8192, 64}};
  uint64_t seed = 80;
  for (DType xt : {DType::BFloat16, DType::Float32}) {
    for (DType qt : {DType::Float8E4M3, DType::Float8E5M2}) {
      for (const Shape& shape : shapes) {
        for (bool pow2 : {true, false}) {
          SCOPED_TRACE(shape_str(shape) + (pow2 ? " pow2 " : " fp32 ") + std::string(to_string(xt)) + " -> " +
                       std::string(to_string(qt)));
          const Tensor x = hard_values(shape, ++seed, xt);
          const Shape t{shape[1], shape[0]}, ss = fp8_block_scale_shape(shape[1], shape[0], false);
          Tensor q = Tensor::empty(t, qt), si = Tensor::zeros(ss, DType::Float32);
          Tensor dq = Tensor::empty(t, qt, kGpu), dsi = Tensor::zeros(ss, DType::Float32, kGpu);
          cpu::fp8_block_quantize_transposed(cpu, x, pow2, q, si);
          cuda::fp8_block_quantize_transposed(gpu, x.to(kGpu), pow2, dq, dsi);
          gpu.synchronize();
          expect_same_codes(dq, q, "q_t");
          expect_same_floats(dsi, si, "scale_inv");
        }
      }
    }
  }
}

// The shard ops of --fp8-param-gather's blockwise recipe (fp8_block_partial_amax /
// fp8_block_partial_quantize) on shards cut anywhere in weights with partial tiles: the tile amaxes
// and the codes equal the CPU's bit for bit.
TEST_F(CudaFp8, BlockPartialShardsBitEqualToCpu) {
  Context cpu, gpu(kGpu);
  uint64_t seed = 90;
  for (DType xt : {DType::Float32, DType::BFloat16}) {
    for (const Shape& shape : std::vector<Shape>{{300, 200}, {128, 4096}, {1000, 130}, {5, 7}}) {
      const int64_t n = shape[0] * shape[1], cols = shape[1];
      const Shape grid{(shape[0] + 127) / 128 + 3, (cols + 127) / 128 + 3};
      const Tensor w = hard_values(shape, ++seed, xt).view({-1}), dw = w.to(kGpu);
      // ascending cuts (a shard may be empty: a small weight's last ranks hold none of it)
      std::vector<int64_t> cuts = {0, n / 3, n / 3 + 1, std::max(n / 3 + 1, n - 129), n};
      for (size_t i = 0; i + 1 < cuts.size(); ++i) {
        const int64_t start = cuts[i], len = cuts[i + 1] - cuts[i];
        SCOPED_TRACE(shape_str(shape) + " " + std::string(to_string(xt)) + " shard " + std::to_string(start) + "+" +
                     std::to_string(len));
        Tensor amax = Tensor::zeros(grid, DType::Float32), damax = Tensor::zeros(grid, DType::Float32, kGpu);
        cpu::fp8_block_partial_amax(cpu, w.flat_slice(start, len), start, cols, amax);
        cuda::fp8_block_partial_amax(gpu, dw.flat_slice(start, len), start, cols, damax);
        gpu.synchronize();
        expect_same_floats(damax, amax, "tile amax");
        Tensor scale = Tensor::empty(grid, DType::Float32);
        Tensor none;
        cpu::fp8_scale_from_amax(cpu, amax, 448.0f, true, scale, none);
        Tensor q = Tensor::empty({len}, DType::Float8E4M3), dq = Tensor::empty({len}, DType::Float8E4M3, kGpu);
        cpu::fp8_block_partial_quantize(cpu, w.flat_slice(start, len), start, cols, scale, q);
        cuda::fp8_block_partial_quantize(gpu, dw.flat_slice(start, len), start, cols, scale.to(kGpu), dq);
        gpu.synchronize();
        expect_same_codes(dq, q, "q");
      }
    }
  }
}

Fp8Operand quantized_operand(Context& ctx, const Tensor& x, Fp8ScaleMode mode, DType t, float scale) {
  Fp8Operand o;
  o.mode = mode;
  o.data = Tensor::empty(x.shape(), t);
  if (mode == Fp8ScaleMode::Tensor) {
    o.scale_inv = scalar(0.0f);
    Tensor none;
    cpu::fp8_quantize(ctx, x, scalar(scale), o.data, none, none, o.scale_inv);
  } else {
    o.scale_inv = Tensor::zeros(fp8_block_scale_shape(x.size(0), x.size(1), mode == Fp8ScaleMode::Block128x128),
                                DType::Float32);
    cpu::fp8_block_quantize(ctx, x, mode == Fp8ScaleMode::Block128x128, true, o.data, o.scale_inv);
  }
  return o;
}

Fp8Operand to_gpu(const Fp8Operand& o) { return {o.data.to(kGpu), o.scale_inv.to(kGpu), o.mode}; }

struct GemmCase {
  int64_t m, n, k;
  DType ta, tb, out;
  Fp8ScaleMode ma = Fp8ScaleMode::Tensor, mb = Fp8ScaleMode::Tensor;
  bool accumulate = false;
  bool bias = false;
  DType bias_type = DType::BFloat16;
  bool fast_accumulation = false;
};

void run_gemm(const GemmCase& g, uint64_t seed) {
  SCOPED_TRACE("m=" + std::to_string(g.m) + " n=" + std::to_string(g.n) + " k=" + std::to_string(g.k) + " " +
               std::string(to_string(g.ta)) + " x " + std::string(to_string(g.tb)) + " -> " +
               std::string(to_string(g.out)) + " modes " + std::to_string(int(g.ma)) + "," + std::to_string(int(g.mb)) +
               (g.accumulate ? " accumulate" : "") + (g.bias ? " bias" : "") +
               (g.fast_accumulation ? " fast accumulation" : ""));
  Context cpu, gpu(kGpu);
  Tensor xa = random_tensor({g.m, g.k}, seed, 1.5f), xb = random_tensor({g.n, g.k}, seed + 1, 0.7f);
  const Fp8Operand a = quantized_operand(cpu, xa, g.ma, g.ta, 40.0f), b = quantized_operand(cpu, xb, g.mb, g.tb, 90.0f);
  Tensor init = random_tensor({g.m, g.n}, seed + 2, 1.0f, g.out);
  Tensor bias = random_tensor({g.n}, seed + 3, 1.0f, g.bias_type);
  Tensor want = init.clone();
  cpu::fp8_gemm(cpu, a, b, g.bias ? bias : Tensor(), want, g.accumulate, false);
  Tensor got = init.to(kGpu);
  Tensor dbias = g.bias ? bias.to(kGpu) : Tensor();
  cuda::fp8_gemm(gpu, to_gpu(a), to_gpu(b), dbias, got, g.accumulate, g.fast_accumulation);
  gpu.synchronize();
  // Hopper's FP8 MMA keeps fewer accumulator bits than fp32 inside each K chunk before cuBLASLt
  // promotes the partial sum (Note [FP8 GEMM accumulation]): 1e-3 of the largest output for fp32,
  // bf16's own rounding for bf16. With fast accumulation (no promotion over the whole K) the
  // forward GEMM's rounding grows with K: 1e-2 for both.
  expect_close(got, want, g.out == DType::Float32 && !g.fast_accumulation ? 1e-3 : 1e-2, "fp8 gemm");
}

TEST_F(CudaFp8, PerTensorGemmMatchesCpuProduct) {
  uint64_t seed = 300;
  const DType e4 = DType::Float8E4M3, e5 = DType::Float8E5M2, f32 = DType::Float32, b16 = DType::BFloat16;
  for (auto [m, n, k] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {16, 16, 16}, {40, 24, 256}, {128, 256, 512}, {1000, 776, 1040}, {4096, 1024, 768}}) {
    for (auto [ta, tb] : std::vector<std::pair<DType, DType>>{{e4, e4}, {e5, e4}, {e4, e5}}) {
      run_gemm({m, n, k, ta, tb, b16}, seed += 3);
      run_gemm({m, n, k, ta, tb, f32}, seed += 3);
      run_gemm({m, n, k, ta, tb, f32, Fp8ScaleMode::Tensor, Fp8ScaleMode::Tensor, true}, seed += 3);
      run_gemm({m, n, k, ta, tb, b16, Fp8ScaleMode::Tensor, Fp8ScaleMode::Tensor, false, true}, seed += 3);
      run_gemm({m, n, k, ta, tb, b16, Fp8ScaleMode::Tensor, Fp8ScaleMode::Tensor, false, true, DType::Float32},
               seed += 3);
      run_gemm({m, n, k, ta, tb, f32, Fp8ScaleMode::Tensor, Fp8ScaleMode::Tensor, false, true}, seed += 3);
      // the linear layer's forward: fast accumulation, bf16 bias through the epilogue
      run_gemm({m, n, k, ta, tb, b16, Fp8ScaleMode::Tensor, Fp8ScaleMode::Tensor, false, true, DType::BFloat16, true},
               seed += 3);
      run_gemm({m, n, k, ta, tb, f32, Fp8ScaleMode::Tensor, Fp8ScaleMode::Tensor, false, false, DType::BFloat16,
                true},
               seed += 3);
    }
  }
}

TEST_F(CudaFp8, BlockScaledGemmMatchesCpuProduct) {
  uint64_t seed = 700;
  const DType e4 = DType::Float8E4M3, e5 = DType::Float8E5M2, f32 = DType::Float32, b16 = DType::BFloat16;
  const auto v = Fp8ScaleMode::Block1x128, t = Fp8ScaleMode::Block128x128;
  for (auto [m, n, k] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {128, 128, 128}, {256, 384, 512}, {136, 128, 384}, {2048, 1536, 1024}}) {
    run_gemm({m, n, k, e4, e4, b16, v, t}, seed += 3);           // forward: activations x weights
    run_gemm({m, n, k, e4, e4, b16, v, t, false, true}, seed += 3);  // with a bias
    run_gemm({m, n, k, e5, e4, b16, v, t}, seed += 3);           // grad_in: e5m2 gradients x weights
    run_gemm({m, n, k, e4, e4, f32, t, v}, seed += 3);
    run_gemm({m, n, k, e5, e4, f32, v, v, true}, seed += 3);     // weight gradient, accumulated
  }
}

// The linear layer's three GEMMs in FP8 (Note [FP8 GEMM layouts]) against the fp32 linear ops on
// the dequantised tensors: forward from x and W, grad_in from dy and the transposed weight copy,
// the weight gradient from the transposed copies of dy and x.
TEST_F(CudaFp8, LinearLayerFormsThroughTransposedCopies) {
  Context cpu, gpu(kGpu);
  const int64_t tokens = 256, in = 384, out = 512;
  Tensor x = random_tensor({tokens, in}, 1, 1.0f, DType::BFloat16), w = random_tensor({out, in}, 2, 0.05f, DType::BFloat16);
  Tensor dy = random_tensor({tokens, out}, 3, 1e-3f, DType::BFloat16);
  auto quant = [&](const Tensor& t, DType qt, float s, Tensor& q, Tensor& q_t, Tensor& si) {
    q = Tensor::empty(t.shape(), qt, kGpu);
    q_t = Tensor::empty({t.size(1), t.size(0)}, qt, kGpu);
    si = scalar(0.0f, kGpu);
    Tensor none, dt = t.to(kGpu), ds = scalar(s, kGpu);
    cuda::fp8_quantize(gpu, dt, ds, q, q_t, none, si);
  };
  Tensor qx, qx_t, sx, qw, qw_t, sw, qdy, qdy_t, sdy;
  quant(x, DType::Float8E4M3, 64.0f, qx, qx_t, sx);
  quant(w, DType::Float8E4M3, 2048.0f, qw, qw_t, sw);
  quant(dy, DType::Float8E5M2, 16384.0f, qdy, qdy_t, sdy);
  Tensor y = Tensor::empty({tokens, out}, DType::BFloat16, kGpu), dx = Tensor::empty({tokens, in}, DType::BFloat16, kGpu);
  Tensor dw = Tensor::zeros({out, in}, DType::Float32, kGpu);
  Tensor none;
  cuda::fp8_gemm(gpu, {qx, sx}, {qw, sw}, none, y, false, false);
  cuda::fp8_gemm(gpu, {qdy, sdy}, {qw_t, sw}, none, dx, false, false);
  cuda::fp8_gemm(gpu, {qdy_t, sdy}, {qx_t, sx}, none, dw, true, false);
  // the fp32 reference on the dequantised tensors
  auto deq = [&](const Tensor& q, const Tensor& si) {
    Tensor o = Tensor::empty(q.shape(), DType::Float32, kGpu);
    cuda::fp8_dequantize(gpu, q, si, o);
    return o;
  };
  Tensor fx = deq(qx, sx).to(Device::cpu()), fw = deq(qw, sw).to(Device::cpu()), fdy = deq(qdy, sdy).to(Device::cpu());
  gpu.synchronize();
  Tensor y_ref = Tensor::empty({tokens, out}, DType::Float32), dx_ref = Tensor::empty({tokens, in}, DType::Float32);
  Tensor dw_ref = Tensor::zeros({out, in}, DType::Float32);
  cpu::linear_forward(cpu, fx, fw, none, y_ref);
  cpu::linear_backward(cpu, fdy, fx, fw, dx_ref, dw_ref, none);
  expect_close(y, y_ref, 1e-2, "forward");
  expect_close(dx, dx_ref, 1e-2, "grad_in");
  expect_close(dw, dw_ref, 1e-3, "weight_grad");
}

// One FP8 linear layer's state on both backends over 3 steps (the delayed recipe's scales moving):
// forward, input and weight gradients within the GEMM tolerance of the CPU's, scales equal.
void run_fp8_linear(Fp8Recipe recipe, const std::string& format) {
  SCOPED_TRACE(to_string(recipe) + " " + format);
  Context cpu, gpu(kGpu);
  Fp8Config c;
  c.format = format;
  c.recipe = recipe;
  const int64_t tokens = 512, in = 768, out = 1024;
  Fp8LinearState on_cpu(c, Device::cpu()), on_gpu(c, kGpu);
  const Tensor w = random_tensor({out, in}, 7, 0.02f, DType::BFloat16), b = random_tensor({out}, 8, 0.1f, DType::BFloat16);
  const Tensor dw = w.to(kGpu), db = b.to(kGpu);
  Tensor wg = Tensor::zeros({out, in}, DType::Float32), bg = Tensor::zeros({out}, DType::Float32);
  Tensor dwg = wg.to(kGpu), dbg = bg.to(kGpu);
  for (int step = 0; step < 3; ++step) {
    const Tensor x = random_tensor({tokens, in}, uint64_t(20 + step), float(step + 1), DType::BFloat16);
    const Tensor dy = random_tensor({tokens, out}, uint64_t(30 + step), 1e-3f, DType::BFloat16);
    Tensor y = Tensor::empty({tokens, out}, DType::BFloat16), gx = Tensor::empty({tokens, in}, DType::BFloat16);
    Tensor dy_out = Tensor::empty({tokens, out}, DType::BFloat16, kGpu), dgx = Tensor::empty({tokens, in}, DType::BFloat16, kGpu);
    on_cpu.forward(cpu, x, w, b, y);
    on_cpu.backward(cpu, dy, x, w, gx, wg, bg);
    const Tensor dx = x.to(kGpu), ddy = dy.to(kGpu);
    on_gpu.forward(gpu, dx, dw, db, dy_out);
    on_gpu.backward(gpu, ddy, dx, dw, dgx, dwg, dbg);
    gpu.synchronize();
    const std::string at = "step " + std::to_string(step);
    expect_close(dy_out, y, 1e-2, at + " y");
    expect_close(dgx, gx, 1e-2, at + " grad_in");
    expect_close(dwg, wg, 1e-3, at + " weight_grad");
    expect_close(dbg, bg, 1e-3, at + " bias_grad");
    on_cpu.update(cpu);
    on_gpu.update(gpu);
    gpu.synchronize();
    if (recipe != Fp8Recipe::Blockwise) {
      expect_same_floats(on_gpu.forward_scaling().scales(), on_cpu.forward_scaling().scales(), at + " forward scales");
      expect_same_floats(on_gpu.backward_scaling().scales(), on_cpu.backward_scaling().scales(), at + " backward scales");
    }
  }
}

TEST_F(CudaFp8, LinearLayerStateEqualsCpu) {
  for (Fp8Recipe r : {Fp8Recipe::Delayed, Fp8Recipe::Tensorwise, Fp8Recipe::Blockwise}) {
    for (const char* f : {"e4m3", "hybrid"}) run_fp8_linear(r, f);
  }
}

}  // namespace
}  // namespace megatron

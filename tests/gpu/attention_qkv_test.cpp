// Attention read from the fused MHA QKV buffer on CUDA (attention_forward_qkv /
// attention_backward_qkv) against the CPU reference (split + attention + merge):
//  * fp32: the split copies and the row-wise kernels, dropout mask included;
//  * bf16/fp16: cuDNN on strided views of the buffer (support asserted for the model's shapes),
//    odd shapes (whatever path they take), a head size cuDNN declines, an unaligned buffer;
//  * dropout on cuDNN: the same mask as the split path's cuDNN graph, a backward consistent with its
//    forward (Σ dO∘O = Σ V∘dV per batch and head), deterministic in (seed, offset), lse unchanged.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
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

constexpr uint64_t kSeed = 2025, kOffset = 11;

#define SKIP_WITHOUT_GPU()                                                  \
  do {                                                                      \
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible"; \
  } while (0)

struct Dims {
  int64_t s, b, nq, d;
  Shape heads() const { return {s, b, nq, d}; }
  Shape fused() const { return {s, b, 3 * nq * d}; }
  Shape lse() const { return {b, nq, s}; }
};

// Host inputs in the storage dtype: the fused buffer and the upstream gradient.
struct Inputs {
  Tensor qkv, grad_out;
};

Inputs make_inputs(const Dims& dm, DType dtype, uint64_t seed) {
  return {random_tensor(dm.fused(), seed, 1.0f, dtype), random_tensor(dm.heads(), seed + 1, 1.0f, dtype)};
}

struct Results {
  Tensor out, lse, grad_qkv;
};

// The CPU reference, outputs in fp32 (exact math on the stored inputs).
Results run_cpu(const Dims& dm, const Inputs& in, float scale, float p, const AttnMask& mask = AttnMask::causal()) {
  Context cpu;
  Results r{Tensor::empty(dm.heads(), DType::Float32), Tensor::empty(dm.lse(), DType::Float32),
            Tensor::empty(dm.fused(), DType::Float32)};
  cpu::attention_forward_qkv(cpu, in.qkv, mask, scale, p, kSeed, kOffset, r.out, r.lse);
  cpu::attention_backward_qkv(cpu, in.grad_out, in.qkv, r.out, r.lse, mask, scale, p, kSeed, kOffset, r.grad_qkv);
  return r;
}

Tensor poisoned(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype, Device::cuda(0));
  t.fill_(kNaN);
  return t;
}

// Forward then backward through the fused ops on the device, outputs poisoned with NaN first.
// (mask: its cu_seqlens on the device.)
Results run_gpu(Context& ctx, const Dims& dm, const Tensor& qkv, const Tensor& grad_out, float scale, float p,
                uint64_t seed = kSeed, uint64_t offset = kOffset, const AttnMask& mask = AttnMask::causal()) {
  const DType dt = qkv.dtype();
  Results r{poisoned(dm.heads(), dt), poisoned(dm.lse(), DType::Float32), poisoned(dm.fused(), dt)};
  cuda::attention_forward_qkv(ctx, qkv, mask, scale, p, seed, offset, r.out, r.lse);
  cuda::attention_backward_qkv(ctx, grad_out, qkv, r.out, r.lse, mask, scale, p, seed, offset, r.grad_qkv);
  ctx.synchronize();
  return r;
}

Results run_gpu(Context& ctx, const Dims& dm, const Inputs& in, float scale, float p, uint64_t seed = kSeed,
                uint64_t offset = kOffset) {
  const Device dev = Device::cuda(0);
  return run_gpu(ctx, dm, in.qkv.to(dev), in.grad_out.to(dev), scale, p, seed, offset);
}

// The same attention on the device through the split copies and the separate-tensor ops (the path
// SelfAttention took before the fused ops, and still takes for GQA and RoPE).
Results run_gpu_split(Context& ctx, const Dims& dm, const Inputs& in, float scale, float p) {
  const Device dev = Device::cuda(0);
  const DType dt = in.qkv.dtype();
  const Tensor qkv = in.qkv.to(dev), grad_out = in.grad_out.to(dev);
  Tensor q = Tensor::empty(dm.heads(), dt, dev), k = Tensor::empty(dm.heads(), dt, dev),
         v = Tensor::empty(dm.heads(), dt, dev);
  cuda::qkv_split_forward(ctx, qkv, q, k, v);
  Results r{poisoned(dm.heads(), dt), poisoned(dm.lse(), DType::Float32), poisoned(dm.fused(), dt)};
  cuda::attention_forward(ctx, q, k, v, AttnMask::causal(), scale, p, kSeed, kOffset, r.out, r.lse);
  Tensor gq = poisoned(dm.heads(), dt), gk = poisoned(dm.heads(), dt), gv = poisoned(dm.heads(), dt);
  cuda::attention_backward(ctx, grad_out, q, k, v, r.out, r.lse, AttnMask::causal(), scale, p, kSeed, kOffset, gq, gk,
                           gv);
  cuda::qkv_split_backward(ctx, gq, gk, gv, r.grad_qkv);
  ctx.synchronize();
  return r;
}

// Errors are measured against at least 0.05 (inputs are O(1)): with one key (s = 1) the q and k
// gradients are zero in exact arithmetic and both sides hold only rounding noise.
void expect_results_close(const Results& got, const Results& want, double tol, double lse_tol) {
  expect_close(got.out, want.out, tol, "out", 0.05);
  expect_close(got.lse, want.lse, lse_tol, "lse", 0.05);
  expect_close(got.grad_qkv, want.grad_qkv, tol, "grad_qkv", 0.05);
}

std::string dims_name(const Dims& dm) {
  return "s" + std::to_string(dm.s) + "_b" + std::to_string(dm.b) + "_nq" + std::to_string(dm.nq) + "_d" +
         std::to_string(dm.d);
}

// ---- fp32: split copies + row-wise kernels, the CPU's dropout mask --------------------------------

struct Fp32Case {
  Dims dims;
  float dropout_p;
};

class AttentionQkvFp32 : public ::testing::TestWithParam<Fp32Case> {};

TEST_P(AttentionQkvFp32, MatchesCpu) {
  SKIP_WITHOUT_GPU();
  const Fp32Case& c = GetParam();
  const Inputs in = make_inputs(c.dims, DType::Float32, 7);
  const float scale = 1.0f / std::sqrt(float(c.dims.d));
  Context ctx(Device::cuda(0));
  expect_results_close(run_gpu(ctx, c.dims, in, scale, c.dropout_p), run_cpu(c.dims, in, scale, c.dropout_p), 1e-4,
                       1e-5);
}

std::vector<Fp32Case> fp32_cases() {
  std::vector<Fp32Case> cases;
  for (Dims dm : {Dims{1, 1, 1, 16}, Dims{7, 3, 3, 24}, Dims{128, 2, 4, 64}, Dims{33, 2, 2, 20}})
    for (float p : {0.0f, 0.2f}) cases.push_back({dm, p});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionQkvFp32, ::testing::ValuesIn(fp32_cases()), [](const auto& info) {
  return dims_name(info.param.dims) + (info.param.dropout_p > 0 ? "_dropout" : "");
});

// ---- bf16, fp16: cuDNN on the strided views -----------------------------------------------------------

struct HalfCase {
  DType dtype;
  Dims dims;
  bool require_cudnn;  // the model's shapes: cuDNN must take the strided views
};

class AttentionQkvHalf : public ::testing::TestWithParam<HalfCase> {};

TEST_P(AttentionQkvHalf, MatchesCpu) {
  SKIP_WITHOUT_GPU();
  const HalfCase& c = GetParam();
  const Inputs in = make_inputs(c.dims, c.dtype, 13);
  const float scale = 1.0f / std::sqrt(float(c.dims.d));
  Context ctx(Device::cuda(0));
  if (c.require_cudnn) {
    const Tensor qkv = in.qkv.to(Device::cuda(0));
    const Tensor out = Tensor::empty(c.dims.heads(), c.dtype, Device::cuda(0));
    for (bool backward : {false, true}) {
      const cuda::CudnnAttentionSupport support =
          cuda::cudnn_attention_qkv_support(ctx, qkv, out, AttnMask::causal(), scale, 0.0f, backward);
      ASSERT_TRUE(support.supported) << (backward ? "backward: " : "forward: ") << support.reason;
    }
  }
  expect_results_close(run_gpu(ctx, c.dims, in, scale, 0.0f), run_cpu(c.dims, in, scale, 0.0f), 2e-2, 1e-3);
}

std::vector<HalfCase> half_cases() {
  std::vector<HalfCase> cases;
  for (DType t : {DType::BFloat16, DType::Float16}) {
    for (Dims dm : {Dims{128, 2, 16, 64}, Dims{512, 2, 8, 128}, Dims{2048, 1, 4, 128}, Dims{1024, 2, 4, 64}})
      cases.push_back({t, dm, true});
    // Odd shapes: one token, odd lengths, batch and head counts; d = 20 is declined by cuDNN (the
    // split copies and the row-wise kernels run).
    for (Dims dm : {Dims{1, 1, 1, 64}, Dims{7, 3, 5, 64}, Dims{333, 3, 3, 128}, Dims{65, 2, 2, 20}})
      cases.push_back({t, dm, false});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionQkvHalf, ::testing::ValuesIn(half_cases()), [](const auto& info) {
  return std::string(to_string(info.param.dtype)) + "_" + dims_name(info.param.dims);
});

// The fused buffer one element past a 16-byte boundary: the op falls back to the split copies.
TEST(AttentionQkvUnaligned, FallsBackToTheSplitCopies) {
  SKIP_WITHOUT_GPU();
  const Dims dm{64, 2, 4, 64};
  const Inputs in = make_inputs(dm, DType::BFloat16, 19);
  const float scale = 0.125f;
  Context ctx(Device::cuda(0));
  const Device dev = Device::cuda(0);
  Tensor big = Tensor::empty({in.qkv.numel() + 1}, DType::BFloat16, dev);
  Tensor qkv = big.flat_slice(1, in.qkv.numel()).view(in.qkv.shape());
  qkv.copy_from(in.qkv);
  const Tensor grad_out = in.grad_out.to(dev);
  expect_results_close(run_gpu(ctx, dm, qkv, grad_out, scale, 0.0f), run_cpu(dm, in, scale, 0.0f), 2e-2, 1e-3);
  // With dropout the fused op takes the split copies (Note [Fused QKV and dropout]), which are
  // aligned, so the misaligned buffer works there too.
  Tensor out = poisoned(dm.heads(), DType::BFloat16), lse = poisoned(dm.lse(), DType::Float32);
  cuda::attention_forward_qkv(ctx, qkv, AttnMask::causal(), scale, 0.2f, kSeed, kOffset, out, lse);
  ctx.synchronize();
  for (float v : out.to_floats()) ASSERT_TRUE(std::isfinite(v));
}

// ---- dropout on cuDNN --------------------------------------------------------------------------------

// Per (batch, head): Σ_{i,c} dO∘O = Σ_{j,c} V∘dV, since O = P̃·V and dV = P̃ᵀ·dO. It holds only when
// the backward regenerates the forward's mask. Returns the worst mismatch relative to Σ |dO∘O|.
double forward_backward_mask_mismatch(const Dims& dm, const Results& r, const Tensor& qkv, const Tensor& grad_out) {
  const std::vector<float> o = r.out.to_floats(), go = grad_out.to_floats(), x = qkv.to_floats(),
                           gx = r.grad_qkv.to_floats();
  double worst = 0;
  for (int64_t bi = 0; bi < dm.b; ++bi)
    for (int64_t h = 0; h < dm.nq; ++h) {
      double lhs = 0, rhs = 0, mag = 0;
      for (int64_t i = 0; i < dm.s; ++i)
        for (int64_t c = 0; c < dm.d; ++c) {
          const size_t head = size_t(((i * dm.b + bi) * dm.nq + h) * dm.d + c);
          const size_t fused = size_t((i * dm.b + bi) * 3 * dm.nq * dm.d + h * 3 * dm.d + 2 * dm.d + c);  // v
          lhs += double(go[head]) * o[head];
          mag += std::fabs(double(go[head]) * o[head]);
          rhs += double(x[fused]) * gx[fused];
        }
      worst = std::max(worst, std::fabs(lhs - rhs) / std::max(mag, 1e-6));
    }
  return worst;
}

TEST(AttentionQkvCudnnDropout, SameMaskAsSplitPathAndConsistent) {
  SKIP_WITHOUT_GPU();
  const Dims dm{256, 2, 8, 64};
  const Inputs in = make_inputs(dm, DType::BFloat16, 37);
  const float scale = 0.125f, p = 0.2f;
  Context ctx(Device::cuda(0));
  const Device dev = Device::cuda(0);
  const Tensor qkv = in.qkv.to(dev), grad_out = in.grad_out.to(dev);
  {
    const Tensor out = Tensor::empty(dm.heads(), DType::BFloat16, dev);
    const cuda::CudnnAttentionSupport support =
        cuda::cudnn_attention_qkv_support(ctx, qkv, out, AttnMask::causal(), scale, p, false);
    ASSERT_TRUE(support.supported) << support.reason;
  }
  const Results a = run_gpu(ctx, dm, qkv, grad_out, scale, p);
  const Results again = run_gpu(ctx, dm, qkv, grad_out, scale, p);
  const Results other = run_gpu(ctx, dm, qkv, grad_out, scale, p, kSeed, kOffset + 1);
  const Results plain = run_gpu(ctx, dm, qkv, grad_out, scale, 0.0f);
  for (const Tensor* t : {&a.out, &a.lse, &a.grad_qkv}) {
    const std::vector<float> v = t->to_floats();
    for (size_t i = 0; i < v.size(); ++i)
      if (!std::isfinite(v[i])) {
        ADD_FAILURE() << t->str() << ": element " << i << " is " << v[i];
        break;
      }
  }
  EXPECT_TRUE(a.out.to_floats() == again.out.to_floats()) << "same (seed, offset), different output";
  EXPECT_TRUE(a.grad_qkv.to_floats() == again.grad_qkv.to_floats()) << "same (seed, offset), different gradient";
  EXPECT_FALSE(a.out.to_floats() == other.out.to_floats()) << "another offset gave the same dropout mask";
  expect_close(a.lse, plain.lse, 1e-5, "lse with dropout vs without");
  EXPECT_LE(forward_backward_mask_mismatch(dm, a, qkv, grad_out), 2e-2) << "backward mask differs from forward's";
  // Today's semantics (Note [Attention dropout on the GPU]): the stream is selected by (seed,
  // offset) alone, so the strided graph must draw the mask the split path's graph draws. A
  // different mask gives O(1) errors; a different engine only bf16 rounding.
  const Results split = run_gpu_split(ctx, dm, in, scale, p);
  expect_close(a.out, split.out, 2e-2, "out vs split path", 0.05);
  expect_close(a.lse, split.lse, 1e-5, "lse vs split path", 0.05);
  expect_close(a.grad_qkv, split.grad_qkv, 2e-2, "grad_qkv vs split path", 0.05);
}

}  // namespace
}  // namespace megatron

namespace megatron {
namespace {

// Documents on the fused buffer: cuDNN's ragged offsets over the strided views (Note [Documents on
// cuDNN]), against the CPU; the shared form, b = 1 (THD) and b = 2, an empty document included.
// And CausalWithOffset as the band's right bound over the same views.
TEST(AttentionQkvMasks, CudnnMatchesCpu) {
  SKIP_WITHOUT_GPU();
  const Tensor cu = Tensor::from_ints({0, 90, 91, 91, 200, 256}, {6}, DType::Int32);
  Context ctx(Device::cuda(0));
  for (const auto& [host, device] :
       {std::pair{AttnMask::documents(cu), AttnMask::documents(cu.to(Device::cuda(0)))},
        std::pair{AttnMask::causal_with_offset(40, 3), AttnMask::causal_with_offset(40, 3)}})
    for (DType dt : {DType::BFloat16, DType::Float16})
      for (Dims dm : {Dims{256, 1, 8, 64}, Dims{256, 2, 4, 128}}) {
        SCOPED_TRACE(std::string(host.kind == AttnMask::Kind::Documents ? "documents_" : "offset_") +
                     std::string(to_string(dt)) + "_" + dims_name(dm));
        const Inputs in = make_inputs(dm, dt, 31);
        const float scale = 1.0f / std::sqrt(float(dm.d));
        const Tensor qkv = in.qkv.to(Device::cuda(0)), grad_out = in.grad_out.to(Device::cuda(0));
        const Tensor out = Tensor::empty(dm.heads(), dt, Device::cuda(0));
        for (bool backward : {false, true}) {
          const cuda::CudnnAttentionSupport support =
              cuda::cudnn_attention_qkv_support(ctx, qkv, out, device, scale, 0.0f, backward);
          ASSERT_TRUE(support.supported) << (backward ? "backward: " : "forward: ") << support.reason;
        }
        expect_results_close(run_gpu(ctx, dm, qkv, grad_out, scale, 0.0f, kSeed, kOffset, device),
                             run_cpu(dm, in, scale, 0.0f, host), 2e-2, 1e-3);
      }
}

}  // namespace
}  // namespace megatron

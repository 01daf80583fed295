// GQA attention on CUDA against the CPU reference: the row-wise kernels (fp32, and bf16 as the
// fallback) must match it, dropout included (same Philox mask); cuDNN's fused attention (bf16,
// fp16) must match it without dropout, and with dropout be finite, deterministic in (seed, offset)
// and leave lse unchanged (its mask differs from the CPU's: Note [Attention dropout on the GPU]).
// Every mask is compared: Causal, Documents (Note [Documents on cuDNN]) and CausalWithOffset (cuDNN's
// band when q_offset >= k_offset, the row-wise kernels otherwise).
#include "megatron/kernels/cuda/attention.h"

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
#include "tests/test_util.h"

namespace megatron {
namespace {

using testing::random_tensor;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr uint64_t kSeed = 2024, kOffset = 7;

// max |got - want| / max |want| <= tol; a non-finite value where the reference is finite fails.
void expect_close(const Tensor& got, const Tensor& want, double tol, const std::string& what) {
  const std::vector<float> g = got.to_floats(), w = want.to_floats();
  ASSERT_EQ(g.size(), w.size()) << what;
  double scale = 0, worst = 0;
  size_t worst_at = 0;
  for (float x : w) scale = std::max(scale, std::fabs(double(x)));
  // Errors are measured against at least 0.05 (inputs are O(1)): with one key (s = 1) the q and k
  // gradients are zero in exact arithmetic and both sides hold only rounding noise.
  scale = std::max(scale, 0.05);
  for (size_t i = 0; i < g.size(); ++i) {
    if (!std::isfinite(g[i]) && std::isfinite(w[i])) {
      ADD_FAILURE() << what << ": element " << i << " is " << g[i] << ", expected " << w[i];
      return;
    }
    const double e = std::fabs(double(g[i]) - double(w[i]));
    if (e > worst) worst = e, worst_at = i;
  }
  EXPECT_LE(worst / scale, tol) << what << " (max abs error " << worst << " at " << worst_at << ", max |ref| " << scale
                                << ")";
}

void expect_finite(const Tensor& t, const std::string& what) {
  const std::vector<float> v = t.to_floats();
  for (size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i])) {
      ADD_FAILURE() << what << ": element " << i << " is " << v[i];
      return;
    }
}

Tensor poisoned(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype, Device::cuda(0));
  t.fill_(kNaN);
  return t;
}

struct Shape5 {
  int64_t s, b, nq, ng, d;
};

// Host inputs in the storage dtype.
struct Inputs {
  Tensor q, k, v, grad_out;
};

Inputs make_inputs(const Shape5& sh, DType dtype, uint64_t seed) {
  return {random_tensor({sh.s, sh.b, sh.nq, sh.d}, seed, 1.0f, dtype),
          random_tensor({sh.s, sh.b, sh.ng, sh.d}, seed + 1, 1.0f, dtype),
          random_tensor({sh.s, sh.b, sh.ng, sh.d}, seed + 2, 1.0f, dtype),
          random_tensor({sh.s, sh.b, sh.nq, sh.d}, seed + 3, 1.0f, dtype)};
}

struct Results {
  Tensor out, lse, grad_q, grad_k, grad_v;
};

// The CPU reference in fp32 (outputs fp32 whatever the input dtype: exact math on the stored inputs).
Results run_cpu(const Inputs& in, float scale, float p, const AttnMask& mask = AttnMask::causal()) {
  Context cpu;
  const Shape& qs = in.q.shape();
  Results r{Tensor::empty(qs, DType::Float32), Tensor::empty({qs[1], qs[2], qs[0]}, DType::Float32),
            Tensor::empty(qs, DType::Float32), Tensor::empty(in.k.shape(), DType::Float32),
            Tensor::empty(in.k.shape(), DType::Float32)};
  cpu::attention_forward(cpu, in.q, in.k, in.v, mask, scale, p, kSeed, kOffset, r.out, r.lse);
  cpu::attention_backward(cpu, in.grad_out, in.q, in.k, in.v, r.out, r.lse, mask, scale, p, kSeed, kOffset, r.grad_q,
                          r.grad_k, r.grad_v);
  return r;
}

enum class Path { Dispatch, Rowwise };

// The mask with its cu_seqlens on the device.
AttnMask on_device(const AttnMask& mask) {
  AttnMask m = mask;
  if (m.cu_seqlens.defined()) m.cu_seqlens = m.cu_seqlens.to(Device::cuda(0));
  return m;
}

// Forward then backward on the device, outputs poisoned with NaN first; `host_mask` as run_cpu takes it.
Results run_gpu(Context& ctx, const Inputs& in, float scale, float p, Path path, uint64_t seed = kSeed,
                uint64_t offset = kOffset, const AttnMask& host_mask = AttnMask::causal()) {
  const Device dev = Device::cuda(0);
  const AttnMask mask = on_device(host_mask);
  const Tensor q = in.q.to(dev), k = in.k.to(dev), v = in.v.to(dev), grad_out = in.grad_out.to(dev);
  const Shape& qs = q.shape();
  Results r{poisoned(qs, q.dtype()), poisoned({qs[1], qs[2], qs[0]}, DType::Float32), poisoned(qs, q.dtype()),
            poisoned(k.shape(), k.dtype()), poisoned(k.shape(), k.dtype())};
  if (path == Path::Dispatch) {
    cuda::attention_forward(ctx, q, k, v, mask, scale, p, seed, offset, r.out, r.lse);
    cuda::attention_backward(ctx, grad_out, q, k, v, r.out, r.lse, mask, scale, p, seed, offset, r.grad_q, r.grad_k,
                             r.grad_v);
  } else {
    cuda::attention_forward_rowwise(ctx, q, k, v, mask, scale, p, seed, offset, r.out, r.lse);
    cuda::attention_backward_rowwise(ctx, grad_out, q, k, v, r.out, r.lse, mask, scale, p, seed, offset, r.grad_q,
                                     r.grad_k, r.grad_v);
  }
  ctx.synchronize();
  return r;
}

void expect_results_close(const Results& got, const Results& want, double tol, double lse_tol) {
  expect_close(got.out, want.out, tol, "out");
  expect_close(got.lse, want.lse, lse_tol, "lse");
  expect_close(got.grad_q, want.grad_q, tol, "grad_q");
  expect_close(got.grad_k, want.grad_k, tol, "grad_k");
  expect_close(got.grad_v, want.grad_v, tol, "grad_v");
}

#define SKIP_WITHOUT_GPU()                                                  \
  do {                                                                      \
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible"; \
  } while (0)

// ---- row-wise kernels (fp32): the CPU's result, dropout mask included -----------------------------

struct RowwiseCase {
  int64_t nq, ng, s, d;
  float dropout_p;
};

class AttentionFp32 : public ::testing::TestWithParam<RowwiseCase> {};

TEST_P(AttentionFp32, MatchesCpu) {
  SKIP_WITHOUT_GPU();
  const RowwiseCase& c = GetParam();
  const Inputs in = make_inputs({c.s, 2, c.nq, c.ng, c.d}, DType::Float32, 11);
  const float scale = 1.0f / std::sqrt(float(c.d));
  Context ctx(Device::cuda(0));
  const Results want = run_cpu(in, scale, c.dropout_p);
  // fp32 goes to the row-wise kernels through the public entry points.
  expect_results_close(run_gpu(ctx, in, scale, c.dropout_p, Path::Dispatch), want, 1e-4, 1e-5);
}

std::vector<RowwiseCase> rowwise_cases() {
  std::vector<RowwiseCase> cases;
  const std::vector<std::pair<int64_t, int64_t>> heads = {{4, 4}, {8, 2}};  // MHA, GQA
  for (auto [nq, ng] : heads)
    for (int64_t s : {1, 7, 128})
      for (int64_t d : {16, 64})
        for (float p : {0.0f, 0.2f}) cases.push_back({nq, ng, s, d, p});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionFp32, ::testing::ValuesIn(rowwise_cases()), [](const auto& info) {
  const RowwiseCase& c = info.param;
  return std::string(c.nq == c.ng ? "MHA" : "GQA") + "_s" + std::to_string(c.s) + "_d" + std::to_string(c.d) +
         (c.dropout_p > 0 ? "_dropout" : "");
});

// The fallback for configurations cuDNN declines: the same kernels on 16-bit storage.
TEST(AttentionRowwise, Bf16MatchesCpu) {
  SKIP_WITHOUT_GPU();
  for (float p : {0.0f, 0.2f}) {
    SCOPED_TRACE(p);
    const Inputs in = make_inputs({128, 2, 8, 2, 64}, DType::BFloat16, 21);
    const float scale = 0.125f;
    Context ctx(Device::cuda(0));
    expect_results_close(run_gpu(ctx, in, scale, p, Path::Rowwise), run_cpu(in, scale, p), 2e-2, 1e-5);
  }
}

// A q that is not 16-byte aligned cannot go to cuDNN: without dropout the dispatcher falls back.
TEST(AttentionRowwise, UnalignedBf16FallsBack) {
  SKIP_WITHOUT_GPU();
  const Inputs in = make_inputs({64, 2, 4, 2, 64}, DType::BFloat16, 31);
  const float scale = 0.125f;
  Context ctx(Device::cuda(0));
  const Device dev = Device::cuda(0);
  Tensor big = Tensor::empty({in.q.numel() + 1}, DType::BFloat16, dev);
  Tensor q = big.flat_slice(1, in.q.numel()).view(in.q.shape());
  q.copy_from(in.q);
  const Tensor k = in.k.to(dev), v = in.v.to(dev);
  Tensor out = poisoned(q.shape(), q.dtype()), lse = poisoned({2, 4, 64}, DType::Float32);
  cuda::attention_forward(ctx, q, k, v, AttnMask::causal(), scale, 0.0f, kSeed, kOffset, out, lse);
  ctx.synchronize();
  const Results want = run_cpu(in, scale, 0.0f);
  expect_close(out, want.out, 2e-2, "out");
  expect_close(lse, want.lse, 1e-5, "lse");
}

// ---- cuDNN (bf16, fp16) ------------------------------------------------------------------------------

struct CudnnCase {
  DType dtype;
  int64_t s, d;
};

class AttentionCudnn : public ::testing::TestWithParam<CudnnCase> {};

TEST_P(AttentionCudnn, MatchesCpu) {
  SKIP_WITHOUT_GPU();
  const CudnnCase& c = GetParam();
  const Inputs in = make_inputs({c.s, 2, 16, 4, c.d}, c.dtype, 41);
  const float scale = 1.0f / std::sqrt(float(c.d));
  Context ctx(Device::cuda(0));
  const Tensor q_dev = in.q.to(Device::cuda(0)), k_dev = in.k.to(Device::cuda(0));
  for (bool backward : {false, true}) {
    const cuda::CudnnAttentionSupport support =
        cuda::cudnn_attention_support(ctx, q_dev, k_dev, AttnMask::causal(), scale, 0.0f, backward);
    ASSERT_TRUE(support.supported) << (backward ? "backward: " : "forward: ") << support.reason;
  }
  expect_results_close(run_gpu(ctx, in, scale, 0.0f, Path::Dispatch), run_cpu(in, scale, 0.0f), 2e-2, 1e-3);
}

std::vector<CudnnCase> cudnn_cases() {
  std::vector<CudnnCase> cases;
  for (DType t : {DType::BFloat16, DType::Float16})
    for (int64_t s : {128, 512, 2048})
      for (int64_t d : {64, 128}) cases.push_back({t, s, d});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionCudnn, ::testing::ValuesIn(cudnn_cases()), [](const auto& info) {
  const CudnnCase& c = info.param;
  return std::string(to_string(c.dtype)) + "_s" + std::to_string(c.s) + "_d" + std::to_string(c.d);
});

// cuDNN's dropout cannot match the CPU mask; check what must hold regardless.
TEST(AttentionCudnnDropout, DeterministicFiniteAndLseUnchanged) {
  SKIP_WITHOUT_GPU();
  const Inputs in = make_inputs({256, 2, 8, 2, 64}, DType::BFloat16, 51);
  const float scale = 0.125f, p = 0.2f;
  Context ctx(Device::cuda(0));
  const Tensor q_dev = in.q.to(Device::cuda(0)), k_dev = in.k.to(Device::cuda(0));
  const cuda::CudnnAttentionSupport support =
      cuda::cudnn_attention_support(ctx, q_dev, k_dev, AttnMask::causal(), scale, p, false);
  ASSERT_TRUE(support.supported) << support.reason;

  const Results a = run_gpu(ctx, in, scale, p, Path::Dispatch);
  const Results again = run_gpu(ctx, in, scale, p, Path::Dispatch);
  const Results other = run_gpu(ctx, in, scale, p, Path::Dispatch, kSeed, kOffset + 1);
  const Results plain = run_gpu(ctx, in, scale, 0.0f, Path::Dispatch);
  for (const Tensor* t : {&a.out, &a.lse, &a.grad_q, &a.grad_k, &a.grad_v}) expect_finite(*t, t->str());
  EXPECT_TRUE(a.out.to_floats() == again.out.to_floats()) << "same (seed, offset), different output";
  EXPECT_FALSE(a.out.to_floats() == other.out.to_floats()) << "another offset gave the same dropout mask";
  // lse is the statistic of the softmax before dropout.
  expect_close(a.lse, plain.lse, 1e-5, "lse with dropout vs without");
  // The output is P̃·V with E[P̃] = P: close to the dropout-free output on average over elements.
  const std::vector<float> with = a.out.to_floats(), without = plain.out.to_floats();
  double mean_with = 0, mean_without = 0;
  for (size_t i = 0; i < with.size(); ++i) mean_with += with[i], mean_without += without[i];
  mean_with /= double(with.size());
  mean_without /= double(with.size());
  EXPECT_NEAR(mean_with, mean_without, 0.05);
}

}  // namespace
}  // namespace megatron

namespace megatron {
namespace {

// --deterministic-mode (Context::deterministic): cuDNN's deterministic backward gives the same bits
// at every call and still the CPU's result; the default backward accumulates dQ with atomics.
TEST(AttentionCudnnDeterministic, SameBitsEveryCallAndMatchesCpu) {
  SKIP_WITHOUT_GPU();
  const Inputs in = make_inputs({1024, 4, 16, 4, 64}, DType::BFloat16, 61);
  const float scale = 0.125f;
  Context ctx(Device::cuda(0));
  ctx.set_deterministic(true);
  const Results first = run_gpu(ctx, in, scale, 0.0f, Path::Dispatch);
  for (int k = 0; k < 3; ++k) {
    const Results again = run_gpu(ctx, in, scale, 0.0f, Path::Dispatch);
    EXPECT_TRUE(first.grad_q.to_floats() == again.grad_q.to_floats()) << "grad_q differs at call " << k + 2;
    EXPECT_TRUE(first.grad_k.to_floats() == again.grad_k.to_floats()) << "grad_k differs at call " << k + 2;
    EXPECT_TRUE(first.grad_v.to_floats() == again.grad_v.to_floats()) << "grad_v differs at call " << k + 2;
  }
  expect_results_close(first, run_cpu(in, scale, 0.0f), 2e-2, 1e-3);
}

}  // namespace
}  // namespace megatron

namespace megatron {
namespace {

// ---- masks: Documents on the row-wise kernels and on cuDNN; CausalWithOffset refused --------------

// cu_seqlens of documents of the given lengths, [n + 1] for every batch row or [b, n + 1].
AttnMask documents(const std::vector<std::vector<int64_t>>& lengths) {
  std::vector<int64_t> cu;
  for (const auto& row : lengths) {
    cu.push_back(0);
    for (int64_t len : row) cu.push_back(cu.back() + len);
  }
  const int64_t n1 = int64_t(lengths[0].size()) + 1;
  const Shape shape = lengths.size() == 1 ? Shape{n1} : Shape{int64_t(lengths.size()), n1};
  return AttnMask::documents(Tensor::from_ints(cu, shape, DType::Int32));
}

struct DocumentsCase {
  std::string name;
  int64_t s, b, nq, ng, d;
  std::vector<std::vector<int64_t>> lengths;  // one row shared, or one per batch row
};

std::vector<DocumentsCase> documents_cases() {
  return {
      {"THD_b1", 256, 1, 8, 2, 64, {{100, 1, 27, 128}}},
      {"THD_b1_d128_MHA", 512, 1, 4, 4, 128, {{300, 200, 12}}},
      {"Shared_b2", 256, 2, 8, 2, 64, {{64, 64, 128}}},
      {"PerRow_b2_EmptyDocument", 256, 2, 8, 2, 64, {{17, 0, 239}, {128, 100, 28}}},
  };
}

class AttentionDocuments : public ::testing::TestWithParam<DocumentsCase> {};

// The row-wise kernels on fp32, dropout included: the CPU's result and the CPU's dropout mask.
TEST_P(AttentionDocuments, RowwiseFp32MatchesCpu) {
  SKIP_WITHOUT_GPU();
  const DocumentsCase& c = GetParam();
  const Inputs in = make_inputs({c.s, c.b, c.nq, c.ng, c.d}, DType::Float32, 71);
  const AttnMask mask = documents(c.lengths);
  const float scale = 1.0f / std::sqrt(float(c.d));
  Context ctx(Device::cuda(0));
  for (float p : {0.0f, 0.2f}) {
    SCOPED_TRACE(p);
    expect_results_close(run_gpu(ctx, in, scale, p, Path::Dispatch, kSeed, kOffset, mask), run_cpu(in, scale, p, mask),
                         1e-4, 1e-5);
  }
}

TEST_P(AttentionDocuments, RowwiseBf16MatchesCpu) {
  SKIP_WITHOUT_GPU();
  const DocumentsCase& c = GetParam();
  const Inputs in = make_inputs({c.s, c.b, c.nq, c.ng, c.d}, DType::BFloat16, 72);
  const AttnMask mask = documents(c.lengths);
  const float scale = 1.0f / std::sqrt(float(c.d));
  Context ctx(Device::cuda(0));
  expect_results_close(run_gpu(ctx, in, scale, 0.0f, Path::Rowwise, kSeed, kOffset, mask),
                       run_cpu(in, scale, 0.0f, mask), 2e-2, 1e-5);
}

// cuDNN's variable-length attention, bf16 and fp16, against the CPU.
TEST_P(AttentionDocuments, CudnnMatchesCpu) {
  SKIP_WITHOUT_GPU();
  const DocumentsCase& c = GetParam();
  const AttnMask mask = documents(c.lengths);
  const float scale = 1.0f / std::sqrt(float(c.d));
  Context ctx(Device::cuda(0));
  for (DType dt : {DType::BFloat16, DType::Float16}) {
    SCOPED_TRACE(to_string(dt));
    const Inputs in = make_inputs({c.s, c.b, c.nq, c.ng, c.d}, dt, 73);
    const Tensor q_dev = in.q.to(Device::cuda(0)), k_dev = in.k.to(Device::cuda(0));
    for (bool backward : {false, true}) {
      const cuda::CudnnAttentionSupport support =
          cuda::cudnn_attention_support(ctx, q_dev, k_dev, on_device(mask), scale, 0.0f, backward);
      ASSERT_TRUE(support.supported) << (backward ? "backward: " : "forward: ") << support.reason;
    }
    expect_results_close(run_gpu(ctx, in, scale, 0.0f, Path::Dispatch, kSeed, kOffset, mask),
                         run_cpu(in, scale, 0.0f, mask), 2e-2, 1e-3);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionDocuments, ::testing::ValuesIn(documents_cases()),
                         [](const auto& info) { return info.param.name; });

// One document covering the sequence is the causal mask on cuDNN too.
TEST(AttentionDocumentsCudnn, OneDocumentEqualsCausal) {
  SKIP_WITHOUT_GPU();
  const Inputs in = make_inputs({512, 1, 8, 2, 64}, DType::BFloat16, 74);
  Context ctx(Device::cuda(0));
  const Results causal = run_gpu(ctx, in, 0.125f, 0.0f, Path::Dispatch);
  const Results one = run_gpu(ctx, in, 0.125f, 0.0f, Path::Dispatch, kSeed, kOffset, documents({{512}}));
  expect_results_close(one, causal, 1e-2, 1e-4);
}

// With dropout a Documents forward and its backward stay on one path: finite and repeatable.
TEST(AttentionDocumentsCudnn, DropoutDeterministicAndFinite) {
  SKIP_WITHOUT_GPU();
  const Inputs in = make_inputs({256, 1, 8, 2, 64}, DType::BFloat16, 75);
  const AttnMask mask = documents({{100, 156}});
  Context ctx(Device::cuda(0));
  const Results a = run_gpu(ctx, in, 0.125f, 0.2f, Path::Dispatch, kSeed, kOffset, mask);
  const Results again = run_gpu(ctx, in, 0.125f, 0.2f, Path::Dispatch, kSeed, kOffset, mask);
  for (const Tensor* t : {&a.out, &a.lse, &a.grad_q, &a.grad_k, &a.grad_v}) expect_finite(*t, t->str());
  EXPECT_TRUE(a.out.to_floats() == again.out.to_floats()) << "same (seed, offset), different output";
  expect_close(a.lse, run_cpu(in, 0.125f, 0.0f, mask).lse, 1e-3, "lse with dropout vs the CPU without");
}

// CausalWithOffset: sq queries at q_offset.. against sk keys at k_offset.. (context-parallel chunks).
struct OffsetCase {
  std::string name;
  int64_t sq, sk, q_offset, k_offset;
};

std::vector<OffsetCase> offset_cases() {
  return {
      {"BottomRight", 64, 128, 64, 0},       // the last 64 queries of 128 positions
      {"RowsWithoutKeys", 96, 64, 0, 32},    // queries 0..31 see no key: out 0, lse -inf
      {"EqualOffsets", 128, 128, 7, 7},      // Causal
      {"PastBottomRight", 33, 77, 50, 0},    // every query sees 51 keys or more
      {"TopLeftLongerKeys", 128, 256, 0, 0}  // sk > sq, aligned at the top
  };
}

Inputs make_offset_inputs(const OffsetCase& c, DType dtype, uint64_t seed) {
  const int64_t b = 2, nq = 8, ng = 2, d = 64;
  return {random_tensor({c.sq, b, nq, d}, seed, 1.0f, dtype), random_tensor({c.sk, b, ng, d}, seed + 1, 1.0f, dtype),
          random_tensor({c.sk, b, ng, d}, seed + 2, 1.0f, dtype),
          random_tensor({c.sq, b, nq, d}, seed + 3, 1.0f, dtype)};
}

class AttentionOffsets : public ::testing::TestWithParam<OffsetCase> {};

// fp32 runs the row-wise kernels: the CPU's result, dropout mask included.
TEST_P(AttentionOffsets, RowwiseFp32MatchesCpu) {
  SKIP_WITHOUT_GPU();
  const OffsetCase& c = GetParam();
  const Inputs in = make_offset_inputs(c, DType::Float32, 81);
  const AttnMask mask = AttnMask::causal_with_offset(c.q_offset, c.k_offset);
  Context ctx(Device::cuda(0));
  for (float p : {0.0f, 0.2f}) {
    SCOPED_TRACE(p);
    expect_results_close(run_gpu(ctx, in, 0.125f, p, Path::Dispatch, kSeed, kOffset, mask),
                         run_cpu(in, 0.125f, p, mask), 1e-4, 1e-5);
  }
}

// bf16, fp16: cuDNN's band when the shift is not negative, else the row-wise kernels.
TEST_P(AttentionOffsets, HalfMatchesCpu) {
  SKIP_WITHOUT_GPU();
  const OffsetCase& c = GetParam();
  const AttnMask mask = AttnMask::causal_with_offset(c.q_offset, c.k_offset);
  Context ctx(Device::cuda(0));
  for (DType dt : {DType::BFloat16, DType::Float16}) {
    SCOPED_TRACE(to_string(dt));
    const Inputs in = make_offset_inputs(c, dt, 82);
    const Tensor q_dev = in.q.to(Device::cuda(0)), k_dev = in.k.to(Device::cuda(0));
    for (bool backward : {false, true}) {
      const cuda::CudnnAttentionSupport support =
          cuda::cudnn_attention_support(ctx, q_dev, k_dev, mask, 0.125f, 0.0f, backward);
      EXPECT_EQ(support.supported, c.q_offset >= c.k_offset)
          << (backward ? "backward: " : "forward: ") << support.reason;
    }
    expect_results_close(run_gpu(ctx, in, 0.125f, 0.0f, Path::Dispatch, kSeed, kOffset, mask),
                         run_cpu(in, 0.125f, 0.0f, mask), 2e-2, 1e-3);
  }
}

INSTANTIATE_TEST_SUITE_P(Chunks, AttentionOffsets, ::testing::ValuesIn(offset_cases()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace megatron

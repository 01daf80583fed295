// Cross-entropy on CUDA against the CPU reference: losses and lse over odd and large vocabularies,
// fp32/bf16/fp16 logits, int32/int64 labels, the backward out of place and in place, out-of-range
// labels as clear errors, and the masked loss sums and their backward.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
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



double tolerance(DType t) { return t == DType::Float32 ? 1e-5 : t == DType::Float16 ? 2e-3 : 1e-2; }

Tensor dev(const Tensor& t) { return t.to(Device::cuda(0)); }

Tensor poisoned(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype, Device::cuda(0));
  t.fill_(kNaN);
  return t;
}

Tensor make_labels(int64_t n, int64_t v, DType dtype, uint64_t seed) {
  std::vector<int64_t> l(static_cast<size_t>(n));
  for (size_t i = 0; i < l.size(); ++i) l[i] = int64_t(philox_element(seed, 0, i) % uint32_t(v));
  if (n > 1) l[1] = v - 1;  // the last column
  return Tensor::from_ints(l, {n}, dtype);
}

struct CeCase {
  int64_t n, v;
  DType dtype;
  DType label_dtype;
};

class CudaCrossEntropy : public ::testing::TestWithParam<CeCase> {};

TEST_P(CudaCrossEntropy, ForwardAndBackwardMatchCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const CeCase c = GetParam();
  Context cpu;
  Context gpu(Device::cuda(0));
  const Tensor logits = random_tensor({c.n, c.v}, 1, 3.0f, c.dtype);
  const Tensor labels = make_labels(c.n, c.v, c.label_dtype, 2);
  const Tensor grad_losses = random_tensor({c.n}, 3, 1.0f);
  const Tensor d_logits = dev(logits), d_labels = dev(labels), d_grad_losses = dev(grad_losses);

  Tensor losses = Tensor::empty({c.n}, DType::Float32), lse = Tensor::empty({c.n}, DType::Float32);
  Tensor d_losses = poisoned({c.n}, DType::Float32), d_lse = poisoned({c.n}, DType::Float32);
  cpu::cross_entropy_forward(cpu, logits, labels, losses, lse);
  cuda::cross_entropy_forward(gpu, d_logits, d_labels, d_losses, d_lse);
  expect_close(d_losses, losses, 2e-5, "losses");
  expect_close(d_lse, lse, 1e-5, "lse");

  // Backward from the CPU's lse on both sides.
  Tensor grad = Tensor::empty({c.n, c.v}, c.dtype), d_grad = poisoned({c.n, c.v}, c.dtype);
  const Tensor d_lse_ref = dev(lse);
  cpu::cross_entropy_backward(cpu, grad_losses, logits, labels, lse, grad);
  cuda::cross_entropy_backward(gpu, d_grad_losses, d_logits, d_labels, d_lse_ref, d_grad);
  expect_close(d_grad, grad, tolerance(c.dtype), "grad_logits");
  Tensor d_inplace = dev(logits);
  cuda::cross_entropy_backward(gpu, d_grad_losses, d_inplace, d_labels, d_lse_ref, d_inplace);
  expect_close(d_inplace, grad, tolerance(c.dtype), "grad_logits in place");

  // lse is optional in the forward.
  Tensor no_lse, d_losses2 = poisoned({c.n}, DType::Float32);
  cuda::cross_entropy_forward(gpu, d_logits, d_labels, d_losses2, no_lse);
  EXPECT_EQ(d_losses2.to_floats(), d_losses.to_floats());
}

std::vector<CeCase> ce_cases() {
  std::vector<CeCase> cases;
  for (int64_t v : {1, 3, 127, 1000, 4100, 32768 + 8}) {
    for (int64_t n : {1, 7}) {
      for (DType dt : {DType::Float32, DType::BFloat16}) cases.push_back({n, v, dt, DType::Int64});
    }
  }
  cases.push_back({5, 262144, DType::BFloat16, DType::Int64});
  cases.push_back({3, 50257, DType::Float32, DType::Int32});
  cases.push_back({7, 1024, DType::Float16, DType::Int32});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaCrossEntropy, ::testing::ValuesIn(ce_cases()),
                         [](const ::testing::TestParamInfo<CeCase>& info) {
                           const CeCase& c = info.param;
                           return "n" + std::to_string(c.n) + "_v" + std::to_string(c.v) + "_" +
                                  std::string(to_string(c.dtype)) + "_" + std::string(to_string(c.label_dtype));
                         });

TEST(CudaCrossEntropyErrors, OutOfRangeLabelThrows) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  Context gpu(Device::cuda(0));
  const int64_t n = 6, v = 50;
  const Tensor logits = dev(random_tensor({n, v}, 1));
  for (int64_t bad : {v, int64_t(-1)}) {
    std::vector<int64_t> l(size_t(n), 0);
    l[4] = bad;
    const Tensor labels = dev(Tensor::from_ints(l, {n}, DType::Int32));
    Tensor losses = poisoned({n}, DType::Float32), lse;
    try {
      cuda::cross_entropy_forward(gpu, logits, labels, losses, lse);
      ADD_FAILURE() << "label " << bad << " was accepted";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("label " + std::to_string(bad) + " at position 4"), std::string::npos) << msg;
    }
  }
}

TEST(CudaMaskedLoss, SumsAndBackwardMatchCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  Context cpu;
  Context gpu(Device::cuda(0));
  for (int64_t n : {1, 7, 5000}) {
    const Tensor losses = random_tensor({n}, 1, 2.0f);
    std::vector<float> m(static_cast<size_t>(n));
    for (size_t i = 0; i < m.size(); ++i) m[i] = float(philox_element(5, 0, i) & 1u);
    const Tensor mask = Tensor::from_floats(m, {n});
    for (bool with_mask : {true, false}) {
      const Tensor cpu_mask = with_mask ? mask : Tensor(), gpu_mask = with_mask ? dev(mask) : Tensor();
      Tensor sums = Tensor::empty({2}, DType::Float32), d_sums = poisoned({2}, DType::Float32);
      cpu::masked_loss_sums(cpu, losses, cpu_mask, sums);
      cuda::masked_loss_sums(gpu, dev(losses), gpu_mask, d_sums);
      expect_close(d_sums, sums, 1e-6, "sums n=" + std::to_string(n));
      Tensor grad = Tensor::empty({n}, DType::Float32), d_grad = poisoned({n}, DType::Float32);
      cpu::masked_loss_backward(cpu, cpu_mask, 0.25f, grad);
      cuda::masked_loss_backward(gpu, gpu_mask, 0.25f, d_grad);
      EXPECT_EQ(d_grad.to_floats(), grad.to_floats());
    }
  }
  // A bf16 loss vector with a bf16 mask.
  const Tensor losses = random_tensor({300}, 2, 1.0f, DType::BFloat16);
  const Tensor mask = Tensor::from_floats(std::vector<float>(300, 1.0f), {300}, DType::BFloat16);
  Tensor sums = Tensor::empty({2}, DType::Float32), d_sums = poisoned({2}, DType::Float32);
  cpu::masked_loss_sums(cpu, losses, mask, sums);
  cuda::masked_loss_sums(gpu, dev(losses), dev(mask), d_sums);
  expect_close(d_sums, sums, 1e-6, "bf16 sums");
}

}  // namespace
}  // namespace megatron

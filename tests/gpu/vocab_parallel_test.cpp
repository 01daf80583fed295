// The vocab-parallel embedding and cross entropy on CUDA against the CPU reference: one rank's shard
// (not the first, so vocab_start matters) with ids and labels inside and outside it, fp32/bf16/fp16,
// int32/int64 indices, odd widths and large shards; the accumulated embedding backward with repeated
// ids; the loss backward out of place and in place; bad ids and labels as clear errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
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

// The error names the id and where it is, like the CPU's.
void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected megatron::Error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// ---- embedding ------------------------------------------------------------------------------------

// Rank 1 of a 20-row vocabulary: rows [7, 13).
constexpr int64_t kB = 3, kS = 5, kVocab = 20, kStart = 7, kShard = 6;

// [b, s] ids over the whole vocabulary; ids 7 (the shard's first row) and 12 (its last) repeat.
Tensor make_tokens(DType dtype, uint64_t seed) {
  std::vector<int64_t> v(size_t(kB * kS));
  for (size_t i = 0; i < v.size(); ++i) v[i] = int64_t(philox_element(seed, 0, i) % uint32_t(kVocab));
  v[1] = v[size_t(kS + 2)] = kStart;
  v[3] = v[size_t(2 * kS)] = kStart + kShard - 1;
  v[4] = kStart - 1;
  v[5] = kStart + kShard;
  return Tensor::from_ints(v, {kB, kS}, dtype);
}

struct EmbeddingCase {
  int64_t h;
  DType dtype;
  DType id_dtype;
};

class CudaVocabParallelEmbedding : public ::testing::TestWithParam<EmbeddingCase> {};

TEST_P(CudaVocabParallelEmbedding, ForwardAndBackwardMatchCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const EmbeddingCase c = GetParam();
  Context cpu;
  Context gpu(Device::cuda(0));
  const Tensor tokens = make_tokens(c.id_dtype, 1), d_tokens = dev(tokens);
  const Tensor shard = random_tensor({kShard, c.h}, 2, 1.0f, c.dtype);

  Tensor out = Tensor::empty({kS, kB, c.h}, c.dtype), d_out = poisoned({kS, kB, c.h}, c.dtype);
  cpu::vocab_parallel_embedding_forward(cpu, tokens, shard, kStart, kVocab, out);
  cuda::vocab_parallel_embedding_forward(gpu, d_tokens, dev(shard), kStart, kVocab, d_out);
  expect_close(d_out, out, 0.0, "out");  // copies and zeros: the same bits

  // Backward twice into a non-zero fp32 grad (accumulation; repeated ids collide).
  const Tensor grad_out = random_tensor({kS, kB, c.h}, 3, 1.0f, c.dtype), d_grad_out = dev(grad_out);
  const Tensor wg0 = random_tensor({kShard, c.h}, 4);
  Tensor wg = wg0.clone(), d_wg = dev(wg0);
  for (int rep = 0; rep < 2; ++rep) {
    cpu::vocab_parallel_embedding_backward(cpu, tokens, grad_out, kStart, wg);
    cuda::vocab_parallel_embedding_backward(gpu, d_tokens, d_grad_out, kStart, d_wg);
  }
  expect_close(d_wg, wg, 1e-5, "word_grad");

  // An undefined grad is skipped.
  Tensor none;
  cuda::vocab_parallel_embedding_backward(gpu, d_tokens, d_grad_out, kStart, none);
}

std::vector<EmbeddingCase> embedding_cases() {
  std::vector<EmbeddingCase> cases;
  for (int64_t h : {1, 3, 8, 127, 1000, 4100, 4096}) {
    for (DType dt : {DType::Float32, DType::BFloat16}) cases.push_back({h, dt, DType::Int64});
  }
  cases.push_back({64, DType::Float16, DType::Int32});
  cases.push_back({1000, DType::Float32, DType::Int32});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaVocabParallelEmbedding, ::testing::ValuesIn(embedding_cases()),
                         [](const ::testing::TestParamInfo<EmbeddingCase>& info) {
                           const EmbeddingCase& c = info.param;
                           return "h" + std::to_string(c.h) + "_" + std::string(to_string(c.dtype)) + "_" +
                                  std::string(to_string(c.id_dtype));
                         });

TEST(CudaVocabParallelEmbeddingErrors, OutOfRangeIdsThrow) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  Context gpu(Device::cuda(0));
  const int64_t h = 16;
  const Tensor shard = dev(random_tensor({kShard, h}, 1));
  Tensor out = poisoned({kS, kB, h}, DType::Float32);
  std::vector<int64_t> ids(size_t(kB * kS), kStart);
  ids[size_t(kS + 3)] = kVocab;  // [1, 3]: in no shard, every rank rejects it
  ids[size_t(kS + 4)] = -2;      // a later bad one: the first is reported
  const Tensor bad = dev(Tensor::from_ints(ids, {kB, kS}, DType::Int32));
  expect_error([&] { cuda::vocab_parallel_embedding_forward(gpu, bad, shard, kStart, kVocab, out); },
               "token id 20 at [1, 3]");
  // The stream is usable after the error.
  const Tensor good = dev(make_tokens(DType::Int64, 9));
  cuda::vocab_parallel_embedding_forward(gpu, good, shard, kStart, kVocab, out);
  gpu.synchronize();
  for (float v : out.to_floats()) ASSERT_TRUE(std::isfinite(v));
}

// ---- cross entropy --------------------------------------------------------------------------------

struct CeCase {
  int64_t n, v;  // v: the shard's width; the shard is rank 1 of 4
  DType dtype;
  DType label_dtype;
};

// Global labels over [0, 4v), with the shard's first and last columns and a neighbour's column forced.
Tensor make_labels(const CeCase& c, uint64_t seed) {
  std::vector<int64_t> l(static_cast<size_t>(c.n));
  for (size_t i = 0; i < l.size(); ++i) l[i] = int64_t(philox_element(seed, 0, i) % uint32_t(4 * c.v));
  if (c.n > 1) l[1] = c.v;          // the shard's first column
  if (c.n > 2) l[2] = 2 * c.v - 1;  // its last
  if (c.n > 3) l[3] = c.v - 1;      // the previous rank's last
  return Tensor::from_ints(l, {c.n}, c.label_dtype);
}

class CudaVocabParallelCrossEntropy : public ::testing::TestWithParam<CeCase> {};

TEST_P(CudaVocabParallelCrossEntropy, EveryPieceMatchesCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const CeCase c = GetParam();
  const int64_t start = c.v;
  Context cpu;
  Context gpu(Device::cuda(0));
  const Tensor logits = random_tensor({c.n, c.v}, 1, 3.0f, c.dtype), d_logits = dev(logits);
  const Tensor labels = make_labels(c, 2), d_labels = dev(labels);

  Tensor max = Tensor::empty({c.n}, DType::Float32), d_max = poisoned({c.n}, DType::Float32);
  cpu::cross_entropy_local_max(cpu, logits, max);
  cuda::cross_entropy_local_max(gpu, d_logits, d_max);
  expect_close(d_max, max, 0.0, "max");

  // Sums against a global max above this shard's, as another rank's larger logit would make it.
  std::vector<float> gm = max.to_floats();
  for (size_t i = 0; i < gm.size(); ++i) gm[i] += i % 2 ? 0.75f : 0.0f;
  const Tensor global_max = Tensor::from_floats(gm, {c.n});
  Tensor sums = Tensor::empty({2, c.n}, DType::Float32), d_sums = poisoned({2, c.n}, DType::Float32);
  cpu::cross_entropy_local_sums(cpu, logits, labels, start, global_max, sums);
  cuda::cross_entropy_local_sums(gpu, d_logits, d_labels, start, dev(global_max), d_sums);
  expect_close(d_sums.slice(0, 1), sums.slice(0, 1), 2e-5, "sums[0]");
  expect_close(d_sums.slice(1, 2), sums.slice(1, 2), 0.0, "sums[1]");  // the label's logit, or 0

  // from_sums on the (reduced) sums: here this rank's own.
  Tensor losses = Tensor::empty({c.n}, DType::Float32), lse = Tensor::empty({c.n}, DType::Float32);
  Tensor d_losses = poisoned({c.n}, DType::Float32), d_lse = poisoned({c.n}, DType::Float32);
  cpu::cross_entropy_from_sums(cpu, global_max, sums, losses, lse);
  const Tensor d_global_max = dev(global_max), d_sums_ref = dev(sums);
  cuda::cross_entropy_from_sums(gpu, d_global_max, d_sums_ref, d_losses, d_lse);
  expect_close(d_losses, losses, 1e-6, "losses", 1.0);
  expect_close(d_lse, lse, 1e-6, "lse", 1.0);
  Tensor no_lse, d_losses2 = poisoned({c.n}, DType::Float32);
  cuda::cross_entropy_from_sums(gpu, d_global_max, d_sums_ref, d_losses2, no_lse);
  EXPECT_EQ(d_losses2.to_floats(), d_losses.to_floats());

  // Backward from the CPU's lse on both sides, out of place and in place.
  const Tensor grad_losses = random_tensor({c.n}, 3, 1.0f), d_grad_losses = dev(grad_losses);
  const Tensor d_lse_ref = dev(lse);
  Tensor grad = Tensor::empty({c.n, c.v}, c.dtype), d_grad = poisoned({c.n, c.v}, c.dtype);
  cpu::vocab_parallel_cross_entropy_backward(cpu, grad_losses, logits, labels, start, lse, grad);
  cuda::vocab_parallel_cross_entropy_backward(gpu, d_grad_losses, d_logits, d_labels, start, d_lse_ref, d_grad);
  expect_close(d_grad, grad, tolerance(c.dtype), "grad_logits");
  Tensor d_inplace = dev(logits);
  cuda::vocab_parallel_cross_entropy_backward(gpu, d_grad_losses, d_inplace, d_labels, start, d_lse_ref, d_inplace);
  expect_close(d_inplace, grad, tolerance(c.dtype), "grad_logits in place");
}

std::vector<CeCase> ce_cases() {
  std::vector<CeCase> cases;
  for (int64_t v : {1, 3, 127, 1000, 4100, 32768 + 8}) {
    for (int64_t n : {1, 7}) {
      for (DType dt : {DType::Float32, DType::BFloat16}) cases.push_back({n, v, dt, DType::Int64});
    }
  }
  cases.push_back({5, 262144 / 4, DType::BFloat16, DType::Int64});
  cases.push_back({3, 50304 / 8, DType::Float32, DType::Int32});
  cases.push_back({7, 1024, DType::Float16, DType::Int32});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaVocabParallelCrossEntropy, ::testing::ValuesIn(ce_cases()),
                         [](const ::testing::TestParamInfo<CeCase>& info) {
                           const CeCase& c = info.param;
                           return "n" + std::to_string(c.n) + "_v" + std::to_string(c.v) + "_" +
                                  std::string(to_string(c.dtype)) + "_" + std::string(to_string(c.label_dtype));
                         });

TEST(CudaVocabParallelCrossEntropyErrors, NegativeLabelThrows) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  Context gpu(Device::cuda(0));
  const int64_t n = 6, v = 50;
  const Tensor logits = dev(random_tensor({n, v}, 1));
  Tensor max = poisoned({n}, DType::Float32), sums = poisoned({2, n}, DType::Float32);
  cuda::cross_entropy_local_max(gpu, logits, max);
  std::vector<int64_t> l(size_t(n), 0);
  l[4] = -100;
  const Tensor labels = dev(Tensor::from_ints(l, {n}, DType::Int32));
  expect_error([&] { cuda::cross_entropy_local_sums(gpu, logits, labels, v, max, sums); }, "label -100 at position 4");
}

}  // namespace
}  // namespace megatron

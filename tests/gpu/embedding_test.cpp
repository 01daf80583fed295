// Embeddings on CUDA against the CPU reference: the [b, s] -> [s, b, h] lookup with and without
// position embeddings, int32/int64 ids, fp32/bf16/fp16 tables, odd widths, the accumulated fp32
// scatter-add backward with repeated ids, and out-of-range ids as clear errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
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

constexpr int64_t kB = 2, kS = 5, kVocab = 11, kPositions = 7;


Tensor dev(const Tensor& t) { return t.to(Device::cuda(0)); }

Tensor poisoned(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype, Device::cuda(0));
  t.fill_(kNaN);
  return t;
}

// [b, s] ids in [0, rows) with repeats (id 3 appears at least twice).
Tensor make_ids(int64_t rows, DType dtype, uint64_t seed) {
  std::vector<int64_t> v(size_t(kB * kS));
  for (size_t i = 0; i < v.size(); ++i) v[i] = int64_t(philox_element(seed, 0, i) % uint32_t(rows));
  v[1] = 3;
  v[size_t(kS + 2)] = 3;
  return Tensor::from_ints(v, {kB, kS}, dtype);
}

struct EmbeddingCase {
  int64_t h;
  DType dtype;
  DType id_dtype;
  bool positions;
};

std::string case_name(const ::testing::TestParamInfo<EmbeddingCase>& info) {
  const EmbeddingCase& c = info.param;
  return "h" + std::to_string(c.h) + "_" + std::string(to_string(c.dtype)) + "_" + std::string(to_string(c.id_dtype)) +
         (c.positions ? "_pos" : "");
}

class CudaEmbedding : public ::testing::TestWithParam<EmbeddingCase> {};

TEST_P(CudaEmbedding, ForwardAndBackwardMatchCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const EmbeddingCase c = GetParam();
  Context cpu;
  Context gpu(Device::cuda(0));
  const Tensor tokens = make_ids(kVocab, c.id_dtype, 1);
  const Tensor pos_ids = c.positions ? make_ids(kPositions, c.id_dtype, 2) : Tensor();
  const Tensor word = random_tensor({kVocab, c.h}, 3, 1.0f, c.dtype);
  const Tensor pos = c.positions ? random_tensor({kPositions, c.h}, 4, 1.0f, c.dtype) : Tensor();
  const Tensor d_tokens = dev(tokens), d_pos_ids = c.positions ? dev(pos_ids) : Tensor();
  const Tensor d_pos = c.positions ? dev(pos) : Tensor();

  Tensor out = Tensor::empty({kS, kB, c.h}, c.dtype), d_out = poisoned({kS, kB, c.h}, c.dtype);
  cpu::embedding_forward(cpu, tokens, pos_ids, word, pos, out);
  cuda::embedding_forward(gpu, d_tokens, d_pos_ids, dev(word), d_pos, d_out);
  expect_close(d_out, out, 1e-6, "out");  // one fp32 add, one rounding: the same bits

  // Backward twice into non-zero fp32 grads (accumulation; repeated ids collide).
  const Tensor grad_out = random_tensor({kS, kB, c.h}, 5, 1.0f, c.dtype), d_grad_out = dev(grad_out);
  const Tensor wg0 = random_tensor({kVocab, c.h}, 6), pg0 = random_tensor({kPositions, c.h}, 7);
  Tensor wg = wg0.clone(), pg = pg0.clone(), d_wg = dev(wg0), d_pg = dev(pg0);
  for (int rep = 0; rep < 2; ++rep) {
    cpu::embedding_backward(cpu, tokens, pos_ids, grad_out, wg, pg);
    cuda::embedding_backward(gpu, d_tokens, d_pos_ids, d_grad_out, d_wg, d_pg);
  }
  expect_close(d_wg, wg, 1e-5, "word_grad");
  expect_close(d_pg, pg, 1e-5, "pos_grad");  // untouched (== pg0) without positions

  // Only the position table's gradient wanted.
  if (c.positions) {
    Tensor no_word_grad;
    Tensor pg_only = pg0.clone(), d_pg_only = dev(pg0);
    cpu::embedding_backward(cpu, tokens, pos_ids, grad_out, no_word_grad, pg_only);
    cuda::embedding_backward(gpu, d_tokens, d_pos_ids, d_grad_out, no_word_grad, d_pg_only);
    expect_close(d_pg_only, pg_only, 1e-5, "pos_grad only");
  }
}

std::vector<EmbeddingCase> embedding_cases() {
  std::vector<EmbeddingCase> cases;
  for (int64_t h : {1, 3, 8, 127, 1000, 4100, 4096}) {
    for (DType dt : {DType::Float32, DType::BFloat16}) cases.push_back({h, dt, DType::Int64, true});
  }
  cases.push_back({64, DType::Float16, DType::Int32, true});
  cases.push_back({1000, DType::Float32, DType::Int32, false});
  cases.push_back({256, DType::BFloat16, DType::Int64, false});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaEmbedding, ::testing::ValuesIn(embedding_cases()), case_name);

// The error names the id and where it is, like the CPU's.
void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected megatron::Error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(CudaEmbeddingErrors, OutOfRangeIdsThrow) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  Context gpu(Device::cuda(0));
  const int64_t h = 16;
  std::vector<int64_t> ids(size_t(kB * kS), 1);
  ids[size_t(kS + 3)] = kVocab;  // [1, 3]
  ids[size_t(kS + 4)] = -2;      // a later bad one: the first is reported
  const Tensor bad_tokens = dev(Tensor::from_ints(ids, {kB, kS}, DType::Int32));
  const Tensor good = dev(make_ids(kPositions, DType::Int64, 9));
  const Tensor word = dev(random_tensor({kVocab, h}, 1)), pos = dev(random_tensor({kPositions, h}, 2));
  Tensor out = poisoned({kS, kB, h}, DType::Float32);
  expect_error([&] { cuda::embedding_forward(gpu, bad_tokens, good, word, pos, out); }, "token id 11 at [1, 3]");

  std::vector<int64_t> pids(size_t(kB * kS), 0);
  pids[2] = kPositions + 5;
  const Tensor bad_pos = dev(Tensor::from_ints(pids, {kB, kS}, DType::Int64));
  const Tensor good_tokens = dev(make_ids(kVocab, DType::Int64, 10));
  expect_error([&] { cuda::embedding_forward(gpu, good_tokens, bad_pos, word, pos, out); }, "position id 12 at [0, 2]");

  Tensor wg = dev(Tensor::zeros({kVocab, h}, DType::Float32)), pg = dev(Tensor::zeros({kPositions, h}, DType::Float32));
  const Tensor grad_out = dev(random_tensor({kS, kB, h}, 3));
  // The backward trusts its forward's check (Note [No id check in backward]): bad rows are skipped,
  // nothing is written out of bounds.
  cuda::embedding_backward(gpu, bad_tokens, good, grad_out, wg, pg);
  gpu.synchronize();
  for (float v : wg.to_floats()) ASSERT_TRUE(std::isfinite(v));
  // The stream is usable after the error.
  cuda::embedding_forward(gpu, good_tokens, good, word, pos, out);
  gpu.synchronize();
  for (float v : out.to_floats()) ASSERT_TRUE(std::isfinite(v));
}

}  // namespace
}  // namespace megatron

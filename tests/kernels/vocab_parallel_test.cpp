// The vocab-parallel embedding and cross entropy: split a problem into tp ∈ {1, 2, 4} vocabulary
// shards, run each rank's pieces, combine them as the caller's all-reduces would (max over shards,
// sums over shards, concatenation of the logit gradients), and compare with the unsharded ops.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "megatron/kernels/cpu/cpu_ops.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

using testing::max_abs_error;
using testing::random_tensor;

constexpr int64_t kV = 12;  // divisible by every tp below

// Columns [start, start + count) of a [N, V] tensor, as a new [N, count] tensor of the same dtype.
Tensor columns(const Tensor& t, int64_t start, int64_t count) {
  const int64_t n = t.size(0), v = t.size(1);
  const std::vector<float> all = t.to_floats();
  std::vector<float> part(size_t(n * count));
  for (int64_t r = 0; r < n; ++r) std::copy_n(all.begin() + r * v + start, count, part.begin() + r * count);
  return Tensor::from_floats(part, {n, count}, t.dtype());
}

// Labels spread over the vocabulary so that every shard of every tp holds some.
Tensor spread_labels(int64_t n, DType dtype) {
  const std::vector<int64_t> pattern = {0, 11, 3, 6, 9, 2, 8, 5, 1, 10, 4, 7};
  std::vector<int64_t> l(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) l[size_t(i)] = pattern[size_t(i) % pattern.size()];
  return Tensor::from_ints(l, {n}, dtype);
}

struct ShardedLoss {
  Tensor losses, lse, grad;  // grad: the shards' gradients concatenated to [N, V]
};

// Every rank's forward and backward with the collectives done by hand. in_place runs the backward
// into each shard's logits.
ShardedLoss run_sharded_cross_entropy(const Tensor& logits, const Tensor& labels, const Tensor& grad_losses, int64_t tp,
                                      bool in_place) {
  Context ctx;
  const int64_t n = logits.size(0), vl = kV / tp;
  std::vector<Tensor> shards;
  for (int64_t r = 0; r < tp; ++r) shards.push_back(columns(logits, r * vl, vl));

  // all-reduce Max of the local maxima
  std::vector<float> max(size_t(n), -INFINITY);
  for (const Tensor& shard : shards) {
    Tensor local = Tensor::empty({n}, DType::Float32);
    cpu::cross_entropy_local_max(ctx, shard, local);
    for (int64_t i = 0; i < n; ++i) max[size_t(i)] = std::max(max[size_t(i)], local.item(i));
  }
  const Tensor global_max = Tensor::from_floats(max, {n});

  // all-reduce Sum of the local sums (fp32, as a collective would)
  std::vector<float> sums(size_t(2 * n), 0.0f);
  for (int64_t r = 0; r < tp; ++r) {
    Tensor local = Tensor::empty({2, n}, DType::Float32);
    cpu::cross_entropy_local_sums(ctx, shards[size_t(r)], labels, r * vl, global_max, local);
    for (int64_t i = 0; i < 2 * n; ++i) sums[size_t(i)] += local.item(i);
  }
  const Tensor global_sums = Tensor::from_floats(sums, {2, n});

  ShardedLoss out{Tensor::empty({n}, DType::Float32), Tensor::empty({n}, DType::Float32), Tensor()};
  cpu::cross_entropy_from_sums(ctx, global_max, global_sums, out.losses, out.lse);

  std::vector<float> grad(size_t(n * kV));
  for (int64_t r = 0; r < tp; ++r) {
    Tensor& shard = shards[size_t(r)];
    Tensor g = in_place ? shard : Tensor::empty({n, vl}, logits.dtype());
    cpu::vocab_parallel_cross_entropy_backward(ctx, grad_losses, shard, labels, r * vl, out.lse, g);
    const std::vector<float> gv = g.to_floats();
    for (int64_t i = 0; i < n; ++i) std::copy_n(gv.begin() + i * vl, vl, grad.begin() + i * kV + r * vl);
  }
  out.grad = Tensor::from_floats(grad, {n, kV});
  return out;
}

TEST(VocabParallelCrossEntropy, ShardsReproduceTheFusedLoss) {
  Context ctx;
  for (int64_t n : {1, 7, 12}) {
    for (DType label_dtype : {DType::Int32, DType::Int64}) {
      const Tensor logits = random_tensor({n, kV}, 1, 3.0f), labels = spread_labels(n, label_dtype);
      const Tensor grad_losses = random_tensor({n}, 2);
      Tensor losses = Tensor::empty({n}, DType::Float32), lse = Tensor::empty({n}, DType::Float32);
      Tensor grad = Tensor::empty({n, kV}, DType::Float32);
      cpu::cross_entropy_forward(ctx, logits, labels, losses, lse);
      cpu::cross_entropy_backward(ctx, grad_losses, logits, labels, lse, grad);
      for (int64_t tp : {1, 2, 4}) {
        for (bool in_place : {false, true}) {
          SCOPED_TRACE("n=" + std::to_string(n) + " tp=" + std::to_string(tp) + (in_place ? " in place" : ""));
          const ShardedLoss sh = run_sharded_cross_entropy(logits, labels, grad_losses, tp, in_place);
          EXPECT_LT(max_abs_error(sh.losses.to_floats(), losses.to_floats()), 2e-6);
          EXPECT_LT(max_abs_error(sh.lse.to_floats(), lse.to_floats()), 2e-6);
          EXPECT_LT(max_abs_error(sh.grad.to_floats(), grad.to_floats()), 1e-6);
        }
      }
    }
  }
}

TEST(VocabParallelCrossEntropy, Bf16ShardsTrackTheFusedLoss) {
  Context ctx;
  const int64_t n = 5;
  const Tensor logits = random_tensor({n, kV}, 3, 3.0f, DType::BFloat16), labels = spread_labels(n, DType::Int64);
  const Tensor grad_losses = random_tensor({n}, 4);
  Tensor losses = Tensor::empty({n}, DType::Float32), lse = Tensor::empty({n}, DType::Float32);
  Tensor grad = Tensor::empty({n, kV}, DType::Float32);
  cpu::cross_entropy_forward(ctx, logits, labels, losses, lse);
  cpu::cross_entropy_backward(ctx, grad_losses, logits, labels, lse, grad);
  const ShardedLoss sh = run_sharded_cross_entropy(logits, labels, grad_losses, 4, /*in_place=*/true);
  EXPECT_LT(max_abs_error(sh.losses.to_floats(), losses.to_floats()), 2e-6);
  EXPECT_LT(testing::max_rel_error(sh.grad.to_floats(), grad.to_floats(), 1e-2), 1.0 / 128);  // bf16 storage
}

TEST(VocabParallelCrossEntropy, LocalPiecesAndOptionalLse) {
  Context ctx;
  // One row, shard [4, 8) of x = {0, ..., 11}: max 7, Σ exp(x - 9) over 4..7, label 6 -> x = 6.
  std::vector<float> row(kV);
  for (int64_t c = 0; c < kV; ++c) row[size_t(c)] = float(c);
  const Tensor shard = columns(Tensor::from_floats(row, {1, kV}), 4, 4);
  Tensor max = Tensor::empty({1}, DType::Float32), sums = Tensor::empty({2, 1}, DType::Float32);
  cpu::cross_entropy_local_max(ctx, shard, max);
  EXPECT_EQ(max.item(0), 7.0f);
  cpu::cross_entropy_local_sums(ctx, shard, Tensor::from_ints({6}, {1}), 4, Tensor::from_floats({9.0f}, {1}), sums);
  double expected = 0;
  for (int c = 4; c < 8; ++c) expected += std::exp(double(c) - 9.0);
  EXPECT_NEAR(sums.item(0), expected, 1e-6);
  EXPECT_EQ(sums.item(1), 6.0f);
  cpu::cross_entropy_local_sums(ctx, shard, Tensor::from_ints({11}, {1}), 4, Tensor::from_floats({9.0f}, {1}), sums);
  EXPECT_EQ(sums.item(1), 0.0f);  // label on another shard

  Tensor losses = Tensor::empty({1}, DType::Float32), no_lse;
  cpu::cross_entropy_from_sums(ctx, Tensor::from_floats({2.0f}, {1}), Tensor::from_floats({4.0f, 1.5f}, {2, 1}), losses,
                               no_lse);
  EXPECT_NEAR(losses.item(0), std::log(4.0) + 2.0 - 1.5, 1e-6);
}

TEST(VocabParallelCrossEntropy, NegativeLabelIsAUserError) {
  Context ctx;
  const Tensor logits = random_tensor({3, 4}, 5);
  Tensor max = Tensor::empty({3}, DType::Float32), sums = Tensor::empty({2, 3}, DType::Float32);
  cpu::cross_entropy_local_max(ctx, logits, max);
  try {
    cpu::cross_entropy_local_sums(ctx, logits, Tensor::from_ints({0, -100, 2}, {3}, DType::Int32), 0, max, sums);
    FAIL() << "expected megatron::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("label -100 at position 1"), std::string::npos) << e.what();
  }
}

// ---- embedding ------------------------------------------------------------------------------------

constexpr int64_t kB = 3, kS = 5, kH = 5;  // odd b, s, h

// [b, s] ids covering every shard of every tp, with repeats.
Tensor spread_tokens(DType dtype) {
  const std::vector<int64_t> ids = {0, 11, 3, 6, 9, 2, 8, 5, 1, 10, 4, 7, 3, 11, 6};
  return Tensor::from_ints(ids, {kB, kS}, dtype);
}

TEST(VocabParallelEmbedding, ShardsReproduceTheFullTable) {
  Context ctx;
  for (DType dtype : {DType::Float32, DType::BFloat16}) {
    for (DType id_dtype : {DType::Int32, DType::Int64}) {
      const Tensor word = random_tensor({kV, kH}, 1, 1.0f, dtype), tokens = spread_tokens(id_dtype);
      Tensor out = Tensor::empty({kS, kB, kH}, dtype);
      cpu::embedding_forward(ctx, tokens, Tensor(), word, Tensor(), out);
      const Tensor grad_out = random_tensor({kS, kB, kH}, 2, 1.0f, dtype);
      const Tensor grad0 = random_tensor({kV, kH}, 3);  // accumulated into
      Tensor grad = grad0.clone(), none;
      cpu::embedding_backward(ctx, tokens, Tensor(), grad_out, grad, none);
      const std::vector<float> full_grad = grad.to_floats();

      for (int64_t tp : {1, 2, 4}) {
        SCOPED_TRACE(std::string(to_string(dtype)) + " tp=" + std::to_string(tp));
        const int64_t vl = kV / tp;
        std::vector<float> sum(size_t(kS * kB * kH), 0.0f);
        for (int64_t r = 0; r < tp; ++r) {
          const Tensor shard = word.slice(r * vl, (r + 1) * vl);
          Tensor part = Tensor::empty({kS, kB, kH}, dtype);
          part.fill_(std::numeric_limits<float>::quiet_NaN());  // every element is written
          cpu::vocab_parallel_embedding_forward(ctx, tokens, shard, r * vl, kV, part);
          const std::vector<float> p = part.to_floats();
          for (size_t i = 0; i < sum.size(); ++i) sum[i] += p[i];  // all-reduce Sum

          Tensor shard_grad = grad0.slice(r * vl, (r + 1) * vl).clone();
          cpu::vocab_parallel_embedding_backward(ctx, tokens, grad_out, r * vl, shard_grad);
          const std::vector<float> want(full_grad.begin() + r * vl * kH, full_grad.begin() + (r + 1) * vl * kH);
          EXPECT_EQ(shard_grad.to_floats(), want) << "rank " << r;
        }
        EXPECT_EQ(sum, out.to_floats());  // the other ranks add exact zeros
      }
    }
  }
}

TEST(VocabParallelEmbedding, OutOfRangeIdIsAUserError) {
  Context ctx;
  const Tensor shard = random_tensor({4, kH}, 1);
  Tensor out = Tensor::empty({kS, kB, kH}, DType::Float32);
  for (int64_t bad : {kV, int64_t(-1)}) {
    std::vector<int64_t> ids(size_t(kB * kS), 5);
    ids[size_t(kS + 3)] = bad;  // [1, 3]
    const Tensor tokens = Tensor::from_ints(ids, {kB, kS}, DType::Int64);
    try {
      // The id lies in no shard; every rank rejects it, not just the one it would belong to.
      cpu::vocab_parallel_embedding_forward(ctx, tokens, shard, 4, kV, out);
      FAIL() << "expected megatron::Error for id " << bad;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("token id " + std::to_string(bad) + " at [1, 3]"), std::string::npos) << msg;
      EXPECT_NE(msg.find("12 rows"), std::string::npos) << msg;
    }
  }
}

}  // namespace
}  // namespace megatron

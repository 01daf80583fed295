// The tensor/sequence-parallel mappings: each forward's partner is its backward, shown as the adjoint
// identity Σ_r <f(x)_r, y_r> = Σ_r <x_r, g(y)_r> over the ranks of a thread group (for random x, y),
// (within fp32 rounding of the collectives' sums; a wrong partner is off by O(1)), and the
// collectives' values against sums computed here.
#include <gtest/gtest.h>

#include <functional>
#include <thread>

#include "megatron/core/tensor_parallel/mappings.h"
#include "megatron/runtime/philox.h"

namespace megatron {
namespace {

using Fn = std::function<Tensor(Context&, Communicator&, const Tensor&)>;

Tensor random_tensor(const Shape& shape, uint64_t seed) {
  std::vector<float> v(size_t(shape_numel(shape)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = philox_uniform(seed, 0, i) - 0.5f;
  return Tensor::from_floats(v, shape);
}

double dot(const Tensor& a, const Tensor& b) {
  const std::vector<float> x = a.to_floats(), y = b.to_floats();
  EXPECT_EQ(x.size(), y.size());
  double s = 0;
  for (size_t i = 0; i < x.size(); ++i) s += double(x[i]) * double(y[i]);
  return s;
}

// Runs f on x (shape x_shape per rank) and g on y (shape y_shape) on every rank; returns the two
// sides of the adjoint identity. `replicated_x`: every rank gets the same x (the input of a
// tensor-parallel region is the same everywhere); then Σ_r <x_r, g(y)_r> counts x once.
std::pair<double, double> adjoint_sides(int size, const Fn& f, const Fn& g, const Shape& x_shape, const Shape& y_shape,
                                        bool replicated_x = false) {
  auto comms = make_local_group(size, "tensor-parallel");
  std::vector<double> lhs(static_cast<size_t>(size)), rhs(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r]() {
      Context ctx;
      Communicator& c = *comms[size_t(r)];
      Tensor x = random_tensor(x_shape, replicated_x ? 100 : 100 + uint64_t(r));
      Tensor y = random_tensor(y_shape, 200 + uint64_t(r));
      Tensor fx = f(ctx, c, x);
      Tensor gy = g(ctx, c, y);
      lhs[size_t(r)] = dot(fx, y);
      rhs[size_t(r)] = replicated_x ? (r == 0 ? dot(x, gy) : 0.0) : dot(x, gy);
    });
  }
  for (auto& t : threads) t.join();
  double a = 0, b = 0;
  for (int r = 0; r < size; ++r) a += lhs[size_t(r)], b += rhs[size_t(r)];
  return {a, b};
}

const Fn identity = [](Context&, Communicator&, const Tensor& x) { return x.clone(); };
const Fn all_reduce = [](Context& ctx, Communicator& c, const Tensor& x) {
  Tensor y = x.clone();
  tensor_parallel::all_reduce_(ctx, c, y);
  return y;
};
const Fn all_gather = [](Context& ctx, Communicator& c, const Tensor& x) {
  return tensor_parallel::all_gather_sequence(ctx, c, x);
};
const Fn reduce_scatter = [](Context& ctx, Communicator& c, const Tensor& x) {
  return tensor_parallel::reduce_scatter_sequence(ctx, c, x);
};
const Fn split = [](Context&, Communicator& c, const Tensor& x) {
  return tensor_parallel::split_sequence(c, x).clone();
};

class Mappings : public ::testing::TestWithParam<int> {};

// copy_to_tensor_model_parallel_region: identity forward on a replicated input, all-reduce backward.
TEST_P(Mappings, CopyToRegionAndAllReduceAreAdjoint) {
  auto [a, b] = adjoint_sides(GetParam(), identity, all_reduce, {6, 2, 4}, {6, 2, 4}, /*replicated_x=*/true);
  EXPECT_NEAR(a, b, 1e-6 * std::abs(a));
}

// gather_from_sequence_parallel_region: all-gather forward, reduce-scatter backward (and
// reduce_scatter_to_sequence_parallel_region the other way round).
TEST_P(Mappings, AllGatherAndReduceScatterAreAdjoint) {
  const int n = GetParam();
  auto [a, b] = adjoint_sides(n, all_gather, reduce_scatter, {3, 2, 4}, {3 * int64_t(n), 2, 4});
  EXPECT_NEAR(a, b, 1e-6 * std::abs(a));
  auto [c, d] = adjoint_sides(n, reduce_scatter, all_gather, {3 * int64_t(n), 2, 4}, {3, 2, 4});
  EXPECT_NEAR(c, d, 1e-6 * std::abs(c));
}

// scatter_to_sequence_parallel_region: this rank's block of a replicated input forward, all-gather
// backward.
TEST_P(Mappings, SplitAndAllGatherAreAdjoint) {
  const int n = GetParam();
  auto [a, b] = adjoint_sides(n, split, all_gather, {2 * int64_t(n), 3, 2}, {2, 3, 2}, /*replicated_x=*/true);
  EXPECT_NEAR(a, b, 1e-6 * std::abs(a));
}

TEST_P(Mappings, CollectiveValues) {
  const int n = GetParam();
  auto comms = make_local_group(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r]() {
      Context ctx;
      Communicator& c = *comms[size_t(r)];
      // x_r = r + 1 everywhere; rows of the gathered tensor are rank blocks.
      Tensor x = Tensor::from_floats(std::vector<float>(4, float(r + 1)), {2, 2});
      const std::vector<float> g = tensor_parallel::all_gather_sequence(ctx, c, x).to_floats();
      for (int k = 0; k < n; ++k)
        for (int i = 0; i < 4; ++i) EXPECT_EQ(g[size_t(k * 4 + i)], float(k + 1));
      Tensor y = Tensor::from_floats(std::vector<float>(size_t(2 * n), 1.0f), {int64_t(2 * n), 1});
      const std::vector<float> rs = tensor_parallel::reduce_scatter_sequence(ctx, c, y).to_floats();
      EXPECT_EQ(rs, std::vector<float>(2, float(n)));
    });
  }
  for (auto& t : threads) t.join();
}

TEST(MappingsErrors, SequenceMustDivide) {
  auto comms = make_local_group(2);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(2);
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r]() {
      Context ctx;
      try {
        tensor_parallel::reduce_scatter_sequence(ctx, *comms[size_t(r)], Tensor::zeros({3, 2}, DType::Float32));
      } catch (const Error& e) {
        errors[size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_NE(errors[0].find("must divide"), std::string::npos) << errors[0];
}

INSTANTIATE_TEST_SUITE_P(GroupSizes, Mappings, ::testing::Values(1, 2, 4));

}  // namespace
}  // namespace megatron

// Expectations every Communicator backend must meet, shared by the local, MPI and NCCL tests (each
// runs them on its own ranks and devices).
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "megatron/core/comm/communicator.h"
#include "megatron/runtime/context.h"

namespace megatron::testing {

/// all_reduce with sum, max and min over every dtype, on the context's device, the three launched
/// before any is waited for and waited in another order: rank r contributes {r, 2r, -r}.
inline void expect_all_reduce_every_dtype_and_op(Communicator& w, Context& ctx) {
  const int r = w.rank(), n = w.size();
  const float sum = float(n * (n - 1) / 2);
  for (DType dt : {DType::Float32, DType::BFloat16, DType::Float16, DType::Int32, DType::Int64}) {
    auto make = [&] {
      return Tensor::from_floats({float(r), 2.f * r, -float(r)}, {3}).to(dt).to(ctx.device());
    };
    Tensor s = make(), mx = make(), mn = make();
    auto ws = w.all_reduce(ctx, s);
    auto wx = w.all_reduce(ctx, mx, ReduceOp::Max);
    auto wn = w.all_reduce(ctx, mn, ReduceOp::Min);
    wn->wait();  // any order of waits
    ws->wait();
    wx->wait();
    EXPECT_EQ(s.to_floats(), (std::vector<float>{sum, 2 * sum, -sum})) << to_string(dt);
    EXPECT_EQ(mx.to_floats(), (std::vector<float>{float(n - 1), 2.f * (n - 1), 0})) << to_string(dt);
    EXPECT_EQ(mn.to_floats(), (std::vector<float>{0, 0, -float(n - 1)})) << to_string(dt);
  }
}

/// all_to_all_v with uneven splits, empty parts among them, over every dtype, the five launched
/// before any is waited for: rank i sends (i + 2j + 1) % 3 rows of shape [2, 2] to rank j, row k
/// holding {v, -v, 0, 1} with v = 32 i + 4 j + k, so a row from or to the wrong rank, or a part at
/// the wrong offset, shows. Then the exchange where every part is empty.
inline void expect_all_to_all_v_every_dtype(Communicator& w, Context& ctx) {
  const int r = w.rank(), n = w.size();
  auto rows = [](int from, int to) { return int64_t((from + 2 * to + 1) % 3); };  // a one-rank group sends 1
  auto append_rows = [&](std::vector<float>& v, int from, int to) {
    for (int64_t k = 0; k < rows(from, to); ++k) {
      const float x = float(32 * from + 4 * to + k);
      v.insert(v.end(), {x, -x, 0.f, 1.f});
    }
  };
  std::vector<int64_t> input_splits, output_splits;
  std::vector<float> input_v, want_v;
  int64_t input_rows = 0, output_rows = 0;
  for (int q = 0; q < n; ++q) {
    input_splits.push_back(rows(r, q));
    output_splits.push_back(rows(q, r));
    input_rows += rows(r, q);
    output_rows += rows(q, r);
    append_rows(input_v, r, q);
    append_rows(want_v, q, r);
  }
  const std::vector<DType> dtypes = {DType::Float32, DType::BFloat16, DType::Float16, DType::Int32, DType::Int64};
  std::vector<Tensor> outputs;
  std::vector<std::unique_ptr<CommWork>> works;
  for (DType dt : dtypes) {
    Tensor input = Tensor::from_floats(input_v, {input_rows, 2, 2}).to(dt).to(ctx.device());
    outputs.push_back(Tensor::empty({output_rows, 2, 2}, dt, ctx.device()));
    works.push_back(w.all_to_all_v(ctx, input, input_splits, outputs.back(), output_splits));
  }
  for (size_t i = works.size(); i-- > 0;) works[i]->wait();  // any order of waits
  for (size_t i = 0; i < dtypes.size(); ++i) {
    // The expected values pass through the dtype (exact below 256 in bf16: up to 8 ranks).
    const std::vector<float> want = Tensor::from_floats(want_v, {output_rows, 2, 2}).to(dtypes[i]).to_floats();
    EXPECT_EQ(outputs[i].to_floats(), want) << to_string(dtypes[i]) << " on rank " << r;
  }
  const std::vector<int64_t> none(size_t(n), 0);
  Tensor empty_in = Tensor::empty({0, 3}, DType::BFloat16, ctx.device());
  Tensor empty_out = Tensor::empty({0, 3}, DType::BFloat16, ctx.device());
  w.all_to_all_v(ctx, empty_in, none, empty_out, none)->wait();
  EXPECT_EQ(empty_out.numel(), 0);
}

/// all_to_all_v's argument errors: each rank's own one-line error, before any communication.
inline void expect_all_to_all_v_argument_errors(Communicator& w, Context& ctx) {
  const int n = w.size();
  auto error_of = [&](const Tensor& input, const std::vector<int64_t>& input_splits, Tensor output,
                      const std::vector<int64_t>& output_splits) -> std::string {
    try {
      w.all_to_all_v(ctx, input, input_splits, output, output_splits)->wait();
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  auto expect_contains = [](const std::string& message, const std::string& part) {
    EXPECT_NE(message.find(part), std::string::npos) << message;
  };
  const std::vector<int64_t> ones(size_t(n), 1);
  Tensor input = Tensor::zeros({n, 2}, DType::Float32, ctx.device());
  Tensor output = Tensor::zeros({n, 2}, DType::Float32, ctx.device());
  const std::string n_str = std::to_string(n);

  std::string e = error_of(input, std::vector<int64_t>(size_t(n) + 1, 0), output, ones);
  expect_contains(e, "all_to_all_v on the " + w.name() + " group");
  expect_contains(e, ": input_splits has " + std::to_string(n + 1) + " entries for a group of " + n_str +
                         " ranks: pass one row count per rank");

  std::vector<int64_t> one_too_many = ones;
  one_too_many[0] = 2;
  std::string listed = "2";
  for (int q = 1; q < n; ++q) listed += ", 1";
  e = error_of(input, ones, output, one_too_many);
  expect_contains(e, ": output_splits (" + listed + ") sum to " + std::to_string(n + 1) + " rows but the tensor fp32[" +
                         n_str + ", 2] on ");
  expect_contains(e, " has " + n_str + ": they must sum to its dim 0");

  std::vector<int64_t> negative = ones;
  negative[0] = -1;
  expect_contains(error_of(input, negative, output, ones), ": input_splits[0] is -1: row counts must be non-negative");

  Tensor wider = Tensor::zeros({n, 3}, DType::Float32, ctx.device());
  expect_contains(error_of(input, ones, wider, ones), "must have the same dtype and the same shape after dim 0");
  expect_contains(error_of(input, ones, input, ones), "overlap: pass a separate output tensor");
}

}  // namespace megatron::testing

// Expectations every Communicator backend must meet, shared by the local, MPI and NCCL tests (each
// runs them on its own ranks and devices).
#pragma once

#include <gtest/gtest.h>

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

}  // namespace megatron::testing

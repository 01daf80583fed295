// The NCCL backend with one rank per GPU (every visible GPU, at least 2), the ranks as threads of
// this process: every collective against expected values, the in-place forms, uneven all-to-all,
// point-to-point in both directions, split groups (ncclCommSplit), identical sums on every rank,
// and async works waited in any order.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <thread>

#include "megatron/core/comm/comm_detail.h"
#include "megatron/core/comm/communicator.h"
#include "megatron/runtime/context.h"
#include "megatron/runtime/device.h"
#include "tests/core/comm/collective_checks.h"

namespace megatron {
namespace {

// Runs body(world, ctx) on a fresh NCCL world of every visible GPU, one thread per rank.
void on_every_gpu(const std::function<void(Communicator&, Context&)>& body) {
  const int n = cuda_device_count();
  if (n < 2) GTEST_SKIP() << "needs 2 GPUs, " << n << " visible";
  const std::vector<char> id = comm_detail::nccl_unique_id();
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto world = comm_detail::make_nccl_world(r, n, Device::cuda(r), id, std::chrono::seconds(60));
        Context ctx(Device::cuda(r));
        body(*world, ctx);
        ctx.synchronize();
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[size_t(r)], "") << "rank " << r;
}

Tensor floats(const std::vector<float>& v, DType dt, const Context& ctx) {
  return Tensor::from_floats(v, {int64_t(v.size())}, DType::Float32).to(dt).to(ctx.device());
}

std::vector<float> iota(int64_t n, float start) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = start + float(i);
  return v;
}

TEST(NcclCommunicator, AllReduceEveryDtypeAndOp) {
  on_every_gpu([](Communicator& w, Context& ctx) { testing::expect_all_reduce_every_dtype_and_op(w, ctx); });
}

TEST(NcclCommunicator, SumsAreIdenticalOnEveryRank) {
  on_every_gpu([](Communicator& w, Context& ctx) {
    const int n = w.size();
    std::vector<float> v(1 << 20);
    for (size_t i = 0; i < v.size(); ++i) v[i] = 1.0f / float(1 + i + 7 * w.rank()) * (i % 3 == 0 ? 1e7f : 1.f);
    Tensor t = floats(v, DType::Float32, ctx);
    w.all_reduce(ctx, t)->wait();
    Tensor all = Tensor::empty({int64_t(n) * t.numel()}, DType::Float32, ctx.device());
    w.all_gather(ctx, t, all)->wait();
    std::vector<float> host = all.to_floats();
    for (int k = 1; k < n; ++k) {
      EXPECT_EQ(0, std::memcmp(host.data(), host.data() + v.size() * size_t(k), v.size() * sizeof(float)))
          << "rank " << k;
    }
  });
}

TEST(NcclCommunicator, ReduceScatterAllGatherAndInPlace) {
  on_every_gpu([](Communicator& w, Context& ctx) {
    const int r = w.rank(), n = w.size();
    auto want = [&](int64_t i) { return 100.f * float(n * (n - 1) / 2) + float(n) * float(i); };
    for (DType dt : {DType::Float32, DType::BFloat16}) {
      Tensor input = floats(iota(2 * n, 100.f * r), dt, ctx);
      Tensor out = Tensor::empty({2}, dt, ctx.device());
      w.reduce_scatter(ctx, input, out)->wait();
      EXPECT_EQ(out.to_floats(), (std::vector<float>{want(2 * r), want(2 * r + 1)})) << to_string(dt);
      Tensor buf = floats(iota(2 * n, 100.f * r), dt, ctx);
      Tensor mine = buf.flat_slice(2 * r, 2);
      w.reduce_scatter(ctx, buf, mine)->wait();
      EXPECT_EQ(mine.to_floats(), (std::vector<float>{want(2 * r), want(2 * r + 1)})) << to_string(dt);
      // The in-place gather puts every rank's reduced block back: the whole sum everywhere.
      w.all_gather(ctx, mine, buf)->wait();
      std::vector<float> whole;
      for (int64_t i = 0; i < 2 * n; ++i) whole.push_back(want(i));
      EXPECT_EQ(buf.to_floats(), whole) << to_string(dt);
    }
  });
}

TEST(NcclCommunicator, BroadcastAndAllToAll) {
  on_every_gpu([](Communicator& w, Context& ctx) {
    const int r = w.rank(), n = w.size();
    for (int root = 0; root < n; ++root) {
      Tensor t = Tensor::from_ints({r, 10 * r}, {2}, DType::Int64, ctx.device());
      w.broadcast(ctx, t, root)->wait();
      EXPECT_EQ(t.to_ints(), (std::vector<int64_t>{root, 10 * root}));
    }
    std::vector<float> in_v, want;
    for (int j = 0; j < n; ++j) in_v.insert(in_v.end(), {10.f * r + j, 10.f * r + j});
    for (int i = 0; i < n; ++i) want.insert(want.end(), {10.f * i + r, 10.f * i + r});
    Tensor in = floats(in_v, DType::Float32, ctx);
    Tensor out = Tensor::empty({2 * n}, DType::Float32, ctx.device());
    w.all_to_all(ctx, in, out)->wait();
    EXPECT_EQ(out.to_floats(), want);
  });
}

TEST(NcclCommunicator, AllToAllVUnevenSplitsEveryDtype) {
  on_every_gpu([](Communicator& w, Context& ctx) {
    testing::expect_all_to_all_v_every_dtype(w, ctx);
    testing::expect_all_to_all_v_argument_errors(w, ctx);
  });
}

// The same on a one-rank NCCL world (one GPU suffices): the part a rank sends itself goes through
// NCCL's grouped send/recv on the communicator's stream like any other.
TEST(NcclCommunicator, AllToAllVOnOneRank) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no GPU";
  const std::vector<char> id = comm_detail::nccl_unique_id();
  auto world = comm_detail::make_nccl_world(0, 1, Device::cuda(0), id, std::chrono::seconds(60));
  Context ctx(Device::cuda(0));
  ASSERT_EQ(world->backend(), "nccl");
  testing::expect_all_to_all_v_every_dtype(*world, ctx);
  testing::expect_all_to_all_v_argument_errors(*world, ctx);
  ctx.synchronize();
}

TEST(NcclCommunicator, BatchSendRecvRingBothWays) {
  on_every_gpu([](Communicator& w, Context& ctx) {
    const int r = w.rank(), n = w.size();
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    Tensor a = floats({float(r), 1}, DType::BFloat16, ctx);
    Tensor b = Tensor::from_ints({r}, {1}, DType::Int64, ctx.device());
    Tensor ra = Tensor::empty({2}, DType::BFloat16, ctx.device());
    Tensor rb = Tensor::empty({1}, DType::Int64, ctx.device());
    auto work = w.batch_isend_irecv(
        ctx, {{P2POp::Recv, ra, prev}, {P2POp::Recv, rb, next}, {P2POp::Send, a, next}, {P2POp::Send, b, prev}});
    work->wait();
    EXPECT_EQ(ra.to_floats(), (std::vector<float>{float(prev), 1}));
    EXPECT_EQ(rb.to_ints(), std::vector<int64_t>{next});
  });
}

TEST(NcclCommunicator, SplitGroups) {
  on_every_gpu([](Communicator& w, Context& ctx) {
    const int r = w.rank(), n = w.size();
    auto g = w.split(r % 2, -r, "parity");  // ordered by descending world rank
    ASSERT_TRUE(g);
    std::vector<int> members;
    for (int q = n - 1; q >= 0; --q) {
      if (q % 2 == r % 2) members.push_back(q);
    }
    EXPECT_EQ(g->global_ranks(), members);
    EXPECT_EQ(g->global_ranks()[size_t(g->rank())], r);
    Tensor t = floats({float(r)}, DType::Float32, ctx);
    g->all_reduce(ctx, t)->wait();
    float want = 0;
    for (int q : members) want += float(q);
    EXPECT_EQ(t.to_floats(), std::vector<float>{want});
    auto rest = w.split(r == 0 ? -1 : 0, 0, "rest");  // rank 0 joins no group
    EXPECT_EQ(bool(rest), r != 0);
    if (rest) {
      EXPECT_EQ(rest->size(), n - 1);
      rest->barrier(ctx);
    }
    w.barrier(ctx);
  });
}

}  // namespace
}  // namespace megatron

// The MPI backend under mpirun (any number of ranks; CTest runs 2 and 4): every collective against
// expected values, the in-place forms, uneven all-to-all, point-to-point, split groups, and
// identical results on every rank.
#include <gtest/gtest.h>

#include <cstring>

#include "tests/core/comm/mpi/mpi_test.h"
#include "tests/core/comm/collective_checks.h"

namespace megatron {
namespace {

using testing::mpi_world;

std::vector<float> iota(int64_t n, float start) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = start + float(i);
  return v;
}

TEST(MpiCommunicator, World) {
  Communicator& w = mpi_world();
  EXPECT_EQ(w.backend(), "mpi");
  EXPECT_EQ(w.name(), "world");
  ASSERT_EQ(int(w.global_ranks().size()), w.size());
  for (int r = 0; r < w.size(); ++r) EXPECT_EQ(w.global_ranks()[r], r);
  EXPECT_EQ(w.rank(), detect_launch().rank);
}

TEST(MpiCommunicator, AllReduceEveryDtypeAndOp) {
  Context ctx;
  testing::expect_all_reduce_every_dtype_and_op(mpi_world(), ctx);
}

TEST(MpiCommunicator, Bf16SumsInFp32) {
  Communicator& w = mpi_world();
  Context ctx;
  // 256 + 1 + 1 + ... stays 256 in bf16 steps; staged through fp32 it is 256 + (n - 1), rounded once.
  Tensor t = Tensor::from_floats({w.rank() == 0 ? 256.f : 1.f}, {1}, DType::BFloat16);
  w.all_reduce(ctx, t)->wait();
  EXPECT_EQ(t.item(), Tensor::from_floats({256.f + float(w.size() - 1)}, {1}, DType::BFloat16).item());
}

TEST(MpiCommunicator, SumsAreIdenticalOnEveryRank) {
  Communicator& w = mpi_world();
  Context ctx;
  int n = w.size();
  std::vector<float> v(1000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = 1.0f / float(1 + i + 7 * w.rank()) * (i % 3 == 0 ? 1e7f : 1.f);
  Tensor t = Tensor::from_floats(v, {1000});
  w.all_reduce(ctx, t)->wait();
  Tensor all = Tensor::empty({int64_t(n) * 1000}, DType::Float32);
  w.all_gather(ctx, t, all)->wait();
  const float* p = all.data<float>();
  for (int k = 1; k < n; ++k) EXPECT_EQ(0, std::memcmp(p, p + 1000 * k, 1000 * sizeof(float))) << "rank " << k;
}

TEST(MpiCommunicator, ReduceScatterAndInPlace) {
  Communicator& w = mpi_world();
  Context ctx;
  int r = w.rank(), n = w.size();
  // Rank q's input element i is 100 q + i: the sum's element i is 100 n(n-1)/2 + n i.
  auto want = [&](int64_t i) { return 100.f * float(n * (n - 1) / 2) + float(n) * float(i); };
  for (DType dt : {DType::Float32, DType::BFloat16}) {
    Tensor input = Tensor::from_floats(iota(2 * n, 100.f * r), {2 * n}, dt);
    Tensor out = Tensor::empty({2}, dt);
    w.reduce_scatter(ctx, input, out)->wait();
    EXPECT_EQ(out.to_floats(), (std::vector<float>{want(2 * r), want(2 * r + 1)})) << to_string(dt);
    Tensor buf = Tensor::from_floats(iota(2 * n, 100.f * r), {2 * n}, dt);
    Tensor mine = buf.flat_slice(2 * r, 2);
    w.reduce_scatter(ctx, buf, mine)->wait();
    EXPECT_EQ(mine.to_floats(), (std::vector<float>{want(2 * r), want(2 * r + 1)})) << to_string(dt);
  }
}

TEST(MpiCommunicator, AllGatherAndInPlace) {
  Communicator& w = mpi_world();
  Context ctx;
  int r = w.rank(), n = w.size();
  std::vector<float> want;
  for (int q = 0; q < n; ++q) want.insert(want.end(), {float(q), float(q) + 0.5f});
  Tensor input = Tensor::from_floats({float(r), float(r) + 0.5f}, {2}, DType::BFloat16);
  Tensor out = Tensor::empty({n, 2}, DType::BFloat16);
  w.all_gather(ctx, input, out)->wait();
  EXPECT_EQ(out.to_floats(), want);
  Tensor buf = Tensor::zeros({2 * n}, DType::BFloat16);
  Tensor mine = buf.flat_slice(2 * r, 2);
  mine.copy_from(input);
  w.all_gather(ctx, mine, buf)->wait();
  EXPECT_EQ(buf.to_floats(), want);
}

TEST(MpiCommunicator, BroadcastFromEveryRoot) {
  Communicator& w = mpi_world();
  Context ctx;
  for (int root = 0; root < w.size(); ++root) {
    Tensor t = Tensor::from_ints({w.rank(), 10 * w.rank()}, {2}, DType::Int64);
    w.broadcast(ctx, t, root)->wait();
    EXPECT_EQ(t.to_ints(), (std::vector<int64_t>{root, 10 * root}));
  }
}

TEST(MpiCommunicator, AllToAllAndAliased) {
  Communicator& w = mpi_world();
  Context ctx;
  int r = w.rank(), n = w.size();
  // Block j of rank i's input holds 10 i + j (two elements each); block i of rank j's output too.
  std::vector<float> in_v, want;
  for (int j = 0; j < n; ++j) in_v.insert(in_v.end(), {10.f * r + j, 10.f * r + j});
  for (int i = 0; i < n; ++i) want.insert(want.end(), {10.f * i + r, 10.f * i + r});
  Tensor in = Tensor::from_floats(in_v, {2 * n});
  Tensor out = Tensor::empty({2 * n}, DType::Float32);
  w.all_to_all(ctx, in, out)->wait();
  EXPECT_EQ(out.to_floats(), want);
  w.all_to_all(ctx, in, in)->wait();
  EXPECT_EQ(in.to_floats(), want);
}

TEST(MpiCommunicator, AllToAllVUnevenSplitsEveryDtype) {
  Context ctx;
  testing::expect_all_to_all_v_every_dtype(mpi_world(), ctx);
}

TEST(MpiCommunicator, AllToAllVArgumentErrorsAreOneLine) {
  Context ctx;
  testing::expect_all_to_all_v_argument_errors(mpi_world(), ctx);
}

TEST(MpiCommunicator, AllToAllVOnASplitGroup) {
  // The parity groups: rank order within the group, not the world, decides where rows go.
  Communicator& w = mpi_world();
  auto g = w.split(w.rank() % 2, w.rank(), "parity");
  Context ctx;
  testing::expect_all_to_all_v_every_dtype(*g, ctx);
}

TEST(MpiCommunicator, BatchSendRecvRing) {
  Communicator& w = mpi_world();
  Context ctx;
  int r = w.rank(), n = w.size();
  int next = (r + 1) % n, prev = (r + n - 1) % n;
  Tensor a = Tensor::from_floats({float(r), 1}, {2}, DType::BFloat16);
  Tensor b = Tensor::from_ints({r}, {1}, DType::Int64);
  Tensor ra = Tensor::empty({2}, DType::BFloat16), rb = Tensor::empty({1}, DType::Int64);
  // Both directions in one batch, the receives listed first.
  auto work = w.batch_isend_irecv(ctx, {{P2POp::Recv, ra, prev},
                                        {P2POp::Recv, rb, next},
                                        {P2POp::Send, a, next},
                                        {P2POp::Send, b, prev}});
  work->wait();
  work->wait();
  EXPECT_EQ(ra.to_floats(), (std::vector<float>{float(prev), 1}));
  EXPECT_EQ(rb.to_ints(), std::vector<int64_t>{next});
}

TEST(MpiCommunicator, SplitGroups) {
  Communicator& w = mpi_world();
  Context ctx;
  int r = w.rank(), n = w.size();
  // Parity groups ordered by descending world rank.
  auto g = w.split(r % 2, -r, "parity");
  ASSERT_TRUE(g);
  EXPECT_EQ(g->name(), "parity");
  std::vector<int> members;
  for (int q = n - 1; q >= 0; --q) {
    if (q % 2 == r % 2) members.push_back(q);
  }
  EXPECT_EQ(g->global_ranks(), members);
  EXPECT_EQ(g->global_ranks()[size_t(g->rank())], r);
  Tensor t = Tensor::from_floats({float(r)}, {1});
  g->all_reduce(ctx, t)->wait();
  float want = 0;
  for (int q : members) want += float(q);
  EXPECT_EQ(t.item(), want);
  Tensor gathered = Tensor::empty({g->size()}, DType::Float32);
  g->all_gather(ctx, Tensor::from_floats({float(r)}, {1}), gathered)->wait();
  std::vector<float> want_g(members.begin(), members.end());
  EXPECT_EQ(gathered.to_floats(), want_g);
  // Rank 0 joins no group; a split of a split maps to world ranks.
  auto rest = w.split(r == 0 ? -1 : 0, 0, "rest");
  EXPECT_EQ(bool(rest), r != 0);
  if (rest) {
    EXPECT_EQ(rest->size(), n - 1);
    rest->barrier(ctx);
  }
  auto single = g->split(g->rank(), 0, "single");
  EXPECT_EQ(single->global_ranks(), std::vector<int>{r});
  w.barrier(ctx);
}

TEST(MpiCommunicator, ArgumentErrorsAreOneLine) {
  Communicator& w = mpi_world();
  Context ctx;
  Tensor in = Tensor::empty({3}, DType::Float32), out = Tensor::empty({2}, DType::Float32);
  EXPECT_THROW(w.all_gather(ctx, in, out), Error);
  EXPECT_THROW(w.broadcast(ctx, in, w.size()), Error);
  Tensor u8 = Tensor::empty({2}, DType::UInt8);
  EXPECT_THROW(w.all_reduce(ctx, u8), Error);
}

}  // namespace
}  // namespace megatron

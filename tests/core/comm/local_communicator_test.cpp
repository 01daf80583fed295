// The local backend (threads of one process): every collective against expected values, in-place
// forms, uneven all-to-all, split groups, point-to-point order, and timeouts that name the
// operation and the group.
#include <gtest/gtest.h>

#include <functional>
#include <thread>

#include "megatron/core/comm/communicator.h"
#include "tests/core/comm/collective_checks.h"

namespace megatron {
namespace {

// Runs fn(comm) on one thread per rank; rethrows the first rank's exception.
void run_ranks(std::vector<std::unique_ptr<Communicator>>& comms, const std::function<void(Communicator&)>& fn) {
  std::vector<std::exception_ptr> errors(comms.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < comms.size(); ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(*comms[r]);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

void run_ranks(int size, const std::function<void(Communicator&)>& fn) {
  auto comms = make_local_group(size);
  run_ranks(comms, fn);
}

std::vector<float> iota(int n, float start, float step = 1) {
  std::vector<float> v(n);
  for (int i = 0; i < n; ++i) v[i] = start + step * i;
  return v;
}

TEST(LocalCommunicator, AllReduceSumMaxMinAcrossDtypes) {
  run_ranks(4, [](Communicator& c) {
    Context ctx;
    testing::expect_all_reduce_every_dtype_and_op(c, ctx);
  });
}

TEST(LocalCommunicator, Bf16SumsInFp32AndRoundsOnce) {
  // 256 + 1 + 1 in bf16 steps would stay 256 (8 bits of mantissa); in fp32 it is 258.
  run_ranks(3, [](Communicator& c) {
    Context ctx;
    Tensor t = Tensor::from_floats({c.rank() == 0 ? 256.f : 1.f}, {1}, DType::BFloat16);
    c.all_reduce(ctx, t)->wait();
    EXPECT_EQ(t.item(), 258.f);
  });
}

TEST(LocalCommunicator, Fp32SumIsInRankOrderAndIdenticalOnEveryRank) {
  std::vector<std::vector<float>> results(4);
  run_ranks(4, [&](Communicator& c) {
    Context ctx;
    const float vals[4] = {1e8f, 1.f, -1e8f, 1.f};  // ((1e8 + 1) - 1e8) + 1 = 1 in fp32
    Tensor t = Tensor::from_floats({vals[c.rank()]}, {1});
    c.all_reduce(ctx, t)->wait();
    results[c.rank()] = t.to_floats();
  });
  for (auto& r : results) EXPECT_EQ(r, results[0]);
  EXPECT_EQ(results[0][0], ((1e8f + 1.f) - 1e8f) + 1.f);
}

TEST(LocalCommunicator, ReduceScatterAndInPlace) {
  run_ranks(4, [](Communicator& c) {
    Context ctx;
    int r = c.rank();
    // rank r's input: 8 values r*100 + i; block b of the sum = sum_r (r*100) + 4*i for i in block b.
    Tensor input = Tensor::from_floats(iota(8, 100.f * r), {8});
    Tensor out = Tensor::empty({2}, DType::Float32);
    c.reduce_scatter(ctx, input, out)->wait();
    std::vector<float> want = {600.f + 4 * (2 * r), 600.f + 4 * (2 * r + 1)};
    EXPECT_EQ(out.to_floats(), want);
    Tensor in_place = Tensor::from_floats(iota(8, 100.f * r), {8});
    Tensor slice = in_place.flat_slice(2 * r, 2);
    c.reduce_scatter(ctx, in_place, slice)->wait();
    EXPECT_EQ(slice.to_floats(), want);
  });
}

TEST(LocalCommunicator, AllGatherAndInPlace) {
  run_ranks(3, [](Communicator& c) {
    Context ctx;
    int r = c.rank();
    Tensor input = Tensor::from_floats({float(r), float(r) + 0.5f}, {2}, DType::BFloat16);
    Tensor out = Tensor::empty({3, 2}, DType::BFloat16);
    c.all_gather(ctx, input, out)->wait();
    std::vector<float> want = {0, 0.5, 1, 1.5, 2, 2.5};
    EXPECT_EQ(out.to_floats(), want);
    Tensor buf = Tensor::zeros({6}, DType::BFloat16);
    Tensor mine = buf.flat_slice(2 * r, 2);
    mine.copy_from(input);
    c.all_gather(ctx, mine, buf)->wait();
    EXPECT_EQ(buf.to_floats(), want);
  });
}

TEST(LocalCommunicator, BroadcastAndAllToAll) {
  run_ranks(4, [](Communicator& c) {
    Context ctx;
    int r = c.rank();
    Tensor t = Tensor::from_ints({r, r * 2}, {2}, DType::Int64);
    c.broadcast(ctx, t, 2)->wait();
    EXPECT_EQ(t.to_ints(), (std::vector<int64_t>{2, 4}));
    // Block j of rank i's input = 10 i + j; block i of rank j's output = 10 i + j.
    Tensor in = Tensor::from_floats(iota(4, 10.f * r), {4}, DType::Int32);
    Tensor out = Tensor::empty({4}, DType::Int32);
    c.all_to_all(ctx, in, out)->wait();
    EXPECT_EQ(out.to_floats(), (std::vector<float>{float(r), 10.f + r, 20.f + r, 30.f + r}));
    c.all_to_all(ctx, in, in)->wait();  // in place
    EXPECT_EQ(in.to_floats(), out.to_floats());
  });
}

TEST(LocalCommunicator, AllToAllVUnevenSplitsEveryDtype) {
  for (int size : {1, 2, 3, 4}) {
    run_ranks(size, [](Communicator& c) {
      Context ctx;
      testing::expect_all_to_all_v_every_dtype(c, ctx);
    });
  }
}

TEST(LocalCommunicator, AllToAllVArgumentErrorsAreOneLine) {
  run_ranks(3, [](Communicator& c) {
    Context ctx;
    testing::expect_all_to_all_v_argument_errors(c, ctx);
  });
}

TEST(LocalCommunicator, AllToAllVSplitsThatDisagreeAcrossRanksAreAnErrorOnEveryRank) {
  // Rank 0 sends one row to rank 1, which expects two: both ranks report the same pair.
  std::vector<std::string> messages(2);
  auto comms = make_local_group(2, "expert-model-parallel");
  run_ranks(comms, [&](Communicator& c) {
    Context ctx;
    const int r = c.rank();
    Tensor input = Tensor::zeros({2}, DType::Float32), output = Tensor::zeros({r == 0 ? 2 : 3}, DType::Float32);
    const std::vector<int64_t> input_splits = {1, 1};
    const std::vector<int64_t> output_splits = r == 0 ? std::vector<int64_t>{1, 1} : std::vector<int64_t>{2, 1};
    try {
      c.all_to_all_v(ctx, input, input_splits, output, output_splits)->wait();
    } catch (const Error& e) {
      messages[size_t(r)] = e.what();
    }
    c.barrier(ctx);  // the group is usable after the error
  });
  for (const std::string& m : messages) {
    EXPECT_EQ(m,
              "all_to_all_v on the expert-model-parallel group (world ranks 0, 1): group rank 0's input_splits[1] is 1 "
              "but group rank 1's output_splits[0] is 2: input_splits[j] on rank i must equal output_splits[i] on "
              "rank j");
  }
}

TEST(LocalCommunicator, BatchSendRecvRingAndOrder) {
  run_ranks(4, [](Communicator& c) {
    Context ctx;
    int r = c.rank(), n = c.size();
    Tensor a = Tensor::from_floats({float(r)}, {1}), b = Tensor::from_floats({float(r) + 0.5f}, {1});
    Tensor ra = Tensor::empty({1}, DType::Float32), rb = Tensor::empty({1}, DType::Float32);
    // Receives posted before the sends they match; two messages to the same peer keep their order.
    auto recv = c.batch_isend_irecv(ctx, {{P2POp::Recv, ra, (r + n - 1) % n}, {P2POp::Recv, rb, (r + n - 1) % n}});
    auto send = c.batch_isend_irecv(ctx, {{P2POp::Send, a, (r + 1) % n}, {P2POp::Send, b, (r + 1) % n}});
    send->wait();
    recv->wait();
    recv->wait();  // idempotent
    int prev = (r + n - 1) % n;
    EXPECT_EQ(ra.item(), float(prev));
    EXPECT_EQ(rb.item(), float(prev) + 0.5f);
  });
}

TEST(LocalCommunicator, SplitGroupsOrderedByKey) {
  run_ranks(4, [](Communicator& c) {
    Context ctx;
    int r = c.rank();
    // Even and odd ranks; key reverses the order; rank 3 joins no group in the second split.
    auto g = c.split(r % 2, -r, "parity");
    ASSERT_TRUE(g);
    EXPECT_EQ(g->size(), 2);
    EXPECT_EQ(g->name(), "parity");
    EXPECT_EQ(g->rank(), r < 2 ? 1 : 0);
    EXPECT_EQ(g->global_ranks(), (r % 2 == 0 ? std::vector<int>{2, 0} : std::vector<int>{3, 1}));
    Tensor t = Tensor::from_floats({float(r)}, {1});
    g->all_reduce(ctx, t)->wait();
    EXPECT_EQ(t.item(), r % 2 == 0 ? 2.f : 4.f);
    auto h = c.split(r == 3 ? -1 : 0, 0, "three");
    EXPECT_EQ(bool(h), r != 3);
    if (h) {
      EXPECT_EQ(h->size(), 3);
      // A subgroup of a subgroup maps to world ranks.
      auto single = g->split(g->rank(), 0, "single");
      EXPECT_EQ(single->global_ranks(), std::vector<int>{r});
      h->barrier(ctx);
    } else {
      g->split(g->rank(), 0, "single");
    }
  });
}

TEST(LocalCommunicator, OneRankWorldIsANoOp) {
  auto comms = make_local_group(1);
  Communicator& c = *comms[0];
  Context ctx;
  Tensor t = Tensor::from_floats({1, 2}, {2});
  c.all_reduce(ctx, t)->wait();
  Tensor out = Tensor::empty({2}, DType::Float32);
  c.all_gather(ctx, t, out)->wait();
  c.reduce_scatter(ctx, t, out)->wait();
  c.broadcast(ctx, t, 0)->wait();
  c.barrier(ctx);
  EXPECT_EQ(out.to_floats(), (std::vector<float>{1, 2}));
  EXPECT_EQ(c.split(0, 0, "tensor-parallel")->size(), 1);
}

TEST(LocalCommunicator, TimeoutNamesTheOperationAndTheGroup) {
  auto world = make_local_group(3, "data-parallel");
  for (auto& c : world) c->set_timeout(std::chrono::milliseconds(200));
  std::vector<std::string> messages(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      Context ctx;
      Tensor t = Tensor::from_floats({1}, {1});
      if (r == 2) return;  // rank 2 skips the collective
      try {
        world[r]->all_reduce(ctx, t)->wait();
      } catch (const Error& e) {
        messages[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(messages[r],
              "all_reduce on the data-parallel group (world ranks 0, 1, 2) did not complete within 200 ms "
              "(--distributed-timeout-minutes): a rank of the group is dead or stuck (group ranks 2 had not reached it)");
  }
}

TEST(LocalCommunicator, RecvTimeoutAndMismatchedCollectivesAreErrors) {
  auto comms = make_local_group(2, "pipeline");
  for (auto& c : comms) c->set_timeout(std::chrono::milliseconds(100));
  Context ctx;
  Tensor t = Tensor::empty({1}, DType::Float32);
  auto w = comms[0]->batch_isend_irecv(ctx, {{P2POp::Recv, t, 1}});
  try {
    w->wait();
    FAIL() << "no timeout";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("recv from group rank 1 on the pipeline group (world ranks 0, 1)"),
              std::string::npos)
        << e.what();
  }
  auto fresh = make_local_group(2);
  for (auto& c : fresh) c->set_timeout(std::chrono::seconds(5));
  EXPECT_THROW(run_ranks(fresh,
                         [](Communicator& c) {
                           Context ctx;
                           Tensor x = Tensor::zeros({c.rank() + 1}, DType::Float32);
                           c.all_reduce(ctx, x)->wait();
                         }),
               Error);
}

TEST(LocalCommunicator, ArgumentErrorsAreOneLine) {
  auto comms = make_local_group(2);
  Context ctx;
  Tensor in = Tensor::empty({3}, DType::Float32), out = Tensor::empty({2}, DType::Float32);
  EXPECT_THROW(comms[0]->all_gather(ctx, in, out), Error);
  EXPECT_THROW(comms[0]->reduce_scatter(ctx, in, out), Error);
  EXPECT_THROW(comms[0]->broadcast(ctx, in, 2), Error);
  Tensor u8 = Tensor::empty({2}, DType::UInt8);
  EXPECT_THROW(comms[0]->all_reduce(ctx, u8), Error);
  EXPECT_THROW(comms[0]->batch_isend_irecv(ctx, {{P2POp::Send, in, 0}}), Error);
}

}  // namespace
}  // namespace megatron

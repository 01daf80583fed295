// The watchdog behind the NCCL backend's timeouts (Note [NCCL watchdog]): completed operations are
// released, one past its deadline is reported once — operation, group and the flag — with its
// abort action run, and a destroyed group's entries are dropped. Fake completion tests stand in for
// CUDA events.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "megatron/core/comm/watchdog.h"

namespace megatron::comm_detail {
namespace {

using namespace std::chrono_literals;

bool eventually(const std::function<bool()>& f) {
  for (int i = 0; i < 200; ++i) {
    if (f()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return false;
}

Watchdog::Entry entry(std::atomic<bool>& done, std::atomic<int>& released, std::chrono::milliseconds timeout,
                      const void* owner = nullptr) {
  Watchdog::Entry e;
  e.done = [&done] { return done.load(); };
  e.release = [&released] { released += 1; };
  e.deadline = std::chrono::steady_clock::now() + timeout;
  e.timeout = timeout;
  e.what = "all_reduce on the data-parallel group (world ranks 0, 1)";
  e.owner = owner;
  return e;
}

TEST(Watchdog, CompletedOperationsAreReleased) {
  std::atomic<int> timeouts{0};
  Watchdog w([&](const std::string&) { timeouts += 1; }, 5ms);
  std::atomic<bool> done{false};
  std::atomic<int> released{0};
  w.watch(entry(done, released, 10s));
  std::this_thread::sleep_for(30ms);
  EXPECT_EQ(w.pending(), 1u);
  done = true;
  EXPECT_TRUE(eventually([&] { return w.pending() == 0; }));
  EXPECT_EQ(released.load(), 1);
  EXPECT_EQ(timeouts.load(), 0);
}

TEST(Watchdog, AStuckOperationIsReportedAndAborted) {
  std::string message;
  std::atomic<int> timeouts{0};
  Watchdog w(
      [&](const std::string& m) {
        message = m;
        timeouts += 1;
      },
      5ms);
  std::atomic<bool> done{false};
  std::atomic<int> released{0};
  std::atomic<bool> aborted{false};
  Watchdog::Entry e = entry(done, released, 50ms);
  e.abort = [&] { aborted = true; };
  w.watch(std::move(e));
  ASSERT_TRUE(eventually([&] { return timeouts.load() == 1; }));
  EXPECT_TRUE(aborted.load());
  EXPECT_NE(message.find("all_reduce on the data-parallel group (world ranks 0, 1) did not complete within 50 ms "
                         "(--distributed-timeout-minutes): a rank of the group is dead or stuck"),
            std::string::npos)
      << message;
  std::this_thread::sleep_for(30ms);
  EXPECT_EQ(timeouts.load(), 1);  // reported once
  EXPECT_EQ(released.load(), 1);
}

TEST(Watchdog, ForgettingAGroupDropsItsEntries) {
  Watchdog w([](const std::string&) {}, 5ms);
  std::atomic<bool> done{false};
  std::atomic<int> released{0};
  int group_a = 0, group_b = 0;
  w.watch(entry(done, released, 10s, &group_a));
  w.watch(entry(done, released, 10s, &group_b));
  w.forget_owner(&group_a);
  EXPECT_EQ(w.pending(), 1u);
  EXPECT_EQ(released.load(), 1);
  done = true;
  EXPECT_TRUE(eventually([&] { return w.pending() == 0; }));
}

}  // namespace
}  // namespace megatron::comm_detail

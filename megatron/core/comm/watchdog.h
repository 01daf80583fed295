// Watchdog: the operations a backend cannot time out on the host (NCCL kernels run on streams; the
// host only notices a stuck collective at its next synchronisation, and then waits forever) are
// registered here with a completion test and a deadline. A background thread polls them; when one
// passes its deadline it prints the timeout error (the same words as every backend's: operation,
// group, world ranks, --distributed-timeout-minutes), runs the entry's abort action (NCCL:
// ncclCommAbort, which unblocks the streams) and ends the process (abort_job, then exit), so a dead
// or stuck rank never leaves the job hanging — PyTorch's NCCL watchdog, in short.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <mutex>
#include <string>
#include <thread>

namespace megatron::comm_detail {

class Watchdog {
 public:
  struct Entry {
    std::function<bool()> done;  // polled from the watchdog thread; true once complete
    std::function<void()> release;  // called once, from the watchdog thread, after done() (may be empty)
    std::chrono::steady_clock::time_point deadline;
    std::string what;                // "all_reduce on the data-parallel group (world ranks 0, 1)"
    std::chrono::milliseconds timeout{0};
    const void* owner = nullptr;     // forget_owner() drops an owner's entries (a destroyed group)
    std::function<void()> abort;     // before ending the process on a timeout (may be empty)
  };
  /// What happens after a timeout was reported and the entry aborted: the default ends the process
  /// (abort_job(1), then _exit(1)); tests install their own.
  using OnTimeout = std::function<void(const std::string& message)>;

  /// The process's watchdog (started on first use, polling every `poll`).
  static Watchdog& instance();
  explicit Watchdog(OnTimeout on_timeout = {}, std::chrono::milliseconds poll = std::chrono::milliseconds(50));
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  void watch(Entry e);
  /// Drops (after releasing) every entry of `owner`; call before destroying what they test.
  void forget_owner(const void* owner);
  size_t pending() const;

 private:
  void run();

  OnTimeout on_timeout_;
  std::chrono::milliseconds poll_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::list<Entry> entries_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace megatron::comm_detail

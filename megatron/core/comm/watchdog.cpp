#include "megatron/core/comm/watchdog.h"

#include <unistd.h>

#include <cstdio>

#include <fmt/format.h>

#include "megatron/core/comm/comm_detail.h"

namespace megatron::comm_detail {

Watchdog& Watchdog::instance() {
  static Watchdog w;
  return w;
}

Watchdog::Watchdog(OnTimeout on_timeout, std::chrono::milliseconds poll)
    : on_timeout_(std::move(on_timeout)), poll_(poll) {
  if (!on_timeout_) {
    on_timeout_ = [](const std::string& message) {
      std::fprintf(stderr, "error: %s\n", message.c_str());
      std::fflush(stderr);
      abort_job(1);
      ::_exit(1);
    };
  }
  thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Watchdog::watch(Entry e) {
  std::lock_guard<std::mutex> lock(mu_);
  entries_.push_back(std::move(e));
}

void Watchdog::forget_owner(const void* owner) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->owner == owner) {
      if (it->release) it->release();
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
}

size_t Watchdog::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

void Watchdog::run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    const auto now = std::chrono::steady_clock::now();
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (it->done()) {
        if (it->release) it->release();
        it = entries_.erase(it);
        continue;
      }
      if (now > it->deadline) {
        const std::string message = fmt::format(
            "{} did not complete within {} (--distributed-timeout-minutes): a rank of the group is dead or stuck",
            it->what, format_duration(it->timeout));
        if (it->abort) it->abort();
        Entry timed_out = std::move(*it);
        entries_.erase(it);
        lock.unlock();
        on_timeout_(message);  // ends the process by default
        if (timed_out.release) timed_out.release();
        lock.lock();
        break;
      }
      ++it;
    }
    cv_.wait_for(lock, poll_, [this] { return stop_; });
  }
}

}  // namespace megatron::comm_detail

// Timers (Megatron's megatron/core/timers.py): named wall-clock timers with a log level; those at or
// below --timing-log-level are printed after the iteration line as
//   (min, max) time across ranks (ms):
//       forward-backward ...............................: (1234.56, 1234.56)
// With one process min == max.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace megatron {

class Timers {
 public:
  explicit Timers(int log_level) : log_level_(log_level) {}
  /// Starts timer `name` (level: 0 always shown, 1 and 2 more detailed).
  void start(const std::string& name, int level = 0);
  void stop(const std::string& name);
  /// Elapsed milliseconds since the last reset (and resets when `reset`).
  double elapsed_ms(const std::string& name, bool reset = true);
  /// The block printed under the iteration line; resets the printed timers.
  std::string log(double normalizer = 1.0);
  /// The timers log() would print, in seconds divided by `normalizer`, without resetting them
  /// (Megatron's Timers.write for --log-timers-to-tensorboard: "<name>-time" scalars).
  std::vector<std::pair<std::string, double>> values(double normalizer = 1.0);
  int log_level() const { return log_level_; }

 private:
  struct Timer {
    int level = 0;
    bool running = false;
    std::chrono::steady_clock::time_point started;
    double elapsed_ms = 0;
  };
  int log_level_;
  std::map<std::string, Timer> timers_;
  std::vector<std::string> order_;
};

}  // namespace megatron

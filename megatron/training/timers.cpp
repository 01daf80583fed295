#include "megatron/training/timers.h"

#include <fmt/format.h>

#include <algorithm>

#include "megatron/runtime/check.h"

namespace megatron {

void Timers::start(const std::string& name, int level) {
  auto [it, inserted] = timers_.try_emplace(name);
  if (inserted) {
    it->second.level = level;
    order_.push_back(name);
  }
  MG_ASSERT(!it->second.running, "timer {} started twice", name);
  it->second.running = true;
  it->second.started = std::chrono::steady_clock::now();
}

void Timers::stop(const std::string& name) {
  auto it = timers_.find(name);
  MG_ASSERT(it != timers_.end() && it->second.running, "timer {} stopped while not running", name);
  it->second.elapsed_ms +=
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - it->second.started).count();
  it->second.running = false;
}

double Timers::elapsed_ms(const std::string& name, bool reset) {
  auto it = timers_.find(name);
  if (it == timers_.end()) return 0.0;
  double ms = it->second.elapsed_ms;
  if (it->second.running) {
    ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - it->second.started).count();
    if (reset) it->second.started = std::chrono::steady_clock::now();
  }
  if (reset) it->second.elapsed_ms = 0;
  return ms;
}

std::vector<std::pair<std::string, double>> Timers::values(double normalizer) {
  std::vector<std::pair<std::string, double>> out;
  for (const std::string& name : order_) {
    if (timers_[name].level > log_level_) continue;
    out.emplace_back(name, elapsed_ms(name, false) / 1000.0 / normalizer);
  }
  return out;
}

std::string Timers::log(double normalizer) {
  std::string out;
  for (const std::string& name : order_) {
    Timer& t = timers_[name];
    if (t.level > log_level_) continue;
    double ms = elapsed_ms(name, true) / normalizer;
    std::string dots(std::max<size_t>(4, 48 - std::min<size_t>(name.size(), 44)), '.');
    out += fmt::format("    {} {}: ({:.2f}, {:.2f})\n", name, dots, ms, ms);
  }
  return out.empty() ? out : "(min, max) time across ranks (ms):\n" + out;
}

}  // namespace megatron

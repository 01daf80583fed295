#include "megatron/runtime/profiler.h"

#include <fmt/format.h>

#include <algorithm>

#include "megatron/runtime/allocator.h"
#include "megatron/runtime/context.h"

namespace megatron {

namespace {
using Clock = std::chrono::steady_clock;
}

OpProfiler::~OpProfiler() { reset(); }

void OpProfiler::begin(Context& ctx, const char* op) {
  Open o{op, nullptr, Clock::now()};
  auto& hooks = detail::cuda_hooks();
  if (ctx.is_cuda() && hooks.event_record) o.start_event = hooks.event_record(ctx.stream());
  open_.push_back(o);
}

void OpProfiler::end(Context& ctx) {
  if (open_.empty()) return;
  Open o = open_.back();
  open_.pop_back();
  if (!open_.empty()) {  // nested ops (an op calling another) count once, in the outer one
    auto& hooks = detail::cuda_hooks();
    if (o.start_event && hooks.event_destroy) hooks.event_destroy(o.start_event);
    return;
  }
  Closed c{o.op, o.start_event, nullptr, 0.0};
  auto& hooks = detail::cuda_hooks();
  if (o.start_event && hooks.event_record) c.end_event = hooks.event_record(ctx.stream());
  c.host_ms = std::chrono::duration<double, std::milli>(Clock::now() - o.start).count();
  closed_.push_back(c);
}

std::map<std::string, OpProfiler::Entry> OpProfiler::collect(Context& ctx) {
  ctx.synchronize();
  std::map<std::string, Entry> out;
  auto& hooks = detail::cuda_hooks();
  for (const Closed& c : closed_) {
    Entry& e = out[c.op];
    e.calls += 1;
    e.ms += c.end_event && hooks.event_elapsed_ms ? hooks.event_elapsed_ms(c.start_event, c.end_event) : c.host_ms;
    e.host_ms += c.host_ms;
  }
  reset();
  return out;
}

void OpProfiler::reset() {
  auto& hooks = detail::cuda_hooks();
  for (const Closed& c : closed_) {
    if (hooks.event_destroy) {
      if (c.start_event) hooks.event_destroy(c.start_event);
      if (c.end_event) hooks.event_destroy(c.end_event);
    }
  }
  closed_.clear();
}

std::string format_op_table(const std::map<std::string, OpProfiler::Entry>& ops, double wall_ms, int64_t iterations,
                            size_t top) {
  std::vector<std::pair<std::string, OpProfiler::Entry>> rows(ops.begin(), ops.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
  const double n = double(std::max<int64_t>(iterations, 1));
  double total = 0;
  for (const auto& r : rows) total += r.second.ms;
  std::string out = fmt::format("{:<44} {:>12} {:>7} {:>9} {:>12}\n", "op", "ms/iteration", "share", "calls/it",
                                "host ms/it");
  auto line = [&](const std::string& name, double ms, double host_ms, double calls) {
    out += fmt::format("{:<44} {:>12.3f} {:>6.1f}% {:>9.1f} {:>12.3f}\n", name.substr(0, 44), ms / n,
                       wall_ms > 0 ? 100.0 * ms / wall_ms : 0.0, calls / n, host_ms / n);
  };
  OpProfiler::Entry rest;
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& [op, e] = rows[i];
    if (i < top) {
      line(op, e.ms, e.host_ms, double(e.calls));
    } else {
      rest.ms += e.ms, rest.host_ms += e.host_ms, rest.calls += e.calls;
    }
  }
  if (rows.size() > top) line(fmt::format("({} other ops)", rows.size() - top), rest.ms, rest.host_ms, double(rest.calls));
  out += fmt::format("{:<44} {:>12.3f} {:>6.1f}%\n", "(between ops: launch gaps, host work, syncs)",
                     std::max(0.0, wall_ms - total) / n, wall_ms > 0 ? 100.0 * std::max(0.0, wall_ms - total) / wall_ms : 0.0);
  out += fmt::format("{:<44} {:>12.3f}\n", "(iteration, wall)", wall_ms / n);
  return out;
}

void device_profiler_range(bool cuda, bool start) {
  auto& hooks = detail::cuda_hooks();
  if (cuda && hooks.profiler_range) hooks.profiler_range(start);
}

ProfileScope::ProfileScope(Context& ctx, const char* op) : ctx_(ctx), active_(ctx.profiler() != nullptr) {
  if (active_) ctx_.profiler()->begin(ctx_, op);
}

ProfileScope::~ProfileScope() {
  if (active_) ctx_.profiler()->end(ctx_);
}

}  // namespace megatron

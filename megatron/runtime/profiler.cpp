#include "megatron/runtime/profiler.h"

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

ProfileScope::ProfileScope(Context& ctx, const char* op) : ctx_(ctx), active_(ctx.profiler() != nullptr) {
  if (active_) ctx_.profiler()->begin(ctx_, op);
}

ProfileScope::~ProfileScope() {
  if (active_) ctx_.profiler()->end(ctx_);
}

}  // namespace megatron

// OpProfiler: where a step's time goes, op by op. When a Context carries a profiler, every op of
// kernels/ops.h is bracketed (ProfileScope): on the GPU by a pair of CUDA events on the op's
// stream (read after the step, so timing does not serialise the work), on the CPU by the wall clock.
// bench/gpt_throughput --profile prints the shares.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace megatron {

class Context;

class OpProfiler {
 public:
  ~OpProfiler();
  void begin(Context& ctx, const char* op);
  void end(Context& ctx);
  /// Milliseconds and call counts per op since the last reset (synchronises the device).
  struct Entry {
    double ms = 0;       // device time (CUDA events) or wall time on the CPU
    double host_ms = 0;  // time the host spent inside the op (launches, allocation, synchronisation)
    int64_t calls = 0;
  };
  std::map<std::string, Entry> collect(Context& ctx);
  void reset();

 private:
  struct Open {
    const char* op;
    void* start_event = nullptr;
    std::chrono::steady_clock::time_point start;
  };
  struct Closed {
    const char* op;
    void* start_event = nullptr;
    void* end_event = nullptr;
    double host_ms = 0;
  };
  std::vector<Open> open_;
  std::vector<Closed> closed_;
};

/// RAII bracket used by the op dispatch (no-op without a profiler).
class ProfileScope {
 public:
  ProfileScope(Context& ctx, const char* op);
  ~ProfileScope();

 private:
  Context& ctx_;
  bool active_;
};

}  // namespace megatron

// OpProfiler: where a step's time goes, op by op. When a Context carries a profiler, every op of
// kernels/ops.h is bracketed (ProfileScope): on the GPU by a pair of CUDA events on the op's
// stream (read after the step, so timing does not serialise the work), on the CPU by the wall clock.
// bench/gpt_throughput --profile prints the shares.
#pragma once

#include <chrono>
#include <cstdint>
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

/// The table `--profile` prints: the ops by device time over `iterations` profiled iterations of
/// `wall_ms` in all (per iteration, share of the wall time, calls), the `top` largest, then the
/// rest and the time between ops (launch gaps, host work, synchronisation).
std::string format_op_table(const std::map<std::string, OpProfiler::Entry>& ops, double wall_ms, int64_t iterations,
                            size_t top = 25);

/// Starts or stops an external profiler's capture range on a CUDA device (cudaProfilerStart/Stop:
/// `nsys profile --capture-range=cudaProfilerApi`); nothing on the CPU.
void device_profiler_range(bool cuda, bool start);

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

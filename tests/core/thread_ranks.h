// Thread-ranks for the tests of parallel code in one process: a local communicator group
// (make_local_group), one thread per world rank, each with its own ParallelState. The data-parallel,
// checkpointing and schedule tests build their worlds this way.
#pragma once

#include <exception>
#include <functional>
#include <thread>
#include <vector>

#include "megatron/core/comm/communicator.h"
#include "megatron/core/parallel_state.h"

namespace megatron::testing {

/// Runs `fn(parallel_state)` on `world` thread-ranks laid out by `config`; when ranks throw, rethrows
/// the lowest rank's exception after every thread has ended.
inline void run_thread_ranks(int world, const ParallelConfig& config, const std::function<void(ParallelState&)>& fn) {
  auto comms = make_local_group(world);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        ParallelState ps(std::move(comms[size_t(r)]), config);
        fn(ps);
      } catch (...) {
        errors[size_t(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

/// run_thread_ranks with every rank data-parallel (the default ParallelConfig).
inline void run_thread_ranks(int world, const std::function<void(ParallelState&)>& fn) {
  run_thread_ranks(world, ParallelConfig{}, fn);
}

}  // namespace megatron::testing

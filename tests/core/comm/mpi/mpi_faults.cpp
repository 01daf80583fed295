// Failures that must end an MPI job instead of hanging it (run by expect_job_failure.sh):
//   timeout  rank 1 of 3 never joins an all_reduce on a "data-parallel" group with a 3 s timeout:
//            the others throw the timeout error naming the group, exit, and mpirun ends the job.
//   kill     rank 1 kills itself (SIGKILL) while rank 0 waits in a barrier: mpirun ends the job.
#include <signal.h>

#include <cstdio>
#include <cstring>
#include <thread>

#include "megatron/core/comm/communicator.h"

int main(int argc, char** argv) {
  using namespace megatron;
  if (argc != 2) return 2;
  try {
    auto world = init_world(detect_launch(), Device::cpu(), std::chrono::seconds(60));
    Context ctx;
    if (std::strcmp(argv[1], "timeout") == 0) {
      auto dp = world->split(0, world->rank(), "data-parallel");
      dp->set_timeout(std::chrono::seconds(3));
      if (world->rank() == 1) {
        std::this_thread::sleep_for(std::chrono::seconds(60));  // stuck
        return 0;
      }
      Tensor t = Tensor::from_floats({1}, {1});
      dp->all_reduce(ctx, t)->wait();
      std::fprintf(stderr, "rank %d: all_reduce completed without rank 1\n", world->rank());
      return 0;
    }
    if (std::strcmp(argv[1], "kill") == 0) {
      if (world->rank() == 1) raise(SIGKILL);
      world->barrier(ctx);
      return 0;
    }
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}

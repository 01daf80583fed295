// main of the MPI GoogleTest binaries: builds the world with init_world (MPI under mpirun), runs
// the tests on every rank, and exits non-zero on every rank when any rank failed, so mpirun's
// status is the job's. Only rank 0 prints the test list; other ranks print their failures.
#include <gtest/gtest.h>

#include <cstdio>

#include "tests/core/comm/mpi/mpi_test.h"

namespace megatron::testing {
namespace {
std::unique_ptr<Communicator> g_world;
}
Communicator& mpi_world() { return *g_world; }
}  // namespace megatron::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  using namespace megatron;
  try {
    megatron::testing::g_world = init_world(detect_launch(), Device::cpu(), std::chrono::seconds(60));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mpi test: %s\n", e.what());
    return 1;
  }
  Communicator& world = *megatron::testing::g_world;
  if (world.rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int failed = RUN_ALL_TESTS() != 0;
  Context ctx;
  Tensor status = Tensor::from_ints({failed}, {1}, DType::Int32);
  world.all_reduce(ctx, status, ReduceOp::Max)->wait();
  if (status.item() != 0 && failed) {
    std::fprintf(stderr, "mpi test: rank %d of %d failed (run with --gtest_filter to narrow it down)\n", world.rank(),
                 world.size());
  }
  megatron::testing::g_world.reset();
  return status.item() != 0 ? 1 : 0;
}

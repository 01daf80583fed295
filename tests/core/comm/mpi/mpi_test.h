// For GoogleTest binaries run under mpirun (megatron_mpi_test in tests/CMakeLists.txt).
#pragma once

#include "megatron/core/comm/communicator.h"

namespace megatron::testing {

/// The MPI world of this run (built by mpi_test_main.cpp with init_world, 60 s timeout).
Communicator& mpi_world();

}  // namespace megatron::testing

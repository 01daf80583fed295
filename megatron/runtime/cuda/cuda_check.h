// CUDA_CHECK: the library check for the CUDA runtime, built on mg_library_failure (runtime/check.h).
#pragma once

#include <cuda_runtime.h>

#include "megatron/runtime/check.h"

#define CUDA_CHECK(stmt)                                                                              \
  do {                                                                                                \
    cudaError_t mg_err_ = (stmt);                                                                     \
    if (mg_err_ != cudaSuccess) [[unlikely]] {                                                        \
      int mg_dev_ = -1;                                                                               \
      cudaGetDevice(&mg_dev_);                                                                        \
      ::megatron::mg_library_failure("CUDA", #stmt, __FILE__, __LINE__, cudaGetErrorString(mg_err_), mg_dev_); \
    }                                                                                                 \
  } while (0)

// Checks the last kernel launch.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

// Helpers the FP8 CUDA files share (fp8.cu: quantisation, recipes, block scaling; fp8_gemm.cu:
// the cuBLASLt GEMM): raw pointers of optional tensors and the device check of an op's tensors.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "megatron/runtime/check.h"
#include "megatron/runtime/tensor.h"

namespace megatron::cuda {

/// The bytes of an fp8 tensor, or null when it is undefined (not wanted).
inline uint8_t* fp8_ptr(const Tensor& t) { return t.defined() ? static_cast<uint8_t*>(t.raw_data()) : nullptr; }
/// The floats of an fp32 tensor, or null when it is undefined.
inline float* f32_ptr(const Tensor& t) { return t.defined() ? static_cast<float*>(t.raw_data()) : nullptr; }

/// Every defined tensor of `op` is on a CUDA device (undefined ones pass).
inline void check_on_gpu(std::initializer_list<const Tensor*> ts, const char* op) {
  for (const Tensor* t : ts) {
    MG_ASSERT(!t->defined() || t->device().is_cuda(), "{}: {} must be on a CUDA device", op, t->str());
  }
}

}  // namespace megatron::cuda

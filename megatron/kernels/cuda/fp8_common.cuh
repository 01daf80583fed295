// Helpers the FP8 CUDA files share (fp8.cu: per-tensor quantisation and recipes; fp8_block.cu:
// block scaling; fp8_gemm.cu: the cuBLASLt GEMM): raw pointers of optional tensors, the device
// check of an op's tensors, and the device functions of encoding, amax and scales.
#pragma once

#include <cuda_fp8.h>

#include <cfloat>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "megatron/kernels/cuda/cuda_common.cuh"

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


__device__ __forceinline__ uint8_t encode_fp8(float v, bool e4m3) {
  return uint8_t(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, e4m3 ? __NV_E4M3 : __NV_E5M2));
}

__device__ __forceinline__ float decode_fp8(uint8_t b, bool e4m3) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(b), e4m3 ? __NV_E4M3 : __NV_E5M2);
  return __half2float(__half(h));
}

// amax of non-negative floats: their bit patterns order as integers.
__device__ __forceinline__ void atomic_max_nonneg(float* p, float v) {
  atomicMax(reinterpret_cast<int*>(p), __float_as_int(v));
}

// Block-wide fmaxf over 1-D or 2-D blocks (whole warps); every thread gets the result.
__device__ inline float block_max(float v) {
  __shared__ float warp_max[32];
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int tid = int(threadIdx.y * blockDim.x + threadIdx.x);
  const int lane = tid % 32, warp = tid / 32;
  const int warps = int(blockDim.x * blockDim.y + 31) / 32;
  __syncthreads();  // warp_max may still be read by a previous call
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  v = lane < warps ? warp_max[lane] : 0.0f;  // every warp reduces the partial maxima
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// TE's compute_scale_from_amax with no epsilon: the CPU's scale_from_amax.
__device__ __forceinline__ float scale_from_amax(float amax, float fp8_max, bool pow2, float value_for_inf) {
  if (isinf(amax) || amax == 0.0f || isnan(amax)) return 1.0f;
  float scale = __fdiv_rn(fp8_max, amax);
  if (isinf(scale)) scale = value_for_inf;
  if (pow2) scale = __int_as_float(__float_as_int(scale) & int(0xff800000u));
  return scale;
}

// The largest finite value of T: a block scale's value when fp8_max / amax overflows (TE's
// compute_scale_from_types).
template <typename T>
inline float max_finite() {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return bits_to_float(0x7f7f0000u);
  } else if constexpr (std::is_same_v<T, __half>) {
    return 65504.0f;
  } else {
    return FLT_MAX;
  }
}

// Column j of the [L, n] history h (tensor j) and its scale (Note [Delayed scaling]).
__device__ __forceinline__ void delayed_update_column(float* __restrict__ h, int64_t len, int64_t n, int64_t j,
                                                      float* __restrict__ scale, float scaled_max, bool use_max) {
  const float last = h[j];
  if (last == 0.0f) return;  // not seen this step: nothing moves (TE's bulk update)
  float amax = last;
  if (use_max) {
    amax = 0.0f;
    for (int64_t i = 0; i < len; ++i) amax = fmaxf(amax, h[i * n + j]);
  }
  for (int64_t i = 1; i < len; ++i) h[(i - 1) * n + j] = h[i * n + j];
  h[(len - 1) * n + j] = last;
  h[j] = 0.0f;
  float s = (isfinite(amax) && amax > 0.0f) ? __fdiv_rn(scaled_max, amax) : scale[j];
  if (isinf(s)) s = FLT_MAX;
  scale[j] = s;
}

}  // namespace megatron::cuda

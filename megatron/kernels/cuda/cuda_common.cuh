// Helpers shared by the CUDA kernel files: CUBLAS_CHECK (built on mg_library_failure like
// CUDA_CHECK), dtype traits that load a storage element as float and store a float back (round to
// nearest even, as the CPU backend does), a float-dtype dispatcher, launch-size helpers and the
// Context's stream as a cudaStream_t.
#pragma once

#include <algorithm>
#include <climits>

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "megatron/runtime/check.h"
#include "megatron/runtime/context.h"
#include "megatron/runtime/cuda/cuda_check.h"
#include "megatron/runtime/dtype.h"
#include "megatron/runtime/tensor.h"

#define CUBLAS_CHECK(stmt)                                                                      \
  do {                                                                                          \
    cublasStatus_t mg_st_ = (stmt);                                                             \
    if (mg_st_ != CUBLAS_STATUS_SUCCESS) [[unlikely]] {                                         \
      int mg_dev_ = -1;                                                                         \
      cudaGetDevice(&mg_dev_);                                                                  \
      ::megatron::mg_library_failure("cuBLAS", #stmt, __FILE__, __LINE__,                       \
                                     cublasLtGetStatusString(mg_st_), mg_dev_);                 \
    }                                                                                           \
  } while (0)

namespace megatron::cuda {

/// Loads a storage element as float and stores a float back into the storage type.
template <typename T>
struct DTypeTraits;

template <>
struct DTypeTraits<float> {
  static constexpr DType dtype = DType::Float32;
  __host__ __device__ static float load(float x) { return x; }
  __host__ __device__ static float store(float x) { return x; }
};

template <>
struct DTypeTraits<__nv_bfloat16> {
  static constexpr DType dtype = DType::BFloat16;
  __device__ static float load(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
};

template <>
struct DTypeTraits<__half> {
  static constexpr DType dtype = DType::Float16;
  __device__ static float load(__half x) { return __half2float(x); }
  __device__ static __half store(float x) { return __float2half_rn(x); }
};

template <typename T>
__device__ __forceinline__ float load_float(T x) {
  return DTypeTraits<T>::load(x);
}
template <typename T>
__device__ __forceinline__ T store_float(float x) {
  return DTypeTraits<T>::store(x);
}

/// Calls f.template operator()<T>() with T the CUDA type of a float dtype (fp32, bf16, fp16):
///   dispatch_float(t.dtype(), [&]<typename T>() { kernel<T><<<...>>>(...); });
/// Other dtypes are the caller's mistake and throw.
template <typename F>
void dispatch_float(DType dtype, F&& f) {
  switch (dtype) {
    case DType::Float32:
      f.template operator()<float>();
      return;
    case DType::BFloat16:
      f.template operator()<__nv_bfloat16>();
      return;
    case DType::Float16:
      f.template operator()<__half>();
      return;
    default:
      MG_CHECK(false, "CUDA op: dtype {} is not supported here (use fp32, bf16 or fp16)", to_string(dtype));
  }
}

/// N elements loaded or stored in one aligned access (16 bytes for the widths the kernels use).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <int N, typename T>
__device__ __forceinline__ void load_pack(const T* p, float (&out)[N]) {
  const Pack<T, N> pk = *reinterpret_cast<const Pack<T, N>*>(p);
#pragma unroll
  for (int k = 0; k < N; ++k) out[k] = load_float(pk.v[k]);
}

template <int N, typename T>
__device__ __forceinline__ void store_pack(T* p, const float (&in)[N]) {
  Pack<T, N> pk;
#pragma unroll
  for (int k = 0; k < N; ++k) pk.v[k] = store_float<T>(in[k]);
  *reinterpret_cast<Pack<T, N>*>(p) = pk;
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

/// A tensor's device pointer as T (no dtype check: T is the CUDA type, e.g. __nv_bfloat16).
template <typename T>
inline T* dev_ptr(const Tensor& t) {
  return static_cast<T*>(t.raw_data());
}

inline cudaStream_t stream_of(const Context& ctx) { return static_cast<cudaStream_t>(ctx.stream()); }
/// What random kernels add to their offset (Note [Random offsets under CUDA graphs], context.h).
inline const uint64_t* rng_shift_of(Context& ctx) {
  return ctx.rng_offset_shift().defined() ? static_cast<const uint64_t*>(ctx.rng_offset_shift().raw_data()) : nullptr;
}

// ---- argument checks of the ops (MG_ASSERT: ops.cpp and the model checked the user's input) ----
inline void check_cuda(const Tensor& t, const char* name) {
  MG_ASSERT(t.defined(), "{} is undefined", name);
  MG_ASSERT(t.device().is_cuda(), "{} must be on a CUDA device, got {}", name, t.str());
}

inline void check_float_cuda(const Tensor& t, const char* name) {
  check_cuda(t, name);
  MG_ASSERT(is_floating(t.dtype()), "{} must be a float tensor, got {}", name, t.str());
}

inline void check_fp32(const Tensor& t, int64_t numel, const char* name) {
  check_cuda(t, name);
  MG_ASSERT(t.dtype() == DType::Float32 && t.numel() == numel, "{} is {}, expected fp32 with {} elements", name,
            t.str(), numel);
}

// Threads of a one-block-per-row kernel over `packs` packs: whole warps, 32 to max_threads.
inline int row_threads(int64_t packs, int max_threads) {
  return int(std::clamp<int64_t>((packs + 31) / 32 * 32, 32, max_threads));
}

inline constexpr int kBlockSize = 256;

/// Blocks of `block` threads covering n elements, capped for grid-stride loops.
/// The largest power of two (up to 256) dividing a pointer's address: cuBLASLt's heuristics and plans
/// depend on the alignments of every pointer they are given (data, scales, bias).
inline uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && (a % align) != 0) align /= 2;
  return align;
}

/// A cuBLASLt heuristic preference: at most max_workspace bytes of workspace, operands aligned to at
/// least align_a / align_b bytes and C = D to align_d (a plan is only valid for pointers as aligned).
inline cublasLtMatmulPreference_t matmul_preference(uint64_t max_workspace, uint32_t align_a, uint32_t align_b,
                                                    uint32_t align_d) {
  cublasLtMatmulPreference_t pref = nullptr;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  auto set = [&](cublasLtMatmulPreferenceAttributes_t attr, const auto& value) {
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)));
  };
  set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, max_workspace);
  set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a);
  set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b);
  set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d);
  set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d);
  return pref;
}

inline unsigned grid_for(int64_t n, int block = kBlockSize, int64_t max_blocks = 65535LL * 16) {
  int64_t b = (n + block - 1) / block;
  if (b < 1) b = 1;
  if (b > max_blocks) b = max_blocks;
  return unsigned(b);
}

// Note [Embedding backward by sorting] (embedding.cu), the summing half shared by the embedding
// backwards: keys[i] is the (sorted) table row of gradient row rows[i], INT_MAX for rows to skip.
// One block per sorted position; the first of each run of equal keys adds the run's gradient rows
// into its table row in a fixed order (deterministic, one read-modify-write per row touched).
template <typename T>
__global__ void sorted_segment_sum(const int32_t* __restrict__ keys, const int32_t* __restrict__ rows, int64_t n,
                                   const T* __restrict__ grad_out, int64_t h, float* __restrict__ table_grad) {
  const int64_t i = blockIdx.x;
  const int32_t key = keys[i];
  if (key == INT_MAX || (i > 0 && keys[i - 1] == key)) return;  // skipped, or not the start of a run
  int64_t end = i + 1;
  while (end < n && keys[end] == key) ++end;
  float* dst = table_grad + int64_t(key) * h;
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
    float acc = 0.0f;
    for (int64_t t = i; t < end; ++t) acc += load_float(grad_out[int64_t(rows[t]) * h + c]);
    dst[c] += acc;
  }
}

/// The plan size for a GEMM dimension holding a varying row count: the power of two (at least 16)
/// at or above it (Note [Plans for varying row counts], linear.cu; the bf16 and FP8 GEMMs).
inline int64_t row_bucket(int64_t v) {
  int64_t b = 16;
  while (b < v) b *= 2;
  return b;
}

}  // namespace megatron::cuda

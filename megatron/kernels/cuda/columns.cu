// copy_columns, CUDA (column_ops.h): one thread per element of the copied block, fp32 arithmetic
// for the accumulating form; bit-exact with the CPU reference (a copy, or one rounded addition).
#include <cuda_runtime.h>

#include <algorithm>

#include "megatron/kernels/column_ops.h"
#include "megatron/kernels/cuda/cuda_common.cuh"

namespace megatron::cuda {

namespace {
template <typename T>
__global__ void copy_columns_kernel(const T* __restrict__ src, int64_t cs, int64_t src_col, T* __restrict__ dst,
                                    int64_t cd, int64_t dst_col, int64_t rows, int64_t width, bool accumulate) {
  const int64_t n = rows * width;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / width, j = i % width;
    const float s = load_float(src[r * cs + src_col + j]);
    T& d = dst[r * cd + dst_col + j];
    d = store_float<T>(accumulate ? load_float(d) + s : s);
  }
}
}  // namespace

void copy_columns(Context& ctx, const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t width,
                  bool accumulate) {
  ops::check_copy_columns(src, src_col, dst, dst_col, width);
  const int64_t rows = src.size(0), n = rows * width;
  if (n == 0) return;
  constexpr int kThreads = 256;
  const unsigned blocks = unsigned(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535));
  dispatch_float(src.dtype(), [&]<typename T>() {
    copy_columns_kernel<T><<<blocks, kThreads, 0, stream_of(ctx)>>>(
        static_cast<const T*>(src.raw_data()), src.size(1), src_col, static_cast<T*>(dst.raw_data()), dst.size(1),
        dst_col, rows, width, accumulate);
  });
  CUDA_CHECK_LAUNCH();
}

}  // namespace megatron::cuda

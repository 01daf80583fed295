// Dispatch of copy_columns (column_ops.h) to the CPU reference or the CUDA kernel, and its checks.
#include "megatron/kernels/column_ops.h"

#include "megatron/runtime/profiler.h"

namespace megatron::ops {

void check_copy_columns(const Tensor& src, int64_t src_col, const Tensor& dst, int64_t dst_col, int64_t width) {
  MG_ASSERT(src.defined() && dst.defined() && src.dim() == 2 && dst.dim() == 2 && src.size(0) == dst.size(0),
            "copy_columns: src and dst must be 2-D with the same rows, got {} and {}", src.str(), dst.str());
  MG_ASSERT(src.dtype() == dst.dtype() && is_floating(src.dtype()) && src.device() == dst.device(),
            "copy_columns: src {} and dst {} must share a float dtype and a device", src.str(), dst.str());
  MG_ASSERT(width >= 0 && src_col >= 0 && dst_col >= 0 && src_col + width <= src.size(1) &&
                dst_col + width <= dst.size(1),
            "copy_columns: columns [{}, {}) of {} to [{}, {}) of {} are out of range", src_col, src_col + width,
            src.str(), dst_col, dst_col + width, dst.str());
}

void copy_columns(Context& ctx, const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t width,
                  bool accumulate) {
  ProfileScope profile(ctx, "copy_columns");
  check_copy_columns(src, src_col, dst, dst_col, width);
#ifdef MEGATRON_WITH_CUDA_OPS
  if (ctx.is_cuda()) return cuda::copy_columns(ctx, src, src_col, dst, dst_col, width, accumulate);
#else
  MG_CHECK(!ctx.is_cuda(), "op copy_columns was asked to run on {} but this build has no CUDA kernels: run on the CPU",
           ctx.device().str());
#endif
  cpu::copy_columns(ctx, src, src_col, dst, dst_col, width, accumulate);
}

}  // namespace megatron::ops

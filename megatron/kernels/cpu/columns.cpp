// copy_columns, CPU reference (column_ops.h): fp32 arithmetic, bf16/fp16 converted on load and store.
#include "megatron/kernels/column_ops.h"
#include "megatron/kernels/cpu/cpu_common.h"

namespace megatron::cpu {

void copy_columns(Context&, const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t width,
                  bool accumulate) {
  ops::check_copy_columns(src, src_col, dst, dst_col, width);
  const int64_t rows = src.size(0), cs = src.size(1), cd = dst.size(1);
  FloatIn in(src);
  FloatOut out(dst, /*load=*/true);  // the other columns keep their values
#pragma omp parallel for schedule(static) if (rows * width >= (int64_t(1) << 16))  // small blocks: no thread start-up
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = in.data() + r * cs + src_col;
    float* d = out.data() + r * cd + dst_col;
    for (int64_t j = 0; j < width; ++j) d[j] = accumulate ? d[j] + s[j] : s[j];
  }
}

}  // namespace megatron::cpu

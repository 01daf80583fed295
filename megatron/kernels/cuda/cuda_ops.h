// The CUDA fast path: megatron::cuda::<op>, the same list and signatures as ops.h, one family per
// .cu file beside this header. Kernels run on the Context's stream.
#pragma once

#include "megatron/kernels/ops.h"

namespace megatron::cuda {
#include "megatron/kernels/op_list.inc"
}  // namespace megatron::cuda

// The CUDA fast path: megatron::cuda::<op>, the same list and signatures as ops.h, one family per
// .cu file beside this header. Kernels run on the Context's stream.
#pragma once

#include "megatron/kernels/ops.h"

namespace megatron::cuda {
#define MG_OP(ret, name, params, args) ret name params;
#define MG_OP_AS(ret, name, label, params, args) ret name params;
#include "megatron/kernels/op_list.inc"
#undef MG_OP
#undef MG_OP_AS
}  // namespace megatron::cuda

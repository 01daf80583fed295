// The CPU reference implementations: megatron::cpu::<op>, the same list and signatures as ops.h.
#pragma once

#include "megatron/kernels/ops.h"

namespace megatron::cpu {
#define MG_OP(ret, name, params, args) ret name params;
#define MG_OP_AS(ret, name, label, params, args) ret name params;
#include "megatron/kernels/op_list.inc"
#undef MG_OP
#undef MG_OP_AS
}  // namespace megatron::cpu

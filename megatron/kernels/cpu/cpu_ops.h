// The CPU reference implementations: megatron::cpu::<op>, the same list and signatures as ops.h.
#pragma once

#include "megatron/kernels/ops.h"

namespace megatron::cpu {
#include "megatron/kernels/op_list.inc"
}  // namespace megatron::cpu

// The communication of tensor and sequence parallelism (Megatron-Core's tensor_parallel/mappings.py).
// Megatron wraps each in an autograd function; with explicit backward passes each is a pair of
// functions, and every pair is the other's backward:
//
//   Megatron's region                              forward                  backward
//   copy_to_tensor_model_parallel_region           identity                 all_reduce_
//   reduce_from_tensor_model_parallel_region       all_reduce_              identity
//   scatter_to_sequence_parallel_region            split_sequence           all_gather_sequence
//   gather_from_sequence_parallel_region           all_gather_sequence      reduce_scatter_sequence
//   reduce_scatter_to_sequence_parallel_region     reduce_scatter_sequence  all_gather_sequence
//
// Sequence-parallel tensors are split along their first dimension ([s, b, h] or its [s·b, h]
// view), which is contiguous, so the collectives need no reordering. Every function is the identity
// (or a plain copy) on a one-rank group.
#pragma once

#include "megatron/core/comm/communicator.h"

namespace megatron::tensor_parallel {

/// In place: the sum over the group.
void all_reduce_(Context& ctx, Communicator& group, Tensor& x);
/// [n/size, ...] on every rank -> [n, ...], rank-major along dimension 0.
Tensor all_gather_sequence(Context& ctx, Communicator& group, const Tensor& x_local);
/// [n, ...] -> this rank's [n/size, ...] block of the sum over the group.
Tensor reduce_scatter_sequence(Context& ctx, Communicator& group, const Tensor& x);
/// [n, ...] -> this rank's [n/size, ...] block (a view; no communication).
Tensor split_sequence(Communicator& group, const Tensor& x);

}  // namespace megatron::tensor_parallel

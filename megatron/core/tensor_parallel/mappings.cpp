#include "megatron/core/tensor_parallel/mappings.h"

namespace megatron::tensor_parallel {

namespace {
int64_t split_rows(const Communicator& group, const Tensor& x) {
  MG_CHECK(x.dim() >= 1 && x.size(0) % group.size() == 0,
           "sequence parallelism splits the sequence ({} rows) over the {} tensor-parallel ranks: it must divide "
           "(choose --seq-length x --micro-batch-size divisible by --tensor-model-parallel-size)",
           x.dim() ? x.size(0) : 0, group.size());
  return x.size(0) / group.size();
}
}  // namespace

void all_reduce_(Context& ctx, Communicator& group, Tensor& x) {
  if (group.size() == 1) return;
  group.all_reduce(ctx, x, ReduceOp::Sum)->wait();
}

Tensor all_gather_sequence(Context& ctx, Communicator& group, const Tensor& x_local) {
  if (group.size() == 1) return x_local;
  Shape shape = x_local.shape();
  shape[0] *= group.size();
  Tensor out = Tensor::empty(shape, x_local.dtype(), ctx.device());
  group.all_gather(ctx, x_local, out)->wait();
  return out;
}

Tensor reduce_scatter_sequence(Context& ctx, Communicator& group, const Tensor& x) {
  if (group.size() == 1) return x;
  Shape shape = x.shape();
  shape[0] = split_rows(group, x);
  Tensor out = Tensor::empty(shape, x.dtype(), ctx.device());
  group.reduce_scatter(ctx, x, out, ReduceOp::Sum)->wait();
  return out;
}

Tensor split_sequence(Communicator& group, const Tensor& x) {
  if (group.size() == 1) return x;
  const int64_t n = split_rows(group, x);
  return x.slice(group.rank() * n, (group.rank() + 1) * n);
}

}  // namespace megatron::tensor_parallel

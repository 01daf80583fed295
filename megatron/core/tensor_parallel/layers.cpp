#include "megatron/core/tensor_parallel/layers.h"

#include "megatron/core/tensor_parallel/fp8_linear.h"
#include "megatron/core/tensor_parallel/mappings.h"
#include "megatron/kernels/ops.h"

namespace megatron {

ShardSpec tp_shard(const Shape& shape, int dim, const Communicator* group, int chunks) {
  ShardSpec s = unsharded(shape);
  const int tp = group_size(group);
  if (dim < 0 || tp == 1) return s;
  MG_CHECK(shape[size_t(dim)] % (int64_t(tp) * chunks) == 0,
           "a dimension of size {} does not split over --tensor-model-parallel-size {}{}", shape[size_t(dim)], tp,
           chunks > 1 ? fmt::format(" in {} blocks", chunks) : std::string());
  s.partition_dim = dim;
  s.rank = group->rank();
  s.size = tp;
  s.chunks = chunks;
  return s;
}

Linear::Linear(ParamAndGradBuffer& params, const std::string& prefix, int64_t in_features, int64_t out_features,
               bool bias, ParamInit weight_init, ParallelMode mode, Communicator* tp_group, bool sequence_parallel,
               int chunks)
    : mode_(mode), tp_(multi_rank(tp_group)), sequence_parallel_(tp_ && sequence_parallel) {
  const bool tp = tp_ != nullptr;
  const bool column = mode == ParallelMode::Column || mode == ParallelMode::ExpertColumn;
  const bool row = mode == ParallelMode::Row || mode == ParallelMode::ExpertRow;
  MG_CHECK(!(bias && tp && mode == ParallelMode::ExpertRow),
           "{}: expert biases need --expert-tensor-parallel-size 1 (as in Megatron)", prefix);
  const int weight_dim = column ? 0 : row ? 1 : -1;
  weight_ = params.add(prefix + ".weight", tp_shard({out_features, in_features}, weight_dim, tp_, chunks),
                       /*no_weight_decay=*/false, weight_init);
  if (bias) {
    bias_ = params.add(prefix + ".bias", tp_shard({out_features}, column ? 0 : -1, tp_, column ? chunks : 1),
                       /*no_weight_decay=*/true, ParamInit::Zeros);
    bias_->tp_duplicate = tp && !column;
  }
}

Linear::Linear(Parameter* shared_weight, ParallelMode mode, Communicator* tp_group, bool sequence_parallel)
    : weight_(shared_weight), mode_(mode), tp_(multi_rank(tp_group)), sequence_parallel_(tp_ && sequence_parallel) {}

std::string Linear::name() const {
  const std::string& w = weight_->name;
  const std::string suffix = ".weight";
  return w.size() > suffix.size() && w.compare(w.size() - suffix.size(), suffix.size(), suffix) == 0
             ? w.substr(0, w.size() - suffix.size())
             : w;
}

void Linear::enable_fp8(const Fp8Config& config, Device device) {
  fp8_ = std::make_shared<Fp8LinearState>(config, device);
  // Note [FP8 parameters]: DistributedDataParallel then holds the weight in FP8.
  if (config.param_gather) weight_->fp8 = fp8_->param();
}

void Linear::gemm_forward(Context& ctx, const ProducedTensor& x, const Tensor& bias, Tensor& y) const {
  if (fp8_) {
    fp8_->forward(ctx, x, weight_->data, bias, y);
  } else {
    ops::linear_forward(ctx, x.materialize(ctx), weight_->data, bias, y);
  }
}

void Linear::gemm_backward(Context& ctx, const ProducedTensor& grad_out, const ProducedTensor& x, Tensor& grad_in,
                           Tensor& bias_grad) const {
  if (fp8_) {
    fp8_->backward(ctx, grad_out, x, weight_->data, grad_in, weight_->main_grad, bias_grad);
  } else {
    ops::linear_backward(ctx, grad_out.materialize(ctx), x.materialize(ctx), weight_->data, grad_in,
                         weight_->main_grad, bias_grad);
  }
}

Tensor Linear::forward(Context& ctx, const ProducedTensor& x) const {
  Communicator* tp = tp_group();
  const int64_t rows = x.shape()[0];
  if (mode_ == ParallelMode::Column && tp && sequence_parallel()) {
    Tensor x_full = tensor_parallel::all_gather_sequence(ctx, *tp, x.materialize(ctx));
    Tensor y = Tensor::empty({x_full.size(0), out_features()}, x.dtype(), ctx.device());
    gemm_forward(ctx, x_full, bias_ ? bias_->data : Tensor(), y);
    return y;
  }
  Tensor y = Tensor::empty({rows, out_features()}, x.dtype(), ctx.device());
  if (mode_ == ParallelMode::Row && tp) {
    gemm_forward(ctx, x, bias_ && tp->rank() == 0 ? bias_->data : Tensor(), y);
    if (sequence_parallel()) return tensor_parallel::reduce_scatter_sequence(ctx, *tp, y);
    tensor_parallel::all_reduce_(ctx, *tp, y);
    return y;
  }
  gemm_forward(ctx, x, bias_ ? bias_->data : Tensor(), y);
  return y;
}

Tensor Linear::forward_gelu(Context& ctx, const Tensor& x, Tensor& pre) const {
  MG_ASSERT(!(mode_ == ParallelMode::Row && tp_group()), "forward_gelu on a row-parallel layer");
  MG_ASSERT(!fp8_, "forward_gelu on an FP8 layer: give the next layer the produced GeLU (Note [Produced tensors])");
  Communicator* tp = tp_group();
  const Tensor x_full = tp && sequence_parallel() ? tensor_parallel::all_gather_sequence(ctx, *tp, x) : x;
  pre = Tensor::empty({x_full.size(0), out_features()}, x.dtype(), ctx.device());
  Tensor out = Tensor::empty(pre.shape(), x.dtype(), ctx.device());
  ops::linear_gelu_forward(ctx, x_full, weight_->data, bias_ ? bias_->data : Tensor(), pre, out);
  return out;
}

Tensor Linear::backward_through_gelu(Context& ctx, const Tensor& grad_out, const Tensor& x, const Tensor& pre) const {
  MG_ASSERT(!(mode_ == ParallelMode::Column && tp_group()), "backward_through_gelu on a column-parallel layer");
  MG_ASSERT(!fp8_, "backward_through_gelu on an FP8 layer: give fc1 the produced GeLU gradient (Note [Produced tensors])");
  Communicator* tp = tp_group();
  const Tensor g = tp && sequence_parallel() ? tensor_parallel::all_gather_sequence(ctx, *tp, grad_out) : grad_out;
  Tensor grad_pre = Tensor::empty(pre.shape(), pre.dtype(), ctx.device());
  Tensor none;
  ops::linear_dgelu_backward(ctx, g, weight_->data, pre, grad_pre);
  ops::linear_backward(ctx, g, x, weight_->data, none, weight_->main_grad, bias_ ? bias_->main_grad : none);
  notify_grad_accumulated(ctx, weight_);
  notify_grad_accumulated(ctx, bias_);
  return grad_pre;
}

Tensor Linear::backward(Context& ctx, const ProducedTensor& grad_out, const ProducedTensor& x,
                        bool need_grad_in) const {
  Communicator* tp = tp_group();
  Tensor no_grad;
  Tensor& bias_grad = bias_ ? bias_->main_grad : no_grad;
  Tensor grad_in;
  if (mode_ == ParallelMode::Column && tp) {
    const ProducedTensor x_full =
        sequence_parallel() ? tensor_parallel::all_gather_sequence(ctx, *tp, x.materialize(ctx)) : x;
    Tensor grad_full = need_grad_in ? Tensor::empty(x_full.shape(), x.dtype(), ctx.device()) : Tensor();
    gemm_backward(ctx, grad_out, x_full, grad_full, bias_grad);
    if (need_grad_in) {
      if (sequence_parallel()) {
        grad_in = tensor_parallel::reduce_scatter_sequence(ctx, *tp, grad_full);
      } else {
        tensor_parallel::all_reduce_(ctx, *tp, grad_full);
        grad_in = grad_full;
      }
    }
  } else if (mode_ == ParallelMode::Row && tp) {
    const ProducedTensor g =
        sequence_parallel() ? tensor_parallel::all_gather_sequence(ctx, *tp, grad_out.materialize(ctx)) : grad_out;
    grad_in = need_grad_in ? Tensor::empty(x.shape(), x.dtype(), ctx.device()) : Tensor();
    gemm_backward(ctx, g, x, grad_in, bias_grad);
  } else {
    grad_in = need_grad_in ? Tensor::empty(x.shape(), x.dtype(), ctx.device()) : Tensor();
    gemm_backward(ctx, grad_out, x, grad_in, bias_grad);
  }
  notify_grad_accumulated(ctx, weight_);
  notify_grad_accumulated(ctx, bias_);
  return grad_in;
}

}  // namespace megatron

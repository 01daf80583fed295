#include "megatron/core/pipeline_parallel/p2p_communication.h"

namespace megatron {

P2PCommunicator::P2PCommunicator(Context& ctx, ParallelState& ps, Shape tensor_shape, DType dtype)
    : ctx_(ctx), ps_(ps), shape_(std::move(tensor_shape)), dtype_(dtype) {
  MG_CHECK(!shape_.empty() && shape_numel(shape_) > 0,
           "pipeline p2p tensor shape {} is empty: set --seq-length, --micro-batch-size and --hidden-size",
           shape_str(shape_));
}

void P2PCommunicator::check_sendable(const Tensor& t, const char* what) const {
  MG_CHECK(t.shape() == shape_ && t.dtype() == dtype_,
           "pipeline stage sends {} {}, but the pipeline exchanges {}{} tensors: every stage's output must "
           "have the shape [seq-length / CP (/ TP with sequence parallelism), micro-batch, hidden]",
           what, t.str(), to_string(dtype_), shape_str(shape_));
  MG_CHECK(t.device() == ctx_.device(), "pipeline stage sends {} {} from {}, but the pipeline runs on {}", what,
           t.str(), t.device().str(), ctx_.device().str());
}

std::pair<Tensor, Tensor> P2PCommunicator::communicate(const Tensor& send_next, const Tensor& send_prev,
                                                       bool recv_prev, bool recv_next) {
  Tensor from_prev, from_next;
  std::vector<P2POp> ops;
  const int next = ps_.pipeline_next_rank(), prev = ps_.pipeline_prev_rank();
  // Activation stream first, gradient stream second: Note [P2P message order].
  if (send_next.defined()) {
    check_sendable(send_next, "an activation");
    ops.push_back({P2POp::Send, send_next, next});
  }
  if (recv_prev) {
    from_prev = Tensor::empty(shape_, dtype_, ctx_.device());
    ops.push_back({P2POp::Recv, from_prev, prev});
  }
  if (send_prev.defined()) {
    check_sendable(send_prev, "a gradient");
    ops.push_back({P2POp::Send, send_prev, prev});
  }
  if (recv_next) {
    from_next = Tensor::empty(shape_, dtype_, ctx_.device());
    ops.push_back({P2POp::Recv, from_next, next});
  }
  if (!ops.empty()) ps_.pipeline().batch_isend_irecv(ctx_, ops)->wait();
  return {from_prev, from_next};
}

Tensor P2PCommunicator::recv_forward(bool is_first_stage) {
  if (is_first_stage) return {};
  return communicate({}, {}, true, false).first;
}

Tensor P2PCommunicator::recv_backward(bool is_last_stage) {
  if (is_last_stage) return {};
  return communicate({}, {}, false, true).second;
}

void P2PCommunicator::send_forward(const Tensor& output, bool is_last_stage) {
  if (!is_last_stage) communicate(output, {}, false, false);
}

void P2PCommunicator::send_backward(const Tensor& input_grad, bool is_first_stage) {
  if (!is_first_stage) communicate({}, input_grad, false, false);
}

Tensor P2PCommunicator::send_forward_recv_backward(const Tensor& output, bool is_last_stage) {
  if (is_last_stage) return {};
  return communicate(output, {}, false, true).second;
}

Tensor P2PCommunicator::send_backward_recv_forward(const Tensor& input_grad, bool is_first_stage) {
  if (is_first_stage) return {};
  return communicate({}, input_grad, true, false).first;
}

Tensor P2PCommunicator::send_forward_recv_forward(const Tensor& output, bool recv_prev) {
  return communicate(output, {}, recv_prev, false).first;
}

Tensor P2PCommunicator::send_backward_recv_backward(const Tensor& input_grad, bool recv_next) {
  return communicate({}, input_grad, false, recv_next).second;
}

std::pair<Tensor, Tensor> P2PCommunicator::send_forward_backward_recv_forward_backward(const Tensor& output,
                                                                                       const Tensor& input_grad,
                                                                                       bool recv_prev,
                                                                                       bool recv_next) {
  return communicate(output, input_grad, recv_prev, recv_next);
}

}  // namespace megatron

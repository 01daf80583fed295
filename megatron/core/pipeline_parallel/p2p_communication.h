// Point-to-point communication between pipeline stages (Megatron-Core's p2p_communication.py):
// activations travel to the next stage, their gradients back to the previous one, as tensors of one
// fixed shape and dtype on the context's device, through the pipeline group's batch_isend_irecv.
//
// Every exchange is one blocking batch (Megatron's batch_p2p_comm without overlap). An undefined
// tensor to send, or a false recv flag, leaves that half out; the stage flags (is_first_stage,
// is_last_stage) turn the plain forms into no-ops at the ends of the pipeline, as Megatron's do.
//
// Note [P2P message order]: with two stages the next and the previous rank are the same rank, so
// one batch may carry an activation and a gradient to the same peer. Messages between two ranks
// are matched in the order they were posted, so sends and receives must rank the two streams
// alike: every batch posts the activation stream first (send to next, receive from previous), then
// the gradient stream (send to previous, receive from next). Megatron's order (send prev, recv prev,
// send next, recv next) would hand an interleaved pp = 2 run each gradient in place of an
// activation (the p2p and schedule tests catch it).
#pragma once

#include <utility>

#include "megatron/core/parallel_state.h"

namespace megatron {

class P2PCommunicator {
 public:
  /// Exchanges tensors of `tensor_shape`/`dtype` on ctx's device over ps.pipeline().
  P2PCommunicator(Context& ctx, ParallelState& ps, Shape tensor_shape, DType dtype);

  const Shape& tensor_shape() const { return shape_; }
  DType dtype() const { return dtype_; }

  /// The general exchange (Megatron's _communicate): sends `send_next` to the next stage and
  /// `send_prev` to the previous one (each when defined), receives from the previous stage
  /// (recv_prev) and from the next one (recv_next). Returns {from previous, from next}; a half not
  /// asked for is undefined.
  std::pair<Tensor, Tensor> communicate(const Tensor& send_next, const Tensor& send_prev, bool recv_prev,
                                        bool recv_next);

  /// The activation for this stage's forward (undefined on the first stage).
  Tensor recv_forward(bool is_first_stage);
  /// The gradient of this stage's output (undefined on the last stage).
  Tensor recv_backward(bool is_last_stage);
  void send_forward(const Tensor& output, bool is_last_stage);
  void send_backward(const Tensor& input_grad, bool is_first_stage);
  /// Sends the output forward and receives its gradient (1F1B's steady state).
  Tensor send_forward_recv_backward(const Tensor& output, bool is_last_stage);
  /// Sends the input's gradient back and receives the next input.
  Tensor send_backward_recv_forward(const Tensor& input_grad, bool is_first_stage);

  // The interleaved schedule's combined forms: the caller decides what to receive.
  Tensor send_forward_recv_forward(const Tensor& output, bool recv_prev);
  Tensor send_backward_recv_backward(const Tensor& input_grad, bool recv_next);
  /// Returns {input from the previous stage, output gradient from the next stage}.
  std::pair<Tensor, Tensor> send_forward_backward_recv_forward_backward(const Tensor& output,
                                                                        const Tensor& input_grad, bool recv_prev,
                                                                        bool recv_next);

 private:
  void check_sendable(const Tensor& t, const char* what) const;

  Context& ctx_;
  ParallelState& ps_;
  Shape shape_;
  DType dtype_;
};

}  // namespace megatron

#include "megatron/core/pipeline_parallel/pipeline_schedules.h"

#include <algorithm>
#include <deque>
#include <utility>
#include <vector>

#include "megatron/core/pipeline_parallel/p2p_communication.h"

namespace megatron {

namespace {

void check_schedule_args(const PipelineStepFuncs& f, int num_microbatches, bool forward_only) {
  MG_CHECK(num_microbatches >= 1,
           "pipeline schedule got {} microbatches: --global-batch-size must be at least --micro-batch-size x "
           "data-parallel size",
           num_microbatches);
  MG_CHECK(f.forward && (forward_only || f.backward), "pipeline schedule needs a forward{} callback",
           forward_only ? "" : " and a backward");
}

// The stages at either end of the pipeline neither receive an input (first stage, first chunk) nor
// send an output (last stage, last chunk); everywhere else a missing tensor would leave the peer
// waiting, so it is an error here rather than a hang there.
Tensor checked_forward(Context& ctx, ParallelState& ps, const PipelineStepFuncs& f, int chunk, int microbatch,
                       const Tensor& input, bool sends_output) {
  Tensor out = f.forward(ctx, chunk, microbatch, input);
  if (!sends_output) return {};
  MG_CHECK(out.defined(),
           "forward of model chunk {} (microbatch {}) returned no activation on pipeline stage {} of {}: every "
           "stage but the last must return its output",
           chunk, microbatch, ps.pp_rank(), ps.pp_size());
  return out;
}

Tensor checked_backward(Context& ctx, ParallelState& ps, const PipelineStepFuncs& f, int chunk, int microbatch,
                        const Tensor& output_grad, bool last_for_chunk, bool sends_grad) {
  Tensor grad = f.backward(ctx, chunk, microbatch, output_grad, last_for_chunk);
  if (!sends_grad) return {};
  MG_CHECK(grad.defined(),
           "backward of model chunk {} (microbatch {}) returned no input gradient on pipeline stage {} of {}: "
           "every stage but the first must return d loss / d input",
           chunk, microbatch, ps.pp_rank(), ps.pp_size());
  return grad;
}

// A microbatch between its forward and its backward: its id and the input it received (kept so the
// callbacks may hold views of it; released when the backward returns).
struct InFlight {
  int microbatch;
  Tensor input;
};

}  // namespace

void forward_backward_pipelining_without_interleaving(Context& ctx, ParallelState& ps, const PipelineStepFuncs& f,
                                                      int num_microbatches, const Shape& tensor_shape, DType dtype,
                                                      bool forward_only) {
  check_schedule_args(f, num_microbatches, forward_only);
  MG_CHECK(ps.vpp_size() == 1,
           "the non-interleaved pipeline schedule runs one model chunk per stage, but the virtual pipeline size "
           "is {}: use the interleaved schedule with --num-layers-per-virtual-pipeline-stage",
           ps.vpp_size());
  ps.set_virtual_pipeline_rank(0);
  P2PCommunicator p2p(ctx, ps, tensor_shape, dtype);
  const bool first = ps.is_pipeline_first_stage(true), last = ps.is_pipeline_last_stage(true);
  const int M = num_microbatches;
  // Earlier stages run ahead by one forward per later stage, so the last stage can start the first
  // backward as soon as the first microbatch reaches it.
  const int num_warmup = std::min(ps.pp_size() - ps.pp_rank() - 1, M);
  const int num_remaining = M - num_warmup;

  std::deque<InFlight> in_flight;
  int next_forward = 0;
  auto forward_step = [&](Tensor input) {
    const int mb = next_forward++;
    Tensor out = checked_forward(ctx, ps, f, 0, mb, input, !last);
    if (!forward_only) in_flight.push_back({mb, std::move(input)});
    return out;
  };
  auto backward_step = [&](const Tensor& output_grad) {
    InFlight done = std::move(in_flight.front());
    in_flight.pop_front();
    return checked_backward(ctx, ps, f, 0, done.microbatch, output_grad, done.microbatch == M - 1, !first);
  };

  for (int i = 0; i < num_warmup; ++i) {
    Tensor out = forward_step(p2p.recv_forward(first));
    p2p.send_forward(out, last);
  }

  Tensor input;
  if (num_remaining > 0) input = p2p.recv_forward(first);
  for (int i = 0; i < num_remaining; ++i) {
    const bool last_iteration = i == num_remaining - 1;
    Tensor out = forward_step(std::move(input));
    input = Tensor();
    if (forward_only) {
      p2p.send_forward(out, last);
      if (!last_iteration) input = p2p.recv_forward(first);
      continue;
    }
    Tensor output_grad = p2p.send_forward_recv_backward(out, last);
    out = Tensor();
    Tensor input_grad = backward_step(output_grad);
    if (last_iteration) {
      p2p.send_backward(input_grad, first);
    } else {
      input = p2p.send_backward_recv_forward(input_grad, first);
    }
  }

  if (!forward_only) {
    for (int i = 0; i < num_warmup; ++i) {
      Tensor output_grad = p2p.recv_backward(last);
      p2p.send_backward(backward_step(output_grad), first);
    }
  }
  MG_ASSERT(in_flight.empty(), "{} microbatches left without a backward", in_flight.size());
}

void forward_backward_pipelining_with_interleaving(Context& ctx, ParallelState& ps, const PipelineStepFuncs& f,
                                                   int num_microbatches, const Shape& tensor_shape, DType dtype,
                                                   bool forward_only) {
  check_schedule_args(f, num_microbatches, forward_only);
  const int pp = ps.pp_size(), V = ps.vpp_size(), M = num_microbatches;
  MG_CHECK(M % pp == 0,
           "the interleaved pipeline schedule needs the number of microbatches ({}) to be a multiple of "
           "--pipeline-model-parallel-size ({}): adjust --global-batch-size, or drop "
           "--num-layers-per-virtual-pipeline-stage",
           M, pp);
  P2PCommunicator p2p(ctx, ps, tensor_shape, dtype);
  const bool first_rank = ps.is_pipeline_first_stage(true), last_rank = ps.is_pipeline_last_stage(true);
  const int total = M * V;

  // Warmup: enough forwards that every stage has work when the first backward arrives; with
  // M == pp the whole step is warmup (Megatron's are_all_microbatches_in_warmup).
  bool all_warmup = false;
  int num_warmup = total;
  if (!forward_only) {
    if (M == pp) {
      all_warmup = true;
    } else {
      num_warmup = std::min((pp - ps.pp_rank() - 1) * 2 + (V - 1) * pp, total);
    }
  }
  const int num_remaining = total - num_warmup;

  // Megatron's get_model_chunk_id / get_microbatch_id_in_model_chunk: groups of pp consecutive
  // microbatches go through chunk 0, then chunk 1, ...; backwards walk the chunks in reverse.
  auto chunk_of = [&](int k, bool forward) {
    const int c = (k % (pp * V)) / pp;
    return forward ? c : V - 1 - c;
  };
  auto microbatch_of = [&](int k) { return (k / (pp * V)) * pp + k % pp; };

  // Per chunk: inputs received and output gradients received (each in microbatch order, as the
  // neighbour produces them), and the microbatches awaiting their backward.
  struct ChunkQueues {
    std::deque<Tensor> inputs, output_grads;
    std::deque<InFlight> in_flight;
  };
  std::vector<ChunkQueues> q(V);

  auto forward_step = [&](int k) {
    const int c = chunk_of(k, true), mb = microbatch_of(k);
    ps.set_virtual_pipeline_rank(c);
    Tensor input;
    if (!(first_rank && c == 0)) {
      MG_ASSERT(!q[c].inputs.empty(), "no input received for chunk {} microbatch {}", c, mb);
      input = std::move(q[c].inputs.front());
      q[c].inputs.pop_front();
    }
    Tensor out = checked_forward(ctx, ps, f, c, mb, input, !(last_rank && c == V - 1));
    if (!forward_only) q[c].in_flight.push_back({mb, std::move(input)});
    return out;
  };
  auto backward_step = [&](int k) {
    const int c = chunk_of(k, false);
    ps.set_virtual_pipeline_rank(c);
    InFlight done = std::move(q[c].in_flight.front());
    q[c].in_flight.pop_front();
    MG_ASSERT(done.microbatch == microbatch_of(k), "chunk {}: backward of microbatch {} before {}", c,
              microbatch_of(k), done.microbatch);
    Tensor output_grad;
    if (!(last_rank && c == V - 1)) {
      MG_ASSERT(!q[c].output_grads.empty(), "no gradient received for chunk {} microbatch {}", c, done.microbatch);
      output_grad = std::move(q[c].output_grads.front());
      q[c].output_grads.pop_front();
    }
    return checked_backward(ctx, ps, f, c, done.microbatch, output_grad, done.microbatch == M - 1,
                            !(first_rank && c == 0));
  };
  // Megatron's recv_tensor_from_previous_stage: whether a tensor arrives at step k (from the previous
  // stage in forward, the next in backward) and for which chunk. The leading stage (first rank in
  // forward, last in backward) is pp - 1 steps ahead of the stage that wraps around to it, and the
  // final chunk of that stage sends nothing.
  auto recv_plan = [&](int k, bool forward) -> std::pair<bool, int> {
    const bool leading = forward ? first_rank : last_rank;
    if (!leading) return {true, chunk_of(k + 1, forward)};
    if (k < pp - 1) return {false, chunk_of(k + 1, forward)};
    const int c = chunk_of(k - (pp - 1), forward);
    if (c == (forward ? V - 1 : 0)) return {false, c};
    return {true, forward ? c + 1 : c - 1};
  };

  if (!first_rank) q[0].inputs.push_back(p2p.recv_forward(false));

  for (int k = 0; k < num_warmup; ++k) {
    Tensor out = forward_step(k);
    auto [recv_prev, next_chunk] = recv_plan(k, true);
    if (k == total - 1) recv_prev = false;
    Tensor input;
    if (k == num_warmup - 1 && !forward_only && !all_warmup) {
      // The last warmup step also receives the first gradient, for the last chunk.
      const bool recv_next = !last_rank;
      auto [in, output_grad] = p2p.send_forward_backward_recv_forward_backward(out, {}, recv_prev, recv_next);
      if (recv_next) q[V - 1].output_grads.push_back(std::move(output_grad));
      input = std::move(in);
    } else {
      input = p2p.send_forward_recv_forward(out, recv_prev);
    }
    if (recv_prev) q[next_chunk].inputs.push_back(std::move(input));
  }

  for (int k = 0; k < num_remaining; ++k) {
    const int forward_k = k + num_warmup, backward_k = k;
    Tensor out = forward_step(forward_k);
    Tensor input_grad = backward_step(backward_k);
    auto [recv_prev, next_forward_chunk] = recv_plan(forward_k, true);
    auto [recv_next, next_backward_chunk] = recv_plan(backward_k, false);
    if (k == num_remaining - 1) recv_prev = false;
    auto [input, output_grad] =
        p2p.send_forward_backward_recv_forward_backward(out, input_grad, recv_prev, recv_next);
    if (recv_prev) q[next_forward_chunk].inputs.push_back(std::move(input));
    if (recv_next) q[next_backward_chunk].output_grads.push_back(std::move(output_grad));
  }

  if (!forward_only) {
    if (all_warmup && !last_rank) q[V - 1].output_grads.push_back(p2p.recv_backward(false));
    for (int k = num_remaining; k < total; ++k) {
      Tensor input_grad = backward_step(k);
      auto [recv_next, next_chunk] = recv_plan(k, false);
      if (k == total - 1) recv_next = false;
      Tensor output_grad = p2p.send_backward_recv_backward(input_grad, recv_next);
      if (recv_next) q[next_chunk].output_grads.push_back(std::move(output_grad));
    }
  }
  for (const ChunkQueues& cq : q) {
    MG_ASSERT(cq.inputs.empty() && cq.output_grads.empty() && cq.in_flight.empty(),
              "interleaved schedule ended with tensors left: {} inputs, {} gradients, {} microbatches in flight",
              cq.inputs.size(), cq.output_grads.size(), cq.in_flight.size());
  }
  ps.set_virtual_pipeline_rank(0);
}

}  // namespace megatron

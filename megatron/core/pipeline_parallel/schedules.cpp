#include "megatron/core/pipeline_parallel/schedules.h"

#include "megatron/core/distributed/distributed_data_parallel.h"
#include "megatron/core/pipeline_parallel/pipeline_schedules.h"
#include "megatron/kernels/ops.h"

namespace megatron {

void check_batch_ids(const MicroBatch& batch, int64_t vocab_rows, int64_t position_rows) {
  // The ids of `t` (empty if undefined) and the index of the first outside [0, rows) (-1: none).
  auto first_outside = [](const Tensor& t, int64_t rows, std::vector<int64_t>& ids) -> int64_t {
    ids = t.defined() ? t.to_ints() : std::vector<int64_t>();
    for (size_t i = 0; i < ids.size(); ++i)
      if (ids[i] < 0 || ids[i] >= rows) return int64_t(i);
    return -1;
  };
  // In the order the step's kernels would find them: token ids, position ids, then labels.
  std::vector<int64_t> ids;
  if (int64_t i = first_outside(batch.tokens, vocab_rows, ids); i >= 0)
    ops::throw_bad_table_id("token id", ids[size_t(i)], i, batch.tokens.size(1), vocab_rows);
  if (position_rows > 0) {
    if (int64_t i = first_outside(batch.position_ids, position_rows, ids); i >= 0)
      ops::throw_bad_table_id("position id", ids[size_t(i)], i, batch.position_ids.size(1), position_rows);
  }
  if (int64_t i = first_outside(batch.labels, vocab_rows, ids); i >= 0)
    ops::throw_bad_label(ids[size_t(i)], i, vocab_rows);
}

namespace {
Tensor on_device(const Tensor& t, Device device) { return t.defined() && t.device() != device ? t.to(device) : t; }

bool on_host(const MicroBatch& b) { return b.tokens.defined() && b.tokens.device().is_host(); }
}  // namespace

LossFunc masked_token_loss(Tensor loss_mask, Communicator* cp, bool per_token) {
  return [mask = std::move(loss_mask), cp, per_token](Context& c, const Tensor& output, Tensor& sums,
                                                      const Tensor& loss_scale, Tensor* grad) {
    Tensor losses = output.view({-1});
    Tensor m = mask.defined() ? mask.view({-1}) : Tensor();
    ops::masked_loss_sums(c, losses, m, sums);
    if (cp && cp->size() > 1) cp->all_reduce(c, sums)->wait();  // Note [Loss under context parallelism]
    if (!grad) return;
    Tensor g = Tensor::empty({losses.numel()}, DType::Float32, c.device());
    if (per_token) {  // Note [Per-token loss]: mask · loss_scale[0] / loss_scale[1] (= 1)
      MG_ASSERT(loss_scale.numel() == 2, "a per-token loss takes the scale {{loss_scale, 1}}, got {}", loss_scale.str());
      ops::masked_loss_backward_normalized(c, m, loss_scale, loss_scale.flat_slice(0, 1), g);
    } else {
      ops::masked_loss_backward_normalized(c, m, sums, loss_scale, g);
      if (cp && cp->size() > 1) ops::scale_(c, g, float(cp->size()));
    }
    *grad = g.view(output.shape());
  };
}

MicroBatch checked_on_device(const MicroBatch& b, const ModelChunk& model, Device device) {
  const ModelChunk::InputRanges r = model.input_ranges();
  if (r.token_rows > 0) check_batch_ids(b, r.token_rows, r.position_rows);
  return MicroBatch{on_device(b.tokens, device), on_device(b.labels, device), on_device(b.loss_mask, device),
                    on_device(b.position_ids, device), b.cu_seqlens};
}

void schedule_forward_backward(Context& ctx, ParallelState* ps, const std::vector<const ModelChunk*>& chunks,
                               const ForwardStepFunc& forward_step, const std::vector<MicroBatch>& batches,
                               const ForwardBackwardArgs& args, const Tensor& loss_scale, Tensor& sums,
                               DistributedDataParallel* ddp) {
  MG_ASSERT(!chunks.empty());
  const int num_mb = args.num_microbatches;
  MG_ASSERT(int(batches.size()) == num_mb, "{} batches for {} microbatches", batches.size(), num_mb);
  MG_ASSERT(sums.numel() == 2 * int64_t(num_mb), "sums {} for {} microbatches", sums.str(), num_mb);
  const int dp = ps ? ps->dp_size() : 1, dp_rank = ps ? ps->dp_rank() : 0;

  const uint64_t rng_base = ctx.rng().offset;
  const uint64_t streams = chunks[0]->random_streams_per_microbatch();
  std::vector<std::vector<std::unique_ptr<ModelStash>>> stashes(chunks.size());
  for (size_t c = 0; c < chunks.size(); ++c)
    for (int mb = 0; mb < num_mb; ++mb) stashes[c].push_back(chunks[c]->make_stash());
  std::vector<Tensor> grad_losses(static_cast<size_t>(num_mb));

  PipelineStepFuncs f;
  f.forward = [&](Context& c, int chunk, int mb, const Tensor& input) -> Tensor {
    const ModelChunk& model = *chunks[size_t(chunk)];
    c.rng().offset = rng_base + uint64_t(mb * dp + dp_rank) * streams;
    std::unique_ptr<ModelStash>& stash = stashes[size_t(chunk)][size_t(mb)];
    ForwardOutput out = forward_step(c, batches[size_t(mb)], model, input, *stash);
    if (args.forward_only) stash = model.make_stash();
    if (!model.post_process()) return out.output;
    const LossFunc loss =
        out.loss_func ? out.loss_func : masked_token_loss(out.loss_mask, nullptr, args.calculate_per_token_loss);
    Tensor mb_sums = sums.flat_slice(2 * int64_t(mb), 2);
    loss(c, out.output, mb_sums, loss_scale, args.forward_only ? nullptr : &grad_losses[size_t(mb)]);
    return Tensor();
  };
  f.backward = [&](Context& c, int chunk, int mb, const Tensor& output_grad, bool last_for_chunk) -> Tensor {
    const ModelChunk& model = *chunks[size_t(chunk)];
    if (ddp) ddp->set_grad_sync(chunk, last_for_chunk);
    const Tensor& grad = model.post_process() ? grad_losses[size_t(mb)] : output_grad;
    Tensor grad_input = model.backward_step(c, grad, *stashes[size_t(chunk)][size_t(mb)]);
    if (model.post_process()) grad_losses[size_t(mb)] = Tensor();
    return grad_input;
  };

  if (!ps || ps->pp_size() == 1) {
    MG_ASSERT(chunks.size() == 1, "{} model chunks without pipeline parallelism", chunks.size());
    for (int mb = 0; mb < num_mb; ++mb) {
      f.forward(ctx, 0, mb, Tensor());
      if (!args.forward_only) f.backward(ctx, 0, mb, Tensor(), mb == num_mb - 1);
      stashes[0][size_t(mb)].reset();
    }
  } else {
    const Shape shape = chunks[0]->stage_activation_shape(args.micro_batch_size, args.seq_length);
    const DType dtype = chunks[0]->activation_dtype();
    if (ps->vpp_size() > 1) {
      forward_backward_pipelining_with_interleaving(ctx, *ps, f, num_mb, shape, dtype, args.forward_only);
    } else {
      forward_backward_pipelining_without_interleaving(ctx, *ps, f, num_mb, shape, dtype, args.forward_only);
    }
    ps->set_virtual_pipeline_rank(0);
  }
  ctx.rng().offset = rng_base + uint64_t(num_mb) * uint64_t(dp) * streams;
}

Tensor loss_scale_tensor(const ForwardBackwardArgs& args, Device device) {
  if (args.calculate_per_token_loss) return Tensor::from_floats({args.loss_scale, 1.0f}, {2}, DType::Float32, device);
  return Tensor::from_floats({args.loss_scale / float(args.num_microbatches)}, {1}, DType::Float32, device);
}

LossSums collect_loss_sums(Context& ctx, ParallelState* ps, const std::vector<const ModelChunk*>& chunks,
                           const Tensor& sums) {
  LossSums total;
  if (!chunks.back()->post_process()) return total;
  const std::vector<float> host = sums.to_floats();
  for (size_t mb = 0; 2 * mb < host.size(); ++mb) {
    total.loss_sum += host[2 * mb];
    total.num_tokens += host[2 * mb + 1];
  }
  // The lm loss over the whole global batch: the last stage's sums over the data-parallel ranks.
  if (ps && ps->dp_size() > 1) {
    const std::vector<double> sum = sum_in_rank_order(ctx, ps->data(), {total.loss_sum, total.num_tokens});
    total = LossSums{sum[0], sum[1]};
  }
  return total;
}

LossSums forward_backward(Context& ctx, ParallelState* ps, const std::vector<const ModelChunk*>& chunks,
                          const ForwardStepFunc& forward_step, BatchIterator& data, const ForwardBackwardArgs& args,
                          DistributedDataParallel* ddp) {
  std::vector<MicroBatch> batches;
  batches.reserve(size_t(args.num_microbatches));
  for (int i = 0; i < args.num_microbatches; ++i) batches.push_back(data());
  return forward_backward(ctx, ps, chunks, forward_step, std::move(batches), args, ddp);
}

LossSums forward_backward(Context& ctx, ParallelState* ps, const std::vector<const ModelChunk*>& chunks,
                          const ForwardStepFunc& forward_step, std::vector<MicroBatch> batches,
                          const ForwardBackwardArgs& args, DistributedDataParallel* ddp) {
  Tensor sums = Tensor::zeros({args.num_microbatches, 2}, DType::Float32, ctx.device());
  const Tensor scale = loss_scale_tensor(args, ctx.device());
  // Note [One wait per step] (schedules.h).
  if (ctx.is_cuda() && !batches.empty() && on_host(batches[0])) {
    for (MicroBatch& b : batches) b = checked_on_device(b, *chunks[0], ctx.device());
    HostCheckedIds checked(ctx);
    schedule_forward_backward(ctx, ps, chunks, forward_step, batches, args, scale, sums, ddp);
  } else {
    schedule_forward_backward(ctx, ps, chunks, forward_step, batches, args, scale, sums, ddp);
  }
  return collect_loss_sums(ctx, ps, chunks, sums);
}

}  // namespace megatron

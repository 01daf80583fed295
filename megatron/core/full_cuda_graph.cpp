#include "megatron/core/full_cuda_graph.h"

#include "megatron/core/parallel_state.h"
#include "megatron/runtime/check.h"

namespace megatron {

namespace {
// Tensors of the graph's own: allocated at the first captured step, written before every launch.
void copy_into(Tensor& dst, const Tensor& src, Device device) {
  if (!src.defined()) return;
  if (!dst.defined()) dst = Tensor::empty(src.shape(), src.dtype(), device);
  dst.copy_from(src);
}

void set_rng_shift(Context& ctx, uint64_t shift) {
  ctx.rng_offset_shift().copy_from(Tensor::from_ints({int64_t(shift)}, {1}, DType::Int64));
}
}  // namespace

LossSums FullCudaGraph::forward_backward(Context& ctx, ParallelState* ps, const std::vector<const ModelChunk*>& chunks,
                                         const ForwardStepFunc& forward_step, BatchIterator& data,
                                         const ForwardBackwardArgs& args, DistributedDataParallel* ddp) {
  MG_ASSERT(!args.forward_only, "evaluation runs eagerly");
  MG_ASSERT(chunks.size() == 1 && (!ps || (ps->pp_size() == 1 && ps->tp_size() == 1)),
            "the full-iteration CUDA graph covers one model chunk without tensor or pipeline parallelism");
  const int num_mb = args.num_microbatches;
  std::vector<MicroBatch> batches;
  batches.reserve(size_t(num_mb));
  for (int i = 0; i < num_mb; ++i) batches.push_back(data());

  const Key key{num_mb, batches[0].tokens.shape(), batches[0].position_ids.defined(), batches[0].loss_mask.defined()};
  for (const MicroBatch& b : batches) {
    MG_CHECK(b.tokens.shape() == key.tokens && b.position_ids.defined() == key.has_positions &&
                 b.loss_mask.defined() == key.has_mask,
             "the microbatches of one step differ in shape ({} vs {}): a CUDA graph needs static shapes",
             b.tokens.str(), batches[0].tokens.str());
  }
  if (!(key == key_)) {  // first step, or the shapes changed: warm up again, then capture
    key_ = key;
    graph_.reset();
    inputs_.clear();
    eager_left_ = warmup_steps_;
  }
  if (eager_left_ > 0) {
    --eager_left_;
    return megatron::forward_backward(ctx, ps, chunks, forward_step, std::move(batches), args, ddp);
  }

  const ModelChunk::InputRanges ranges = chunks[0]->input_ranges();
  const Device device = ctx.device();
  inputs_.resize(batches.size());
  for (size_t j = 0; j < batches.size(); ++j) {
    if (ranges.token_rows > 0) check_batch_ids(batches[j], ranges.token_rows, ranges.position_rows);
    copy_into(inputs_[j].tokens, batches[j].tokens, device);
    copy_into(inputs_[j].labels, batches[j].labels, device);
    copy_into(inputs_[j].loss_mask, batches[j].loss_mask, device);
    copy_into(inputs_[j].position_ids, batches[j].position_ids, device);
  }
  copy_into(loss_scale_, loss_scale_tensor(args, Device::cpu()), device);
  if (!sums_.defined() || sums_.numel() != 2 * int64_t(num_mb))
    sums_ = Tensor::empty({num_mb, 2}, DType::Float32, device);

  const uint64_t rng_base = ctx.rng().offset;
  if (!graph_.captured()) {
    graph_.capture(ctx, [&] {
      schedule_forward_backward(ctx, ps, chunks, forward_step, inputs_, args, loss_scale_, sums_, ddp);
    });
    captured_rng_base_ = rng_base;
    ++captures_;
  }
  // Note [Random offsets under CUDA graphs]: the graph's random ops hold the captured step's
  // offsets; the device shift moves them to this step's (wrapping arithmetic, as the offsets).
  const uint64_t shift = rng_base - captured_rng_base_;
  if (shift != 0) set_rng_shift(ctx, shift);
  const int dp = ps ? ps->dp_size() : 1;
  ctx.rng().offset = rng_base + uint64_t(num_mb) * uint64_t(dp) * chunks[0]->random_streams_per_microbatch();
  graph_.replay(ctx);
  ++launches_;
  const LossSums sums = collect_loss_sums(ctx, ps, chunks, sums_);
  if (shift != 0) set_rng_shift(ctx, 0);  // eager work (evaluation) draws its own offsets
  return sums;
}

}  // namespace megatron

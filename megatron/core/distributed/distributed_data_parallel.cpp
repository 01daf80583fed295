// DistributedDataParallel and finalize_model_grads (distributed_data_parallel.h).
#include "megatron/core/distributed/distributed_data_parallel.h"

#include <algorithm>

#include "megatron/kernels/ops.h"

namespace megatron {

DistributedDataParallel::DistributedDataParallel(ParallelState& ps, std::vector<ParamAndGradBuffer*> chunks,
                                                 const DDPConfig& config)
    : ps_(ps), chunks_(std::move(chunks)), config_(config) {
  MG_CHECK(!chunks_.empty(), "DistributedDataParallel needs at least one model chunk");
  MG_CHECK(!config_.overlap_param_gather || config_.use_distributed_optimizer,
           "--overlap-param-gather needs --use-distributed-optimizer");
  const int dp = data_parallel_group().size();
  for (size_t c = 0; c < chunks_.size(); ++c) {
    ParamAndGradBuffer& buf = *chunks_[c];
    MG_ASSERT(buf.allocated(), "DistributedDataParallel: model chunk {} is not allocated", c);
    MG_CHECK(buf.dp_size() == dp && buf.ddp_config().use_distributed_optimizer == config_.use_distributed_optimizer &&
                 effective_bucket_size(buf.ddp_config(), dp) == effective_bucket_size(config_, dp),
             "DistributedDataParallel: model chunk {} was allocated for another layout (dp {}, distributed "
             "optimizer {}): allocate it with the DDP config and data-parallel size {}",
             c, buf.dp_size(), buf.ddp_config().use_distributed_optimizer, dp);
    buckets_.emplace_back(buf.buckets().size());
    for (size_t b = 0; b < buf.buckets().size(); ++b) {
      for (Parameter* p : buf.buckets()[b].params) {
        MG_CHECK(by_name_.emplace(p->name, p).second, "DistributedDataParallel: parameter '{}' is in two chunks",
                 p->name);
        params_[p] = ParamState{int(c), int(b), 1, 0};
        p->grad_hook = this;
      }
    }
  }
  next_launch_.assign(chunks_.size(), 0);
  sync_enabled_.assign(chunks_.size(), true);
  reset_grad_state();
}

DistributedDataParallel::~DistributedDataParallel() {
  for (auto& [name, p] : by_name_) p->grad_hook = nullptr;
}

std::vector<Parameter> DistributedDataParallel::parameters() const {
  std::vector<Parameter> out;
  for (ParamAndGradBuffer* buf : chunks_)
    for (Parameter* p : buf->parameters()) out.push_back(*p);
  return out;
}

Parameter* DistributedDataParallel::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

void DistributedDataParallel::reset_grad_state() {
  for (size_t c = 0; c < chunks_.size(); ++c) {
    const auto& bks = chunks_[c]->buckets();
    for (size_t b = 0; b < bks.size(); ++b) {
      buckets_[c][b].pending = int(bks[b].params.size());
      buckets_[c][b].launched = false;
      buckets_[c][b].grad_work.reset();
    }
    next_launch_[c] = 0;
  }
  for (auto& [p, st] : params_) st.count = 0;
}

void DistributedDataParallel::zero_grad(Context& ctx) {
  for (auto& chunk : buckets_)
    for (BucketState& b : chunk)
      if (b.grad_work) b.grad_work->wait();
  for (ParamAndGradBuffer* buf : chunks_) buf->zero_grad();
  reset_grad_state();
}

void DistributedDataParallel::set_expected_accumulations(const Parameter* p, int n) {
  auto it = params_.find(p);
  MG_CHECK(it != params_.end(), "set_expected_accumulations: parameter {} is not in the model chunks",
           p ? p->name : "(null)");
  MG_CHECK(n >= 1, "set_expected_accumulations: {} accumulations for {}: it must be >= 1", n, p->name);
  it->second.expected = n;
}

void DistributedDataParallel::enable_grad_sync() {
  for (int c = 0; c < num_chunks(); ++c) set_grad_sync(c, true);
}

void DistributedDataParallel::disable_grad_sync() {
  for (int c = 0; c < num_chunks(); ++c) set_grad_sync(c, false);
}

void DistributedDataParallel::set_grad_sync(int chunk, bool enabled) { sync_enabled_.at(size_t(chunk)) = enabled; }

void DistributedDataParallel::grad_accumulated(Context& ctx, Parameter& param) {
  if (!config_.overlap_grad_reduce) return;
  auto it = params_.find(&param);
  MG_ASSERT(it != params_.end(), "gradient hook of {} called on a DDP that does not hold it", param.name);
  ParamState& st = it->second;
  if (!sync_enabled_[size_t(st.chunk)]) return;
  ++st.count;
  MG_ASSERT(st.count <= st.expected,
            "parameter {} accumulated {} times in the last microbatch, {} expected: "
            "call set_expected_accumulations for parameters used more than once",
            param.name, st.count, st.expected);
  if (st.count < st.expected) return;
  BucketState& b = buckets_[size_t(st.chunk)][size_t(st.bucket)];
  MG_ASSERT(b.pending > 0);
  if (--b.pending == 0) launch_ready_buckets(ctx, st.chunk);
}

void DistributedDataParallel::launch_ready_buckets(Context& ctx, int chunk) {
  auto& bks = buckets_[size_t(chunk)];
  int& next = next_launch_[size_t(chunk)];
  while (size_t(next) < bks.size() && bks[size_t(next)].pending == 0) launch_bucket(ctx, chunk, next++);
}

void DistributedDataParallel::launch_bucket(Context& ctx, int chunk, int bucket) {
  BucketState& st = buckets_[size_t(chunk)][size_t(bucket)];
  MG_ASSERT(!st.launched, "bucket {} of chunk {} launched twice", bucket, chunk);
  st.launched = true;
  Communicator& group = data_parallel_group();
  const int dp = group.size();
  if (dp == 1) return;
  const Bucket& b = chunks_[size_t(chunk)]->buckets()[size_t(bucket)];
  Tensor grad = b.grad_data;
  ops::scale_(ctx, grad, 1.0f / float(dp));  // Megatron's gradient_scaling_factor: the sum is the mean
  if (config_.use_distributed_optimizer) {
    const int64_t n = b.numel() / dp;
    Tensor shard = grad.flat_slice(n * group.rank(), n);
    st.grad_work = group.reduce_scatter(ctx, grad, shard);
  } else {
    st.grad_work = group.all_reduce(ctx, grad);
  }
}

void DistributedDataParallel::finish_grad_sync(Context& ctx) {
  for (int c = 0; c < num_chunks(); ++c) {
    auto& bks = buckets_[size_t(c)];
    for (int& next = next_launch_[size_t(c)]; size_t(next) < bks.size(); ++next) launch_bucket(ctx, c, next);
  }
  for (auto& chunk : buckets_)
    for (BucketState& b : chunk)
      if (b.grad_work) b.grad_work->wait();
  reset_grad_state();
}

void DistributedDataParallel::start_param_sync(Context& ctx) {
  if (!config_.use_distributed_optimizer) return;
  Communicator& group = data_parallel_group();
  const int dp = group.size();
  if (dp == 1) return;
  finish_param_sync(ctx);
  for (size_t c = 0; c < chunks_.size(); ++c) {
    const auto& bks = chunks_[c]->buckets();
    for (size_t b = 0; b < bks.size(); ++b) {
      Tensor all = bks[b].param_data;
      const int64_t n = bks[b].numel() / dp;
      const Tensor own = all.flat_slice(n * group.rank(), n);
      buckets_[c][b].param_work = group.all_gather(ctx, own, all);
    }
  }
  if (!config_.overlap_param_gather) finish_param_sync(ctx);
}

void DistributedDataParallel::finish_param_sync(Context& ctx) {
  for (int c = 0; c < num_chunks(); ++c) finish_param_sync(ctx, c);
}

void DistributedDataParallel::finish_param_sync(Context& ctx, int chunk) {
  for (BucketState& b : buckets_.at(size_t(chunk))) {
    if (!b.param_work) continue;
    b.param_work->wait();
    b.param_work.reset();
  }
}

void DistributedDataParallel::broadcast_params(Context& ctx) {
  Communicator& group = data_parallel_group();
  if (group.size() == 1) return;
  finish_param_sync(ctx);
  for (ParamAndGradBuffer* buf : chunks_) {
    Tensor t = buf->param_buffer();
    if (t.numel() > 0) group.broadcast(ctx, t, 0)->wait();
  }
}

ParamShard DistributedDataParallel::shard(const std::string& name, int dp_rank) const {
  const Parameter* p = find(name);
  MG_CHECK(p, "DistributedDataParallel has no parameter '{}'", name);
  const int64_t numel = p->data.numel();
  if (!config_.use_distributed_optimizer) return ParamShard{0, numel};
  const ParamState& st = params_.at(p);
  const ParamAndGradBuffer& buf = *chunks_[size_t(st.chunk)];
  const Bucket& b = buf.buckets()[size_t(st.bucket)];
  const int dp = buf.dp_size();
  MG_ASSERT(dp_rank >= 0 && dp_rank < dp, "data-parallel rank {} of {}", dp_rank, dp);
  const int64_t n = b.numel() / dp;
  const int64_t lo = b.start + n * dp_rank, hi = lo + n;
  const int64_t ps = buf.location(p).offset, pe = ps + numel;
  const int64_t s = std::max(lo, ps), e = std::min(hi, pe);
  return e > s ? ParamShard{s - ps, e - s} : ParamShard{};
}

namespace {

// All-reduces the main grads of `params` over `group` as one flat buffer (Megatron's coalesced
// _flatten_dense_tensors / all_reduce / _unflatten_dense_tensors).
void all_reduce_main_grads(Context& ctx, Communicator& group, const std::vector<Parameter*>& params) {
  if (params.empty() || group.size() == 1) return;
  if (params.size() == 1) {
    Tensor g = params[0]->main_grad.view({-1});
    group.all_reduce(ctx, g)->wait();
    return;
  }
  int64_t total = 0;
  for (const Parameter* p : params) total += p->main_grad.numel();
  Tensor flat = Tensor::empty({total}, DType::Float32, params[0]->main_grad.device());
  int64_t off = 0;
  for (const Parameter* p : params) {
    flat.flat_slice(off, p->main_grad.numel()).copy_from(p->main_grad);
    off += p->main_grad.numel();
  }
  group.all_reduce(ctx, flat)->wait();
  off = 0;
  for (Parameter* p : params) {
    p->main_grad.copy_from(flat.flat_slice(off, p->main_grad.numel()));
    off += p->main_grad.numel();
  }
}

}  // namespace

void finalize_model_grads(Context& ctx, DistributedDataParallel& ddp) {
  ddp.finish_grad_sync(ctx);
  ParallelState& ps = ddp.parallel_state();
  std::vector<Parameter*> sequence_parallel, embedding;
  for (int c = 0; c < ddp.num_chunks(); ++c) {
    for (Parameter* p : ddp.chunk(c).parameters()) {
      if (p->sequence_parallel) sequence_parallel.push_back(p);
      if (p->shared_embedding_copy || p->in_embedding_group) embedding.push_back(p);
    }
  }
  // Megatron's _allreduce_non_tensor_model_parallel_grads (layernorm grads under SP).
  if (ps.sequence_parallel() && ps.tp_size() > 1) all_reduce_main_grads(ctx, ps.tensor(), sequence_parallel);
  // Megatron's _allreduce_word_embedding_grads.
  if (ps.pp_size() > 1 && ps.embedding()) all_reduce_main_grads(ctx, *ps.embedding(), embedding);
}

}  // namespace megatron

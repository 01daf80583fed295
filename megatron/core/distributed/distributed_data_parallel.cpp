// DistributedDataParallel and finalize_model_grads (distributed_data_parallel.h).
#include "megatron/core/distributed/distributed_data_parallel.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "megatron/core/fp8_utils.h"
#include "megatron/kernels/ops.h"

namespace megatron {

DistributedDataParallel::DistributedDataParallel(ParallelState& ps, std::vector<ParamAndGradBuffer*> chunks,
                                                 const DDPConfig& config)
    : ps_(ps), chunks_(std::move(chunks)), config_(config) {
  MG_CHECK(!chunks_.empty(), "DistributedDataParallel needs at least one model chunk");
  MG_CHECK(!config_.overlap_param_gather || config_.use_distributed_optimizer,
           "--overlap-param-gather needs --use-distributed-optimizer");
  build_buffers();
  for (size_t i = 0; i < buffers_.size(); ++i) {
    const ParamAndGradBuffer& buf = *buffers_[i].buffer;
    buckets_.emplace_back(buf.buckets().size());
    for (size_t b = 0; b < buf.buckets().size(); ++b) {
      for (Parameter* p : buf.buckets()[b].params) {
        MG_CHECK(by_name_.emplace(p->name, p).second, "DistributedDataParallel: parameter '{}' is in two chunks",
                 p->name);
        params_[p] = ParamState{int(i), int(b), 1, 0};
        p->grad_hook = this;
      }
    }
  }
  next_launch_.assign(buffers_.size(), 0);
  sync_enabled_.assign(chunks_.size(), true);
  reset_grad_state();
}

// Note [Buffers per reduction group].
void DistributedDataParallel::build_buffers() {
  for (size_t c = 0; c < chunks_.size(); ++c) {
    ParamAndGradBuffer& chunk = *chunks_[c];
    MG_ASSERT(chunk.allocated(), "DistributedDataParallel: model chunk {} is not allocated", c);
    std::vector<Parameter*> dense, fp8, expert, fp8_expert;
    for (Parameter* p : chunk.parameters()) {
      MG_CHECK(!p->fp8 || config_.use_distributed_optimizer,
               "--fp8-param-gather only works with the distributed optimizer: add --use-distributed-optimizer");
      const bool is_expert = p->reduce_group == GradReduceGroup::ExpertData;
      (is_expert ? (p->fp8 ? fp8_expert : expert) : (p->fp8 ? fp8 : dense)).push_back(p);
    }
    const int dense_dp = reduction_group(GradReduceGroup::DataContext).size();
    if (expert.empty() && fp8.empty() && fp8_expert.empty() && chunk.has_layout(config_, dense_dp)) {
      buffers_.push_back(GradBuffer{int(c), GradReduceGroup::DataContext, &chunk, nullptr});
      continue;
    }
    MG_CHECK(!chunk.parameters().empty(), "DistributedDataParallel: model chunk {} has no parameters", c);
    const Tensor& any = chunk.parameters().front()->data;
    // Note [FP8 parameters]: the FP8 weights' buffer holds fp8 bytes; their model values stay
    // here (views of the chunk's released storage) until the optimizer has taken them.
    for (const std::vector<Parameter*>* group : {&fp8, &fp8_expert}) {
      for (Parameter* p : *group) {
        has_fp8_params_ = true;
        fp8_init_values_[p->name] = p->data;
        p->fp8->model_dtype = p->data.dtype();
      }
    }
    for (auto [g, params, dtype] : {std::tuple{GradReduceGroup::DataContext, &dense, any.dtype()},
                                    std::tuple{GradReduceGroup::DataContext, &fp8, DType::Float8E4M3},
                                    std::tuple{GradReduceGroup::ExpertData, &expert, any.dtype()},
                                    std::tuple{GradReduceGroup::ExpertData, &fp8_expert, DType::Float8E4M3}}) {
      if (params->empty()) continue;
      auto owned = std::make_unique<ParamAndGradBuffer>(dtype, any.device(), *params, config_, reduction_group(g).size());
      buffers_.push_back(GradBuffer{int(c), g, owned.get(), std::move(owned)});
    }
    chunk.release_storage();
  }
}

DistributedDataParallel::~DistributedDataParallel() {
  for (auto& [name, p] : by_name_) p->grad_hook = nullptr;
}

Communicator& DistributedDataParallel::reduction_group(GradReduceGroup group) const {
  return group == GradReduceGroup::DataContext ? ps_.data_context() : ps_.expert_data();
}

Communicator& DistributedDataParallel::reduction_group_of(const std::string& name) const {
  const Parameter* p = find(name);
  MG_CHECK(p, "DistributedDataParallel has no parameter '{}'", name);
  return reduction_group(p->reduce_group);
}

std::vector<Parameter> DistributedDataParallel::parameters() const {
  std::vector<Parameter> out;
  for (ParamAndGradBuffer* buf : chunks_)
    for (Parameter* p : buf->parameters()) out.push_back(*p);
  return out;
}

Tensor DistributedDataParallel::fp8_init_value(const std::string& name) const {
  auto it = fp8_init_values_.find(name);
  MG_ASSERT(it != fp8_init_values_.end(), "no initial value of FP8 parameter {}: the optimizer took them already", name);
  return it->second;
}

Parameter* DistributedDataParallel::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

void DistributedDataParallel::reset_grad_state() {
  for (size_t i = 0; i < buffers_.size(); ++i) {
    const auto& bks = buffers_[i].buffer->buckets();
    for (size_t b = 0; b < bks.size(); ++b) {
      buckets_[i][b].pending = int(bks[b].params.size());
      buckets_[i][b].launched = false;
      buckets_[i][b].grad_work.reset();
    }
    next_launch_[i] = 0;
  }
  for (auto& [p, st] : params_) st.count = 0;
}

void DistributedDataParallel::zero_grad(Context& ctx) {
  for (auto& buffer : buckets_)
    for (BucketState& b : buffer)
      if (b.grad_work) b.grad_work->wait();
  for (GradBuffer& buf : buffers_) buf.buffer->zero_grad();
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
  if (!sync_enabled_[size_t(buffers_[size_t(st.buffer)].chunk)]) return;
  ++st.count;
  MG_ASSERT(st.count <= st.expected,
            "parameter {} accumulated {} times in the last microbatch, {} expected: "
            "call set_expected_accumulations for parameters used more than once",
            param.name, st.count, st.expected);
  if (st.count < st.expected) return;
  BucketState& b = buckets_[size_t(st.buffer)][size_t(st.bucket)];
  MG_ASSERT(b.pending > 0);
  if (--b.pending == 0) launch_ready_buckets(ctx, st.buffer);
}

void DistributedDataParallel::launch_ready_buckets(Context& ctx, int buffer) {
  auto& bks = buckets_[size_t(buffer)];
  int& next = next_launch_[size_t(buffer)];
  while (size_t(next) < bks.size() && bks[size_t(next)].pending == 0) launch_bucket(ctx, buffer, next++);
}

void DistributedDataParallel::launch_bucket(Context& ctx, int buffer, int bucket) {
  BucketState& st = buckets_[size_t(buffer)][size_t(bucket)];
  MG_ASSERT(!st.launched, "bucket {} of buffer {} launched twice", bucket, buffer);
  st.launched = true;
  Communicator& group = reduction_group(buffers_[size_t(buffer)].group);
  const int dp = group.size();
  // Megatron's gradient_scaling_factor: the sum over the data × context ranks is their mean. Expert
  // gradients take the same factor (expert_gradient_scaling_factor = 1 / dp×cp, not 1 / expert-dp):
  // an expert's gradient already sums the tokens the dispatcher brought from every data rank.
  // With a per-token loss the factor is 1: the ranks' gradients are summed, and
  // finalize_model_grads divides by the global batch's tokens (Note [Per-token loss]).
  const int dense_dp = reduction_group(GradReduceGroup::DataContext).size();
  const Bucket& b = buffers_[size_t(buffer)].buffer->buckets()[size_t(bucket)];
  Tensor grad = b.grad_data;
  if (dense_dp > 1 && !config_.calculate_per_token_loss) ops::scale_(ctx, grad, 1.0f / float(dense_dp));
  if (dp == 1) return;
  // Note [Gradient reduction dtype]: a bf16 reduction rounds the scaled gradients into the reduce
  // buffer; finish_grad_sync widens the result back.
  Tensor reduced = b.reduce_data;
  if (reduced.raw_data() != grad.raw_data()) reduced.copy_from(grad);
  if (config_.use_distributed_optimizer) {
    const int64_t n = b.numel() / dp;
    Tensor shard = reduced.flat_slice(n * group.rank(), n);
    st.grad_work = group.reduce_scatter(ctx, reduced, shard);
  } else {
    st.grad_work = group.all_reduce(ctx, reduced);
  }
}

void DistributedDataParallel::widen_reduced_grads(int buffer, int bucket) {
  const Bucket& b = buffers_[size_t(buffer)].buffer->buckets()[size_t(bucket)];
  if (b.reduce_data.raw_data() == b.grad_data.raw_data()) return;
  if (config_.use_distributed_optimizer) {  // only the owned shard holds the reduced values
    const Communicator& group = reduction_group(buffers_[size_t(buffer)].group);
    const int64_t n = b.numel() / group.size();
    Tensor own = b.grad_data.flat_slice(n * group.rank(), n);
    own.copy_from(b.reduce_data.flat_slice(n * group.rank(), n));
  } else {
    Tensor all = b.grad_data;
    all.copy_from(b.reduce_data);
  }
}

void DistributedDataParallel::scale_gradients(Context& ctx, float factor) {
  for (GradBuffer& buf : buffers_) {
    Tensor g = buf.buffer->grad_buffer();
    if (g.numel() > 0) ops::scale_(ctx, g, factor);
  }
}

void DistributedDataParallel::finish_grad_sync(Context& ctx) {
  for (int i = 0; i < num_buffers(); ++i) {
    auto& bks = buckets_[size_t(i)];
    for (int& next = next_launch_[size_t(i)]; size_t(next) < bks.size(); ++next) launch_bucket(ctx, i, next);
  }
  for (size_t i = 0; i < buckets_.size(); ++i) {
    for (size_t b = 0; b < buckets_[i].size(); ++b) {
      if (!buckets_[i][b].grad_work) continue;
      buckets_[i][b].grad_work->wait();
      widen_reduced_grads(int(i), int(b));
    }
  }
  reset_grad_state();
}

void DistributedDataParallel::start_param_sync(Context& ctx) {
  if (!config_.use_distributed_optimizer) return;
  finish_param_sync(ctx);
  for (size_t i = 0; i < buffers_.size(); ++i) {
    Communicator& group = reduction_group(buffers_[i].group);
    const int dp = group.size();
    if (dp == 1) continue;
    const auto& bks = buffers_[i].buffer->buckets();
    for (size_t b = 0; b < bks.size(); ++b) {
      Tensor all = bks[b].param_data;
      const int64_t n = bks[b].numel() / dp;
      const Tensor own = all.flat_slice(n * group.rank(), n);
      buckets_[i][b].param_work = group.all_gather(ctx, own, all);
    }
  }
  if (!config_.overlap_param_gather) finish_param_sync(ctx);
}

void DistributedDataParallel::finish_param_sync(Context& ctx) {
  for (int c = 0; c < num_chunks(); ++c) finish_param_sync(ctx, c);
}

void DistributedDataParallel::finish_param_sync(Context& ctx, int chunk) {
  for (size_t i = 0; i < buffers_.size(); ++i) {
    if (buffers_[i].chunk != chunk) continue;
    for (BucketState& b : buckets_[i]) {
      if (!b.param_work) continue;
      b.param_work->wait();
      b.param_work.reset();
    }
  }
}

void DistributedDataParallel::broadcast_params(Context& ctx) {
  finish_param_sync(ctx);
  for (const GradBuffer& buf : buffers_) {
    Communicator& group = reduction_group(buf.group);
    if (group.size() == 1) continue;
    Tensor t = buf.buffer->param_buffer();
    if (t.numel() > 0) group.broadcast(ctx, t, 0)->wait();
  }
}

ParamShard DistributedDataParallel::shard(const std::string& name, int dp_rank) const {
  const Parameter* p = find(name);
  MG_CHECK(p, "DistributedDataParallel has no parameter '{}'", name);
  const int64_t numel = p->data.numel();
  if (!config_.use_distributed_optimizer) return ParamShard{0, numel};
  const ParamState& st = params_.at(p);
  const ParamAndGradBuffer& buf = *buffers_[size_t(st.buffer)].buffer;
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

void finalize_model_grads(Context& ctx, DistributedDataParallel& ddp, std::optional<double> num_tokens) {
  ddp.finish_grad_sync(ctx);
  ParallelState& ps = ddp.parallel_state();
  std::vector<Parameter*> tp_partial, embedding;
  const bool sp = ps.sequence_parallel() && ps.tp_size() > 1;
  for (int c = 0; c < ddp.num_chunks(); ++c) {
    for (Parameter* p : ddp.chunk(c).parameters()) {
      if ((sp && p->sequence_parallel) || p->tp_partial_grad) tp_partial.push_back(p);
      if (p->shared_embedding_copy || p->in_embedding_group) embedding.push_back(p);
    }
  }
  // Megatron's _allreduce_layernorm_grads: norm and bias gradients under SP, and the q/k layernorms'.
  if (ps.tp_size() > 1) all_reduce_main_grads(ctx, ps.tensor(), tp_partial);
  // Megatron's _allreduce_word_embedding_grads.
  if (ps.pp_size() > 1 && ps.embedding()) all_reduce_main_grads(ctx, *ps.embedding(), embedding);
  // Note [Per-token loss]: the last stage knows the global batch's tokens; every stage divides by them.
  if (num_tokens) {
    double tokens = *num_tokens;
    if (ps.pp_size() > 1) {
      Tensor t = Tensor::from_ints({std::llround(tokens)}, {1}, DType::Int64, ctx.device());
      ps.pipeline().broadcast(ctx, t, ps.pp_size() - 1)->wait();
      tokens = double(t.to_ints()[0]);
    }
    if (tokens > 0) ddp.scale_gradients(ctx, float(1.0 / tokens));
  }
}

}  // namespace megatron

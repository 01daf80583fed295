#include "megatron/core/distributed/param_and_grad_buffer.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "megatron/kernels/fp8_ops.h"
#include "megatron/runtime/philox.h"

namespace megatron {

namespace {
// FNV-1a: the parameter name picks its random stream (Note [Random stream layout]).
uint64_t name_hash(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }
}  // namespace

int64_t effective_bucket_size(const DDPConfig& config, int dp_size) {
  if (config.bucket_size) return *config.bucket_size;
  return config.overlap_grad_reduce ? std::max<int64_t>(40000000, int64_t(1000000) * dp_size) : 0;
}

Parameter* ParamAndGradBuffer::add(const std::string& name, const Shape& shape, bool no_weight_decay, ParamInit init) {
  return add(name, unsharded(shape), no_weight_decay, init);
}

Parameter* ParamAndGradBuffer::add(const std::string& name, const ShardSpec& spec, bool no_weight_decay,
                                   ParamInit init) {
  MG_ASSERT(!allocated(), "parameter {} registered after allocation", name);
  MG_ASSERT(!by_name_.count(name), "parameter {} registered twice", name);
  Parameter& param = owned_.emplace_back();
  param.name = name;
  param.no_weight_decay = no_weight_decay;
  param.shard = spec;
  entries_.push_back(Entry{&param, local_shape(spec), init, {}});
  params_.push_back(&param);
  by_name_[name] = &param;
  entry_of_[&param] = &entries_.back();
  return &param;
}

ParamAndGradBuffer::ParamAndGradBuffer(DType param_dtype, Device device, const std::vector<Parameter*>& params,
                                       const DDPConfig& config, int dp_size)
    : param_dtype_(param_dtype), device_(device) {
  for (Parameter* p : params) {
    MG_ASSERT(p && p->data.defined(), "a parameter to adopt has no data");
    MG_ASSERT(!by_name_.count(p->name), "parameter {} adopted twice", p->name);
    // Note [FP8 parameters]: a buffer of FP8 weights adopts them in their model dtype.
    MG_ASSERT((p->data.dtype() == param_dtype || (is_fp8(param_dtype) && p->fp8)) && p->data.device() == device,
              "parameter {} is {} on {}, the buffer {} on {}", p->name, to_string(p->data.dtype()),
              p->data.device().str(), to_string(param_dtype), device.str());
    entries_.push_back(Entry{p, p->data.shape(), ParamInit::Zeros, {}});
    params_.push_back(p);
    by_name_[p->name] = p;
    entry_of_[p] = &entries_.back();
  }
  std::vector<Tensor> values;
  for (Parameter* p : params_) values.push_back(p->data);
  lay_out(config, dp_size);
  // FP8 weights get their values from the optimizer's main params (Note [FP8 parameters]).
  if (is_fp8(param_dtype)) return;
  for (size_t i = 0; i < params_.size(); ++i) params_[i]->data.copy_from(values[i]);
}

void ParamAndGradBuffer::allocate(const DDPConfig& config, int dp_size, bool with_grads) {
  MG_ASSERT(!allocated(), "buffer allocated twice");
  with_grads_ = with_grads;
  lay_out(config, dp_size);
}

void ParamAndGradBuffer::release_storage() {
  param_buffer_ = grad_buffer_ = reduce_buffer_ = Tensor();
  buckets_.clear();
  released_ = true;
}

bool ParamAndGradBuffer::has_layout(const DDPConfig& config, int dp_size) const {
  return param_buffer_.defined() && with_grads_ && dp_size_ == dp_size &&
         config_.use_distributed_optimizer == config.use_distributed_optimizer &&
         config_.grad_reduce_in_fp32 == config.grad_reduce_in_fp32 &&
         effective_bucket_size(config_, dp_size) == effective_bucket_size(config, dp_size);
}

void ParamAndGradBuffer::lay_out(const DDPConfig& config, int dp_size) {
  MG_CHECK(dp_size >= 1, "data-parallel size {} must be >= 1", dp_size);
  MG_CHECK(!config.bucket_size || *config.bucket_size >= 0, "--ddp-bucket-size {} must be >= 0", *config.bucket_size);
  config_ = config;
  dp_size_ = dp_size;
  const bool dist_opt = config.use_distributed_optimizer;
  const int64_t bucket_size = effective_bucket_size(config, dp_size);  // 0: one bucket
  const int64_t bucket_multiple = dist_opt ? std::lcm(int64_t(dp_size), int64_t(128)) : 1;
  const int64_t param_alignment = dist_opt ? 64 : 1;
  auto own_bucket = [&](const Parameter& p) {
    return dist_opt && (p.shared_embedding_copy || p.in_embedding_group);
  };

  // Note [Buckets and padding]: the layout first, in reverse registration order (backward order).
  struct Cut {
    int64_t start;
    std::vector<Entry*> entries;
  };
  std::vector<Cut> cuts{{0, {}}};
  numel_ = 0;
  int64_t offset = 0;
  auto close_bucket = [&](int64_t end) {
    const int64_t padded = cuts.back().start + round_up(end - cuts.back().start, bucket_multiple);
    cuts.push_back({padded, {}});
    return padded;
  };
  for (auto it = entries_.rbegin(); it != entries_.rend(); ++it) {
    const int64_t n = shape_numel(it->shape);
    numel_ += n;
    if (own_bucket(*it->param) && !cuts.back().entries.empty()) offset = close_bucket(offset);
    offset = cuts.back().start + round_up(offset - cuts.back().start, param_alignment);
    it->location = Location{offset, int(cuts.size()) - 1};
    cuts.back().entries.push_back(&*it);
    offset += n;
    if ((bucket_size > 0 && offset - cuts.back().start >= bucket_size) || own_bucket(*it->param)) offset = close_bucket(offset);
  }
  if (!cuts.back().entries.empty()) offset = close_bucket(offset);
  cuts.pop_back();  // the empty bucket after the last cut
  const int64_t total = offset;

  param_buffer_ = Tensor::zeros({total}, param_dtype_, device_);  // init_weights or a checkpoint fills it
  grad_buffer_ = with_grads_ ? Tensor::zeros({total}, DType::Float32, device_) : Tensor();
  // Note [Gradient reduction dtype]: Megatron reduces in the parameters' dtype unless in fp32.
  // FP8 weights' gradients are reduced in bf16 (Note [FP8 parameters]: their model dtype's).
  const bool low_precision_reduce = with_grads_ && !config.grad_reduce_in_fp32 && param_dtype_ != DType::Float32;
  const DType reduce_dtype = is_fp8(param_dtype_) ? DType::BFloat16 : param_dtype_;
  reduce_buffer_ = low_precision_reduce ? Tensor::zeros({total}, reduce_dtype, device_) : Tensor();
  buckets_.clear();
  for (size_t b = 0; b < cuts.size(); ++b) {
    Bucket bucket;
    bucket.start = cuts[b].start;
    bucket.end = b + 1 < cuts.size() ? cuts[b + 1].start : total;
    bucket.param_data = param_buffer_.flat_slice(bucket.start, bucket.numel());
    if (with_grads_) bucket.grad_data = grad_buffer_.flat_slice(bucket.start, bucket.numel());
    bucket.reduce_data = low_precision_reduce ? reduce_buffer_.flat_slice(bucket.start, bucket.numel()) : bucket.grad_data;
    for (Entry* e : cuts[b].entries) {
      const int64_t n = shape_numel(e->shape);
      e->param->data = param_buffer_.flat_slice(e->location.offset, n).view(e->shape);
      e->param->main_grad = with_grads_ ? grad_buffer_.flat_slice(e->location.offset, n).view(e->shape) : Tensor();
      bucket.params.push_back(e->param);
    }
    buckets_.push_back(std::move(bucket));
  }
}

ParamAndGradBuffer::Location ParamAndGradBuffer::location(const Parameter* p) const {
  MG_ASSERT(allocated(), "location of a parameter before allocation");
  auto it = entry_of_.find(p);
  MG_ASSERT(it != entry_of_.end(), "parameter {} is not in this buffer", p ? p->name : "(null)");
  return it->second->location;
}

void ParamAndGradBuffer::init_weights(uint64_t seed, float std, int num_layers, bool zero_centered_gamma) {
  MG_ASSERT(allocated());
  const float scaled_std = std / std::sqrt(2.0f * float(num_layers));
  for (Entry& e : entries_) {
    const int64_t n = shape_numel(e.shape);
    // Host fp32 parameters are written in place; others through an fp32 staging copy.
    const bool direct = e.param->data.device().is_host() && e.param->data.dtype() == DType::Float32;
    Tensor staging = direct ? e.param->data : Tensor::empty(e.shape, DType::Float32);
    float* v = staging.data<float>();
    switch (e.init) {
      case ParamInit::Normal:
      case ParamInit::ScaledNormal: {
        const float s = e.init == ParamInit::Normal ? std : scaled_std;
        const uint64_t stream = name_hash(e.param->name);
        // Element i of the full tensor is normal number i of the parameter's stream; a shard
        // draws the runs of the full tensor it holds.
        std::vector<FlatRun> runs;
        for (const ShardBox& box : shard_boxes(e.param->shard)) {
          for (const FlatRun& r : flat_runs(box, e.param->shard.global_shape, e.shape)) runs.push_back(r);
        }
        for (const FlatRun& r : runs) {
          constexpr int64_t kChunk = 1 << 16;  // chunks of whole Philox blocks, spread over the cores
#pragma omp parallel for schedule(static)
          for (int64_t c = 0; c < r.count; c += kChunk) {
            const int64_t len = std::min(kChunk, r.count - c);
            float* out = v + r.local_start + c;
            philox_normals(seed, stream, uint64_t(r.global_start + c), uint64_t(len), out);
            for (int64_t i = 0; i < len; ++i) out[i] *= s;
          }
        }
        break;
      }
      case ParamInit::Zeros:
        std::fill(v, v + n, 0.0f);
        break;
      case ParamInit::Ones:
        std::fill(v, v + n, zero_centered_gamma ? 0.0f : 1.0f);
        break;
    }
    if (!direct) e.param->data.copy_from(staging);
  }
}

void ParamAndGradBuffer::zero_grad() {
  MG_ASSERT(allocated());
  MG_CHECK(with_grads_, "the parameters have no gradients: the model was built for inference only");
  if (grad_buffer_.defined()) {
    grad_buffer_.zero_();
    return;
  }
  for (Parameter* p : params_) p->main_grad.zero_();  // released: the views live in another buffer
}

Parameter* ParamAndGradBuffer::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

}  // namespace megatron

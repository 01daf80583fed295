#include "megatron/core/distributed/param_and_grad_buffer.h"

#include <algorithm>
#include <cmath>

#include "megatron/runtime/philox.h"

namespace megatron {

namespace {
// FNV-1a: the parameter name picks its random stream (Note [Random stream layout]).
uint64_t name_hash(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}
}  // namespace

Parameter* ParamAndGradBuffer::add(const std::string& name, const Shape& shape, bool no_weight_decay, ParamInit init) {
  return add(name, unsharded(shape), no_weight_decay, init);
}

Parameter* ParamAndGradBuffer::add(const std::string& name, const ShardSpec& spec, bool no_weight_decay,
                                   ParamInit init) {
  MG_ASSERT(!allocated(), "parameter {} registered after allocation", name);
  MG_ASSERT(!by_name_.count(name), "parameter {} registered twice", name);
  Parameter param;
  param.name = name;
  param.no_weight_decay = no_weight_decay;
  param.shard = spec;
  entries_.push_back(Entry{param, local_shape(spec), init});
  Parameter* p = &entries_.back().param;
  params_.push_back(p);
  by_name_[name] = p;
  return p;
}

void ParamAndGradBuffer::allocate() {
  MG_ASSERT(!allocated(), "buffer allocated twice");
  numel_ = 0;
  for (const Entry& e : entries_) numel_ += shape_numel(e.shape);
  param_buffer_ = Tensor::zeros({numel_}, param_dtype_, device_);  // init_weights or a checkpoint fills it
  grad_buffer_ = Tensor::zeros({numel_}, DType::Float32, device_);
  int64_t offset = 0;
  for (auto it = entries_.rbegin(); it != entries_.rend(); ++it) {  // reverse: backward order
    int64_t n = shape_numel(it->shape);
    it->param.data = param_buffer_.flat_slice(offset, n).view(it->shape);
    it->param.main_grad = grad_buffer_.flat_slice(offset, n).view(it->shape);
    offset += n;
  }
}

void ParamAndGradBuffer::init_weights(uint64_t seed, float std, int num_layers, bool zero_centered_gamma) {
  MG_ASSERT(allocated());
  const float scaled_std = std / std::sqrt(2.0f * float(num_layers));
  for (Entry& e : entries_) {
    const int64_t n = shape_numel(e.shape);
    // Host fp32 parameters are written in place; others through an fp32 staging copy.
    const bool direct = e.param.data.device().is_host() && e.param.data.dtype() == DType::Float32;
    Tensor staging = direct ? e.param.data : Tensor::empty(e.shape, DType::Float32);
    float* v = staging.data<float>();
    switch (e.init) {
      case ParamInit::Normal:
      case ParamInit::ScaledNormal: {
        const float s = e.init == ParamInit::Normal ? std : scaled_std;
        const uint64_t stream = name_hash(e.param.name);
        // Element i of the full tensor is normal number i of the parameter's stream; a shard
        // draws the runs of the full tensor it holds.
        std::vector<FlatRun> runs;
        for (const ShardBox& box : shard_boxes(e.param.shard)) {
          for (const FlatRun& r : flat_runs(box, e.param.shard.global_shape, e.shape)) runs.push_back(r);
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
    if (!direct) e.param.data.copy_from(staging);
  }
}

void ParamAndGradBuffer::zero_grad() {
  MG_ASSERT(allocated());
  grad_buffer_.zero_();
}

Parameter* ParamAndGradBuffer::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

}  // namespace megatron

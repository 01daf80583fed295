// MegatronPretrainingSampler and the prefetching DataLoader (see data_loader.h).
#include "megatron/core/datasets/data_loader.h"

#include <cstring>

#include "megatron/runtime/check.h"

namespace megatron {

MegatronPretrainingSampler::MegatronPretrainingSampler(int64_t total_samples, int64_t consumed_samples,
                                                       int64_t micro_batch_size, int64_t data_parallel_rank,
                                                       int64_t data_parallel_size, bool drop_last)
    : total_(total_samples),
      consumed_(consumed_samples),
      mbs_(micro_batch_size),
      rank_(data_parallel_rank),
      dp_(data_parallel_size),
      drop_last_(drop_last) {
  MG_CHECK(total_ > 0, "no sample to load: the dataset is empty");
  MG_CHECK(consumed_ >= 0 && consumed_ < total_,
           "consumed samples ({}) must be in [0, {}): the run has already seen the whole dataset", consumed_, total_);
  MG_CHECK(mbs_ > 0, "--micro-batch-size must be positive (got {})", mbs_);
  MG_CHECK(dp_ > 0, "data-parallel size must be positive (got {})", dp_);
  MG_CHECK(rank_ >= 0 && rank_ < dp_, "data-parallel rank {} is not in [0, {})", rank_, dp_);
}

std::optional<std::vector<int64_t>> MegatronPretrainingSampler::next() {
  const int64_t step = mbs_ * dp_;
  const int64_t available = total_ - consumed_;
  if (available <= 0) return std::nullopt;
  const int64_t take = std::min(step, available);
  if (take < step && drop_last_) return std::nullopt;
  const int64_t lo = consumed_ + std::min(rank_ * mbs_, take);
  const int64_t hi = consumed_ + std::min((rank_ + 1) * mbs_, take);
  std::vector<int64_t> out;
  for (int64_t i = lo; i < hi; ++i) out.push_back(i);
  consumed_ += take;
  return out;
}

DataLoader::DataLoader(std::shared_ptr<const MegatronDataset> dataset, DataLoaderOptions options)
    : dataset_(std::move(dataset)),
      options_(options),
      sampler_(dataset_ ? dataset_->size() : 0, options.consumed_samples, options.micro_batch_size,
               options.data_parallel_rank, options.data_parallel_size, options.drop_last),
      consumed_(options.consumed_samples) {
  MG_CHECK(options_.prefetch > 0, "the data loader needs a prefetch depth of at least 1");
  thread_ = std::thread([this] { worker(); });
}

DataLoader::~DataLoader() { shutdown(); }

void DataLoader::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

GPTBatch DataLoader::assemble(const std::vector<int64_t>& indices, int64_t consumed_after) const {
  Device device = Device::cpu();
#ifdef MEGATRON_WITH_CUDA
  if (options_.pin_memory) device = Device::pinned();
#endif
  const int64_t rows = int64_t(indices.size());
  GPTBatch b;
  GPTSample s;
  for (int64_t r = 0; r < rows; ++r) {
    dataset_->get(indices[size_t(r)], s);
    const int64_t L = int64_t(s.tokens.size());
    if (r == 0) {
      b.tokens = Tensor::empty({rows, L}, DType::Int64, device);
      b.labels = Tensor::empty({rows, L}, DType::Int64, device);
      b.loss_mask = Tensor::empty({rows, L}, DType::Float32, device);
      b.position_ids = Tensor::empty({rows, L}, DType::Int64, device);
      if (!s.attention_segments.empty()) b.attention_segments = Tensor::empty({rows, L}, DType::Int32, device);
    }
    const size_t off = size_t(r * L);
    std::memcpy(b.tokens.data<int64_t>() + off, s.tokens.data(), size_t(L) * sizeof(int64_t));
    std::memcpy(b.labels.data<int64_t>() + off, s.labels.data(), size_t(L) * sizeof(int64_t));
    std::memcpy(b.loss_mask.data<float>() + off, s.loss_mask.data(), size_t(L) * sizeof(float));
    std::memcpy(b.position_ids.data<int64_t>() + off, s.position_ids.data(), size_t(L) * sizeof(int64_t));
    if (b.attention_segments.defined())
      std::memcpy(b.attention_segments.data<int32_t>() + off, s.attention_segments.data(), size_t(L) * sizeof(int32_t));
  }
  b.sample_indices = indices;
  b.consumed_samples = consumed_after;
  return b;
}

void DataLoader::worker() {
  try {
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || int(queue_.size()) < options_.prefetch; });
        if (stop_) return;
      }
      std::optional<std::vector<int64_t>> indices = sampler_.next();
      if (!indices || indices->empty()) break;
      GPTBatch batch = assemble(*indices, sampler_.consumed_samples());
      {
        std::lock_guard<std::mutex> lock(mu_);
        queue_.push_back(std::move(batch));
      }
      cv_.notify_all();
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = std::current_exception();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
  }
  cv_.notify_all();
}

std::optional<GPTBatch> DataLoader::next() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !queue_.empty() || done_ || stop_; });
  if (queue_.empty()) {
    if (error_) std::rethrow_exception(error_);
    return std::nullopt;
  }
  GPTBatch b = std::move(queue_.front());
  queue_.pop_front();
  consumed_ = b.consumed_samples;
  lock.unlock();
  cv_.notify_all();
  return b;
}

}  // namespace megatron

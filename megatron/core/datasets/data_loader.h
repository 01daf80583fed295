// The pretraining data loader: Megatron's MegatronPretrainingSampler plus a background thread that
// assembles micro-batches ahead of the training loop.
//
// The sampler walks the dataset sequentially from consumed_samples; each step takes mbs * dp
// consecutive sample indices and data-parallel rank r keeps [r * mbs, (r + 1) * mbs) of them; an
// incomplete last step is dropped (unless drop_last is off, when each rank keeps its share of it).
// Resuming a run means constructing the loader with the consumed_samples saved in the checkpoint.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "megatron/core/datasets/gpt_dataset.h"
#include "megatron/runtime/tensor.h"

namespace megatron {

/// Megatron's MegatronPretrainingSampler.
class MegatronPretrainingSampler {
 public:
  MegatronPretrainingSampler(int64_t total_samples, int64_t consumed_samples, int64_t micro_batch_size,
                             int64_t data_parallel_rank, int64_t data_parallel_size, bool drop_last = true);

  /// This rank's next micro-batch of sample indices, or none when the data is exhausted.
  std::optional<std::vector<int64_t>> next();
  /// Samples consumed by all ranks so far (the value a checkpoint saves).
  int64_t consumed_samples() const { return consumed_; }

 private:
  int64_t total_;
  int64_t consumed_;
  int64_t mbs_;
  int64_t rank_;
  int64_t dp_;
  bool drop_last_;
};

/// One micro-batch, host tensors of shape [mbs, seq_length].
struct GPTBatch {
  Tensor tokens;        // int64
  Tensor labels;        // int64
  Tensor loss_mask;     // fp32
  Tensor position_ids;  // int64
  /// int32 EOD counts per position with --reset-attention-mask (see GPTSample); else undefined.
  Tensor attention_segments;
  /// Sample indices of this rank's rows.
  std::vector<int64_t> sample_indices;
  /// Samples consumed by all ranks once this batch is taken.
  int64_t consumed_samples = 0;
};

struct DataLoaderOptions {
  int64_t micro_batch_size = 1;
  int64_t data_parallel_rank = 0;
  int64_t data_parallel_size = 1;
  int64_t consumed_samples = 0;
  bool drop_last = true;
  /// Micro-batches assembled ahead of the consumer.
  int prefetch = 4;
  /// Pinned host memory for the batch tensors (CUDA builds; plain host memory otherwise).
  bool pin_memory = false;
};

/// Iterates micro-batches of a dataset on a background thread.
class DataLoader {
 public:
  DataLoader(std::shared_ptr<const MegatronDataset> dataset, DataLoaderOptions options);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  /// The next micro-batch (blocks until ready), or none at the end of the data. An error raised
  /// while reading is rethrown here.
  std::optional<GPTBatch> next();
  /// Samples consumed (all ranks) by the batches handed out so far.
  int64_t consumed_samples() const { return consumed_; }
  /// Stops the background thread (also done by the destructor).
  void shutdown();

 private:
  void worker();
  GPTBatch assemble(const std::vector<int64_t>& indices, int64_t consumed_after) const;

  std::shared_ptr<const MegatronDataset> dataset_;
  DataLoaderOptions options_;
  MegatronPretrainingSampler sampler_;
  int64_t consumed_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<GPTBatch> queue_;
  bool done_ = false;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace megatron

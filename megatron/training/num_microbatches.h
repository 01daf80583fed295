// Megatron's num_microbatches_calculator: the global batch size (constant, or ramped up with
// --rampup-batch-size START INCR SAMPLES) and the number of microbatches per iteration
// = global batch / (micro batch x data-parallel size).
#pragma once

#include <cstdint>
#include <vector>

namespace megatron {

class NumMicroBatchesCalculator {
 public:
  NumMicroBatchesCalculator(int global_batch_size, int micro_batch_size, int data_parallel_size,
                            std::vector<int64_t> rampup_batch_size = {});
  /// Updates the current global batch size for the samples consumed so far.
  void update(int64_t consumed_samples);
  int current_global_batch_size() const { return current_global_batch_size_; }
  int num_microbatches() const { return current_global_batch_size_ / micro_batch_times_dp_; }

 private:
  int global_batch_size_;
  int micro_batch_times_dp_;
  std::vector<int64_t> rampup_;
  int current_global_batch_size_;
};

}  // namespace megatron

#include "megatron/training/num_microbatches.h"

#include "megatron/runtime/check.h"

namespace megatron {

NumMicroBatchesCalculator::NumMicroBatchesCalculator(int global_batch_size, int micro_batch_size,
                                                     int data_parallel_size, std::vector<int64_t> rampup)
    : global_batch_size_(global_batch_size),
      micro_batch_times_dp_(micro_batch_size * data_parallel_size),
      rampup_(std::move(rampup)),
      current_global_batch_size_(global_batch_size) {
  MG_CHECK(micro_batch_times_dp_ > 0 && global_batch_size_ % micro_batch_times_dp_ == 0,
           "--global-batch-size ({}) must be divisible by --micro-batch-size x data-parallel size ({})",
           global_batch_size_, micro_batch_times_dp_);
  if (!rampup_.empty()) {
    MG_CHECK(rampup_.size() == 3, "--rampup-batch-size takes START INCR SAMPLES");
    const int64_t start = rampup_[0], incr = rampup_[1], samples = rampup_[2];
    MG_CHECK(start > 0 && incr > 0 && samples >= 0, "--rampup-batch-size values must be positive");
    MG_CHECK((global_batch_size_ - start) % incr == 0,
             "--rampup-batch-size: global batch size ({}) minus START ({}) must be divisible by INCR ({})",
             global_batch_size_, start, incr);
    MG_CHECK(start % micro_batch_times_dp_ == 0 && incr % micro_batch_times_dp_ == 0,
             "--rampup-batch-size START ({}) and INCR ({}) must be divisible by micro batch x DP ({})", start, incr,
             micro_batch_times_dp_);
    update(0);
  }
}

void NumMicroBatchesCalculator::update(int64_t consumed_samples) {
  if (rampup_.empty()) return;
  const int64_t start = rampup_[0], incr = rampup_[1], samples = rampup_[2];
  if (consumed_samples > samples) {
    current_global_batch_size_ = global_batch_size_;
    return;
  }
  // Megatron: rampup_samples_per_increment = samples / num_increments; steps = consumed / that.
  const int64_t num_increments = (global_batch_size_ - start) / incr;
  const double per_increment = num_increments > 0 ? double(samples) / double(num_increments) : 1.0;
  const int64_t steps = per_increment > 0 ? int64_t(double(consumed_samples) / per_increment) : num_increments;
  int64_t gbs = start + steps * incr;
  if (gbs > global_batch_size_) gbs = global_batch_size_;
  // Rounded down to a multiple of micro batch x DP, as Megatron does.
  gbs = gbs / micro_batch_times_dp_ * micro_batch_times_dp_;
  current_global_batch_size_ = int(gbs);
}

}  // namespace megatron

// pretrain(): Megatron's training driver (megatron/training/training.py) — initialize, build the
// model and optimizer, load a checkpoint, build the data iterators, train with periodic logging,
// evaluation and checkpoints, honour the exit conditions, and evaluate at the end.
#pragma once

#include <chrono>
#include <functional>
#include <memory>

#include "megatron/core/pipeline_parallel/schedules.h"
#include "megatron/core/tokenizers/tokenizer.h"
#include "megatron/training/arguments.h"

namespace megatron {

/// The train/valid/test data iterators; an empty iterator means the split has no data.
struct DataIterators {
  BatchIterator train, valid, test;
};

/// Megatron's model_provider: this rank's model chunk `vp_stage` of the model the config describes,
/// its parameters allocated on `device` (not initialised). pretrain() calls it once per virtual
/// pipeline stage.
using ModelProvider = std::function<std::unique_ptr<ModelChunk>(const TransformerConfig& config, Device device,
                                                                const ParallelState& ps, int vp_stage)>;

/// What a training script provides (Megatron's train_valid_test_datasets_provider, model_provider
/// and forward_step, whose result carries the loss function).
struct PretrainCallbacks {
  /// Builds the datasets and data loaders; resumes each loader at its consumed samples.
  std::function<DataIterators(const Arguments&, const Tokenizer*, int64_t consumed_train, int64_t consumed_valid)>
      data_iterators;
  ForwardStepFunc forward_step;
  ModelProvider model_provider;
};

/// Runs training as the arguments say. Returns the process exit code. Throws megatron::Error for
/// the user's mistakes (the binary prints them as one line).
int pretrain(Arguments args, const PretrainCallbacks& callbacks, std::chrono::steady_clock::time_point program_start);

/// Prints one line on the rank that prints (Megatron's print_rank_0; here the last rank, which also
/// prints the iteration lines). Before pretrain() has set up the ranks, every process prints.
void print_rank_last(const std::string& line);

/// Selects the device --device asks for ("auto": the GPU when this build and machine have one);
/// with several processes per node, GPU local_rank (modulo the visible GPUs).
Device select_device(const std::string& requested, int local_rank = 0);

}  // namespace megatron

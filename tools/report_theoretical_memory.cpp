// report_theoretical_memory: Megatron's estimate of the memory one GPU needs for the given
// pretrain_gpt flags (weights and optimizer state, activations), without building anything.
//
//   build/bin/report_theoretical_memory --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
//       --seq-length 2048 --micro-batch-size 4 --train-iters 1 --lr 1e-4 --mock-data --vocab-size 50257
// WORLD_SIZE=64 sets the number of ranks (default: the smallest the parallel sizes allow); MoE
// layouts count the experts over --expert-tensor-parallel-size × --expert-model-parallel-size.
#include <cstdio>
#include <cstdlib>
#include <numeric>

#include "megatron/core/transformer/transformer_config.h"
#include "megatron/runtime/check.h"
#include "megatron/training/num_microbatches.h"
#include "megatron/training/training_log.h"

using namespace megatron;

int main(int argc, char** argv) {
  try {
    std::optional<Arguments> args =
        parse_args(argc, argv, "Megatron's theoretical memory footprint for pretrain_gpt's flags");
    if (!args) return 0;
    // The estimate needs the model shape only: the world is $WORLD_SIZE (as a launcher sets it),
    // else the smallest the parallel sizes allow (dense and expert layouts both dividing it).
    if (const char* w = std::getenv("WORLD_SIZE"); w && *w) {
      args->world_size = std::atoi(w);
      MG_CHECK(args->world_size > 0, "WORLD_SIZE={} is not a positive number of ranks", w);
    } else {
      const int dense = args->tensor_model_parallel_size * args->pipeline_model_parallel_size *
                        args->context_parallel_size;
      const int etp = args->expert_tensor_parallel_size > 0 ? args->expert_tensor_parallel_size
                                                            : args->tensor_model_parallel_size;
      const int expert = etp * args->expert_model_parallel_size * args->pipeline_model_parallel_size;
      args->world_size = std::lcm(dense, args->num_experts > 0 ? expert : 1);
    }
    if (args->train_iters == 0 && args->train_samples == 0) args->train_iters = 1;
    if (args->lr < 0) args->lr = 0;
    if (!args->mock_data && args->data_path.empty()) args->mock_data = true;
    validate_args(*args);
    MG_CHECK(args->vocab_size > 0, "give --vocab-size (the tokenizer's vocabulary size) for the embedding estimate");
    const int padded =
        padded_vocab_size(int(args->vocab_size), args->make_vocab_size_divisible_by, args->tensor_model_parallel_size);
    NumMicroBatchesCalculator mb(args->global_batch_size, args->micro_batch_size, args->data_parallel_size);
    std::printf("%s\n", format_theoretical_memory(theoretical_memory(*args, padded, mb.num_microbatches())).c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

// prepare_cache: builds the GPTDataset index caches (document, sample and shuffle indices, and
// blend indices) offline with pretrain_gpt's flags, as Megatron's tools/prepare_cache.py does, so
// a large run does not build them at startup. The files are those Megatron writes: a cache built
// here is used by Megatron and the other way round.
//
//   build/bin/prepare_cache <pretrain_gpt flags> --data-cache-path cache [--prepare-cache-world-size N]
#include <cstdio>
#include <cstring>
#include <vector>

#include "megatron/core/datasets/blended_megatron_dataset_builder.h"
#include "megatron/runtime/check.h"
#include "megatron/training/arguments.h"

using namespace megatron;

int main(int argc, char** argv) {
  try {
    // --prepare-cache-world-size is this tool's own flag: the data-parallel world the sample counts
    // are computed for. The rest are pretrain_gpt's.
    int world_size = 1;
    std::vector<const char*> rest = {argv[0]};
    for (int i = 1; i < argc; ++i) {
      if (std::strcmp(argv[i], "--prepare-cache-world-size") == 0 && i + 1 < argc) {
        world_size = std::atoi(argv[++i]);
      } else if (std::strncmp(argv[i], "--prepare-cache-world-size=", 27) == 0) {
        world_size = std::atoi(argv[i] + 27);
      } else {
        rest.push_back(argv[i]);
      }
    }
    MG_CHECK(world_size > 0, "--prepare-cache-world-size must be positive");
    std::optional<Arguments> args = parse_args(int(rest.size()), rest.data(), "Build the dataset index caches offline");
    if (!args) return 0;
    args->world_size = world_size;
    if (args->lr < 0) args->lr = 0;
    validate_args(*args);
    MG_CHECK(!args->mock_data, "--mock-data has no index cache to prepare");
    MG_CHECK(!args->tokenizer_type.empty() || args->vocab_size > 0, "give --tokenizer-type (or --vocab-size)");
    if (args->tokenizer_type.empty()) args->tokenizer_type = "NullTokenizer";
    std::shared_ptr<const Tokenizer> tokenizer = build_tokenizer(tokenizer_args_from_args(*args));
    GPTDataArgs d;
    d.data_path = args->data_path;
    d.train_data_path = args->train_data_path;
    d.valid_data_path = args->valid_data_path;
    d.test_data_path = args->test_data_path;
    d.split = args->split;
    if (!args->data_cache_path.empty()) d.data_cache_path = args->data_cache_path;
    d.seq_length = args->seq_length;
    d.seed = args->seed;
    d.reset_position_ids = args->reset_position_ids;
    d.reset_attention_mask = args->reset_attention_mask;
    d.eod_mask_loss = args->eod_mask_loss;
    if (args->train_samples > 0) d.train_samples = args->train_samples;
    d.train_iters = args->train_iters;
    d.eval_interval = args->eval_interval;
    d.eval_iters = args->eval_iters;
    d.global_batch_size = args->global_batch_size;
    SplitDatasets ds = prepare_data_cache(d, tokenizer);
    const char* names[] = {"train", "valid", "test"};
    for (size_t i = 0; i < ds.size(); ++i) {
      if (ds[i]) std::printf(" > %s: %lld samples\n", names[i], (long long)ds[i]->size());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

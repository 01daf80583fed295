// BlendedMegatronDatasetBuilder (Megatron-LM blended_megatron_dataset_builder.py) and the glue from
// Megatron's data flags to the train/valid/test datasets (pretrain_gpt.py's
// train_valid_test_datasets_provider, training.py's sample counts).
//
// Per split the result is a GPTDataset (one prefix, no weights), a BlendedDataset (several
// prefixes, or weights given), or none (the split's range is empty, e.g. --split 100,0,0).
//   --data-path [w1] p1 [w2 p2 ...] + --split: one distribution cut into three ranges of sequences.
//     With weights, dataset d builds ceil(ceil(size * w_d) * (1 + surplus)) samples and the blend
//     draws sum_d ceil(size * w_d); without, each dataset is one epoch and weights are its length.
//   --train-data-path / --valid-data-path / --test-data-path: a separate blend per split.
//   --mock-data: MockGPTDataset over synthetic sequences, split "1,1,1", never cached.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "megatron/core/datasets/blended_dataset.h"
#include "megatron/core/datasets/gpt_dataset.h"

namespace megatron {

using SplitSizes = std::array<std::optional<int64_t>, kNumSplits>;
using SplitDatasets = std::array<std::shared_ptr<const MegatronDataset>, kNumSplits>;

/// Megatron's get_blend_from_list: "[w1] p1 [w2] p2 ..." (tokens may hold several words). Weights
/// are taken when every other token parses as a number; none parsing means prefixes only; a mix
/// is an error. An empty list gives none.
std::optional<Blend> get_blend_from_list(const std::vector<std::string>& blend);

class BlendedMegatronDatasetBuilder {
 public:
  /// `sizes`: samples wanted per split (none: one epoch). `config` is finalized here.
  BlendedMegatronDatasetBuilder(SplitSizes sizes, GPTDatasetConfig config);

  /// Builds (or loads from the cache) every split.
  SplitDatasets build();

 private:
  using GPTSplits = std::array<std::shared_ptr<const GPTDataset>, kNumSplits>;
  GPTSplits build_megatron_dataset_splits(const std::optional<std::string>& prefix, const SplitMatrix& split,
                                          const SplitSizes& sizes);
  std::shared_ptr<const LowLevelDataset> low_level_dataset(const std::optional<std::string>& prefix);
  /// The blend of `prefixes` for the splits `split` marks, or a single GPTDataset.
  void build_blend(const Blend& blend, const SplitMatrix& split, const SplitSizes& sizes, SplitDatasets& out,
                   std::optional<int> only_split);

  SplitSizes sizes_;
  GPTDatasetConfig config_;
  std::map<std::string, std::shared_ptr<const LowLevelDataset>> opened_;
};

/// The data flags of pretrain_gpt (Megatron's names), with Megatron's defaults.
struct GPTDataArgs {
  std::vector<std::string> data_path;               // --data-path
  std::vector<std::string> train_data_path;         // --train-data-path
  std::vector<std::string> valid_data_path;         // --valid-data-path
  std::vector<std::string> test_data_path;          // --test-data-path
  std::optional<std::string> split;                 // --split (default "969, 30, 1"; "1,1,1" for mock)
  bool mock_data = false;                           // --mock-data
  std::optional<std::string> data_cache_path;       // --data-cache-path
  int64_t seq_length = 0;                           // --seq-length
  int64_t seed = 1234;                              // --seed
  bool reset_position_ids = false;                  // --reset-position-ids
  bool reset_attention_mask = false;                // --reset-attention-mask
  bool eod_mask_loss = false;                       // --eod-mask-loss
  bool create_attention_mask_in_dataloader = true;  // --no-create-attention-mask-in-dataloader
  bool mmap_bin_files = true;                       // --no-mmap-bin-files
  double mid_level_dataset_surplus = 0.005;         // --mid-level-dataset-surplus
  std::optional<int64_t> train_samples;             // --train-samples
  int64_t train_iters = 0;                          // --train-iters
  int64_t eval_interval = 1000;                     // --eval-interval
  int64_t eval_iters = 100;                         // --eval-iters
  int64_t global_batch_size = 1;                    // --global-batch-size
};

/// Samples per split: train = train_samples or train_iters * gbs; valid = (train_iters //
/// eval_interval + 1) * eval_iters * gbs; test = eval_iters * gbs.
SplitSizes train_valid_test_num_samples(const GPTDataArgs& args);

/// Megatron's core_gpt_dataset_config_from_args (finalized).
GPTDatasetConfig gpt_dataset_config_from_args(const GPTDataArgs& args, std::shared_ptr<const Tokenizer> tokenizer);

/// The train, valid and test datasets the flags describe (pretrain_gpt's provider).
SplitDatasets build_train_valid_test_datasets(const GPTDataArgs& args, std::shared_ptr<const Tokenizer> tokenizer);

/// What tools/prepare_cache does: builds every split's index cache (writing the files that are
/// missing, loading those present) and returns the datasets. Mock data has no cache: an error.
SplitDatasets prepare_data_cache(const GPTDataArgs& args, std::shared_ptr<const Tokenizer> tokenizer);

}  // namespace megatron

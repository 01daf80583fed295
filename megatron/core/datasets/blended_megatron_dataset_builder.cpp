// BlendedMegatronDatasetBuilder and the flags-to-datasets glue (see the header).
#include "megatron/core/datasets/blended_megatron_dataset_builder.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <sstream>

#include "megatron/core/datasets/indexed_dataset.h"
#include "megatron/runtime/check.h"

namespace megatron {

std::optional<Blend> get_blend_from_list(const std::vector<std::string>& raw) {
  std::vector<std::string> tokens;
  for (const std::string& t : raw) {
    std::istringstream ss(t);
    for (std::string w; ss >> w;) tokens.push_back(w);
  }
  if (tokens.empty()) return std::nullopt;
  auto number = [](const std::string& w, double& v) {
    char* end = nullptr;
    v = std::strtod(w.c_str(), &end);
    return !w.empty() && end == w.c_str() + w.size();
  };
  Blend blend;
  if (tokens.size() % 2 == 1) {
    // Megatron reads an odd count as prefixes only; a number among them that names no dataset is a
    // weight whose partner is missing.
    for (const std::string& t : tokens) {
      double v = 0;
      MG_CHECK(!number(t, v) || IndexedDataset::exists(t),
               "--data-path '{}' has {} values: a weighted blend is pairs of weight and prefix (an even count), and "
               "'{}' reads as a weight, not a dataset; give a weight for every prefix, or prefixes alone",
               fmt::join(tokens, " "), tokens.size(), t);
    }
    blend.prefixes = tokens;
    return blend;
  }
  std::vector<double> weights;
  size_t parsed = 0;
  for (size_t i = 0; i < tokens.size(); i += 2) {
    double v = 0;
    if (number(tokens[i], v)) {
      ++parsed;
      weights.push_back(v);
    }
    blend.prefixes.push_back(tokens[i + 1]);
  }
  if (parsed == 0) {
    blend.prefixes = tokens;
    return blend;
  }
  MG_CHECK(parsed == tokens.size() / 2,
           "--data-path: could not parse the blend weights in '{}'; give 'w1 prefix1 w2 prefix2 ...' with numeric "
           "weights, or prefixes only",
           fmt::join(tokens, " "));
  blend.weights = weights;
  return blend;
}

BlendedMegatronDatasetBuilder::BlendedMegatronDatasetBuilder(SplitSizes sizes, GPTDatasetConfig config)
    : sizes_(sizes), config_(std::move(config)) {
  config_.finalize();
  for (const auto& s : sizes_) MG_CHECK(!s || *s >= 0, "a split's sample count must be >= 0 (got {})", *s);
}

std::shared_ptr<const LowLevelDataset> BlendedMegatronDatasetBuilder::low_level_dataset(
    const std::optional<std::string>& prefix) {
  const std::string key = prefix.value_or("");
  auto it = opened_.find(key);
  if (it != opened_.end()) return it->second;
  std::shared_ptr<const LowLevelDataset> ds;
  if (config_.mock)
    ds = std::make_shared<MockGPTLowLevelDataset>(config_.tokenizer->eod(), config_.tokenizer->vocab_size());
  else
    ds = std::make_shared<IndexedLowLevelDataset>(*prefix);
  opened_[key] = ds;
  return ds;
}

BlendedMegatronDatasetBuilder::GPTSplits BlendedMegatronDatasetBuilder::build_megatron_dataset_splits(
    const std::optional<std::string>& prefix, const SplitMatrix& split, const SplitSizes& sizes) {
  auto low = low_level_dataset(prefix);
  const int64_t num_elements = int64_t(low->sequence_lengths().size());
  MG_CHECK(num_elements > 0, "the dataset {} holds no sequences (an empty corpus): check --data-path",
           prefix.value_or("<mock>"));
  GPTSplits out;
  for (size_t i = 0; i < size_t(kNumSplits); ++i) {
    if (!split[i]) continue;
    // Python's int(round(x)): round half to even.
    const int64_t beg = int64_t(std::nearbyint(split[i]->first * double(num_elements)));
    const int64_t end = int64_t(std::nearbyint(split[i]->second * double(num_elements)));
    MG_CHECK(end > beg, "--split gives the {} split of {} no sequences ({} in all); widen its share or give it 0",
             split_name(Split(i)), prefix.value_or("<mock>"), num_elements);
    out[i] = std::make_shared<GPTDataset>(low, prefix, beg, end, sizes[i], Split(i), config_);
    MG_ASSERT(!sizes[i] || *sizes[i] <= out[i]->size(), "dataset holds {} samples, fewer than {}", out[i]->size(),
              *sizes[i]);
  }
  return out;
}

void BlendedMegatronDatasetBuilder::build_blend(const Blend& blend, const SplitMatrix& split, const SplitSizes& sizes,
                                                SplitDatasets& out, std::optional<int> only_split) {
  std::optional<std::vector<double>> weights;
  if (blend.weights) weights = normalize(*blend.weights);
  const auto& prefixes = blend.prefixes;
  auto wanted = [&](size_t i) { return split[i] && (!only_split || size_t(*only_split) == i); };
  const bool single = only_split ? prefixes.size() == 1 : (prefixes.size() == 1 && !weights);
  if (single) {
    GPTSplits g = build_megatron_dataset_splits(prefixes[0], split, sizes);
    for (size_t i = 0; i < size_t(kNumSplits); ++i)
      if (wanted(i)) out[i] = g[i];
    return;
  }
  const size_t n = prefixes.size();
  std::vector<SplitSizes> buffer(n);
  std::vector<std::array<int64_t, kNumSplits>> target(n);
  if (weights) {
    for (size_t i = 0; i < size_t(kNumSplits); ++i)
      MG_CHECK(!split[i] || sizes[i], "blend weights need a sample count for the {} split", split_name(Split(i)));
    for (size_t d = 0; d < n; ++d) {
      for (size_t i = 0; i < size_t(kNumSplits); ++i) {
        const int64_t masked = split[i] && sizes[i] ? *sizes[i] : 0;
        const double t = std::ceil(double(masked) * (*weights)[d]);
        target[d][i] = int64_t(t);
        buffer[d][i] = int64_t(std::ceil(t * (1.0 + config_.mid_level_dataset_surplus)));
      }
    }
  }
  std::vector<GPTSplits> mids(n);
  for (size_t d = 0; d < n; ++d) mids[d] = build_megatron_dataset_splits(prefixes[d], split, buffer[d]);
  for (size_t i = 0; i < size_t(kNumSplits); ++i) {
    if (!wanted(i)) continue;
    std::vector<std::shared_ptr<const GPTDataset>> parts;
    for (size_t d = 0; d < n; ++d) parts.push_back(mids[d][i]);
    std::vector<double> w;
    std::optional<int64_t> size;
    if (weights) {
      w = *weights;
      int64_t total = 0;
      for (size_t d = 0; d < n; ++d) total += target[d][i];
      size = total;
    } else {
      int64_t total = 0;
      for (const auto& p : parts) {
        w.push_back(double(p->size()));
        total += p->size();
      }
      if (sizes[i]) size = std::min(*sizes[i], total);
    }
    out[i] = std::make_shared<BlendedDataset>(parts, w, size, config_);
  }
}

SplitDatasets BlendedMegatronDatasetBuilder::build() {
  SplitDatasets out;
  if (config_.mock) {
    GPTSplits g = build_megatron_dataset_splits(std::nullopt, *config_.split_matrix, sizes_);
    for (size_t i = 0; i < size_t(kNumSplits); ++i) out[i] = g[i];
  } else if (config_.blend) {
    build_blend(*config_.blend, *config_.split_matrix, sizes_, out, std::nullopt);
  } else {
    for (int i = 0; i < kNumSplits; ++i) {
      const auto& blend = (*config_.blend_per_split)[size_t(i)];
      if (!blend) continue;
      SplitMatrix spoof;
      spoof[size_t(i)] = std::make_pair(0.0, 1.0);
      SplitSizes sizes_spoof{int64_t(0), int64_t(0), int64_t(0)};
      sizes_spoof[size_t(i)] = sizes_[size_t(i)];
      build_blend(*blend, spoof, sizes_spoof, out, i);
    }
  }
  MG_CHECK(out[0] || !sizes_[0] || *sizes_[0] == 0,
           "no training data: {} training samples are needed but {} leaves the train split empty", *sizes_[0],
           config_.split ? fmt::format("--split '{}'", *config_.split) : std::string("the data paths"));
  return out;
}

SplitSizes train_valid_test_num_samples(const GPTDataArgs& a) {
  MG_CHECK(a.global_batch_size > 0, "--global-batch-size must be positive");
  MG_CHECK(a.eval_interval > 0, "--eval-interval must be positive");
  MG_CHECK(a.train_samples || a.train_iters >= 0, "--train-iters must be >= 0");
  const int64_t train = a.train_samples ? *a.train_samples : a.train_iters * a.global_batch_size;
  const int64_t train_iters = a.train_samples && a.train_iters == 0 ? train / a.global_batch_size : a.train_iters;
  const int64_t eval_iters = (train_iters / a.eval_interval + 1) * a.eval_iters;
  return {train, eval_iters * a.global_batch_size, a.eval_iters * a.global_batch_size};
}

GPTDatasetConfig gpt_dataset_config_from_args(const GPTDataArgs& a, std::shared_ptr<const Tokenizer> tokenizer) {
  const bool per_split = !a.train_data_path.empty() || !a.valid_data_path.empty() || !a.test_data_path.empty();
  MG_CHECK(int(a.mock_data) + int(!a.data_path.empty()) + int(per_split) <= 1,
           "give a single data source: --mock-data, --data-path, or --train/valid/test-data-path");
  MG_CHECK(a.mock_data || !a.data_path.empty() || per_split,
           "no training data: give --data-path, --train-data-path ... or --mock-data");
  GPTDatasetConfig c;
  c.random_seed = a.seed;
  c.sequence_length = a.seq_length;
  if (!a.mock_data) {
    c.blend = get_blend_from_list(a.data_path);
    if (per_split)
      c.blend_per_split = {get_blend_from_list(a.train_data_path), get_blend_from_list(a.valid_data_path),
                           get_blend_from_list(a.test_data_path)};
  }
  c.split = a.split;
  if (!c.split && a.mock_data) c.split = "1,1,1";
  if (!c.split && !a.data_path.empty()) c.split = "969, 30, 1";
  c.path_to_cache = a.data_cache_path;
  c.mmap_bin_files = a.mmap_bin_files;
  c.mock = a.mock_data;
  c.tokenizer = std::move(tokenizer);
  c.reset_position_ids = a.reset_position_ids;
  c.reset_attention_mask = a.reset_attention_mask;
  c.eod_mask_loss = a.eod_mask_loss;
  c.create_attention_mask = a.create_attention_mask_in_dataloader;
  c.mid_level_dataset_surplus = a.mid_level_dataset_surplus;
  c.finalize();
  return c;
}

SplitDatasets build_train_valid_test_datasets(const GPTDataArgs& args, std::shared_ptr<const Tokenizer> tokenizer) {
  BlendedMegatronDatasetBuilder builder(train_valid_test_num_samples(args),
                                        gpt_dataset_config_from_args(args, std::move(tokenizer)));
  return builder.build();
}

SplitDatasets prepare_data_cache(const GPTDataArgs& args, std::shared_ptr<const Tokenizer> tokenizer) {
  MG_CHECK(!args.mock_data, "--mock-data builds its indices in memory and has no cache to prepare");
  return build_train_valid_test_datasets(args, std::move(tokenizer));
}

}  // namespace megatron

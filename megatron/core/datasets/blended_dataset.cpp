// BlendedDataset: blending indices and their cache (see blended_dataset.h).
#include "megatron/core/datasets/blended_dataset.h"

#include <fmt/format.h>

#include <filesystem>
#include <limits>
#include <set>

#include "megatron/core/datasets/npy.h"
#include "megatron/runtime/check.h"

namespace megatron {

namespace fs = std::filesystem;

void build_blending_indices(std::span<const double> weights, int64_t size, std::vector<int16_t>& dataset_index,
                            std::vector<int64_t>& dataset_sample_index) {
  const size_t n = weights.size();
  MG_ASSERT(n > 0 && n < 32767, "bad number of blended datasets {}", n);
  dataset_index.assign(size_t(size), 0);
  dataset_sample_index.assign(size_t(size), 0);
  std::vector<int64_t> current(n, 0);
  for (int64_t s = 0; s < size; ++s) {
    const double x = std::max(double(s), 1.0);
    size_t best = 0;
    double best_error = weights[0] * x - double(current[0]);
    for (size_t d = 1; d < n; ++d) {
      double error = weights[d] * x - double(current[d]);
      if (error > best_error) {
        best_error = error;
        best = d;
      }
    }
    dataset_index[size_t(s)] = int16_t(best);
    dataset_sample_index[size_t(s)] = current[best];
    current[best] += 1;
  }
}

void build_exhaustive_blending_indices(std::span<const int64_t> sizes, std::vector<int16_t>& dataset_index,
                                       std::vector<int64_t>& dataset_sample_index) {
  const size_t n = sizes.size();
  MG_ASSERT(n > 0 && n < 32767, "bad number of blended datasets {}", n);
  int64_t total = 0;
  std::set<size_t> unspent;
  for (size_t d = 0; d < n; ++d) {
    total += sizes[d];
    if (sizes[d] > 0) unspent.insert(d);
  }
  std::vector<double> weights(n);
  for (size_t d = 0; d < n; ++d) weights[d] = double(sizes[d]) / double(total);
  dataset_index.assign(size_t(total), 0);
  dataset_sample_index.assign(size_t(total), 0);
  std::vector<int64_t> counts(n, 0);
  for (int64_t s = 0; !unspent.empty(); ++s) {
    const double x = std::max(double(s), 1.0);
    size_t best = *unspent.begin();
    double best_error = std::numeric_limits<double>::lowest();
    for (size_t d : unspent) {
      double error = weights[d] * x - double(counts[d]);
      if (error > best_error) {
        best_error = error;
        best = d;
      }
    }
    dataset_index[size_t(s)] = int16_t(best);
    dataset_sample_index[size_t(s)] = counts[best];
    counts[best] += 1;
    if (counts[best] == sizes[best]) unspent.erase(best);
  }
}

BlendedDataset::BlendedDataset(std::vector<std::shared_ptr<const GPTDataset>> datasets, std::vector<double> weights,
                               std::optional<int64_t> size, const GPTDatasetConfig& config)
    : datasets_(std::move(datasets)), weights_(std::move(weights)), size_(size) {
  MG_CHECK(!datasets_.empty() && datasets_.size() == weights_.size(),
           "a blend needs as many weights as datasets ({} vs {})", weights_.size(), datasets_.size());
  MG_CHECK(datasets_.size() < 32767, "a blend holds at most 32766 datasets (got {})", datasets_.size());
  split_ = datasets_[0]->index_split();
  for (const auto& d : datasets_) MG_ASSERT(d->index_split() == split_, "blended datasets of different splits");
  for (size_t d = 0; d < weights_.size(); ++d)
    MG_CHECK(weights_[d] > 0.0,
             "the {} blend: dataset {} ({}) has weight {}; with no weights given this means it "
             "yields no {}-token sample from its share of --split",
             split_name(split_), d, datasets_[d]->unique_identifiers().value("dataset_path", "?"), weights_[d],
             datasets_[d]->config().sequence_length);
  if (size_) weights_ = normalize(weights_);

  nlohmann::ordered_json u;
  u["class"] = "BlendedDataset";
  u["datasets"] = nlohmann::ordered_json::array();
  for (const auto& d : datasets_) u["datasets"].push_back(d->unique_identifiers());
  u["split"] = split_name(split_);
  u["weights"] = nlohmann::ordered_json::array();
  for (double w : weights_) {
    if (size_)
      u["weights"].push_back(w);
    else
      u["weights"].push_back(int64_t(w));  // exact sample counts are Python ints
  }
  u["size"] = size_ ? nlohmann::ordered_json(*size_) : nlohmann::ordered_json(nullptr);
  unique_description_ = python_json_dumps(u, 4);
  unique_description_hash_ = md5_hex(unique_description_);

  std::string base;
  if (config.path_to_cache) {
    base = (fs::path(*config.path_to_cache) /
            fmt::format("{}-BlendedDataset-{}-", unique_description_hash_, split_name(split_)))
               .string();
    if (load_cache(base)) return;
  }
  if (size_) {
    build_blending_indices(weights_, *size_, dataset_index_, dataset_sample_index_);
  } else {
    std::vector<int64_t> sizes;
    for (double w : weights_) sizes.push_back(int64_t(w));
    build_exhaustive_blending_indices(sizes, dataset_index_, dataset_sample_index_);
  }
  built_anew_ = true;
  std::vector<int64_t> counts(datasets_.size(), 0);
  for (int16_t d : dataset_index_) counts[size_t(d)] += 1;
  for (size_t d = 0; d < datasets_.size(); ++d)
    MG_CHECK(counts[d] <= datasets_[d]->size(),
             "the {} blend oversamples dataset {} ({}): it requests {} samples of its {}; raise "
             "--mid-level-dataset-surplus (now {})",
             split_name(split_), d, datasets_[d]->unique_identifiers().value("dataset_path", "?"), counts[d],
             datasets_[d]->size(), config.mid_level_dataset_surplus);
  if (config.path_to_cache) {
    std::error_code ec;
    fs::create_directories(*config.path_to_cache, ec);
    MG_CHECK(!ec, "cannot create the index cache directory {}: {}", *config.path_to_cache, ec.message());
    const int64_t shape[] = {int64_t(dataset_index_.size())};
    write_npy(base + "dataset_index.npy", NpyDType::Int16, shape, dataset_index_.data());
    write_npy(base + "dataset_sample_index.npy", NpyDType::Int64, shape, dataset_sample_index_.data());
    write_file_atomic(base + "description.txt", unique_description_);
  }
}

bool BlendedDataset::load_cache(const std::string& base) {
  for (const char* part : {"description.txt", "dataset_index.npy", "dataset_sample_index.npy"})
    if (!fs::is_regular_file(base + part)) return false;
  NpyArray di = read_npy(base + "dataset_index.npy");
  NpyArray dsi = read_npy(base + "dataset_sample_index.npy");
  MG_CHECK(di.shape.size() == 1 && dsi.shape == di.shape,
           "blend cache {}dataset_index.npy / dataset_sample_index.npy disagree in shape; delete them to rebuild",
           base);
  dataset_index_.resize(size_t(di.numel()));
  dataset_sample_index_ = dsi.to_int64();
  for (int64_t i = 0; i < di.numel(); ++i) {
    int64_t d = di.at(i);
    MG_CHECK(d >= 0 && d < int64_t(datasets_.size()) && dataset_sample_index_[size_t(i)] >= 0 &&
                 dataset_sample_index_[size_t(i)] < datasets_[size_t(d)]->size(),
             "blend cache {}dataset_index.npy entry {} is out of range; delete the cache files to rebuild", base, i);
    dataset_index_[size_t(i)] = int16_t(d);
  }
  built_anew_ = false;
  return true;
}

void BlendedDataset::get(int64_t idx, GPTSample& out) const {
  MG_CHECK(idx >= 0 && idx < size(), "sample {} is out of range for the {} blend of {} samples", idx,
           split_name(split_), size());
  datasets_[size_t(dataset_index_[size_t(idx)])]->get(dataset_sample_index_[size_t(idx)], out);
}

}  // namespace megatron

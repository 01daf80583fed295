// BlendedDataset and the weighted --data-path path of the builder: blending indices (the
// DATA_FORMAT.md example), per-dataset sample counts with the mid-level surplus, the blend's cache
// named by the md5 Python computes, and the --data-path parsing rules.
#include <gtest/gtest.h>

#include "megatron/core/datasets/blended_dataset.h"
#include "megatron/core/datasets/blended_megatron_dataset_builder.h"
#include "megatron/core/datasets/npy.h"
#include "megatron/runtime/check.h"
#include "tests/core/datasets/dataset_test_util.h"

namespace megatron {
namespace {

namespace fs = std::filesystem;
using testing::megatron_data;
using testing::ScopedCwd;
using testing::ScratchDir;

TEST(BlendingIndices, SpecExample) {
  std::vector<int16_t> di;
  std::vector<int64_t> dsi;
  const double w[] = {0.3, 0.7};
  build_blending_indices(w, 10, di, dsi);
  EXPECT_EQ(di, (std::vector<int16_t>{1, 0, 1, 1, 0, 1, 1, 0, 1, 1}));
  EXPECT_EQ(dsi, (std::vector<int64_t>{0, 0, 1, 2, 1, 3, 4, 2, 5, 6}));
}

TEST(BlendingIndices, TiesGoToTheLowestDataset) {
  std::vector<int16_t> di;
  std::vector<int64_t> dsi;
  const double w[] = {0.5, 0.5};
  build_blending_indices(w, 4, di, dsi);
  EXPECT_EQ(di, (std::vector<int16_t>{0, 1, 0, 1}));
  EXPECT_EQ(dsi, (std::vector<int64_t>{0, 0, 1, 1}));
}

TEST(BlendingIndices, ExhaustiveDrawsEverySampleOnce) {
  std::vector<int16_t> di;
  std::vector<int64_t> dsi;
  const int64_t sizes[] = {2, 5, 3};
  build_exhaustive_blending_indices(sizes, di, dsi);
  ASSERT_EQ(di.size(), 10u);
  std::vector<int64_t> next(3, 0);
  for (size_t s = 0; s < di.size(); ++s) EXPECT_EQ(dsi[s], next[size_t(di[s])]++);
  EXPECT_EQ(next, (std::vector<int64_t>{2, 5, 3}));
}

TEST(BlendList, Parsing) {
  auto b = get_blend_from_list({"0.3", "a", "0.7", "b"});
  ASSERT_TRUE(b && b->weights);
  EXPECT_EQ(b->prefixes, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(*b->weights, (std::vector<double>{0.3, 0.7}));
  b = get_blend_from_list({"30 a 70 b"});
  ASSERT_TRUE(b && b->weights);
  EXPECT_EQ(b->prefixes, (std::vector<std::string>{"a", "b"}));
  b = get_blend_from_list({"a", "b"});
  ASSERT_TRUE(b);
  EXPECT_FALSE(b->weights);
  EXPECT_EQ(b->prefixes, (std::vector<std::string>{"a", "b"}));
  b = get_blend_from_list({"a"});
  EXPECT_TRUE(b && !b->weights && b->prefixes.size() == 1);
  EXPECT_FALSE(get_blend_from_list({}));
  EXPECT_THROW(get_blend_from_list({"0.5", "a", "b", "c"}), Error);
}

GPTDataArgs blend_args() {
  GPTDataArgs a;
  a.data_path = {"0.3", "data/shakespeare_text_document", "0.7", "data/shakespeare_spm_text_document"};
  a.split = "969,30,1";
  a.seq_length = 128;
  a.data_cache_path = "cache";
  a.train_iters = 40;
  a.global_batch_size = 16;
  a.eval_interval = 10;
  a.eval_iters = 2;
  return a;
}

TEST(BlendedDataset, WeightedDataPath) {
  ScratchDir dir("blend");
  fs::copy(megatron_data() / "data", dir.path() / "data", fs::copy_options::recursive);
  ScopedCwd cwd(dir.path());
  SplitDatasets ds = build_train_valid_test_datasets(blend_args(), testing::null_tokenizer());
  const int64_t sizes[] = {640, 160, 33};                       // sum of ceil(size * w)
  const int64_t mids[][2] = {{193, 451}, {49, 113}, {11, 24}};  // ceil(ceil(size * w) * 1.005)
  for (int i = 0; i < kNumSplits; ++i) {
    auto b = std::dynamic_pointer_cast<const BlendedDataset>(ds[size_t(i)]);
    ASSERT_TRUE(b) << i;
    EXPECT_TRUE(b->built_anew_on_cache_miss());
    EXPECT_EQ(b->size(), sizes[i]);
    ASSERT_EQ(b->datasets().size(), 2u);
    for (int d = 0; d < 2; ++d) EXPECT_EQ(b->datasets()[size_t(d)]->num_samples(), mids[i][d]);
    for (int64_t s = 0; s < b->size(); s += 7) {
      GPTSample x = b->get(s),
                y = b->datasets()[size_t(b->dataset_index()[size_t(s)])]->get(b->dataset_sample_index()[size_t(s)]);
      EXPECT_EQ(x.tokens, y.tokens);
    }
  }
  // The md5 Python's json.dumps of the train blend's description gives (computed with Megatron's code).
  auto train = std::dynamic_pointer_cast<const BlendedDataset>(ds[0]);
  EXPECT_EQ(train->unique_description_hash(), "e7fc874ae8c360441b20be07379bdca3");
  const std::string base = "cache/e7fc874ae8c360441b20be07379bdca3-BlendedDataset-train-";
  EXPECT_EQ(testing::file_bytes(base + "description.txt"), train->unique_description());
  NpyArray di = read_npy(base + "dataset_index.npy");
  EXPECT_EQ(di.dtype, NpyDType::Int16);
  EXPECT_EQ(read_npy(base + "dataset_sample_index.npy").dtype, NpyDType::Int64);

  SplitDatasets again = build_train_valid_test_datasets(blend_args(), testing::null_tokenizer());
  auto reloaded = std::dynamic_pointer_cast<const BlendedDataset>(again[0]);
  EXPECT_FALSE(reloaded->built_anew_on_cache_miss());
  EXPECT_FALSE(reloaded->datasets()[0]->built_anew_on_cache_miss());
  EXPECT_EQ(reloaded->dataset_index(), train->dataset_index());
  EXPECT_EQ(reloaded->dataset_sample_index(), train->dataset_sample_index());
}

TEST(BlendedDataset, PrefixesWithoutWeightsAndPerSplitPaths) {
  ScratchDir dir("blend_nw");
  fs::copy(megatron_data() / "data", dir.path() / "data", fs::copy_options::recursive);
  ScopedCwd cwd(dir.path());
  GPTDataArgs a = blend_args();
  a.data_path = {"data/shakespeare_text_document", "data/shakespeare_spm_text_document"};
  // One epoch of the 1-sequence test share is less than one sample: Megatron refuses that blend too.
  EXPECT_THROW(build_train_valid_test_datasets(a, testing::null_tokenizer()), Error);
  a.split = "90,10,0";
  SplitDatasets ds = build_train_valid_test_datasets(a, testing::null_tokenizer());
  auto b = std::dynamic_pointer_cast<const BlendedDataset>(ds[0]);
  ASSERT_TRUE(b);
  EXPECT_EQ(b->size(), 640);  // min(640, one epoch of each)
  EXPECT_FALSE(b->datasets()[0]->num_samples().has_value());

  GPTDataArgs p = blend_args();
  p.data_path.clear();
  p.split.reset();
  p.train_data_path = {"data/shakespeare_text_document"};
  p.valid_data_path = {"1", "data/shakespeare_text_document", "1", "data/shakespeare_spm_text_document"};
  SplitDatasets per = build_train_valid_test_datasets(p, testing::null_tokenizer());
  auto train = std::dynamic_pointer_cast<const GPTDataset>(per[0]);
  ASSERT_TRUE(train);
  EXPECT_EQ(train->unique_identifiers()["split"], nullptr);
  EXPECT_EQ(train->unique_identifiers()["split_matrix"], nullptr);
  auto valid = std::dynamic_pointer_cast<const BlendedDataset>(per[1]);
  ASSERT_TRUE(valid);
  EXPECT_EQ(valid->size(), 160);
  EXPECT_FALSE(per[2]);
}

}  // namespace
}  // namespace megatron

// MegatronPretrainingSampler slicing and resume, and the prefetching DataLoader's batches,
// end-of-data, early shutdown and error propagation.
#include "megatron/core/datasets/data_loader.h"

#include <gtest/gtest.h>

#include "megatron/runtime/check.h"
#include "tests/core/datasets/dataset_test_util.h"

namespace megatron {
namespace {

std::vector<std::vector<int64_t>> drain(MegatronPretrainingSampler& s) {
  std::vector<std::vector<int64_t>> out;
  while (auto b = s.next()) out.push_back(*b);
  return out;
}

TEST(Sampler, RanksTakeTheirSliceAndTheTailIsDropped) {
  MegatronPretrainingSampler r0(10, 0, 2, 0, 2), r1(10, 0, 2, 1, 2);
  EXPECT_EQ(drain(r0), (std::vector<std::vector<int64_t>>{{0, 1}, {4, 5}}));
  EXPECT_EQ(drain(r1), (std::vector<std::vector<int64_t>>{{2, 3}, {6, 7}}));
  EXPECT_EQ(r1.consumed_samples(), 8);
  MegatronPretrainingSampler keep0(10, 0, 2, 0, 2, false), keep1(10, 0, 2, 1, 2, false);
  EXPECT_EQ(drain(keep0), (std::vector<std::vector<int64_t>>{{0, 1}, {4, 5}, {8, 9}}));
  EXPECT_EQ(drain(keep1).size(), 3u);
}

TEST(Sampler, ResumesFromConsumedSamples) {
  MegatronPretrainingSampler s(20, 6, 3, 1, 2);
  EXPECT_EQ(drain(s), (std::vector<std::vector<int64_t>>{{9, 10, 11}, {15, 16, 17}}));
  EXPECT_THROW(MegatronPretrainingSampler(20, 20, 1, 0, 1), Error);
  EXPECT_THROW(MegatronPretrainingSampler(20, 0, 0, 0, 1), Error);
  EXPECT_THROW(MegatronPretrainingSampler(20, 0, 1, 2, 2), Error);
}

std::shared_ptr<const GPTDataset> counting_dataset(int64_t L, int64_t tokens) {
  GPTDatasetConfig c;
  c.sequence_length = L;
  c.split = "1";
  c.blend = Blend{{"unused"}, std::nullopt};
  c.tokenizer = testing::null_tokenizer();
  c.finalize();
  std::vector<int64_t> seq(static_cast<size_t>(tokens));
  for (int64_t i = 0; i < tokens; ++i) seq[size_t(i)] = i;
  auto low = std::make_shared<testing::VectorLowLevelDataset>(std::vector<std::vector<int64_t>>{seq});
  return std::make_shared<GPTDataset>(low, std::nullopt, 0, 1, std::nullopt, Split::train, c);
}

TEST(DataLoader, BatchesMatchTheDataset) {
  auto ds = counting_dataset(8, 8 * 40 + 1);  // 40 samples
  DataLoaderOptions o;
  o.micro_batch_size = 3;
  o.data_parallel_rank = 1;
  o.data_parallel_size = 2;
  o.consumed_samples = 6;
  DataLoader loader(ds, o);
  int64_t expected_start = 6;
  int batches = 0;
  while (auto b = loader.next()) {
    ++batches;
    ASSERT_EQ(b->tokens.shape(), (Shape{3, 8}));
    EXPECT_EQ(b->tokens.dtype(), DType::Int64);
    EXPECT_EQ(b->loss_mask.dtype(), DType::Float32);
    EXPECT_FALSE(b->attention_segments.defined());
    EXPECT_EQ(b->sample_indices, (std::vector<int64_t>{expected_start + 3, expected_start + 4, expected_start + 5}));
    expected_start += 6;
    EXPECT_EQ(b->consumed_samples, expected_start);
    EXPECT_EQ(loader.consumed_samples(), expected_start);
    std::vector<int64_t> tokens = b->tokens.to_ints(), labels = b->labels.to_ints(), pos = b->position_ids.to_ints();
    for (int r = 0; r < 3; ++r) {
      GPTSample s = ds->get(b->sample_indices[size_t(r)]);
      for (int k = 0; k < 8; ++k) {
        ASSERT_EQ(tokens[size_t(r * 8 + k)], s.tokens[size_t(k)]);
        ASSERT_EQ(labels[size_t(r * 8 + k)], s.labels[size_t(k)]);
        ASSERT_EQ(pos[size_t(r * 8 + k)], k);
      }
    }
  }
  EXPECT_EQ(batches, 5);  // (40 - 6) // 6 full steps
  EXPECT_FALSE(loader.next().has_value());
}

TEST(DataLoader, EarlyShutdownAndRestart) {
  auto ds = counting_dataset(16, 16 * 1000 + 1);
  DataLoaderOptions o;
  o.micro_batch_size = 4;
  o.prefetch = 2;
  int64_t consumed;
  {
    DataLoader loader(ds, o);
    loader.next();
    loader.next();
    consumed = loader.consumed_samples();
  }  // destroyed with a full queue and the worker waiting
  EXPECT_EQ(consumed, 8);
  o.consumed_samples = consumed;
  DataLoader resumed(ds, o);
  auto b = resumed.next();
  ASSERT_TRUE(b);
  EXPECT_EQ(b->sample_indices, (std::vector<int64_t>{8, 9, 10, 11}));
  resumed.shutdown();
  resumed.shutdown();
}

class FailingDataset : public MegatronDataset {
 public:
  int64_t size() const override { return 10; }
  void get(int64_t idx, GPTSample& out) const override {
    MG_CHECK(idx < 5, "sample {} is unreadable", idx);
    out.tokens.assign(4, idx);
    out.labels.assign(4, idx);
    out.loss_mask.assign(4, 1.0f);
    out.position_ids.assign(4, 0);
  }
  Split index_split() const override { return Split::train; }
};

TEST(DataLoader, ReadErrorsReachTheConsumer) {
  DataLoaderOptions o;
  o.micro_batch_size = 2;
  DataLoader loader(std::make_shared<FailingDataset>(), o);
  EXPECT_TRUE(loader.next());
  EXPECT_TRUE(loader.next());
  EXPECT_THROW(loader.next(), Error);
}

}  // namespace
}  // namespace megatron

// ParamAndGradBuffer bucketing (Note [Buckets and padding]): cuts at parameter boundaries once a
// bucket reaches the requested size, reverse registration order, the distributed optimizer's
// parameter alignment, bucket padding to lcm(dp, 128) and the tied embeddings' own bucket.
#include "megatron/core/distributed/param_and_grad_buffer.h"

#include <gtest/gtest.h>

namespace megatron {
namespace {

// Registration order a.weight, a.bias, b.weight, norm.weight, c.weight; layout order reversed.
void add_toy_params(ParamAndGradBuffer& buf) {
  buf.add("a.weight", {7, 5}, false, ParamInit::Normal);
  buf.add("a.bias", {7}, true, ParamInit::Normal);
  buf.add("b.weight", {3, 11}, false, ParamInit::Normal);
  buf.add("norm.weight", {13}, true, ParamInit::Ones);
  buf.add("c.weight", {9, 4}, false, ParamInit::ScaledNormal);
}

std::vector<std::string> names(const Bucket& b) {
  std::vector<std::string> out;
  for (const Parameter* p : b.params) out.push_back(p->name);
  return out;
}

struct Range {
  int64_t start, end;
  bool operator==(const Range&) const = default;
};

std::vector<Range> ranges(const ParamAndGradBuffer& buf) {
  std::vector<Range> out;
  for (const Bucket& b : buf.buckets()) out.push_back({b.start, b.end});
  return out;
}

TEST(ParamAndGradBuffer, OneBucketByDefaultInBackwardOrder) {
  ParamAndGradBuffer buf(DType::Float32, Device::cpu());
  add_toy_params(buf);
  buf.allocate();
  EXPECT_EQ(buf.numel(), 35 + 7 + 33 + 13 + 36);
  EXPECT_EQ(buf.param_buffer().numel(), buf.numel());
  ASSERT_EQ(buf.buckets().size(), 1u);
  EXPECT_EQ(names(buf.buckets()[0]),
            (std::vector<std::string>{"c.weight", "norm.weight", "b.weight", "a.bias", "a.weight"}));
  int64_t offset = 0;
  for (const Parameter* p : buf.buckets()[0].params) {
    EXPECT_EQ(buf.location(p).offset, offset) << p->name;
    offset += p->data.numel();
  }
  // The overlapped default: max(40M, 1M·dp) elements, one bucket for this toy.
  DDPConfig overlap;
  overlap.overlap_grad_reduce = true;
  EXPECT_EQ(effective_bucket_size(overlap, 8), 40000000);
  EXPECT_EQ(effective_bucket_size(overlap, 64), 64000000);
  EXPECT_EQ(effective_bucket_size(DDPConfig{}, 64), 0);
}

TEST(ParamAndGradBuffer, BucketsCloseAtTheRequestedSize) {
  ParamAndGradBuffer buf(DType::BFloat16, Device::cpu());
  add_toy_params(buf);
  DDPConfig cfg;
  cfg.bucket_size = 40;
  buf.allocate(cfg, 4);
  // c 36 + norm 13 = 49 >= 40; b 33 + a.bias 7 = 40; a.weight alone.
  EXPECT_EQ(ranges(buf), (std::vector<Range>{{0, 49}, {49, 89}, {89, 124}}));
  EXPECT_EQ(names(buf.buckets()[1]), (std::vector<std::string>{"b.weight", "a.bias"}));
  // Parameters are views of the buffers.
  const Parameter* b = buf.find("b.weight");
  EXPECT_EQ(b->data.raw_data(), buf.buckets()[1].param_data.raw_data());
  EXPECT_EQ(b->main_grad.raw_data(), buf.buckets()[1].grad_data.raw_data());
  EXPECT_EQ(buf.location(b).bucket, 1);
}

TEST(ParamAndGradBuffer, DistributedOptimizerAlignsParamsAndPadsBuckets) {
  for (int dp : {1, 4, 3}) {
    SCOPED_TRACE(dp);
    ParamAndGradBuffer buf(DType::Float32, Device::cpu());
    add_toy_params(buf);
    DDPConfig cfg;
    cfg.bucket_size = 40;
    cfg.use_distributed_optimizer = true;
    buf.allocate(cfg, dp);
    const int64_t m = dp == 3 ? 384 : 128;  // lcm(dp, 128)
    // c at 0 (36); norm at 64 (ends 77 >= 40); b at m (33); a.bias at m + 64 (ends 71 >= 40); a.weight.
    EXPECT_EQ(ranges(buf), (std::vector<Range>{{0, m}, {m, 2 * m}, {2 * m, 3 * m}}));
    EXPECT_EQ(buf.location(buf.find("norm.weight")).offset, 64);
    EXPECT_EQ(buf.location(buf.find("a.bias")).offset, m + 64);
    EXPECT_EQ(buf.numel(), 124);
    EXPECT_EQ(buf.grad_buffer().numel(), 3 * m);
    for (const Bucket& b : buf.buckets()) EXPECT_EQ(b.numel() % dp, 0);
  }
}

TEST(ParamAndGradBuffer, TiedEmbeddingsGetTheirOwnBucket) {
  for (bool dist_opt : {false, true}) {
    ParamAndGradBuffer buf(DType::Float32, Device::cpu());
    buf.add("embedding.word_embeddings.weight", {10, 3}, false, ParamInit::Normal)->in_embedding_group = true;
    add_toy_params(buf);
    DDPConfig cfg;
    cfg.use_distributed_optimizer = dist_opt;
    buf.allocate(cfg, 2);
    if (!dist_opt) {
      EXPECT_EQ(buf.buckets().size(), 1u);
      continue;
    }
    ASSERT_EQ(buf.buckets().size(), 2u);
    EXPECT_EQ(names(buf.buckets()[1]), (std::vector<std::string>{"embedding.word_embeddings.weight"}));
    EXPECT_EQ(buf.buckets()[1].numel(), 128);
  }
}

TEST(ParamAndGradBuffer, InitialisationIsIndependentOfTheLayout) {
  ParamAndGradBuffer plain(DType::Float32, Device::cpu()), bucketed(DType::Float32, Device::cpu());
  add_toy_params(plain);
  add_toy_params(bucketed);
  plain.allocate();
  DDPConfig cfg;
  cfg.bucket_size = 10;
  cfg.use_distributed_optimizer = true;
  bucketed.allocate(cfg, 4);
  plain.init_weights(7, 0.02f, 2, false);
  bucketed.init_weights(7, 0.02f, 2, false);
  for (const Parameter* p : plain.parameters())
    EXPECT_EQ(p->data.to_floats(), bucketed.find(p->name)->data.to_floats()) << p->name;
}

}  // namespace
}  // namespace megatron

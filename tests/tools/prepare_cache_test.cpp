// tools/prepare_cache run from a copy of the fixture folder with the fixture's flags writes exactly
// the index-cache files Megatron's tools/prepare_cache.py wrote (cache-shared/), byte for byte.
#include "tests/functional/run_util.h"

namespace megatron::testing {
namespace {

TEST(PrepareCache, WritesMegatronsCacheFiles) {
  ScratchDir dir("prepare_cache");
  const fs::path fixture = fs::absolute(data_fixtures_dir());
  fs::create_directories(dir.path / "data");
  for (const char* ext : {".bin", ".idx"}) {
    fs::copy_file(fixture / "data" / (std::string("shakespeare_text_document") + ext),
                  dir.path / "data" / (std::string("shakespeare_text_document") + ext));
  }
  RunResult r = run({bin("prepare_cache"), "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                     "--max-position-embeddings", "512", "--micro-batch-size", "4", "--prepare-cache-world-size", "1",
                     "--tokenizer-type", "NullTokenizer", "--vocab-size", "50257", "--seq-length", "128",
                     "--global-batch-size", "16", "--train-iters", "40", "--eval-interval", "10", "--eval-iters", "2",
                     "--data-path", "data/shakespeare_text_document", "--split", "969,30,1", "--seed", "1234",
                     "--data-cache-path", "cache-shared"},
                    dir.path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  int compared = 0;
  for (const auto& e : fs::directory_iterator(fixture / "cache-shared")) {
    const fs::path ours = dir.path / "cache-shared" / e.path().filename();
    ASSERT_TRUE(fs::exists(ours)) << ours;
    EXPECT_EQ(read_file(ours), read_file(e.path())) << e.path().filename();
    ++compared;
  }
  EXPECT_EQ(compared, 12);
  size_t ours_count = 0;
  for (const auto& e : fs::directory_iterator(dir.path / "cache-shared")) ours_count += e.is_regular_file();
  EXPECT_EQ(ours_count, 12u) << "no extra files";
}

TEST(PrepareCache, MockDataHasNoCache) {
  ScratchDir dir("prepare_cache_mock");
  RunResult r = run({bin("prepare_cache"), "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                     "--seq-length", "128", "--micro-batch-size", "4", "--train-iters", "4", "--mock-data",
                     "--vocab-size", "100"},
                    dir.path);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--mock-data has no index cache"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace megatron::testing

// GPTDataset against Megatron's own index cache (fixtures/megatron_data/cache-shared): the cache we
// write is byte-identical, a cache Megatron wrote is used as is, samples are slices of the shuffled
// token stream, and the mask / position semantics follow _get_ltor_masks_and_position_ids.
#include "megatron/core/datasets/gpt_dataset.h"

#include <gtest/gtest.h>

#include <set>

#include "megatron/core/datasets/blended_megatron_dataset_builder.h"
#include "megatron/core/datasets/indexed_dataset.h"
#include "megatron/core/datasets/npy.h"
#include "megatron/runtime/check.h"
#include "tests/core/datasets/dataset_test_util.h"

namespace megatron {
namespace {

namespace fs = std::filesystem;
using testing::file_bytes;
using testing::megatron_data;
using testing::ScopedCwd;
using testing::ScratchDir;
using testing::VectorLowLevelDataset;

// The fixture README's prepare_cache flags.
GPTDataArgs fixture_args() {
  GPTDataArgs a;
  a.data_path = {"data/shakespeare_text_document"};
  a.split = "969,30,1";
  a.seq_length = 128;
  a.seed = 1234;
  a.data_cache_path = "cache-shared";
  a.train_iters = 40;
  a.global_batch_size = 16;
  a.eval_interval = 10;
  a.eval_iters = 2;
  return a;
}

void copy_fixture(const fs::path& to, bool with_cache) {
  fs::copy(megatron_data() / "data", to / "data", fs::copy_options::recursive);
  if (with_cache) {
    fs::copy(megatron_data() / "cache-shared", to / "cache-shared", fs::copy_options::recursive);
    for (auto& e : fs::directory_iterator(to / "cache-shared"))
      fs::permissions(e.path(), fs::perms::owner_read | fs::perms::group_read | fs::perms::others_read);
  }
}

std::set<std::string> listing(const fs::path& dir) {
  std::set<std::string> names;
  for (auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
  return names;
}

TEST(GPTDatasetCache, WritesMegatronsCacheByteForByte) {
  ScratchDir dir("gpt_cache");
  copy_fixture(dir.path(), false);
  ScopedCwd cwd(dir.path());
  SplitDatasets ds = prepare_data_cache(fixture_args(), testing::null_tokenizer());
  const std::set<std::string> expected = listing(megatron_data() / "cache-shared");
  ASSERT_EQ(expected.size(), 12u);
  EXPECT_EQ(listing("cache-shared"), expected);
  for (const std::string& name : expected)
    EXPECT_EQ(file_bytes(fs::path("cache-shared") / name), file_bytes(megatron_data() / "cache-shared" / name)) << name;
  const int64_t want[] = {640, 160, 32};
  for (int i = 0; i < kNumSplits; ++i) {
    auto g = std::dynamic_pointer_cast<const GPTDataset>(ds[size_t(i)]);
    ASSERT_TRUE(g) << i;
    EXPECT_TRUE(g->built_anew_on_cache_miss());
    EXPECT_GE(g->size(), want[i]);
  }
}

TEST(GPTDatasetCache, UsesACacheMegatronWrote) {
  ScratchDir dir("gpt_reuse");
  copy_fixture(dir.path(), true);
  ScopedCwd cwd(dir.path());
  const auto before = listing("cache-shared");
  const auto mtime = fs::last_write_time(fs::path("cache-shared") / *before.begin());
  fs::permissions("cache-shared", fs::perms::owner_read | fs::perms::owner_exec);
  SplitDatasets ds = prepare_data_cache(fixture_args(), testing::null_tokenizer());
  fs::permissions("cache-shared", fs::perms::owner_all);
  EXPECT_EQ(listing("cache-shared"), before);
  EXPECT_EQ(fs::last_write_time(fs::path("cache-shared") / *before.begin()), mtime);
  for (int i = 0; i < kNumSplits; ++i) {
    auto g = std::dynamic_pointer_cast<const GPTDataset>(ds[size_t(i)]);
    ASSERT_TRUE(g);
    EXPECT_FALSE(g->built_anew_on_cache_miss()) << i;
    EXPECT_EQ(g->unique_description(),
              file_bytes(fs::path("cache-shared") /
                         (g->unique_description_hash() + "-GPTDataset-" + split_name(Split(i)) + "-description.txt")));
  }
  auto train = std::dynamic_pointer_cast<const GPTDataset>(ds[0]);
  EXPECT_EQ(train->size(), 2553);
  EXPECT_EQ(train->indices().document_index.size(), 1328u);
}

TEST(GPTDatasetCache, CorruptCacheFileIsAClearError) {
  ScratchDir dir("gpt_corrupt");
  copy_fixture(dir.path(), true);
  ScopedCwd cwd(dir.path());
  const fs::path victim = "cache-shared/d2a7764daeca839cfa7381f84ed888ca-GPTDataset-train-sample_index.npy";
  fs::permissions(victim, fs::perms::owner_all);
  std::string bytes = file_bytes(victim);
  bytes.replace(bytes.find("<i4"), 3, "|O8");
  std::ofstream(victim, std::ios::binary | std::ios::trunc) << bytes;
  try {
    prepare_data_cache(fixture_args(), testing::null_tokenizer());
    ADD_FAILURE() << "a corrupt cache file was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("corrupt .npy"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("train-sample_index.npy"), std::string::npos) << e.what();
  }
}

TEST(GPTDataset, SamplesAreSlicesOfTheShuffledStream) {
  ScratchDir dir("gpt_stream");
  copy_fixture(dir.path(), true);
  ScopedCwd cwd(dir.path());
  SplitDatasets ds = build_train_valid_test_datasets(fixture_args(), testing::null_tokenizer());
  IndexedDataset raw("data/shakespeare_text_document");
  for (int split = 0; split < kNumSplits; ++split) {
    auto g = std::dynamic_pointer_cast<const GPTDataset>(ds[size_t(split)]);
    std::vector<int64_t> stream;
    for (int32_t seq : g->indices().document_index) {
      std::vector<int64_t> t = raw.get(size_t(seq));
      stream.insert(stream.end(), t.begin(), t.end());
    }
    const int64_t L = 128;
    for (int64_t i = 0; i < g->size(); ++i) {
      const int64_t k = g->indices().shuffle_index[size_t(i)];
      GPTSample s = g->get(i);
      ASSERT_EQ(s.tokens, std::vector<int64_t>(stream.begin() + k * L, stream.begin() + k * L + L)) << i;
      ASSERT_EQ(s.labels, std::vector<int64_t>(stream.begin() + k * L + 1, stream.begin() + k * L + L + 1)) << i;
      ASSERT_EQ(s.loss_mask, std::vector<float>(size_t(L), 1.0f));
      ASSERT_EQ(s.position_ids[size_t(L - 1)], L - 1);
      ASSERT_TRUE(s.attention_segments.empty());
    }
  }
  EXPECT_THROW(ds[0]->get(ds[0]->size()), Error);
}

GPTDatasetConfig small_config(int64_t L) {
  GPTDatasetConfig c;
  c.sequence_length = L;
  c.split = "1";
  c.blend = Blend{{"unused"}, std::nullopt};
  c.tokenizer = testing::null_tokenizer();
  c.finalize();
  return c;
}

TEST(GPTDataset, ResetAndMaskSemantics) {
  GPTDatasetConfig c = small_config(4);
  const int64_t E = c.tokenizer->eod();
  auto low = std::make_shared<VectorLowLevelDataset>(std::vector<std::vector<int64_t>>{{5, 6, E, 7, 8, 9, 10, E, 11}});
  GPTDataset plain(low, std::nullopt, 0, 1, std::nullopt, Split::train, c);
  ASSERT_EQ(plain.size(), 2);
  c.reset_position_ids = c.reset_attention_mask = c.eod_mask_loss = true;
  GPTDataset reset(low, std::nullopt, 0, 1, std::nullopt, Split::train, c);
  EXPECT_FALSE(reset.cache_dir().has_value());
  for (int64_t i = 0; i < 2; ++i) {
    GPTSample p = plain.get(i), r = reset.get(i);
    EXPECT_EQ(p.loss_mask, (std::vector<float>{1, 1, 1, 1}));
    EXPECT_EQ(p.position_ids, (std::vector<int64_t>{0, 1, 2, 3}));
    EXPECT_TRUE(p.attention_segments.empty());
    EXPECT_EQ(p.tokens, r.tokens);
    if (r.tokens[0] == 5) {
      EXPECT_EQ(r.tokens, (std::vector<int64_t>{5, 6, E, 7}));
      EXPECT_EQ(r.labels, (std::vector<int64_t>{6, E, 7, 8}));
      EXPECT_EQ(r.loss_mask, (std::vector<float>{1, 1, 0, 1}));
      EXPECT_EQ(r.position_ids, (std::vector<int64_t>{0, 1, 2, 0}));
      EXPECT_EQ(r.attention_segments, (std::vector<int32_t>{0, 0, 0, 1}));
      EXPECT_EQ(expand_attention_mask(r), (std::vector<uint8_t>{0, 1, 1, 1,  //
                                                                0, 0, 1, 1,  //
                                                                0, 0, 0, 1,  //
                                                                1, 1, 1, 0}));
    } else {
      EXPECT_EQ(r.tokens, (std::vector<int64_t>{8, 9, 10, E}));
      EXPECT_EQ(r.labels, (std::vector<int64_t>{9, 10, E, 11}));
      EXPECT_EQ(r.loss_mask, (std::vector<float>{1, 1, 1, 0}));
      EXPECT_EQ(r.position_ids, (std::vector<int64_t>{0, 1, 2, 3}));
      EXPECT_EQ(r.attention_segments, (std::vector<int32_t>{0, 0, 0, 0}));
    }
  }
  EXPECT_EQ(expand_attention_mask(plain.get(0)),
            (std::vector<uint8_t>{0, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0}));
}

TEST(GPTDataset, PartialValidationSampleIsPadded) {
  GPTDatasetConfig c = small_config(4);
  c.drop_last_partial_validation_sequence = false;
  auto low = std::make_shared<VectorLowLevelDataset>(
      std::vector<std::vector<int64_t>>{{100, 101, 102, 103, 104, 105, 106, 107, 108, 109}});
  GPTDataset valid(low, std::nullopt, 0, 1, std::nullopt, Split::valid, c);
  GPTDataset train(low, std::nullopt, 0, 1, std::nullopt, Split::train, c);
  EXPECT_EQ(train.size(), 2);  // (10 - 1) // 4
  ASSERT_EQ(valid.size(), 3);  // ceil((10 - 1) / 4)
  bool seen = false;
  for (int64_t i = 0; i < 3; ++i) {
    GPTSample s = valid.get(i);
    if (s.tokens[0] != 108) continue;
    seen = true;
    EXPECT_EQ(s.tokens, (std::vector<int64_t>{108, 109, 0, 0}));
    EXPECT_EQ(s.labels, (std::vector<int64_t>{109, 0, 0, 0}));
    EXPECT_EQ(s.loss_mask, (std::vector<float>{1, 0, 0, 0}));
  }
  EXPECT_TRUE(seen);
}

TEST(GPTDataset, WithoutExtraToken) {
  GPTDatasetConfig c = small_config(4);
  c.add_extra_token_to_sequence = false;
  auto low = std::make_shared<VectorLowLevelDataset>(std::vector<std::vector<int64_t>>{{1, 2, 3, 4, 5, 6, 7, 8, 9}});
  GPTDataset d(low, std::nullopt, 0, 1, std::nullopt, Split::train, c);
  ASSERT_EQ(d.size(), 2);  // 9 // 4
  std::set<int64_t> firsts;
  for (int64_t i = 0; i < 2; ++i) {
    GPTSample s = d.get(i);
    firsts.insert(s.tokens[0]);
    const int64_t t0 = s.tokens[0];
    EXPECT_EQ(s.tokens, (std::vector<int64_t>{t0, t0 + 1, t0 + 2, t0 + 3}));
    EXPECT_EQ(s.labels, (std::vector<int64_t>{t0 + 1, t0 + 2, t0 + 3, 0}));
    EXPECT_EQ(s.loss_mask, (std::vector<float>{1, 1, 1, 0}));
  }
  EXPECT_EQ(firsts, (std::set<int64_t>{1, 5}));
}

TEST(GPTIndex, SeparateFinalEpochAndEpochCount) {
  std::vector<int32_t> lengths(50, 10);  // 500 tokens per epoch
  GPTIndexParams p;
  p.sequence_length = 10;
  p.num_samples = 60;  // 601 tokens: 2 epochs, 10 of 49 samples from the last -> separate
  GPTIndices x = build_gpt_indices(lengths, 0, 50, p);
  EXPECT_EQ(x.num_epochs, 2);
  EXPECT_TRUE(x.separate_final_epoch);
  EXPECT_EQ(x.num_samples(), 99);  // (1000 - 1) // 10
  std::set<int64_t> first(x.shuffle_index.begin(), x.shuffle_index.begin() + 49);
  EXPECT_EQ(*first.rbegin(), 48);  // sans-final samples (999-... ) = (500 - 1) // 10 = 49
  std::set<int32_t> last_epoch(x.document_index.begin() + 50, x.document_index.end());
  EXPECT_EQ(last_epoch.size(), 50u);
  p.num_samples = 90;
  x = build_gpt_indices(lengths, 0, 50, p);
  EXPECT_FALSE(x.separate_final_epoch);
  EXPECT_EQ(gpt_num_epochs(500, p), 2);
  p.num_samples = std::nullopt;
  EXPECT_EQ(gpt_num_epochs(500, p), 1);
}

TEST(MockGPTDataset, LengthsAndSamples) {
  auto tok = testing::null_tokenizer();
  MockGPTLowLevelDataset mock(tok->eod(), tok->vocab_size());
  auto lengths = mock.sequence_lengths();
  ASSERT_EQ(lengths.size(), 100000u);
  EXPECT_EQ(std::vector<int32_t>(lengths.begin(), lengths.begin() + 10),
            (std::vector<int32_t>{3484, 2609, 2094, 1105, 1261, 168, 309, 68, 718, 3331}));
  std::vector<int64_t> seq;
  mock.read_into(7, 0, 68, seq);
  EXPECT_EQ(seq.front(), 1);
  EXPECT_EQ(seq[66], 67);
  EXPECT_EQ(seq.back(), tok->eod());

  GPTDataArgs a;
  a.mock_data = true;
  a.seq_length = 64;
  a.train_iters = 10;
  a.global_batch_size = 4;
  a.eval_interval = 5;
  a.eval_iters = 1;
  SplitDatasets ds = build_train_valid_test_datasets(a, tok);
  for (int i = 0; i < kNumSplits; ++i) {
    auto g = std::dynamic_pointer_cast<const GPTDataset>(ds[size_t(i)]);
    ASSERT_TRUE(g);
    EXPECT_FALSE(g->cache_dir().has_value());
    EXPECT_TRUE(g->unique_description().empty());
  }
  EXPECT_GE(ds[0]->size(), 40);
  const int64_t E = tok->eod();
  for (int64_t i = 0; i < 40; ++i) {
    GPTSample s = ds[0]->get(i);
    for (size_t k = 0; k + 1 < s.tokens.size(); ++k) {
      const int64_t a0 = s.tokens[k], a1 = s.tokens[k + 1];
      ASSERT_TRUE(a1 == a0 + 1 || a1 == E || (a0 == E && a1 == 1)) << a0 << " " << a1;
    }
  }
}

TEST(Split, ParseAndMatrix) {
  auto v = parse_and_normalize_split("969, 30, 1");
  SplitMatrix m = convert_split_vector_to_split_matrix(v);
  ASSERT_TRUE(m[0] && m[1] && m[2]);
  EXPECT_EQ(m[0]->second, 0.969);
  EXPECT_EQ(m[1]->second, 0.999);
  EXPECT_EQ(m[2]->second, 1.0);
  m = convert_split_vector_to_split_matrix(parse_and_normalize_split("100"));
  EXPECT_TRUE(m[0] && !m[1] && !m[2]);
  m = convert_split_vector_to_split_matrix(parse_and_normalize_split("0,1,0"));
  EXPECT_TRUE(!m[0] && m[1] && !m[2]);
  EXPECT_THROW(parse_and_normalize_split("1,2,3,4"), Error);
  EXPECT_THROW(parse_and_normalize_split("0,0,0"), Error);
  EXPECT_THROW(parse_and_normalize_split("train"), Error);
  EXPECT_THROW(parse_and_normalize_split("1.2.3,1"), Error);
}

TEST(Split, EmptyNeededSplitsAreErrors) {
  ScratchDir dir("gpt_split");
  copy_fixture(dir.path(), false);
  ScopedCwd cwd(dir.path());
  GPTDataArgs a = fixture_args();
  a.split = "0,1,0";
  try {
    build_train_valid_test_datasets(a, testing::null_tokenizer());
    ADD_FAILURE() << "an empty train split was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("train split empty"), std::string::npos) << e.what();
  }
  a.split = "99999,0,1";  // the test split rounds to no sequence
  EXPECT_THROW(build_train_valid_test_datasets(a, testing::null_tokenizer()), Error);
  a.split = "100,0,0";
  SplitDatasets ds = build_train_valid_test_datasets(a, testing::null_tokenizer());
  EXPECT_TRUE(ds[0] && !ds[1] && !ds[2]);
  a.data_path = {"data/does_not_exist"};
  EXPECT_THROW(build_train_valid_test_datasets(a, testing::null_tokenizer()), Error);
}

TEST(SampleCounts, FromTrainingFlags) {
  GPTDataArgs a = fixture_args();
  SplitSizes s = train_valid_test_num_samples(a);
  EXPECT_EQ(s[0], 640);
  EXPECT_EQ(s[1], 160);
  EXPECT_EQ(s[2], 32);
  a.train_samples = 1000;
  a.train_iters = 0;
  s = train_valid_test_num_samples(a);
  EXPECT_EQ(s[0], 1000);
  EXPECT_EQ(s[1], (62 / 10 + 1) * 2 * 16);
}

TEST(PythonJson, FloatRepr) {
  const std::pair<double, const char*> cases[] = {{0.969, "0.969"},
                                                  {1.0, "1.0"},
                                                  {0.999, "0.999"},
                                                  {1e-05, "1e-05"},
                                                  {1e16, "1e+16"},
                                                  {1e15, "1000000000000000.0"},
                                                  {0.1 + 0.2, "0.30000000000000004"},
                                                  {1.0 / 3, "0.3333333333333333"},
                                                  {123456.789, "123456.789"},
                                                  {-2.5, "-2.5"},
                                                  {0.0001, "0.0001"},
                                                  {1.5e-7, "1.5e-07"},
                                                  {2.5e20, "2.5e+20"},
                                                  {0.0, "0.0"},
                                                  {5e-324, "5e-324"},
                                                  {1.7976931348623157e308, "1.7976931348623157e+308"}};
  for (auto [v, s] : cases) EXPECT_EQ(python_float_repr(v), s);
}

TEST(PythonJson, DumpsIndent4) {
  nlohmann::ordered_json j;
  j["a"] = nlohmann::ordered_json::array();
  j["b"] = nlohmann::ordered_json::object();
  j["c"] = "\xc3\xa9\n\"\\\x01\xf0\x9f\x98\x80";
  j["d"] = nullptr;
  j["e"] = true;
  j["f"] = {1, 2.5, {0, 0.969}};
  EXPECT_EQ(python_json_dumps(j),
            "{\n    \"a\": [],\n    \"b\": {},\n    \"c\": \"\\u00e9\\n\\\"\\\\\\u0001\\ud83d\\ude00\",\n    \"d\": "
            "null,\n    \"e\": true,\n    \"f\": [\n        1,\n        2.5,\n        [\n            0,\n            "
            "0.969\n        ]\n    ]\n}");
  EXPECT_EQ(md5_hex("abc"), "900150983cd24fb0d6963f7d28e17f72");
}

}  // namespace
}  // namespace megatron

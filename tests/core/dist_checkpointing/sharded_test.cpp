// Sharded safetensors (dist_checkpointing/sharded.h): a tensor written in one layout (whole, split
// on rows, on columns, SwiGLU's two chunks split on rows) reads back exactly in every other layout,
// in 2-D and 3-D and across dtypes; holes, disagreeing files and corrupt metadata are one-line
// errors naming the file or the tensor.
#include "megatron/core/dist_checkpointing/sharded.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace megatron::dist_checkpointing {
namespace {

namespace fs = std::filesystem;
using ::megatron::testing::random_tensor;

ShardSpec split(const Shape& global, int dim, int size, int rank, int chunks = 1) {
  ShardSpec s;
  s.global_shape = global;
  s.partition_dim = dim;
  s.size = size;
  s.rank = rank;
  s.chunks = chunks;
  return s;
}

/// A layout: how many ranks and each one's spec.
struct Layout {
  std::string name;
  int ranks;
  std::function<ShardSpec(int)> spec;
};

std::vector<Layout> layouts_2d(const Shape& g) {
  return {{"whole", 1, [g](int) { return unsharded(g); }},
          {"rows2", 2, [g](int r) { return split(g, 0, 2, r); }},
          {"rows4_swiglu", 4, [g](int r) { return split(g, 0, 4, r, 2); }},
          {"cols2", 2, [g](int r) { return split(g, 1, 2, r); }},
          {"cols3", 3, [g](int r) { return split(g, 1, 3, r); }}};
}

/// The local tensor of `spec` cut out of `global` element by element (independently of flat_runs).
std::vector<float> expected_local(const std::vector<float>& global, const ShardSpec& spec) {
  const Shape& gs = spec.global_shape;
  const Shape ls = local_shape(spec);
  std::vector<float> out(size_t(shape_numel(ls)), NAN);
  const size_t nd = gs.size();
  for (const ShardBox& b : shard_boxes(spec)) {
    std::vector<int64_t> i(nd, 0);
    if (shape_numel(Shape(b.shape.begin(), b.shape.end())) == 0) continue;
    while (true) {
      int64_t g = 0, l = 0;
      for (size_t d = 0; d < nd; ++d) {
        g = g * gs[d] + b.global_offset[d] + i[d];
        l = l * ls[d] + b.local_offset[d] + i[d];
      }
      out[size_t(l)] = global[size_t(g)];
      size_t d = nd;
      while (d > 0 && ++i[d - 1] == b.shape[d - 1]) i[--d] = 0;
      if (d == 0) break;
    }
  }
  return out;
}

class Sharded : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / ("mg_sharded_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  /// Writes `global` (named `name`) in `layout` into dir_/sub as dtype `dtype`.
  std::string save_layout(const std::string& sub, const std::string& name, const Tensor& global, const Layout& layout,
                          DType dtype) {
    const fs::path d = dir_ / sub;
    fs::create_directories(d);
    const std::vector<float> g = global.to_floats();
    for (int r = 0; r < layout.ranks; ++r) {
      const ShardSpec spec = layout.spec(r);
      Tensor local = Tensor::from_floats(expected_local(g, spec), local_shape(spec), dtype);
      save_shards(d.string(), "model", r, {{name, local, spec}});
    }
    return d.string();
  }

  /// Every rank of `layout` loads `name` from `dir` (as `dtype`) and gets its slice of `global`.
  void expect_loads(const std::string& dir, const std::string& name, const std::vector<float>& global,
                    const Layout& layout, DType dtype, const std::string& what) {
    ShardIndex index(dir, "model");
    for (int r = 0; r < layout.ranks; ++r) {
      const ShardSpec spec = layout.spec(r);
      Tensor local = Tensor::empty(local_shape(spec), dtype);
      local.fill_(NAN);
      EXPECT_EQ(index.load_into(name, spec, local), local.nbytes());
      const std::vector<float> want = Tensor::from_floats(expected_local(global, spec), local_shape(spec), dtype).to_floats();
      EXPECT_EQ(local.to_floats(), want) << what << ", rank " << r;
    }
  }

  /// `f` throws megatron::Error with a one-line message containing every one of `words`.
  void expect_error(const std::function<void()>& f, const std::vector<std::string>& words) {
    try {
      f();
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      const std::string msg = e.what();
      for (const auto& w : words) EXPECT_NE(msg.find(w), std::string::npos) << "'" << w << "' not in: " << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
  }

  fs::path dir_;
};

TEST_F(Sharded, EveryLayoutReadsEveryOtherLayout2D) {
  const Shape g{16, 6};
  const Tensor global = random_tensor(g, 11);
  const std::vector<float> values = global.to_floats();
  for (const Layout& saved : layouts_2d(g)) {
    const std::string d = save_layout(saved.name, "w", global, saved, DType::Float32);
    for (const Layout& loaded : layouts_2d(g))
      expect_loads(d, "w", values, loaded, DType::Float32, saved.name + " -> " + loaded.name);
  }
}

TEST_F(Sharded, EveryLayoutReadsEveryOtherLayout3D) {
  const Shape g{4, 6, 10};
  const std::vector<Layout> layouts = {{"whole", 1, [g](int) { return unsharded(g); }},
                                       {"d0_swiglu", 2, [g](int r) { return split(g, 0, 2, r, 2); }},
                                       {"d1", 3, [g](int r) { return split(g, 1, 3, r); }},
                                       {"d2", 5, [g](int r) { return split(g, 2, 5, r); }},
                                       {"d2_chunks", 5, [g](int r) { return split(g, 2, 5, r, 2); }}};
  const Tensor global = random_tensor(g, 12);
  for (const Layout& saved : layouts) {
    const std::string d = save_layout(saved.name, "t", global, saved, DType::Float32);
    for (const Layout& loaded : layouts)
      expect_loads(d, "t", global.to_floats(), loaded, DType::Float32, saved.name + " -> " + loaded.name);
  }
}

TEST_F(Sharded, ConvertsDtypes) {
  const Shape g{16, 6};
  const auto layouts = layouts_2d(g);
  const Tensor global = random_tensor(g, 13);
  // bf16 pieces into fp32 tensors: the bf16 values exactly.
  const std::string bf = save_layout("bf16", "w", global, layouts[2], DType::BFloat16);
  EXPECT_EQ(ShardIndex(bf, "model").tensor("w").dtype, DType::BFloat16);
  expect_loads(bf, "w", global.to(DType::BFloat16).to_floats(), layouts[3], DType::Float32, "bf16 -> fp32");
  // fp32 pieces into bf16 tensors: rounded once.
  const std::string fp = save_layout("fp32", "w", global, layouts[3], DType::Float32);
  expect_loads(fp, "w", global.to_floats(), layouts[2], DType::BFloat16, "fp32 -> bf16");
}

TEST_F(Sharded, ScalarsVectorsAndSeveralTensorsPerFile) {
  const fs::path d = dir_ / "mixed";
  fs::create_directories(d);
  const Tensor bias = random_tensor({8}, 14), scalar = Tensor::from_floats({3.5f}, {});
  for (int r = 0; r < 2; ++r) {
    const ShardSpec s = split({8}, 0, 2, r);
    std::vector<ShardedTensor> tensors = {
        {"bias", Tensor::from_floats(expected_local(bias.to_floats(), s), {4}), s}};
    if (r == 0) tensors.push_back({"scalar", scalar, ShardSpec{}});  // empty spec: whole
    save_shards(d.string(), "model", r, tensors);
  }
  ShardIndex index(d.string(), "model");
  EXPECT_EQ(index.names(), (std::vector<std::string>{"bias", "scalar"}));
  EXPECT_EQ(index.files().size(), 2u);
  Tensor whole = Tensor::empty({8}, DType::Float32), s = Tensor::empty({}, DType::Float32);
  index.load_into("bias", ShardSpec{}, whole);
  index.load_into("scalar", ShardSpec{}, s);
  EXPECT_EQ(whole.to_floats(), bias.to_floats());
  EXPECT_EQ(s.to_floats(), std::vector<float>{3.5f});
}

TEST_F(Sharded, FilesWithoutShardMetadataAreWholeTensors) {
  // A single-rank checkpoint of format 1: plain safetensors, no "shards" metadata.
  const Tensor w = random_tensor({6, 4}, 15);
  safetensors::write((dir_ / "model_rank00000.safetensors").string(), {{"w", w}}, {{"format", "megatron.cpp"}});
  ShardIndex index(dir_.string(), "model");
  EXPECT_EQ(index.tensor("w").shape, (Shape{6, 4}));
  for (int r = 0; r < 2; ++r) {
    const ShardSpec s = split({6, 4}, 1, 2, r);
    Tensor local = Tensor::empty({6, 2}, DType::Float32);
    index.load_into("w", s, local);
    EXPECT_EQ(local.to_floats(), expected_local(w.to_floats(), s));
  }
}

TEST_F(Sharded, OverlappingPiecesAreAllowed) {
  // Two ranks each wrote the whole tensor (a duplicated parameter): still one global tensor.
  const Tensor w = random_tensor({4, 4}, 16);
  for (int r = 0; r < 2; ++r) save_shards(dir_.string(), "model", r, {{"w", w, unsharded({4, 4})}});
  ShardIndex index(dir_.string(), "model");
  EXPECT_EQ(index.tensor("w").pieces.size(), 2u);
  Tensor local = Tensor::empty({2, 4}, DType::Float32);
  index.load_into("w", split({4, 4}, 0, 2, 1), local);
  EXPECT_EQ(local.to_floats(), expected_local(w.to_floats(), split({4, 4}, 0, 2, 1)));
}

TEST_F(Sharded, AMissingRankIsAnErrorNamingTheTensorAndTheHole) {
  const Shape g{16, 6};
  const std::string d = save_layout("holes", "decoder.w", random_tensor(g, 17), layouts_2d(g)[2], DType::Float32);
  fs::remove(fs::path(d) / "model_rank00002.safetensors");
  // Rank 2 of 4 with two chunks held rows [4, 6) and [12, 14).
  expect_error([&] { ShardIndex(d, "model"); }, {d, "decoder.w", "not fully covered", "[4, 0]", "[2, 6]"});
}

TEST_F(Sharded, NoFilesIsAnError) {
  expect_error([&] { ShardIndex(dir_.string(), "model"); }, {dir_.string(), "model_rank*.safetensors"});
  expect_error([&] { ShardIndex((dir_ / "nope").string(), "model"); }, {"does not exist"});
}

TEST_F(Sharded, FilesThatDisagreeAreErrorsNamingBoth) {
  save_shards(dir_.string(), "model", 0, {{"w", random_tensor({2, 4}, 1), split({4, 4}, 0, 2, 0)}});
  save_shards(dir_.string(), "model", 1, {{"w", random_tensor({3, 4}, 2), split({6, 4}, 0, 2, 1)}});
  expect_error([&] { ShardIndex(dir_.string(), "model"); },
               {"'w'", "[4, 4]", "[6, 4]", "model_rank00000.safetensors", "model_rank00001.safetensors"});

  fs::remove_all(dir_);
  fs::create_directories(dir_);
  save_shards(dir_.string(), "model", 0, {{"w", random_tensor({2, 4}, 1), split({4, 4}, 0, 2, 0)}});
  save_shards(dir_.string(), "model", 1,
              {{"w", random_tensor({2, 4}, 2, 1.0f, DType::BFloat16), split({4, 4}, 0, 2, 1)}});
  expect_error([&] { ShardIndex(dir_.string(), "model"); }, {"'w'", "model_rank00001.safetensors", "bf16"});
}

TEST_F(Sharded, CorruptFilesAndMetadataAreErrorsNamingTheFile) {
  const Tensor w = random_tensor({4, 4}, 18);
  const std::string file = (dir_ / "model_rank00000.safetensors").string();
  auto with_shards = [&](const std::string& shards) {
    safetensors::write(file, {{"w", w}}, {{"shards", shards}});
  };
  with_shards("{not json");
  expect_error([&] { ShardIndex(dir_.string(), "model"); }, {file, "not valid JSON"});
  with_shards(R"({"w": {"global_shape": [4, 4]}})");
  expect_error([&] { ShardIndex(dir_.string(), "model"); }, {file, "'w'", "boxes"});
  with_shards(R"({"w": {"global_shape": [4, 4], "boxes": [{"global_offset": [2, 0], "local_offset": [0, 0],
                 "shape": [4, 4]}]}})");
  expect_error([&] { ShardIndex(dir_.string(), "model"); }, {file, "'w'", "does not fit"});
  with_shards(R"({"v": {"global_shape": [4], "boxes": []}})");
  expect_error([&] { ShardIndex(dir_.string(), "model"); }, {file, "'v'"});
  // A truncated file: safetensors::File names it.
  save_shards(dir_.string(), "model", 0, {{"w", w, ShardSpec{}}});
  fs::resize_file(file, fs::file_size(file) / 2);
  expect_error([&] { ShardIndex(dir_.string(), "model"); }, {file});
}

TEST_F(Sharded, LoadingAnotherShapeOrAMissingTensorIsAnError) {
  save_shards(dir_.string(), "model", 0, {{"w", random_tensor({4, 4}, 19), ShardSpec{}}});
  ShardIndex index(dir_.string(), "model");
  Tensor t = Tensor::empty({2, 6}, DType::Float32);
  expect_error([&] { index.load_into("w", split({4, 6}, 0, 2, 0), t); }, {"'w'", "[4, 4]", "[4, 6]"});
  expect_error([&] { index.load_into("nope", ShardSpec{}, t); }, {"'nope'", dir_.string()});
}

TEST_F(Sharded, SavingALocalTensorThatDoesNotMatchItsSpecIsAnError) {
  expect_error([&] { save_shards(dir_.string(), "model", 0, {{"w", random_tensor({3, 4}, 1), split({4, 4}, 0, 2, 0)}}); },
               {"'w'", "[3, 4]", "[4, 4]"});
}

}  // namespace
}  // namespace megatron::dist_checkpointing

// Safetensors I/O: the HuggingFace fixture, write/read round trips for every dtype and the metadata,
// the exact bytes the writer produces (the Python library's layout), and one test per kind of
// corruption, each of which must name the file in its error.
#include "megatron/core/dist_checkpointing/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace megatron::safetensors {
namespace {

namespace fs = std::filesystem;
using ::megatron::testing::fixtures_dir;
using ::megatron::testing::random_tensor;

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[size_t(i)] = char(uint8_t(v >> (8 * i)));
  return s;
}

/// A safetensors file from a raw header (padded to 8 bytes) and `data_bytes` bytes of data.
std::string raw_file(std::string header, size_t data_bytes) {
  header.append((8 - header.size() % 8) % 8, ' ');
  return le64(header.size()) + header + std::string(data_bytes, '\x01');
}

bool same_bytes(const Tensor& a, const void* b, size_t nbytes) {
  return a.nbytes() == nbytes && (nbytes == 0 || std::memcmp(a.raw_data(), b, nbytes) == 0);
}

class Safetensors : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / ("mg_safetensors_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  /// Opening (and, when `tensor` is given, reading) the file fails with an Error naming the file
  /// and containing every one of `words`.
  void expect_corrupt(const std::string& file, const std::vector<std::string>& words, const std::string& tensor = "") {
    try {
      File f(file);
      if (!tensor.empty()) f.read(tensor);
      ADD_FAILURE() << "no error for " << file;
    } catch (const Error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find(file), std::string::npos) << msg;
      for (const auto& w : words) EXPECT_NE(msg.find(w), std::string::npos) << "'" << w << "' not in: " << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
  }

  fs::path dir_;
};

// ---- the HuggingFace fixture ---------------------------------------------------------------------

TEST(SafetensorsFixture, ReadsGpt2Model) {
  const std::string path = fixtures_dir() + "/gpt2_model.safetensors";
  File f(path);
  EXPECT_EQ(f.size(), 28u);
  ASSERT_TRUE(f.contains("transformer.wte.weight"));
  EXPECT_FALSE(f.contains("lm_head.weight"));  // tied embeddings
  const Entry& wte = f.entry("transformer.wte.weight");
  EXPECT_EQ(wte.dtype, DType::Float32);
  EXPECT_EQ(wte.shape, (Shape{512, 64}));
  EXPECT_EQ(wte.nbytes(), 512u * 64u * 4u);

  auto config = nlohmann::json::parse(f.metadata().at("config"));
  EXPECT_EQ(config["n_embd"], 64);
  EXPECT_EQ(config["vocab_size"], 512);
  EXPECT_EQ(config["n_layer"], 2);

  // The copy equals the bytes at the header's offsets, read independently of the reader.
  Tensor t = f.read("transformer.wte.weight");
  EXPECT_EQ(t.shape(), (Shape{512, 64}));
  std::string bytes = file_bytes(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_TRUE(same_bytes(t, bytes.data() + 8 + n + wte.begin, wte.nbytes()));

  MappedTensor v = f.view("transformer.wte.weight");
  EXPECT_EQ(v.shape, wte.shape);
  EXPECT_TRUE(same_bytes(t, v.data(), v.nbytes()));

  std::vector<float> values = t.to_floats();
  double sum_sq = 0;
  for (float x : values) {
    ASSERT_TRUE(std::isfinite(x));
    sum_sq += double(x) * x;
  }
  EXPECT_GT(sum_sq, 0.0);

  Tensor as_bf16 = f.read("transformer.wte.weight", DType::BFloat16);
  EXPECT_EQ(as_bf16.dtype(), DType::BFloat16);
  for (size_t i = 0; i < values.size(); i += 97) EXPECT_EQ(as_bf16.data<bf16>()[i].bits, to_bf16(values[i]).bits);
}

TEST(SafetensorsFixture, ViewOutlivesTheFile) {
  MappedTensor v;
  std::vector<float> expected;
  {
    File f(fixtures_dir() + "/gpt2_model.safetensors");
    v = f.view("transformer.wpe.weight");
    expected = f.read("transformer.wpe.weight").to_floats();
  }
  ASSERT_EQ(v.nbytes(), expected.size() * 4);
  EXPECT_EQ(std::memcmp(v.data_as<float>(), expected.data(), v.nbytes()), 0);
}

// ---- round trips ---------------------------------------------------------------------------------

TEST_F(Safetensors, RoundTripsEveryDtype) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  const std::vector<DType> dtypes = {DType::Float32,    DType::BFloat16,   DType::Float16,
                                     DType::Float8E4M3, DType::Float8E5M2, DType::Int32,
                                     DType::Int64,      DType::UInt16,     DType::UInt8};
  for (DType t : dtypes) {
    std::string name = "t." + std::string(to_string(t));
    if (is_floating(t)) {
      tensors.emplace_back(name, random_tensor({3, 5}, uint64_t(t) + 1, 1.0f, t));
    } else {
      std::vector<int64_t> v(7);
      for (size_t i = 0; i < v.size(); ++i) v[i] = int64_t(i * 37 % 251);
      tensors.emplace_back(name, Tensor::from_ints(v, {7}, t));
    }
  }
  tensors.emplace_back("scalar", Tensor::from_floats({2.5f}, {}));
  tensors.emplace_back("empty", Tensor::zeros({0, 4}, DType::BFloat16));

  const std::string p = path("all.safetensors");
  write(p, tensors, {{"format", "pt"}});
  EXPECT_FALSE(fs::exists(p + ".tmp"));

  File f(p);
  EXPECT_EQ(f.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    SCOPED_TRACE(name);
    const Entry& e = f.entry(name);
    EXPECT_EQ(e.dtype, t.dtype());
    EXPECT_EQ(e.shape, t.shape());
    Tensor back = f.read(name);
    EXPECT_EQ(back.dtype(), t.dtype());
    EXPECT_EQ(back.shape(), t.shape());
    EXPECT_TRUE(same_bytes(back, t.raw_data(), t.nbytes()));
    MappedTensor v = f.view(name);
    EXPECT_TRUE(same_bytes(t, v.data(), v.nbytes()));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data()) % size_of(t.dtype()), 0u);
    EXPECT_EQ(f.read(name, DType::Float32).to_floats(), t.to_floats());
  }
}

TEST_F(Safetensors, RoundTripsMetadata) {
  const Metadata metadata = {{"config", R"({"n_embd": 64, "name": "gpt\"2"})"},
                             {"empty", ""},
                             {"quotes \"and\\ backslash", "line\nbreak\ttab"},
                             {"unicode", "h\xC3\xA9llo \xE2\x9C\x93"}};
  const std::string p = path("meta.safetensors");
  write(p, {{"w", Tensor::from_floats({1, 2}, {2})}}, metadata);
  File f(p);
  EXPECT_EQ(f.metadata(), metadata);
  EXPECT_EQ(nlohmann::json::parse(f.metadata().at("config"))["name"], "gpt\"2");

  write(p, {}, {});  // overwrite: no tensors, no metadata
  File g(p);
  EXPECT_EQ(g.size(), 0u);
  EXPECT_TRUE(g.metadata().empty());
  EXPECT_TRUE(g.names().empty());
}

// ---- the bytes the writer produces ---------------------------------------------------------------

TEST_F(Safetensors, WritesThePythonLibraryLayout) {
  // The Python library's own serialization test: one F32 [1, 2, 3] tensor, a 64-byte header.
  const std::string p = path("attn.safetensors");
  write(p, {{"attn.0", Tensor::from_floats({0, 1, 2, 3, 4, 5}, {1, 2, 3})}});
  const std::string header = R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})";
  std::vector<float> data = {0, 1, 2, 3, 4, 5};
  EXPECT_EQ(file_bytes(p), le64(64) + header + std::string(reinterpret_cast<const char*>(data.data()), 24));

  write(p, {});
  EXPECT_EQ(file_bytes(p), le64(8) + "{}      ");
  write(p, {}, {{"framework", "pt"}});
  EXPECT_EQ(file_bytes(p), le64(40) + R"({"__metadata__":{"framework":"pt"}})" + "     ");
}

TEST_F(Safetensors, HeaderIsSortedJsonAndDataFollowsIt) {
  const std::vector<std::string> names = {"layers.1.weight", "b", "layers.0.weight", "a.bias", "z", "layers.10.weight"};
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (size_t i = 0; i < names.size(); ++i) tensors.emplace_back(names[i], random_tensor({int64_t(i) + 1, 3}, i));
  const std::string p = path("sorted.safetensors");
  write(p, tensors, {{"k", "v"}});

  const std::string bytes = file_bytes(p);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  const std::string header = bytes.substr(8, n);
  EXPECT_EQ(header.find_last_not_of(' '), header.rfind('}'));
  auto j = nlohmann::ordered_json::parse(header);  // keeps the file's key order
  ASSERT_TRUE(j.is_object());

  std::vector<std::string> keys;
  for (const auto& [key, value] : j.items()) keys.push_back(key);
  ASSERT_EQ(keys.size(), names.size() + 1);
  EXPECT_EQ(keys.front(), "__metadata__");
  std::vector<std::string> tensor_keys(keys.begin() + 1, keys.end());
  std::vector<std::string> sorted = names;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(tensor_keys, sorted);

  // Data in header order, contiguous from 0 to the end of the file, each tensor's bytes intact.
  File f(p);
  uint64_t offset = 0;
  for (const auto& key : tensor_keys) {
    EXPECT_EQ(j[key]["data_offsets"][0].get<uint64_t>(), offset) << key;
    offset = j[key]["data_offsets"][1].get<uint64_t>();
    const Tensor* t = nullptr;
    for (const auto& [name, tensor] : tensors) {
      if (name == key) t = &tensor;
    }
    ASSERT_NE(t, nullptr);
    EXPECT_TRUE(same_bytes(*t, bytes.data() + 8 + n + f.entry(key).begin, t->nbytes())) << key;
    EXPECT_TRUE(same_bytes(f.read(key), t->raw_data(), t->nbytes())) << key;
  }
  EXPECT_EQ(bytes.size(), 8 + n + offset);
}

TEST_F(Safetensors, MixedDtypesAreOrderedByAlignmentThenName) {
  const std::string p = path("mixed.safetensors");
  write(p, {{"a_u8", Tensor::from_ints({1, 2, 3}, {3}, DType::UInt8)},
            {"b_f32", Tensor::from_floats({1, 2}, {2})},
            {"c_i64", Tensor::from_ints({4}, {1}, DType::Int64)},
            {"d_bf16", Tensor::from_floats({1}, {1}, DType::BFloat16)},
            {"a_f32", Tensor::from_floats({3}, {1})}});
  const std::string bytes = file_bytes(p);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  auto j = nlohmann::ordered_json::parse(bytes.substr(8, n));
  std::vector<std::string> keys;
  for (const auto& [key, value] : j.items()) keys.push_back(key);
  EXPECT_EQ(keys, (std::vector<std::string>{"c_i64", "a_f32", "b_f32", "d_bf16", "a_u8"}));
  File f(p);
  for (const auto& key : keys) EXPECT_EQ(f.entry(key).begin % size_of(f.entry(key).dtype), 0u) << key;
}

// ---- the atomic writer ---------------------------------------------------------------------------

TEST_F(Safetensors, WriteReplacesAtomicallyAndReportsFailures) {
  const std::string p = path("model.safetensors");
  write(p, {{"x", Tensor::from_floats({1}, {1})}});
  write(p, {{"y", Tensor::from_floats({2, 3}, {2})}});
  File f(p);
  EXPECT_EQ(f.names(), std::vector<std::string>{"y"});
  EXPECT_FALSE(fs::exists(p + ".tmp"));

  const std::string missing_dir = path("no/such/dir/model.safetensors");
  try {
    write(missing_dir, {{"x", Tensor::from_floats({1}, {1})}});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(missing_dir), std::string::npos) << e.what();
  }

  EXPECT_THROW(write(p, {{"x", Tensor::from_floats({1}, {1})}, {"x", Tensor::from_floats({1}, {1})}}), Error);
  EXPECT_THROW(write(p, {{"__metadata__", Tensor::from_floats({1}, {1})}}), Error);
  EXPECT_THROW(write(p, {{"u", Tensor()}}), Error);
  EXPECT_THROW(write(p, {}, {{"bad", "\xFF\xFE"}}), Error);
  EXPECT_EQ(File(p).names(), std::vector<std::string>{"y"});  // failed writes left the file alone
  EXPECT_FALSE(fs::exists(p + ".tmp"));
}

// ---- corruption ----------------------------------------------------------------------------------

TEST_F(Safetensors, MissingOrUnreadableFile) {
  expect_corrupt(path("nope.safetensors"), {"cannot open"});
  expect_corrupt(dir_.string(), {"not a regular file"});
}

TEST_F(Safetensors, ShorterThanTheLength) {
  const std::string p = path("short.safetensors");
  write_bytes(p, std::string("\x08\x00\x00", 3));
  expect_corrupt(p, {"3 bytes", "truncated"});
}

TEST_F(Safetensors, TruncatedHeader) {
  const std::string p = path("header.safetensors");
  write(p, {{"w", Tensor::from_floats({1, 2, 3, 4}, {4})}});
  fs::resize_file(p, 8 + 20);
  expect_corrupt(p, {"header", "truncated"});
}

TEST_F(Safetensors, AbsurdHeaderLength) {
  const std::string p = path("absurd.safetensors");
  write_bytes(p, le64(uint64_t(1) << 40) + "{}");
  expect_corrupt(p, {"100 MB"});
}

TEST_F(Safetensors, TruncatedData) {
  const std::string p = path("data.safetensors");
  write(p, {{"w", Tensor::from_floats({1, 2, 3, 4}, {4})}});
  fs::resize_file(p, fs::file_size(p) - 4);
  expect_corrupt(p, {"'w'", "truncated"});
}

TEST_F(Safetensors, BadJson) {
  const std::string p = path("json.safetensors");
  write_bytes(p, raw_file(R"({"w": {"dtype": "F32", "shape": [1], )", 4));
  expect_corrupt(p, {"not valid JSON"});
  write_bytes(p, raw_file("[1, 2, 3]", 0));
  expect_corrupt(p, {"not an object"});
  write_bytes(p, raw_file(R"({"w": [1, 2]})", 0));
  expect_corrupt(p, {"'w'", "not an object"});
  write_bytes(p, raw_file(R"({"w": {"dtype": "F32", "shape": [1]}})", 4));
  expect_corrupt(p, {"'w'", "data_offsets"});
  write_bytes(p, raw_file(R"({"__metadata__": {"k": 1}})", 0));
  expect_corrupt(p, {"__metadata__", "'k'"});
}

TEST_F(Safetensors, UnknownDtype) {
  const std::string p = path("dtype.safetensors");
  write_bytes(p, raw_file(R"({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}})", 2));
  expect_corrupt(p, {"'w'", "'Q4'", "F32, BF16"});
  write_bytes(p, raw_file(R"({"w": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}})", 8));
  expect_corrupt(p, {"'w'", "'F64'"});
}

TEST_F(Safetensors, NegativeDimension) {
  const std::string p = path("shape.safetensors");
  write_bytes(p, raw_file(R"({"w": {"dtype": "F32", "shape": [-1, 4], "data_offsets": [0, 16]}})", 16));
  expect_corrupt(p, {"'w'", "negative"});
  write_bytes(p, raw_file(R"({"w": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}})", 4));
  expect_corrupt(p, {"'w'", "non-integer"});
}

TEST_F(Safetensors, BadDataOffsets) {
  const std::string p = path("offsets.safetensors");
  for (const char* offsets : {"[0]", "[16, 0]", "[-16, 0]", R"(["0", "16"])", "[0, 16, 32]", "7"}) {
    SCOPED_TRACE(offsets);
    write_bytes(p,
                raw_file(std::string(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": )") + offsets + "}}", 16));
    expect_corrupt(p, {"'w'", "two increasing integers"});
  }
}

TEST_F(Safetensors, OffsetsPastTheEnd) {
  const std::string p = path("past.safetensors");
  write_bytes(p, raw_file(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 8));
  expect_corrupt(p, {"'w'", "ends at byte 16", "8 bytes"});
  // Sizes that overflow 64 bits must not wrap around to a small size.
  write_bytes(p, raw_file(R"({"w": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 0]}})", 0));
  expect_corrupt(p, {"'w'", "needs"});
}

TEST_F(Safetensors, SizeMismatch) {
  const std::string p = path("size.safetensors");
  write_bytes(p, raw_file(R"({"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 8]}})", 8));
  expect_corrupt(p, {"'w'", "needs 6 bytes", "hold 8"});
}

TEST_F(Safetensors, OverlappingTensors) {
  const std::string p = path("overlap.safetensors");
  write_bytes(p, raw_file(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                              "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}})",
                          24));
  expect_corrupt(p, {"'a'", "'b'", "overlap"});
}

TEST_F(Safetensors, MissingTensor) {
  const std::string p = path("missing.safetensors");
  write(p, {{"a", Tensor::from_floats({1}, {1})}, {"b", Tensor::from_floats({1}, {1})}});
  expect_corrupt(p, {"tensor 'nope' not found in " + p + "; it has 2 tensors, e.g. a, b"}, "nope");
  File f(p);
  EXPECT_THROW(f.view("nope"), Error);
  EXPECT_THROW(f.entry("nope"), Error);
}

TEST_F(Safetensors, UnalignedTensorsAreReadButNotViewed) {
  // Another writer may place an F32 tensor at an odd offset: read() copies it, view() refuses.
  const std::string p = path("unaligned.safetensors");
  std::string bytes = raw_file(R"({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                                   "w": {"dtype": "F32", "shape": [1], "data_offsets": [1, 5]}})",
                               0);
  const float one = 1.0f;
  bytes += '\x07' + std::string(reinterpret_cast<const char*>(&one), 4);
  write_bytes(p, bytes);
  File f(p);
  EXPECT_EQ(f.read("w").item(), 1.0f);
  EXPECT_EQ(f.read("a").to_ints(), std::vector<int64_t>{7});
  try {
    f.view("w");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace megatron::safetensors

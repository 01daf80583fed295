// .npy files: numpy.save's exact headers, byte-identical rewrites of Megatron's cache files, and
// clear errors for corrupt files.
#include "megatron/core/datasets/npy.h"

#include <gtest/gtest.h>

#include "megatron/runtime/check.h"
#include "tests/core/datasets/dataset_test_util.h"

namespace megatron {
namespace {

namespace fs = std::filesystem;
using testing::file_bytes;
using testing::ScratchDir;

std::string numpy_header(const std::string& dict) {
  // The headers numpy 2.x writes (printed with np.save into BytesIO): dict + spaces + "\n", 118 bytes.
  std::string h("\x93NUMPY\x01\x00\x76\x00", 10);
  h.append(dict);
  h.append(117 - dict.size(), ' ');
  h += '\n';
  return h;
}

TEST(Npy, HeadersMatchNumpy) {
  const int64_t s10[] = {10};
  EXPECT_EQ(npy_header(NpyDType::Int16, s10),
            numpy_header("{'descr': '<i2', 'fortran_order': False, 'shape': (10,), }"));
  const int64_t s32[] = {3, 2};
  EXPECT_EQ(npy_header(NpyDType::Int64, s32),
            numpy_header("{'descr': '<i8', 'fortran_order': False, 'shape': (3, 2), }"));
  const int64_t s0[] = {0};
  EXPECT_EQ(npy_header(NpyDType::UInt32, s0),
            numpy_header("{'descr': '<u4', 'fortran_order': False, 'shape': (0,), }"));
  const int64_t big[] = {1234567};
  EXPECT_EQ(npy_header(NpyDType::Int64, big),
            numpy_header("{'descr': '<i8', 'fortran_order': False, 'shape': (1234567,), }"));
  for (int64_t n : {int64_t(1), int64_t(99), int64_t(123456789012)}) {
    const int64_t s[] = {n};
    EXPECT_EQ(npy_header(NpyDType::Int32, s).size() % 64, 0u);
  }
}

TEST(Npy, FixtureFilesRoundTripByteForByte) {
  int seen = 0;
  for (const auto& e : fs::directory_iterator(testing::megatron_data() / "cache-shared")) {
    if (e.path().extension() != ".npy") continue;
    ++seen;
    const std::string bytes = file_bytes(e.path());
    NpyArray a = read_npy(e.path().string());
    EXPECT_EQ(npy_bytes(a.dtype, a.shape, a.data.data()), bytes) << e.path();
  }
  EXPECT_EQ(seen, 9);
}

TEST(Npy, WriteAndRead) {
  ScratchDir dir("npy");
  std::vector<int16_t> v{1, -2, 3, 32767};
  const int64_t shape[] = {4};
  write_npy<int16_t>(dir.str() + "/a.npy", v, shape);
  NpyArray a = read_npy(dir.str() + "/a.npy");
  EXPECT_EQ(a.dtype, NpyDType::Int16);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{4}));
  EXPECT_EQ(a.to_int64(), (std::vector<int64_t>{1, -2, 3, 32767}));
  std::vector<int64_t> m{1, 2, 3, 4, 5, 6};
  const int64_t shape2[] = {3, 2};
  write_npy<int64_t>(dir.str() + "/b.npy", m, shape2);
  NpyArray b = read_npy(dir.str() + "/b.npy");
  EXPECT_EQ(b.shape, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(b.to_int64(), m);
  EXPECT_EQ(b.at(5), 6);
}

void expect_error(const std::string& bytes, const std::string& needle) {
  try {
    parse_npy(bytes, "x.npy");
    ADD_FAILURE() << "no error for " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("x.npy"), std::string::npos) << e.what();
  }
}

TEST(Npy, CorruptFilesAreClearErrors) {
  const int64_t shape[] = {3};
  const int32_t data[] = {1, 2, 3};
  const std::string good = npy_bytes(NpyDType::Int32, shape, data);
  EXPECT_NO_THROW(parse_npy(good, "x.npy"));
  expect_error("", "bad magic");
  expect_error("PK\x03\x04 not an npy file", "bad magic");
  std::string s = good;
  s[6] = 9;
  expect_error(s, "version");
  s = good;
  s.replace(s.find("<i4"), 3, "<f8");
  expect_error(s, "unsupported dtype");
  s = good;
  s.replace(s.find("False"), 5, "True ");
  expect_error(s, "fortran_order");
  expect_error(good.substr(0, good.size() - 1), "data bytes");
  expect_error(good + "xxxx", "data bytes");
  expect_error(good.substr(0, 40), "truncated");
  s = good;
  s.replace(s.find("'shape'"), 7, "'shapo'");
  expect_error(s, "'shape'");
  EXPECT_THROW(read_npy("/nonexistent/dir/a.npy"), Error);
}

}  // namespace
}  // namespace megatron

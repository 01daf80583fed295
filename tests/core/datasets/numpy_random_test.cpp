// numpy's generators bit for bit: expected values printed by numpy 2.x (RandomState, SeedSequence,
// PCG64, Generator.integers) and the DATA_FORMAT.md test vectors.
#include "megatron/core/datasets/numpy_random.h"

#include <gtest/gtest.h>

#include <numeric>
#include <random>

namespace megatron {
namespace {

TEST(NumpyRandomState, Mt19937FirstOutputs) {
  NumpyRandomState rs(1234);
  EXPECT_EQ(rs.next_uint32(), 822569775u);
  EXPECT_EQ(rs.next_uint32(), 2137449171u);
  EXPECT_EQ(rs.next_uint32(), 2671936806u);
}

TEST(NumpyRandomState, ShuffleArange10) {
  NumpyRandomState rs(1234);
  std::vector<int32_t> a(10);
  std::iota(a.begin(), a.end(), 0);
  rs.shuffle(std::span<int32_t>(a));
  EXPECT_EQ(a, (std::vector<int32_t>{7, 2, 9, 1, 0, 8, 4, 5, 6, 3}));
}

TEST(NumpyRandomState, ShuffleArange100000Checksum) {
  // numpy: a = arange(100000, dtype=int32); RandomState(1234).shuffle(a); sum(i * a[i])
  NumpyRandomState rs(1234);
  std::vector<int32_t> a(100000);
  std::iota(a.begin(), a.end(), 0);
  rs.shuffle(std::span<int32_t>(a));
  EXPECT_EQ(std::vector<int32_t>(a.begin(), a.begin() + 5), (std::vector<int32_t>{13504, 72599, 42217, 97650, 99120}));
  uint64_t sum = 0;
  for (size_t i = 0; i < a.size(); ++i) sum += uint64_t(i) * uint64_t(a[i]);
  EXPECT_EQ(sum, 249809377481287ull);
}

TEST(NumpyRandomState, ConsecutiveShufflesShareTheStream) {
  // numpy: rs = RandomState(42); shuffle(arange(1000, dtype=uint32)); shuffle(arange(1000, 2000)).
  NumpyRandomState rs(42);
  std::vector<uint32_t> a(1000), b(1000);
  std::iota(a.begin(), a.end(), 0u);
  std::iota(b.begin(), b.end(), 1000u);
  rs.shuffle(std::span<uint32_t>(a));
  rs.shuffle(std::span<uint32_t>(b));
  EXPECT_EQ(std::vector<uint32_t>(a.begin(), a.begin() + 5), (std::vector<uint32_t>{521, 737, 740, 660, 411}));
  EXPECT_EQ(std::vector<uint32_t>(b.begin(), b.begin() + 5), (std::vector<uint32_t>{1093, 1692, 1100, 1562, 1729}));
}

TEST(NumpyRandomState, WideIntervalsDrawHighWordFirst) {
  const uint64_t max = (uint64_t(1) << 33) + 5;  // mask 2^34 - 1
  NumpyRandomState rs(7);
  std::mt19937 mt(7);
  for (int k = 0; k < 100; ++k) {
    uint64_t v;
    do {
      uint64_t hi = mt();
      v = ((hi << 32) | mt()) & ((uint64_t(1) << 34) - 1);
    } while (v > max);
    ASSERT_EQ(rs.random_interval(max), v);
  }
  EXPECT_EQ(rs.random_interval(0), 0u);
}

TEST(NumpySeedSequence, GenerateState) {
  NumpySeedSequence ss(0);
  EXPECT_EQ(ss.generate_state_u32(8), (std::vector<uint32_t>{0xb0f478be, 0xdb2cd7e7, 0x2c71ba49, 0xabf4641a, 0x9d7b8d41,
                                                             0x20c6ed6d, 0x223c39d4, 0x2c4099de}));
  EXPECT_EQ(ss.generate_state_u64(4), (std::vector<uint64_t>{15793235383387715774ull, 12390638538380655177ull,
                                                             2361836109651742017ull, 3188717715514472916ull}));
}

TEST(NumpyPCG64, RandomRaw) {
  NumpyPCG64 g(0);  // numpy.random.PCG64(0).random_raw(3)
  EXPECT_EQ(g.next_uint64(), 11749869230777074271ull);
  EXPECT_EQ(g.next_uint64(), 4976686463289251617ull);
  EXPECT_EQ(g.next_uint64(), 755828109848996024ull);
}

TEST(NumpyPCG64, Next32SplitsOneDrawLowHalfFirst) {
  NumpyPCG64 g(0);
  EXPECT_EQ(g.next_uint32(), uint32_t(11749869230777074271ull));
  EXPECT_EQ(g.next_uint32(), uint32_t(11749869230777074271ull >> 32));
}

TEST(NumpyGenerator, MockSequenceLengths) {
  // default_rng(0).integers(1, 4096, size=100000, dtype=int32): all 100000 via sums.
  std::vector<int32_t> v = NumpyGenerator(0).integers_int32(1, 4096, 100000);
  ASSERT_EQ(v.size(), 100000u);
  EXPECT_EQ(std::vector<int32_t>(v.begin(), v.begin() + 10),
            (std::vector<int32_t>{3484, 2609, 2094, 1105, 1261, 168, 309, 68, 718, 3331}));
  EXPECT_EQ(std::vector<int32_t>(v.end() - 3, v.end()), (std::vector<int32_t>{61, 100, 769}));
  int64_t sum = 0, weighted = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    sum += v[i];
    weighted += int64_t(i) * v[i];
  }
  EXPECT_EQ(sum, 204637097);
  EXPECT_EQ(weighted, 10235325438683);
}

TEST(NumpyGenerator, SmallRange) {
  // default_rng(7).integers(5, 17, size=20, dtype=int32)
  EXPECT_EQ(NumpyGenerator(7).integers_int32(5, 17, 20),
            (std::vector<int32_t>{16, 12, 13, 15, 11, 14, 15, 7, 5, 8, 8, 15, 15, 5, 10, 14, 6, 14, 6, 10}));
}

}  // namespace
}  // namespace megatron

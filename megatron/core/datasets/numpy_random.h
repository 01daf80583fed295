// numpy's random number generators, bit for bit, for the dataset indices Megatron builds with them.
//
// NumpyRandomState is numpy.random.RandomState(seed): MT19937 seeded by init_genrand (the same
// stream as std::mt19937(seed)), numpy's legacy bounded integers (masked rejection, high word
// first for 64-bit bounds) and its legacy shuffle of a 1-D array (Fisher-Yates from the end).
// GPTDataset shuffles its document and shuffle indices with one such state.
//
// NumpyGenerator is numpy.random.default_rng(seed): PCG64 (XSL-RR 128/64) seeded through
// SeedSequence, with numpy's buffered 32-bit draws and Lemire's bounded integers. MockGPTDataset
// draws its sequence lengths with default_rng(0).integers(1, 4096, size=100000, dtype=int32).
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <utility>
#include <vector>

namespace megatron {

/// numpy.random.RandomState(seed) (the legacy MT19937 generator).
class NumpyRandomState {
 public:
  explicit NumpyRandomState(uint32_t seed) : mt_(seed) {}

  uint32_t next_uint32() { return static_cast<uint32_t>(mt_()); }
  /// numpy's mt19937_next64: the first draw is the high word.
  uint64_t next_uint64() {
    uint64_t hi = next_uint32();
    return (hi << 32) | next_uint32();
  }
  /// numpy's random_interval: uniform in [0, max] by masked rejection.
  uint64_t random_interval(uint64_t max);

  /// numpy's legacy RandomState.shuffle of a 1-D array.
  template <typename T>
  void shuffle(std::span<T> a) {
    for (size_t i = a.size(); i-- > 1;) {
      size_t j = static_cast<size_t>(random_interval(i));
      std::swap(a[i], a[j]);
    }
  }

 private:
  std::mt19937 mt_;
};

/// numpy.random.SeedSequence(entropy) with the default pool size of 4 and no spawn key.
class NumpySeedSequence {
 public:
  explicit NumpySeedSequence(uint64_t entropy);
  /// generate_state(n_words, uint32).
  std::vector<uint32_t> generate_state_u32(size_t n_words) const;
  /// generate_state(n_words, uint64): pairs of 32-bit words, low word first.
  std::vector<uint64_t> generate_state_u64(size_t n_words) const;

 private:
  uint32_t pool_[4];
};

/// numpy's PCG64 bit generator (XSL-RR output), with numpy's buffered 32-bit draws.
class NumpyPCG64 {
 public:
  /// PCG64(SeedSequence(seed)).
  explicit NumpyPCG64(uint64_t seed);
  uint64_t next_uint64();
  /// Half of a 64-bit draw: the low half first, the high half on the next call.
  uint32_t next_uint32();

 private:
  unsigned __int128 state_ = 0;
  unsigned __int128 inc_ = 0;
  bool has_uint32_ = false;
  uint32_t uinteger_ = 0;
};

/// numpy.random.default_rng(seed) (a Generator over PCG64), the calls Megatron makes.
class NumpyGenerator {
 public:
  explicit NumpyGenerator(uint64_t seed) : bitgen_(seed) {}
  /// Generator.integers(low, high, size=n, dtype=numpy.int32): values in [low, high).
  std::vector<int32_t> integers_int32(int32_t low, int32_t high, size_t n);

 private:
  NumpyPCG64 bitgen_;
};

}  // namespace megatron

// numpy's MT19937 legacy bounded integers, SeedSequence, PCG64 and Lemire's bounded int32.
#include "megatron/core/datasets/numpy_random.h"

#include "megatron/runtime/check.h"

namespace megatron {

uint64_t NumpyRandomState::random_interval(uint64_t max) {
  if (max == 0) return 0;
  uint64_t mask = max;
  mask |= mask >> 1;
  mask |= mask >> 2;
  mask |= mask >> 4;
  mask |= mask >> 8;
  mask |= mask >> 16;
  mask |= mask >> 32;
  uint64_t value;
  if (max <= 0xFFFFFFFFull) {
    while ((value = (next_uint32() & mask)) > max) {
    }
  } else {
    while ((value = (next_uint64() & mask)) > max) {
    }
  }
  return value;
}

// ---- SeedSequence ---------------------------------------------------------------------------------
namespace {
constexpr uint32_t kInitA = 0x43b0d7e5u;
constexpr uint32_t kMultA = 0x931e8875u;
constexpr uint32_t kInitB = 0x8b51f9ddu;
constexpr uint32_t kMultB = 0x58f38dedu;
constexpr uint32_t kMixMultL = 0xca01f9ddu;
constexpr uint32_t kMixMultR = 0x4973f715u;
constexpr int kXShift = 16;

uint32_t hashmix(uint32_t value, uint32_t& hash_const) {
  value ^= hash_const;
  hash_const *= kMultA;
  value *= hash_const;
  value ^= value >> kXShift;
  return value;
}

uint32_t mix(uint32_t x, uint32_t y) {
  uint32_t result = kMixMultL * x - kMixMultR * y;
  result ^= result >> kXShift;
  return result;
}
}  // namespace

NumpySeedSequence::NumpySeedSequence(uint64_t entropy) {
  // numpy splits a Python int into 32-bit words, least significant first (0 -> [0]).
  std::vector<uint32_t> words{static_cast<uint32_t>(entropy)};
  if (entropy >> 32) words.push_back(static_cast<uint32_t>(entropy >> 32));
  uint32_t hash_const = kInitA;
  constexpr size_t n = 4;
  for (size_t i = 0; i < n; ++i) pool_[i] = hashmix(i < words.size() ? words[i] : 0u, hash_const);
  for (size_t src = 0; src < n; ++src)
    for (size_t dst = 0; dst < n; ++dst)
      if (src != dst) pool_[dst] = mix(pool_[dst], hashmix(pool_[src], hash_const));
  for (size_t src = n; src < words.size(); ++src)
    for (size_t dst = 0; dst < n; ++dst) pool_[dst] = mix(pool_[dst], hashmix(words[src], hash_const));
}

std::vector<uint32_t> NumpySeedSequence::generate_state_u32(size_t n_words) const {
  std::vector<uint32_t> state(n_words);
  uint32_t hash_const = kInitB;
  for (size_t i = 0; i < n_words; ++i) {
    uint32_t v = pool_[i % 4];
    v ^= hash_const;
    hash_const *= kMultB;
    v *= hash_const;
    v ^= v >> kXShift;
    state[i] = v;
  }
  return state;
}

std::vector<uint64_t> NumpySeedSequence::generate_state_u64(size_t n_words) const {
  std::vector<uint32_t> w = generate_state_u32(2 * n_words);
  std::vector<uint64_t> out(n_words);
  for (size_t i = 0; i < n_words; ++i) out[i] = uint64_t(w[2 * i]) | (uint64_t(w[2 * i + 1]) << 32);
  return out;
}

// ---- PCG64 ------------------------------------------------------------------------------------------
namespace {
constexpr unsigned __int128 kPcgMultiplier =
    (static_cast<unsigned __int128>(2549297995355413924ull) << 64) | 4865540595714422341ull;
}

NumpyPCG64::NumpyPCG64(uint64_t seed) {
  std::vector<uint64_t> v = NumpySeedSequence(seed).generate_state_u64(4);
  unsigned __int128 initstate = (static_cast<unsigned __int128>(v[0]) << 64) | v[1];
  unsigned __int128 initseq = (static_cast<unsigned __int128>(v[2]) << 64) | v[3];
  // pcg_setseq_128_srandom_r
  state_ = 0;
  inc_ = (initseq << 1) | 1;
  state_ = state_ * kPcgMultiplier + inc_;
  state_ += initstate;
  state_ = state_ * kPcgMultiplier + inc_;
}

uint64_t NumpyPCG64::next_uint64() {
  state_ = state_ * kPcgMultiplier + inc_;
  uint64_t x = static_cast<uint64_t>(state_ >> 64) ^ static_cast<uint64_t>(state_);
  unsigned rot = static_cast<unsigned>(state_ >> 122);
  return (x >> rot) | (x << ((64 - rot) & 63));
}

uint32_t NumpyPCG64::next_uint32() {
  if (has_uint32_) {
    has_uint32_ = false;
    return uinteger_;
  }
  uint64_t next = next_uint64();
  has_uint32_ = true;
  uinteger_ = static_cast<uint32_t>(next >> 32);
  return static_cast<uint32_t>(next & 0xFFFFFFFFu);
}

// ---- Generator.integers ------------------------------------------------------------------------------
std::vector<int32_t> NumpyGenerator::integers_int32(int32_t low, int32_t high, size_t n) {
  MG_CHECK(low < high, "integers: low ({}) must be below high ({})", low, high);
  // numpy draws in [off, off + rng] with rng = high - 1 - low (closed interval), as uint32.
  const uint32_t off = static_cast<uint32_t>(low);
  const uint32_t rng = static_cast<uint32_t>(int64_t(high) - 1 - int64_t(low));
  std::vector<int32_t> out(n);
  for (size_t i = 0; i < n; ++i) {
    uint32_t v;
    if (rng == 0) {
      v = 0;
    } else if (rng == 0xFFFFFFFFu) {
      v = bitgen_.next_uint32();
    } else {
      // Lemire's nearly-divisionless method (numpy's buffered_bounded_lemire_uint32).
      const uint32_t rng_excl = rng + 1;
      uint64_t m = uint64_t(bitgen_.next_uint32()) * rng_excl;
      uint32_t leftover = static_cast<uint32_t>(m);
      if (leftover < rng_excl) {
        const uint32_t threshold = (0xFFFFFFFFu - rng) % rng_excl;
        while (leftover < threshold) {
          m = uint64_t(bitgen_.next_uint32()) * rng_excl;
          leftover = static_cast<uint32_t>(m);
        }
      }
      v = static_cast<uint32_t>(m >> 32);
    }
    out[i] = static_cast<int32_t>(off + v);
  }
  return out;
}

}  // namespace megatron

// Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"), the counter-based
// generator behind curand and PyTorch's CUDA RNG. A random number is a pure function of
// (seed, counter), so a dropout mask is regenerated exactly in backward and under activation
// recomputation from the (seed, offset) recorded at forward time, on CPU and GPU alike.
//
// Note [Random stream layout]: a random op with state (seed, offset) draws element i from
// philox(key = seed, counter = {i/4 lo, i/4 hi, offset lo, offset hi})[i % 4]. Each random op takes a
// fresh offset (RngState::next_offset), so streams never overlap.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define MG_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MG_HOST_DEVICE inline
#endif

namespace megatron {

using Philox4 = std::array<uint32_t, 4>;

MG_HOST_DEVICE void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  uint64_t p = uint64_t(a) * uint64_t(b);
  hi = uint32_t(p >> 32);
  lo = uint32_t(p);
}

/// One Philox-4x32-10 block: 4 random 32-bit words for a 128-bit counter and a 64-bit key.
MG_HOST_DEVICE void philox4x32_10(const uint32_t ctr_in[4], const uint32_t key_in[2], uint32_t out[4]) {
  uint32_t c0 = ctr_in[0], c1 = ctr_in[1], c2 = ctr_in[2], c3 = ctr_in[3];
  uint32_t k0 = key_in[0], k1 = key_in[1];
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(0xD2511F53u, c0, hi0, lo0);
    philox_mulhilo(0xCD9E8D57u, c2, hi1, lo1);
    uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0, c1 = n1, c2 = n2, c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

/// Element i of the random stream (seed, offset) as raw 32 bits (Note [Random stream layout]).
MG_HOST_DEVICE uint32_t philox_element(uint64_t seed, uint64_t offset, uint64_t i) {
  uint64_t block = i >> 2;
  uint32_t ctr[4] = {uint32_t(block), uint32_t(block >> 32), uint32_t(offset), uint32_t(offset >> 32)};
  uint32_t key[2] = {uint32_t(seed), uint32_t(seed >> 32)};
  uint32_t out[4];
  philox4x32_10(ctr, key, out);
  return out[i & 3];
}

/// Uniform in [0, 1) with 24 random bits.
MG_HOST_DEVICE float philox_uniform(uint64_t seed, uint64_t offset, uint64_t i) {
  return float(philox_element(seed, offset, i) >> 8) * (1.0f / 16777216.0f);
}

/// Standard normal from the Box-Muller transform of elements 2i and 2i+1 of the stream.
MG_HOST_DEVICE float philox_normal(uint64_t seed, uint64_t offset, uint64_t i) {
  float u1 = (float(philox_element(seed, offset, 2 * i) >> 8) + 1.0f) * (1.0f / 16777216.0f);  // (0, 1]
  float u2 = philox_uniform(seed, offset, 2 * i + 1);
  return sqrtf(-2.0f * logf(u1)) * cosf(6.28318530717958647692f * u2);
}

/// Standard normals [first, first + count) of the stream (seed, offset), four per Philox block:
/// block j gives elements 4j..4j+3 from two Box-Muller pairs of its four words. Used for bulk
/// initialisation (a pure function of the index, so any split of the range gives the same values).
inline void philox_normals(uint64_t seed, uint64_t offset, uint64_t first, uint64_t count, float* out) {
  const uint32_t key[2] = {uint32_t(seed), uint32_t(seed >> 32)};
  uint64_t i = first;
  const uint64_t end = first + count;
  while (i < end) {
    const uint64_t block = i >> 2;
    const uint32_t ctr[4] = {uint32_t(block), uint32_t(block >> 32), uint32_t(offset), uint32_t(offset >> 32)};
    uint32_t w[4];
    philox4x32_10(ctr, key, w);
    float z[4];
    for (int pair = 0; pair < 2; ++pair) {
      const float u1 = (float(w[2 * pair] >> 8) + 1.0f) * (1.0f / 16777216.0f);  // (0, 1]
      const float u2 = float(w[2 * pair + 1] >> 8) * (1.0f / 16777216.0f);
      const float r = sqrtf(-2.0f * logf(u1)), t = 6.28318530717958647692f * u2;
      z[2 * pair] = r * cosf(t);
      z[2 * pair + 1] = r * sinf(t);
    }
    for (uint64_t k = i & 3; k < 4 && i < end; ++k, ++i) out[i - first] = z[k];
  }
}

/// The generator's state: a seed and the next unused offset.
struct RngState {
  uint64_t seed = 1234;
  uint64_t offset = 0;
  /// Reserves a fresh stream for one random op and returns its offset.
  uint64_t next_offset() { return offset++; }
};

}  // namespace megatron

// Causal attention over a KV cache (inference), CPU reference.
//
// The caches are slot-major [B, S, ng, d]: the keys of one slot are S rows of ng·d floats, so the
// keys of a (slot, group) are rows a fixed stride apart and feed cblas_sgemm directly, as in
// attention.cpp. For each batch row i (cache slot slots[i], first new position starts[i]) the new
// keys/values are written at positions starts[i] .. starts[i]+s-1, then for each head
//   S = scale·Q·Kᵀ [s, L] over L = starts[i]+s cached positions; query j sees positions <= starts[i]+j;
//   P = softmax (fp32 exp, fp64 sum, as attention_forward); O = P·V.
// With starts = 0 and s = L this is attention_forward without dropout, term for term.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "megatron/kernels/cpu/cpu_common.h"
#include "megatron/kernels/cpu/cpu_ops.h"

namespace megatron::cpu {

namespace {
// The shapes and indices of a write of k_new/v_new [s, b, ng, d] into caches [B, S, ng, d].
struct CacheWrite {
  std::vector<int64_t> slot, start;
};

CacheWrite check_cache_write(const Tensor& k_new, const Tensor& v_new, const Tensor& slots, const Tensor& starts,
                             const Tensor& k_cache, const Tensor& v_cache) {
  MG_ASSERT(k_new.dim() == 4 && k_new.shape() == v_new.shape(), "k_new {} and v_new {} must be [s, b, ng, d]",
            k_new.str(), v_new.str());
  MG_ASSERT(k_cache.dim() == 4 && k_cache.shape() == v_cache.shape() && k_cache.size(2) == k_new.size(2) &&
                k_cache.size(3) == k_new.size(3),
            "caches {} / {} do not fit k_new {}", k_cache.str(), v_cache.str(), k_new.str());
  const int64_t s = k_new.size(0), b = k_new.size(1), num_slots = k_cache.size(0), max_len = k_cache.size(1);
  CacheWrite w{load_indices(slots, "slots"), load_indices(starts, "starts")};
  MG_ASSERT(int64_t(w.slot.size()) == b && int64_t(w.start.size()) == b, "slots {} and starts {} must have {} entries",
            slots.str(), starts.str(), b);
  for (int64_t i = 0; i < b; ++i) {
    MG_ASSERT(w.slot[size_t(i)] >= 0 && w.slot[size_t(i)] < num_slots, "cache slot {} outside [0, {})",
              w.slot[size_t(i)], num_slots);
    MG_ASSERT(w.start[size_t(i)] >= 0 && w.start[size_t(i)] + s <= max_len,
              "positions {}..{} do not fit a cache of {} positions", w.start[size_t(i)], w.start[size_t(i)] + s - 1,
              max_len);
  }
  return w;
}
}  // namespace

void kv_cache_append(Context&, const Tensor& k_new, const Tensor& v_new, const Tensor& slots, const Tensor& starts,
                     Tensor& k_cache, Tensor& v_cache) {
  assert_float(k_new, "k_new");
  assert_float(v_new, "v_new");
  assert_float(k_cache, "k_cache");
  assert_float(v_cache, "v_cache");
  const CacheWrite w = check_cache_write(k_new, v_new, slots, starts, k_cache, v_cache);
  const int64_t s = k_new.size(0), b = k_new.size(1), max_len = k_cache.size(1);
  const int64_t row = k_new.size(2) * k_new.size(3);  // one cached position of one slot
  FloatIn kin(k_new), vin(v_new);
  FloatOut kc(k_cache, /*load=*/true), vc(v_cache, /*load=*/true);
  for (int64_t j = 0; j < s; ++j) {
    for (int64_t i = 0; i < b; ++i) {
      const int64_t dst = (w.slot[size_t(i)] * max_len + w.start[size_t(i)] + j) * row, src = (j * b + i) * row;
      std::memcpy(kc.data() + dst, kin.data() + src, size_t(row) * sizeof(float));
      std::memcpy(vc.data() + dst, vin.data() + src, size_t(row) * sizeof(float));
    }
  }
}

void attention_kv_cache_forward(Context& ctx, const Tensor& q, const Tensor& k_new, const Tensor& v_new,
                                const Tensor& slots, const Tensor& starts, float softmax_scale, Tensor& k_cache,
                                Tensor& v_cache, Tensor& out) {
  assert_float(q, "q");
  MG_ASSERT(q.dim() == 4 && k_new.dim() == 4,
            "attention_kv_cache expects q [s, b, nq, d], k_new/v_new [s, b, ng, d]; got {}, {}, {}", q.str(),
            k_new.str(), v_new.str());
  const int64_t s = q.size(0), b = q.size(1), nq = q.size(2), d = q.size(3), ng = k_new.size(2);
  MG_ASSERT(k_new.size(0) == s && k_new.size(1) == b && k_new.size(3) == d && ng > 0 && nq % ng == 0,
            "q {} and k_new {} do not fit GQA attention", q.str(), k_new.str());
  assert_numel(out, q.numel(), "out");
  const CacheWrite w = check_cache_write(k_new, v_new, slots, starts, k_cache, v_cache);
  const std::vector<int64_t>&slot = w.slot, &start = w.start;
  kv_cache_append(ctx, k_new, v_new, slots, starts, k_cache, v_cache);
  const int64_t max_len = k_cache.size(1), row = ng * d;
  FloatIn qin(q), kc(k_cache), vc(v_cache);
  FloatOut o(out);
  const int64_t ldq = b * nq * d, group = nq / ng;
  std::vector<float> probs;
  for (int64_t i = 0; i < b; ++i) {
    const int64_t len = start[size_t(i)] + s;
    probs.resize(size_t(s * len));
    const float* kbase = kc.data() + slot[size_t(i)] * max_len * row;
    const float* vbase = vc.data() + slot[size_t(i)] * max_len * row;
    for (int64_t h = 0; h < nq; ++h) {
      const int64_t q_off = (i * nq + h) * d, k_off = (h / group) * d;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(s), int(len), int(d), softmax_scale, qin.data() + q_off,
                  int(ldq), kbase + k_off, int(row), 0.0f, probs.data(), int(len));
      for (int64_t j = 0; j < s; ++j) {
        float* p = probs.data() + j * len;
        const int64_t last = start[size_t(i)] + j;  // the query's own position
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t <= last; ++t) m = std::max(m, p[t]);
        double sum = 0.0;
        for (int64_t t = 0; t <= last; ++t) {
          p[t] = std::exp(p[t] - m);
          sum += p[t];
        }
        const float inv = float(1.0 / sum);
        for (int64_t t = 0; t <= last; ++t) p[t] *= inv;
        std::fill(p + last + 1, p + len, 0.0f);
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(s), int(d), int(len), 1.0f, probs.data(), int(len),
                  vbase + k_off, int(row), 0.0f, o.data() + q_off, int(ldq));
    }
  }
}

}  // namespace megatron::cpu

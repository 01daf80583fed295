// The fused QKV layout (ops.h): per query group, nq/ng query heads then one key and one value head.
// Split and merge are pure copies; they work on any dtype by element size.
#include <cstring>

#include "megatron/kernels/cpu/cpu_ops.h"

namespace megatron::cpu {

namespace {
// Walks the grouped layout, calling copy(qkv_offset, part_ptr_offset, part) for each head-sized chunk.
template <typename Fn>
void for_each_head(const Tensor& q, const Tensor& k, Fn&& copy) {
  const int64_t sb = q.size(0) * q.size(1), nq = q.size(2), d = q.size(3), ng = k.size(2);
  const int64_t per_group = nq / ng;
  const int64_t row = ng * (per_group + 2) * d;
  for (int64_t t = 0; t < sb; ++t) {
    for (int64_t g = 0; g < ng; ++g) {
      int64_t base = t * row + g * (per_group + 2) * d;
      for (int64_t j = 0; j < per_group; ++j) copy(base + j * d, (t * nq + g * per_group + j) * d, 0);
      copy(base + per_group * d, (t * ng + g) * d, 1);
      copy(base + (per_group + 1) * d, (t * ng + g) * d, 2);
    }
  }
}

void check_shapes(const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v) {
  MG_ASSERT(q.dim() == 4 && k.dim() == 4 && v.shape() == k.shape(), "q {} k {} v {}", shape_str(q.shape()),
            shape_str(k.shape()), shape_str(v.shape()));
  MG_ASSERT(q.size(2) % k.size(2) == 0 && q.size(3) == k.size(3), "q {} k {}", shape_str(q.shape()),
            shape_str(k.shape()));
  MG_ASSERT(qkv.numel() == q.numel() + 2 * k.numel(), "qkv {} for q {} k {}", shape_str(qkv.shape()),
            shape_str(q.shape()), shape_str(k.shape()));
  MG_ASSERT(qkv.dtype() == q.dtype() && k.dtype() == q.dtype() && v.dtype() == q.dtype(), "mixed dtypes");
}
}  // namespace

void qkv_split_forward(Context&, const Tensor& qkv, Tensor& q, Tensor& k, Tensor& v) {
  check_shapes(qkv, q, k, v);
  const size_t es = size_of(qkv.dtype()), head_bytes = size_t(q.size(3)) * es;
  auto* src = static_cast<const char*>(qkv.raw_data());
  char* dst[3] = {static_cast<char*>(q.raw_data()), static_cast<char*>(k.raw_data()), static_cast<char*>(v.raw_data())};
  for_each_head(q, k, [&](int64_t from, int64_t to, int part) {
    std::memcpy(dst[part] + size_t(to) * es, src + size_t(from) * es, head_bytes);
  });
}

void qkv_split_backward(Context&, const Tensor& grad_q, const Tensor& grad_k, const Tensor& grad_v, Tensor& grad_qkv) {
  check_shapes(grad_qkv, grad_q, grad_k, grad_v);
  const size_t es = size_of(grad_qkv.dtype()), head_bytes = size_t(grad_q.size(3)) * es;
  auto* dst = static_cast<char*>(grad_qkv.raw_data());
  const char* src[3] = {static_cast<const char*>(grad_q.raw_data()), static_cast<const char*>(grad_k.raw_data()),
                        static_cast<const char*>(grad_v.raw_data())};
  for_each_head(grad_q, grad_k, [&](int64_t to, int64_t from, int part) {
    std::memcpy(dst + size_t(to) * es, src[part] + size_t(from) * es, head_bytes);
  });
}

}  // namespace megatron::cpu

// Dropout, dropout-add and add, CPU reference: one pointwise kernel serves all four ops.
//
//   out[i] = residual[i] + x[i]·keep_i/(1-p),  keep_i = philox_uniform(seed, offset, i) >= p
// with i the flat element index (Note [Random stream layout] in runtime/philox.h). dropout and its
// backward are the kernel without a residual (the same mask is regenerated from (seed, offset));
// add is the kernel with p = 0. p = 0 never touches the generator; p = 1 drops everything. out may
// alias x or residual: each element is read before it is written.
#include <algorithm>
#include <optional>

#include "megatron/kernels/cpu/cpu_common.h"
#include "megatron/kernels/cpu/cpu_ops.h"

namespace megatron::cpu {

namespace {

// out = residual + dropout(x); residual may be undefined.
void dropout_add(const Tensor& x, const Tensor& residual, float p, uint64_t seed, uint64_t offset, Tensor& out) {
  MG_ASSERT(p >= 0.0f && p <= 1.0f, "dropout probability {} must be in [0, 1]", p);
  assert_float(x, "x");
  const int64_t n = x.numel();
  assert_numel(out, n, "out");
  if (p == 0.0f && !residual.defined()) {
    if (out.raw_data() != x.raw_data()) out.copy_from(x);
    return;
  }
  std::optional<FloatIn> res;
  if (residual.defined()) {
    assert_numel(residual, n, "residual");
    res.emplace(residual);
  }
  FloatIn in(x);
  FloatOut o(out);
  const float keep_scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
  constexpr int64_t kChunk = 4096;
  std::vector<float> uniform(size_t(p > 0.0f ? std::min(n, kChunk) : 0));
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t len = std::min(kChunk, n - start);
    if (p > 0.0f) philox_uniforms(seed, offset, uint64_t(start), len, uniform.data());
    for (int64_t k = 0; k < len; ++k) {
      const int64_t i = start + k;
      const float dropped = p > 0.0f ? (uniform[k] >= p ? in[i] * keep_scale : 0.0f) : in[i];
      o[i] = res ? (*res)[i] + dropped : dropped;
    }
  }
}

}  // namespace

void dropout_forward(Context& ctx, const Tensor& x, float p, uint64_t seed, uint64_t offset, Tensor& out) {
  dropout_add(x, Tensor(), p, seed, offset, out);
}

void dropout_backward(Context& ctx, const Tensor& grad_out, float p, uint64_t seed, uint64_t offset, Tensor& grad_in) {
  dropout_add(grad_out, Tensor(), p, seed, offset, grad_in);
}

void dropout_add_forward(Context& ctx, const Tensor& x, const Tensor& residual, float p, uint64_t seed, uint64_t offset,
                         Tensor& out) {
  MG_ASSERT(residual.defined(), "dropout_add_forward needs a residual");
  dropout_add(x, residual, p, seed, offset, out);
}

void add(Context& ctx, const Tensor& a, const Tensor& b, Tensor& out) {
  MG_ASSERT(b.defined(), "add needs two tensors");
  dropout_add(a, b, 0.0f, 0, 0, out);
}

}  // namespace megatron::cpu

// Pointwise activations, CPU reference: GeLU (tanh approximation) and SwiGLU.
//
// GeLU: y = ½x(1 + tanh(u)), u = √(2/π)(x + 0.044715x³) (Megatron's bias_gelu, HF gelu_new);
//   dy/dx = ½(1 + t) + ½x(1 - t²)·√(2/π)(1 + 3·0.044715x²), t = tanh(u).
// SwiGLU: each row of x [N, 2f] is [gate | up]; y = silu(gate)·up, silu(g) = g·σ(g);
//   dgate = dy·up·σ(g)(1 + g(1 - σ(g))),  dup = dy·silu(g).
// Quick-GeGLU with clamps (Megatron's quick_gelu gated, glu_linear_offset, activation_func_clamp_value;
//   GPT-OSS's experts): g = min(gate, L), u = clamp(up, -L, L), y = g·σ(a·g)·(u + c);
//   dgate = [gate <= L]·dy·(u + c)·σ(a·g)(1 + a·g(1 - σ(a·g))),  dup = [-L <= up <= L]·dy·g·σ(a·g).
// grad_in may alias grad_out for GeLU (each element is read before it is written).
#include <algorithm>
#include <cmath>

#include "megatron/kernels/cpu/cpu_common.h"
#include "megatron/kernels/cpu/cpu_ops.h"

namespace megatron::cpu {

namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCoeff = 0.044715f;

float gelu(float x) {
  const float u = kSqrt2OverPi * (x + kGeluCoeff * x * x * x);
  return 0.5f * x * (1.0f + std::tanh(u));
}

float gelu_grad(float x) {
  const float u = kSqrt2OverPi * (x + kGeluCoeff * x * x * x);
  const float t = std::tanh(u);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * kGeluCoeff * x * x);
}

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// Rows and f of a SwiGLU input x [N, 2f] and output [N, f].
int64_t swiglu_rows(const Tensor& x, const Tensor& half, int64_t& f) {
  assert_float(x, "x");
  MG_ASSERT(x.dim() >= 1 && x.size(-1) % 2 == 0, "swiglu input {} must have an even last dimension", x.str());
  f = x.size(-1) / 2;
  const int64_t n = rows_of(x, 2 * f, "x");
  assert_float(half, "swiglu output / grad_out");
  MG_ASSERT(rows_of(half, f, "swiglu output / grad_out") == n, "{} does not match swiglu input {}", half.str(),
            x.str());
  return n;
}

}  // namespace

void gelu_forward(Context& ctx, const Tensor& x, Tensor& out) {
  assert_numel(out, x.numel(), "out");
  FloatIn in(x);
  FloatOut y(out);
  for (int64_t i = 0; i < x.numel(); ++i) y[i] = gelu(in[i]);
}

void gelu_backward(Context& ctx, const Tensor& grad_out, const Tensor& x, Tensor& grad_in) {
  assert_numel(grad_out, x.numel(), "grad_out");
  assert_numel(grad_in, x.numel(), "grad_in");
  FloatIn in(x), dy(grad_out);
  FloatOut dx(grad_in);
  for (int64_t i = 0; i < x.numel(); ++i) dx[i] = dy[i] * gelu_grad(in[i]);
}

void swiglu_forward(Context& ctx, const Tensor& x, Tensor& out) {
  int64_t f = 0;
  const int64_t n = swiglu_rows(x, out, f);
  FloatIn in(x);
  FloatOut y(out);
  for (int64_t r = 0; r < n; ++r) {
    const float* gate = in.data() + r * 2 * f;
    const float* up = gate + f;
    float* yr = y.data() + r * f;
    for (int64_t c = 0; c < f; ++c) yr[c] = gate[c] * sigmoid(gate[c]) * up[c];
  }
}

void swiglu_backward(Context& ctx, const Tensor& grad_out, const Tensor& x, Tensor& grad_in) {
  int64_t f = 0;
  const int64_t n = swiglu_rows(x, grad_out, f);
  assert_numel(grad_in, x.numel(), "grad_in");
  FloatIn in(x), dy(grad_out);
  FloatOut dx(grad_in);
  for (int64_t r = 0; r < n; ++r) {
    const float* gate = in.data() + r * 2 * f;
    const float* up = gate + f;
    const float* dyr = dy.data() + r * f;
    float* dgate = dx.data() + r * 2 * f;
    float* dup = dgate + f;
    for (int64_t c = 0; c < f; ++c) {
      const float g = gate[c], u = up[c], s = sigmoid(g);
      dgate[c] = dyr[c] * u * s * (1.0f + g * (1.0f - s));
      dup[c] = dyr[c] * g * s;
    }
  }
}

void quick_geglu_forward(Context& ctx, const Tensor& x, float alpha, float limit, float linear_offset, Tensor& out) {
  int64_t f = 0;
  const int64_t n = swiglu_rows(x, out, f);
  FloatIn in(x);
  FloatOut y(out);
  for (int64_t r = 0; r < n; ++r) {
    const float* gate = in.data() + r * 2 * f;
    const float* up = gate + f;
    float* yr = y.data() + r * f;
    for (int64_t c = 0; c < f; ++c) {
      const float g = std::min(gate[c], limit), u = std::clamp(up[c], -limit, limit);
      yr[c] = g * sigmoid(alpha * g) * (u + linear_offset);
    }
  }
}

void quick_geglu_backward(Context& ctx, const Tensor& grad_out, const Tensor& x, float alpha, float limit,
                          float linear_offset, Tensor& grad_in) {
  int64_t f = 0;
  const int64_t n = swiglu_rows(x, grad_out, f);
  assert_numel(grad_in, x.numel(), "grad_in");
  FloatIn in(x), dy(grad_out);
  FloatOut dx(grad_in);
  for (int64_t r = 0; r < n; ++r) {
    const float* gate = in.data() + r * 2 * f;
    const float* up = gate + f;
    const float* dyr = dy.data() + r * f;
    float* dgate = dx.data() + r * 2 * f;
    float* dup = dgate + f;
    for (int64_t c = 0; c < f; ++c) {
      const float g = std::min(gate[c], limit), u = std::clamp(up[c], -limit, limit);
      const float s = sigmoid(alpha * g);
      const bool gate_in = gate[c] <= limit, up_in = up[c] >= -limit && up[c] <= limit;
      const float d = dyr[c];
      dgate[c] = gate_in ? d * (u + linear_offset) * s * (1.0f + alpha * g * (1.0f - s)) : 0.0f;
      dup[c] = up_in ? d * g * s : 0.0f;
    }
  }
}

}  // namespace megatron::cpu

namespace megatron::cpu {

void linear_gelu_forward(Context& ctx, const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& pre,
                         Tensor& out) {
  linear_forward(ctx, x, weight, bias, pre);
  gelu_forward(ctx, pre, out);
}

void linear_dgelu_backward(Context& ctx, const Tensor& grad_out, const Tensor& weight, const Tensor& pre,
                           Tensor& grad_pre) {
  // The product rounds to grad_pre's dtype once, as the GPU's fused epilogue applies gelu' to the
  // fp32 accumulator: here the product is kept in fp32.
  Tensor product = Tensor::empty(grad_pre.shape(), DType::Float32, grad_pre.device());
  Tensor none;
  linear_backward(ctx, grad_out, pre, weight, product, none, none);
  gelu_backward(ctx, product, pre, grad_pre);
}

}  // namespace megatron::cpu

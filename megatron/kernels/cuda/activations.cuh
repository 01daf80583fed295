// The MLP activations' pointwise math on the GPU, shared by the activation kernels
// (elementwise.cu) and the FP8 quantisation passes that compute the activation themselves
// (fp8.cu, Note [Quantising inside the activation]): one definition, so both write the same bits.
#pragma once

namespace megatron::cuda {

inline constexpr float kSqrt2OverPi = 0.7978845608028654f;
inline constexpr float kGeluCoeff = 0.044715f;

// GeLU, tanh approximation (Megatron's openai_gelu / bias_gelu), and its derivative.
__device__ __forceinline__ float gelu(float x) {
  const float u = kSqrt2OverPi * (x + kGeluCoeff * x * x * x);
  return 0.5f * x * (1.0f + tanhf(u));
}

__device__ __forceinline__ float gelu_grad(float x) {
  const float u = kSqrt2OverPi * (x + kGeluCoeff * x * x * x);
  const float t = tanhf(u);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * kGeluCoeff * x * x);
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// SwiGLU of one (gate, up) pair: silu(g) · u.
__device__ __forceinline__ float swiglu_value(float g, float u) { return g * sigmoid(g) * u; }

// SwiGLU's input gradients for the output gradient d: dg = d · u · silu'(g), du = d · silu(g).
__device__ __forceinline__ void swiglu_grads(float d, float g, float u, float& dg, float& du) {
  const float s = sigmoid(g);
  dg = d * u * s * (1.0f + g * (1.0f - s));
  du = d * g * s;
}

}  // namespace megatron::cuda

// The gated activations' pointwise math on the GPU, shared by the activation kernels
// (elementwise.cu) and the FP8 quantisation passes that compute the activation themselves
// (fp8.cu, Note [Quantising inside SwiGLU]): one definition, so both write the same bits.
#pragma once

namespace megatron::cuda {

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

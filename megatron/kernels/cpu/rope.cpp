// Rotary position embedding, CPU reference.
//
// x [s, b, n, d]; freqs [s, r/2] fp32 angles θ for the first r <= d channels of every head; the
// channels from r on pass through. Pair k (k < r/2) is rotated by θ[pos, k]:
//   rotate-half (interleaved = false, Megatron's default): channels (k, k + r/2)
//   interleaved                                           : channels (2k, 2k + 1)
//   (a, b) -> (a·c - b·s, b·c + a·s),  c = scale·cos θ, s = scale·sin θ
// (scale: YaRN's attention factor, 1 for plain RoPE). A scaled rotation's transpose is the scaled
// rotation by -θ, so the backward is that: one kernel serves both.
// out may alias x (each pair is read before it is written).
#include <cmath>

#include "megatron/kernels/cpu/cpu_common.h"
#include "megatron/kernels/cpu/cpu_ops.h"

namespace megatron::cpu {

namespace {

// out = scale · rotate(x, sign·θ).
void rope_rotate(const Tensor& x, const Tensor& freqs, bool interleaved, float sign, float scale, Tensor& out) {
  assert_float(x, "x");
  MG_ASSERT(x.dim() == 4, "rope input must be [s, b, n, d], got {}", x.str());
  assert_numel(out, x.numel(), "out");
  assert_fp32(freqs, "freqs");
  const int64_t s = x.size(0), heads = x.size(1) * x.size(2), d = x.size(3);
  MG_ASSERT(freqs.dim() == 2 && freqs.size(0) == s, "freqs is {}, expected [{}, r/2]", freqs.str(), s);
  const int64_t half = freqs.size(1);
  MG_ASSERT(2 * half <= d, "rotary dimension {} exceeds head dimension {}", 2 * half, d);
  // Pair k: channels (lo(k), hi(k)).
  const int64_t lo_step = interleaved ? 2 : 1, hi_offset = interleaved ? 1 : half;

  FloatIn in(x);
  FloatOut o(out);
  const float* theta = freqs.data<float>();
  std::vector<float> cos_t(static_cast<size_t>(half)), sin_t(static_cast<size_t>(half));
  for (int64_t pos = 0; pos < s; ++pos) {
    for (int64_t k = 0; k < half; ++k) {
      cos_t[k] = std::cos(theta[pos * half + k]) * scale;
      sin_t[k] = sign * (std::sin(theta[pos * half + k]) * scale);
    }
    for (int64_t hd = 0; hd < heads; ++hd) {
      const float* xr = in.data() + (pos * heads + hd) * d;
      float* yr = o.data() + (pos * heads + hd) * d;
      for (int64_t k = 0; k < half; ++k) {
        const int64_t lo = k * lo_step, hi = lo + hi_offset;
        const float a = xr[lo], b = xr[hi];
        yr[lo] = a * cos_t[k] - b * sin_t[k];
        yr[hi] = b * cos_t[k] + a * sin_t[k];
      }
      for (int64_t c = 2 * half; c < d; ++c) yr[c] = xr[c];
    }
  }
}

}  // namespace

void rope_forward(Context& ctx, const Tensor& x, const Tensor& freqs, bool interleaved, float scale, Tensor& out) {
  rope_rotate(x, freqs, interleaved, 1.0f, scale, out);
}

void rope_backward(Context& ctx, const Tensor& grad_out, const Tensor& freqs, bool interleaved, float scale,
                   Tensor& grad_in) {
  rope_rotate(grad_out, freqs, interleaved, -1.0f, scale, grad_in);
}

}  // namespace megatron::cpu

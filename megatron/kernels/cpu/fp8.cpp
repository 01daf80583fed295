// The FP8 ops, CPU reference (fp8_ops.h; the formats, layouts and recipes are its Notes). Element
// encoding is runtime/dtype.cpp's, which is the GPU's satfinite conversion bit for bit (Note [FP8
// rounding and saturation]); the scale arithmetic is single fp32 operations in the order the CUDA
// kernels do them, so both backends produce the same bits. The GEMM is OpenBLAS sgemm on the
// dequantised operands.
#include <cblas.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#include "megatron/kernels/cpu/cpu_common.h"
#include "megatron/kernels/cpu/cpu_ops.h"
#include "megatron/kernels/fp8_ops.h"

namespace megatron::cpu {

namespace {

uint8_t encode(float v, DType t) { return t == DType::Float8E4M3 ? to_fp8_e4m3(v).bits : to_fp8_e5m2(v).bits; }
float decode(uint8_t b, DType t) { return t == DType::Float8E4M3 ? to_float(fp8_e4m3{b}) : to_float(fp8_e5m2{b}); }

uint8_t* bytes(const Tensor& t) { return static_cast<uint8_t*>(t.raw_data()); }

void assert_host(const Tensor& t, const char* name) {
  MG_ASSERT(!t.defined() || t.device().is_host(), "{} is {}, the CPU kernels need a host tensor", name, t.str());
}

// TE's compute_scale_from_amax with no epsilon (Note [FP8 formats and scaling]).
float scale_from_amax(float amax, float fp8_max, bool pow2, float value_for_inf) {
  if (std::isinf(amax) || amax == 0.0f || std::isnan(amax)) return 1.0f;
  float scale = fp8_max / amax;
  if (std::isinf(scale)) scale = value_for_inf;
  if (pow2) scale = bits_to_float(float_to_bits(scale) & 0xff800000u);
  return scale;
}

// The largest finite value of x's dtype: what a block scale becomes when fp8_max / amax overflows
// (TE's compute_scale_from_types).
float max_finite_of(DType t) {
  switch (t) {
    case DType::BFloat16: return bits_to_float(0x7f7f0000u);
    case DType::Float16: return 65504.0f;
    default: return FLT_MAX;
  }
}

// Dequantised fp32 copy of a GEMM operand [rows, K].
std::vector<float> dequantized(const Fp8Operand& o) {
  const int64_t rows = o.data.size(0), k = o.data.size(1);
  const DType t = o.data.dtype();
  const uint8_t* q = bytes(o.data);
  const float* s = o.scale_inv.data<float>();
  std::vector<float> out(size_t(rows * k));
  const int64_t ld = o.scale_inv.dim() == 2 ? o.scale_inv.size(1) : 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      float si = s[0];
      if (o.mode == Fp8ScaleMode::Block1x128) si = s[(c / kFp8BlockLen) * ld + r];
      if (o.mode == Fp8ScaleMode::Block128x128) si = s[(r / kFp8BlockLen) * ld + c / kFp8BlockLen];
      out[size_t(r * k + c)] = decode(q[r * k + c], t) * si;
    }
  }
  return out;
}

}  // namespace

void fp8_quantize(Context& ctx, const Tensor& x, const Tensor& scale, Tensor& q, Tensor& q_t, Tensor& amax,
                  Tensor& scale_inv) {
  const auto [m, k] = ops::check_fp8_quantize(x, scale, q, q_t, amax, scale_inv);
  for (const Tensor* t : std::initializer_list<const Tensor*>{&x, &scale, &q, &q_t, &amax, &scale_inv}) assert_host(*t, "fp8_quantize's tensors");
  FloatIn xin(x);
  const float s = scale.data<float>()[0];
  float local = 0.0f;
  uint8_t* qd = q.defined() ? bytes(q) : nullptr;
  uint8_t* qt = q_t.defined() ? bytes(q_t) : nullptr;
  const DType t = q.defined() ? q.dtype() : (q_t.defined() ? q_t.dtype() : DType::Float8E4M3);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      const float v = xin[r * k + c];
      local = std::fmax(local, std::fabs(v));
      if (qd == nullptr && qt == nullptr) continue;
      const uint8_t code = encode(v * s, t);
      if (qd) qd[r * k + c] = code;
      if (qt) qt[c * m + r] = code;
    }
  }
  if (amax.defined()) amax.data<float>()[0] = std::fmax(amax.data<float>()[0], local);
  if (scale_inv.defined()) scale_inv.data<float>()[0] = 1.0f / s;
}

void fp8_quantize_dbias(Context& ctx, const Tensor& x, const Tensor& scale, Tensor& q, Tensor& q_t, Tensor& amax,
                        Tensor& scale_inv, Tensor& dbias) {
  const auto [m, k] = ops::check_fp8_quantize_dbias(x, scale, q, q_t, amax, scale_inv, dbias);
  assert_host(dbias, "dbias");
  fp8_quantize(ctx, x, scale, q, q_t, amax, scale_inv);
  FloatIn xin(x);
  std::vector<float> sums(size_t(k), 0.0f);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < k; ++c) sums[size_t(c)] += xin[r * k + c];
  float* db = dbias.data<float>();
  for (int64_t c = 0; c < k; ++c) db[c] += sums[size_t(c)];
}

// The reference is the definition: x made by the activation's op into pre's dtype, then quantised.
void fp8_quantize_activation(Context& ctx, Fp8Activation act, const Tensor& pre, const Tensor& grad,
                             const Tensor& scale, Tensor& q, Tensor& q_t, Tensor& amax, Tensor& scale_inv,
                             Tensor& dbias) {
  ops::check_fp8_quantize_activation(act, pre, grad, scale, q, q_t, amax, scale_inv, dbias);
  const Tensor x = ops::fp8_activation_values(ctx, act, pre, grad);
  if (dbias.defined()) {
    fp8_quantize_dbias(ctx, x, scale, q, q_t, amax, scale_inv, dbias);
  } else {
    fp8_quantize(ctx, x, scale, q, q_t, amax, scale_inv);
  }
}

void fp8_amax(Context& ctx, const Tensor& x, Tensor& amax) {
  assert_float(x, "x");
  assert_fp32(amax, "amax");
  assert_numel(amax, 1, "amax");
  FloatIn xin(x);
  float local = 0.0f;
  for (int64_t i = 0; i < x.numel(); ++i) local = std::fmax(local, std::fabs(xin[i]));
  amax.data<float>()[0] = local;
}

void fp8_dequantize(Context& ctx, const Tensor& q, const Tensor& scale_inv, Tensor& out) {
  MG_CHECK(q.defined() && is_fp8(q.dtype()), "fp8_dequantize: q must be fp8, got {}", q.defined() ? q.str() : "undefined");
  assert_host(q, "q");
  assert_fp32(scale_inv, "scale_inv");
  assert_numel(scale_inv, 1, "scale_inv");
  assert_float(out, "out");
  assert_numel(out, q.numel(), "out");
  const float si = scale_inv.data<float>()[0];
  const uint8_t* qd = bytes(q);
  FloatOut o(out);
  for (int64_t i = 0; i < q.numel(); ++i) o[i] = decode(qd[i], q.dtype()) * si;
}

void fp8_scale_from_amax(Context& ctx, const Tensor& amax, float fp8_max, bool power_of_two_scales, Tensor& scale,
                         Tensor& scale_inv) {
  assert_fp32(amax, "amax");
  assert_fp32(scale, "scale");
  assert_numel(scale, amax.numel(), "scale");
  if (scale_inv.defined()) {
    assert_fp32(scale_inv, "scale_inv");
    assert_numel(scale_inv, amax.numel(), "scale_inv");
  }
  for (int64_t i = 0; i < amax.numel(); ++i) {
    const float s = scale_from_amax(amax.data<float>()[i], fp8_max, power_of_two_scales, FLT_MAX);
    scale.data<float>()[i] = s;
    if (scale_inv.defined()) scale_inv.data<float>()[i] = 1.0f / s;
  }
}

void fp8_delayed_scale_update(Context& ctx, Tensor& amax_history, Tensor& scale, const Fp8DelayedParams& p) {
  const auto [len, n] = ops::check_fp8_delayed_scale_update(amax_history, scale);
  assert_host(amax_history, "amax_history");
  assert_host(scale, "scale");
  float* h = amax_history.data<float>();
  float* s = scale.data<float>();
  const float scaled_max = p.scaled_max();
  for (int64_t j = 0; j < n; ++j) {
    const float last = h[j];
    if (last == 0.0f) continue;  // not seen this step: nothing moves (TE's bulk update)
    float amax = last;
    if (p.use_max) {
      amax = 0.0f;
      for (int64_t i = 0; i < len; ++i) amax = std::fmax(amax, h[i * n + j]);
    }
    for (int64_t i = 1; i < len; ++i) h[(i - 1) * n + j] = h[i * n + j];  // roll: row i - 1 takes row i
    h[(len - 1) * n + j] = last;                                           // the oldest row takes the newest
    h[j] = 0.0f;                                                           // row 0 waits for the next step
    float sc = (std::isfinite(amax) && amax > 0.0f) ? scaled_max / amax : s[j];
    if (std::isinf(sc)) sc = FLT_MAX;
    s[j] = sc;
  }
}

// The reference is the definition: per member the single ops, then the transposed copy's padding.
void fp8_quantize_grouped(Context& ctx, const std::vector<Tensor>& x, std::vector<Tensor>& scale,
                          std::vector<Tensor>& q, std::vector<Tensor>& q_t, std::vector<Tensor>& amax,
                          std::vector<Tensor>& scale_inv, bool current_scaling, float fp8_max) {
  const size_t n = ops::check_fp8_quantize_grouped(x, scale, q, q_t, amax, scale_inv, current_scaling);
  for (size_t i = 0; i < n; ++i) {
    Tensor none, qi = q.empty() ? none : q[i], ai = amax.empty() ? none : amax[i];
    Tensor si = scale_inv.empty() ? none : scale_inv[i];
    const int64_t m = x[i].size(0), k = x[i].size(1);
    const Tensor padded = q_t.empty() ? none : q_t[i];
    Tensor qt = padded.defined() ? Tensor::empty({k, m}, padded.dtype(), padded.device()) : none;
    ops::fp8_quantize_member(ctx, x[i], scale[i], qi, qt, ai, si, current_scaling, fp8_max);
    if (!padded.defined()) continue;
    assert_host(padded, "q_t");
    const int64_t p = padded.size(1);
    uint8_t* dst = bytes(padded);
    const uint8_t* src = bytes(qt);
    for (int64_t c = 0; c < k; ++c) {
      std::memcpy(dst + c * p, src + c * m, size_t(m));
      std::memset(dst + c * p + m, 0, size_t(p - m));
    }
  }
}

void fp8_delayed_scale_update_grouped(Context& ctx, std::vector<Tensor>& amax_histories, std::vector<Tensor>& scales,
                                      const Fp8DelayedParams& p) {
  MG_CHECK(amax_histories.size() == scales.size(), "fp8_delayed_scale_update_grouped: {} histories for {} scales",
           amax_histories.size(), scales.size());
  for (size_t i = 0; i < scales.size(); ++i) fp8_delayed_scale_update(ctx, amax_histories[i], scales[i], p);
}

void fp8_block_quantize(Context& ctx, const Tensor& x, bool tile_2d, bool power_of_two_scales, Tensor& q,
                        Tensor& scale_inv) {
  const auto [m, k] = ops::check_fp8_block_quantize(x, tile_2d, q, scale_inv);
  assert_host(x, "x");
  assert_host(q, "q");
  assert_host(scale_inv, "scale_inv");
  FloatIn xin(x);
  uint8_t* qd = bytes(q);
  float* si = scale_inv.data<float>();
  const int64_t ld = scale_inv.size(1);
  const float fp8_max = fp8_max_of(q.dtype()), inf_scale = max_finite_of(x.dtype());
  const int64_t row_tile = tile_2d ? kFp8BlockLen : 1;
  for (int64_t r0 = 0; r0 < m; r0 += row_tile) {
    const int64_t r1 = std::min(m, r0 + row_tile);
    for (int64_t c0 = 0; c0 < k; c0 += kFp8BlockLen) {
      const int64_t c1 = std::min(k, c0 + kFp8BlockLen);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) amax = std::fmax(amax, std::fabs(xin[r * k + c]));
      const float s = scale_from_amax(amax, fp8_max, power_of_two_scales, inf_scale);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) qd[r * k + c] = encode(xin[r * k + c] * s, q.dtype());
      const int64_t j = c0 / kFp8BlockLen;
      if (tile_2d) {
        si[(r0 / kFp8BlockLen) * ld + j] = 1.0f / s;
      } else {
        si[j * ld + r0] = 1.0f / s;
      }
    }
  }
}

// The reference is the definition: the transpose, then its 1x128 quantisation.
void fp8_block_quantize_transposed(Context& ctx, const Tensor& x, bool power_of_two_scales, Tensor& q_t,
                                   Tensor& scale_inv) {
  const auto [m, k] = ops::check_fp8_block_quantize_transposed(x, q_t, scale_inv);
  Tensor xt = Tensor::empty({k, m}, x.dtype(), x.device());
  transpose_01(ctx, x, xt);
  fp8_block_quantize(ctx, xt, /*tile_2d=*/false, power_of_two_scales, q_t, scale_inv);
}

void fp8_block_partial_amax(Context& ctx, const Tensor& x, int64_t start, int64_t cols, Tensor& amax) {
  Tensor none;
  ops::check_fp8_block_partial("fp8_block_partial_amax", x, start, cols, amax, none);
  assert_host(x, "x");
  assert_host(amax, "amax");
  FloatIn xin(x);
  float* a = amax.data<float>();
  const int64_t ld = amax.size(1);
  for (int64_t j = 0; j < x.numel(); ++j) {
    const int64_t f = start + j, tile = (f / cols / kFp8BlockLen) * ld + (f % cols) / kFp8BlockLen;
    a[tile] = std::fmax(a[tile], std::fabs(xin[j]));
  }
}

void fp8_block_partial_quantize(Context& ctx, const Tensor& x, int64_t start, int64_t cols, const Tensor& scale,
                                Tensor& q) {
  ops::check_fp8_block_partial("fp8_block_partial_quantize", x, start, cols, scale, q);
  MG_CHECK(q.defined(), "fp8_block_partial_quantize: q must be given");
  assert_host(x, "x");
  assert_host(scale, "scale");
  assert_host(q, "q");
  FloatIn xin(x);
  const float* s = scale.data<float>();
  uint8_t* qd = bytes(q);
  const int64_t ld = scale.size(1);
  for (int64_t j = 0; j < x.numel(); ++j) {
    const int64_t f = start + j, tile = (f / cols / kFp8BlockLen) * ld + (f % cols) / kFp8BlockLen;
    qd[j] = encode(xin[j] * s[tile], q.dtype());
  }
}

void fp8_gemm_grouped(Context& ctx, const std::vector<Fp8Operand>& a, const std::vector<Fp8Operand>& b,
                      const std::vector<Tensor>& bias, std::vector<Tensor>& out, bool accumulate,
                      bool fast_accumulation, bool /*rows_in_k: plans are a GPU matter*/) {
  ops::check_fp8_gemm_grouped(a, b, bias, out);
  for (size_t i = 0; i < a.size(); ++i)
    fp8_gemm(ctx, a[i], b[i], bias.empty() ? Tensor() : bias[i], out[i], accumulate, fast_accumulation);
}

void fp8_gemm(Context& ctx, const Fp8Operand& a, const Fp8Operand& b, const Tensor& bias, Tensor& out,
              bool accumulate, bool /*fast_accumulation: a GPU rounding mode*/) {
  ops::check_fp8_gemm(a, b, bias, out, accumulate, /*cuda=*/false);
  assert_host(bias, "bias");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&a.data, &a.scale_inv, &b.data, &b.scale_inv, &out}) assert_host(*t, "fp8_gemm's tensors");
  const int64_t m = a.data.size(0), k = a.data.size(1), n = b.data.size(0);
  const std::vector<float> da = dequantized(a), db = dequantized(b);
  FloatOut o(out, accumulate);
  if (m > 0 && n > 0) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(m), int(n), int(k), 1.0f, da.data(), int(k), db.data(),
                int(k), accumulate ? 1.0f : 0.0f, o.data(), int(n));
  }
  if (bias.defined()) {
    FloatIn bv(bias);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < n; ++c) o[r * n + c] += bv[c];
  }
}

}  // namespace megatron::cpu

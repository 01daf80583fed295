#include "megatron/runtime/dtype.h"

#include <cmath>

#include "megatron/runtime/check.h"

namespace megatron {

size_t size_of(DType t) {
  switch (t) {
#define MG_DTYPE_SIZE(name, Enum, bytes, st) \
  case DType::Enum:                          \
    return bytes;
    MG_FORALL_DTYPES(MG_DTYPE_SIZE)
#undef MG_DTYPE_SIZE
  }
  MG_ASSERT(false, "bad dtype {}", int(t));
}

std::string_view to_string(DType t) {
  switch (t) {
#define MG_DTYPE_NAME(name, Enum, bytes, st) \
  case DType::Enum:                          \
    return #name;
    MG_FORALL_DTYPES(MG_DTYPE_NAME)
#undef MG_DTYPE_NAME
  }
  MG_ASSERT(false, "bad dtype {}", int(t));
}

std::string_view safetensors_name(DType t) {
  switch (t) {
#define MG_DTYPE_ST(name, Enum, bytes, st) \
  case DType::Enum:                        \
    return st;
    MG_FORALL_DTYPES(MG_DTYPE_ST)
#undef MG_DTYPE_ST
  }
  MG_ASSERT(false, "bad dtype {}", int(t));
}

DType dtype_from_string(std::string_view s) {
#define MG_DTYPE_PARSE(name, Enum, bytes, st) \
  if (s == #name || s == st) return DType::Enum;
  MG_FORALL_DTYPES(MG_DTYPE_PARSE)
#undef MG_DTYPE_PARSE
  MG_CHECK(false, "unknown dtype '{}': expected one of fp32 bf16 fp16 fp8_e4m3 fp8_e5m2 int32 int64 uint16 uint8 "
           "(or the safetensors names F32 BF16 F16 F8_E4M3 F8_E5M2 I32 I64 U16 U8)", s);
  return DType::Float32;
}

bool is_floating(DType t) {
  switch (t) {
    case DType::Float32:
    case DType::BFloat16:
    case DType::Float16:
    case DType::Float8E4M3:
    case DType::Float8E5M2:
      return true;
    default:
      return false;
  }
}

// ---- fp16 (IEEE binary16) ------------------------------------------------------------------------
float to_float(fp16 x) {
  uint32_t sign = uint32_t(x.bits & 0x8000u) << 16;
  uint32_t exp = (x.bits >> 10) & 0x1fu;
  uint32_t mant = x.bits & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return bits_to_float(sign);
    float f = std::ldexp(float(mant), -24);  // subnormal
    return sign ? -f : f;
  }
  if (exp == 31) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  return bits_to_float(sign | ((exp + 112) << 23) | (mant << 13));
}

fp16 to_fp16(float f) {
  uint32_t u = float_to_bits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return fp16{uint16_t(sign | 0x7e00u)};  // NaN
  if (a >= 0x477ff000u) return fp16{uint16_t(sign | 0x7c00u)};  // overflow (>= 65520) -> inf
  if (a < 0x38800000u) {                                        // subnormal or zero in fp16
    float v = bits_to_float(a);
    // round to nearest even on the subnormal grid of 2^-24
    float scaled = v * 16777216.0f;
    float r = std::nearbyint(scaled);
    return fp16{uint16_t(sign | uint16_t(r))};
  }
  uint32_t mant_round = a + 0xfffu + ((a >> 13) & 1u);
  uint32_t e = (mant_round >> 23) - 112;
  return fp16{uint16_t(sign | (e << 10) | ((mant_round >> 13) & 0x3ffu))};
}

// ---- fp8 (OCP 8-bit floating point) ------------------------------------------------------------
namespace {
// Decodes an fp8 with `mbits` mantissa bits and exponent bias `bias`.
float fp8_decode(uint8_t b, int mbits, int bias, bool e4m3) {
  int sign = b >> 7;
  int exp = (b >> mbits) & ((1 << (7 - mbits)) - 1);
  int mant = b & ((1 << mbits) - 1);
  int max_exp = (1 << (7 - mbits)) - 1;
  float v;
  if (e4m3 && exp == max_exp && mant == (1 << mbits) - 1) {
    v = NAN;
  } else if (!e4m3 && exp == max_exp) {
    v = mant == 0 ? INFINITY : NAN;
  } else if (exp == 0) {
    v = std::ldexp(float(mant), 1 - bias - mbits);
  } else {
    v = std::ldexp(float((1 << mbits) + mant), exp - bias - mbits);
  }
  return sign ? -v : v;
}

// Note [FP8 rounding and saturation]: the encoders are the GPU's __nv_cvt_float_to_fp8(x,
// __NV_SATFINITE, ...) (cuda_fp8.hpp, the cvt.rn.satfinite PTX instruction) bit for bit: round to
// nearest, ties to an even mantissa, on the format's grid including its subnormals; anything past
// the largest finite value plus half an ulp — infinities included — saturates to ±max (448 for
// e4m3, 57344 for e5m2); a magnitude at most half the smallest subnormal becomes +0 or -0 by its
// sign; NaN stays NaN with its sign (e4m3 has one NaN, S.1111.111; for e5m2 the code is S.11111.1x
// with x the float's second mantissa bit, as the CUDA header's host path gives).
uint8_t fp8_encode(float f, int mbits, int bias, bool e4m3) {
  const uint32_t u = float_to_bits(f);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint8_t(sign | (e4m3 ? 0x7fu : (0x7eu | ((u >> 21) & 1u))));
  const uint8_t max_code = e4m3 ? 0x7e : 0x7b;
  const float max_finite = e4m3 ? 448.0f : 57344.0f;
  // the rounding threshold to overflow: max + half an ulp (an ulp at max is 2^(emax - mbits))
  const float half_ulp = e4m3 ? 16.0f : 4096.0f;
  const float v = bits_to_float(a);
  if (v >= max_finite + half_ulp) return uint8_t(sign | max_code);
  // the value on the grid of its binade (or the subnormal grid), in units of its ulp; an integer
  // and a half in fp32 exactly, so nearbyint (ties to even under the default rounding mode) is RNE.
  const int min_exp = 1 - bias;  // exponent of the smallest normal
  int e = int((a >> 23) & 0xff) - 127;
  if (e < min_exp) e = min_exp;  // subnormal range: a fixed ulp of 2^(min_exp - mbits)
  const float units = std::ldexp(v, mbits - e);  // exact: a power-of-two scaling of an fp32
  const float r = std::nearbyint(units);
  // r in [0, 2^(mbits+1)]: carrying into the next binade is the code arithmetic's own carry
  int64_t code;
  if (e == min_exp && r < float(1 << mbits)) {
    code = int64_t(r);  // subnormal (or zero)
  } else {
    code = (int64_t(e + bias) << mbits) + (int64_t(r) - (1 << mbits));
  }
  if (code > max_code) code = max_code;  // rounds up to max exactly below the threshold
  return uint8_t(sign | uint8_t(code));
}
}  // namespace

float to_float(fp8_e4m3 x) { return fp8_decode(x.bits, 3, 7, true); }
fp8_e4m3 to_fp8_e4m3(float f) { return fp8_e4m3{fp8_encode(f, 3, 7, true)}; }
float to_float(fp8_e5m2 x) { return fp8_decode(x.bits, 2, 15, false); }
fp8_e5m2 to_fp8_e5m2(float f) { return fp8_e5m2{fp8_encode(f, 2, 15, false)}; }

// ---- bulk conversion -----------------------------------------------------------------------------
namespace {
double load_element(const void* p, DType t, size_t i) {
  switch (t) {
    case DType::Float32: return static_cast<const float*>(p)[i];
    case DType::BFloat16: return to_float(static_cast<const bf16*>(p)[i]);
    case DType::Float16: return to_float(static_cast<const fp16*>(p)[i]);
    case DType::Float8E4M3: return to_float(static_cast<const fp8_e4m3*>(p)[i]);
    case DType::Float8E5M2: return to_float(static_cast<const fp8_e5m2*>(p)[i]);
    case DType::Int32: return static_cast<const int32_t*>(p)[i];
    case DType::Int64: return double(static_cast<const int64_t*>(p)[i]);
    case DType::UInt16: return static_cast<const uint16_t*>(p)[i];
    case DType::UInt8: return static_cast<const uint8_t*>(p)[i];
  }
  MG_ASSERT(false);
}

void store_element(void* p, DType t, size_t i, double v) {
  switch (t) {
    case DType::Float32: static_cast<float*>(p)[i] = float(v); return;
    case DType::BFloat16: static_cast<bf16*>(p)[i] = to_bf16(float(v)); return;
    case DType::Float16: static_cast<fp16*>(p)[i] = to_fp16(float(v)); return;
    case DType::Float8E4M3: static_cast<fp8_e4m3*>(p)[i] = to_fp8_e4m3(float(v)); return;
    case DType::Float8E5M2: static_cast<fp8_e5m2*>(p)[i] = to_fp8_e5m2(float(v)); return;
    case DType::Int32: static_cast<int32_t*>(p)[i] = int32_t(v); return;
    case DType::Int64: static_cast<int64_t*>(p)[i] = int64_t(v); return;
    case DType::UInt16: static_cast<uint16_t*>(p)[i] = uint16_t(v); return;
    case DType::UInt8: static_cast<uint8_t*>(p)[i] = uint8_t(v); return;
  }
  MG_ASSERT(false);
}
}  // namespace

void convert_elements(const void* src, DType src_type, void* dst, DType dst_type, size_t n) {
  if (src_type == dst_type) {
    std::memcpy(dst, src, n * size_of(src_type));
    return;
  }
  // Fast paths for the conversions on the training path.
  if (src_type == DType::BFloat16 && dst_type == DType::Float32) {
    auto* s = static_cast<const bf16*>(src);
    auto* d = static_cast<float*>(dst);
#pragma omp parallel for schedule(static) if (n >= (1 << 20))
    for (size_t i = 0; i < n; ++i) d[i] = to_float(s[i]);
    return;
  }
  if (src_type == DType::Float32 && dst_type == DType::BFloat16) {
    auto* s = static_cast<const float*>(src);
    auto* d = static_cast<bf16*>(dst);
#pragma omp parallel for schedule(static) if (n >= (1 << 20))
    for (size_t i = 0; i < n; ++i) d[i] = to_bf16(s[i]);
    return;
  }
  if (src_type == DType::Int64 && dst_type == DType::Int32) {
    auto* s = static_cast<const int64_t*>(src);
    auto* d = static_cast<int32_t*>(dst);
    for (size_t i = 0; i < n; ++i) d[i] = int32_t(s[i]);
    return;
  }
  for (size_t i = 0; i < n; ++i) store_element(dst, dst_type, i, load_element(src, src_type, i));
}

}  // namespace megatron

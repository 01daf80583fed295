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

// Encodes by searching the nearest representable value (ties to even mantissa); saturating.
uint8_t fp8_encode(float f, int mbits, int bias, bool e4m3, float max_finite) {
  if (std::isnan(f)) return e4m3 ? 0x7f : 0x7e;
  uint8_t sign = std::signbit(f) ? 0x80 : 0;
  float a = std::fabs(f);
  if (a >= max_finite) {
    if (!e4m3 && std::isinf(f)) return sign | 0x7c;
    a = max_finite;
  }
  uint8_t best = 0;
  float best_err = INFINITY;
  for (int code = 0; code < 128; ++code) {
    float v = fp8_decode(uint8_t(code), mbits, bias, e4m3);
    if (std::isnan(v) || std::isinf(v)) continue;
    float err = std::fabs(v - a);
    if (err < best_err || (err == best_err && (code & 1) == 0)) {
      best_err = err;
      best = uint8_t(code);
    }
  }
  return sign | best;
}
}  // namespace

float to_float(fp8_e4m3 x) { return fp8_decode(x.bits, 3, 7, true); }
fp8_e4m3 to_fp8_e4m3(float f) { return fp8_e4m3{fp8_encode(f, 3, 7, true, 448.0f)}; }
float to_float(fp8_e5m2 x) { return fp8_decode(x.bits, 2, 15, false); }
fp8_e5m2 to_fp8_e5m2(float f) { return fp8_e5m2{fp8_encode(f, 2, 15, false, 57344.0f)}; }

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

// Element types. One list (MG_FORALL_DTYPES) generates the enum, size_of and to_string — the one
// place a macro list is worth it. bf16, fp16 and the two fp8 formats are storage types: the CPU
// backend converts them to fp32 on load and back (round to nearest even) on store.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace megatron {

// name, enum value, bytes, safetensors name
#define MG_FORALL_DTYPES(_)           \
  _(fp32, Float32, 4, "F32")          \
  _(bf16, BFloat16, 2, "BF16")        \
  _(fp16, Float16, 2, "F16")          \
  _(fp8_e4m3, Float8E4M3, 1, "F8_E4M3") \
  _(fp8_e5m2, Float8E5M2, 1, "F8_E5M2") \
  _(int32, Int32, 4, "I32")           \
  _(int64, Int64, 8, "I64")           \
  _(uint16, UInt16, 2, "U16")         \
  _(uint8, UInt8, 1, "U8")

enum class DType : uint8_t {
#define MG_DTYPE_ENUM(name, Enum, bytes, st) Enum,
  MG_FORALL_DTYPES(MG_DTYPE_ENUM)
#undef MG_DTYPE_ENUM
};

size_t size_of(DType t);
std::string_view to_string(DType t);         // "fp32", "bf16", ...
std::string_view safetensors_name(DType t);  // "F32", "BF16", ...
/// Parses either spelling ("bf16" or "BF16"); throws megatron::Error naming the valid ones.
DType dtype_from_string(std::string_view s);
bool is_floating(DType t);

// ---- storage types and conversions -------------------------------------------------------------
struct bf16 {
  uint16_t bits = 0;
};
struct fp16 {
  uint16_t bits = 0;
};
struct fp8_e4m3 {
  uint8_t bits = 0;
};
struct fp8_e5m2 {
  uint8_t bits = 0;
};

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float to_float(bf16 x) { return bits_to_float(uint32_t(x.bits) << 16); }
inline bf16 to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                               // round to nearest even
  return bf16{uint16_t(u >> 16)};
}
float to_float(fp16 x);
fp16 to_fp16(float f);
float to_float(fp8_e4m3 x);
fp8_e4m3 to_fp8_e4m3(float f);  // saturates to ±448 (OCP "satfinite")
float to_float(fp8_e5m2 x);
fp8_e5m2 to_fp8_e5m2(float f);

/// C++ type -> DType, for Tensor::data<T>().
template <typename T>
constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::Float32; }
template <> constexpr DType dtype_of<bf16>() { return DType::BFloat16; }
template <> constexpr DType dtype_of<fp16>() { return DType::Float16; }
template <> constexpr DType dtype_of<fp8_e4m3>() { return DType::Float8E4M3; }
template <> constexpr DType dtype_of<fp8_e5m2>() { return DType::Float8E5M2; }
template <> constexpr DType dtype_of<int32_t>() { return DType::Int32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::Int64; }
template <> constexpr DType dtype_of<uint16_t>() { return DType::UInt16; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::UInt8; }

/// Converts n elements between any two dtypes through fp32 (integers through int64 where exact).
void convert_elements(const void* src, DType src_type, void* dst, DType dst_type, size_t n);

}  // namespace megatron

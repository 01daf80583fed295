// Helpers shared by the CPU reference kernels (cpu_common.h).
#include "megatron/kernels/cpu/cpu_common.h"

#include "megatron/runtime/philox.h"

namespace megatron::cpu {

FloatIn::FloatIn(const Tensor& t) {
  assert_float(t, "input");
  if (t.dtype() == DType::Float32) {
    ptr_ = t.data<float>();
    return;
  }
  buf_.resize(size_t(t.numel()));
  convert_elements(t.raw_data(), t.dtype(), buf_.data(), DType::Float32, buf_.size());
  ptr_ = buf_.data();
}

FloatOut::FloatOut(Tensor& t, bool load) : tensor_(t) {
  assert_float(t, "output");
  if (t.dtype() == DType::Float32) {
    ptr_ = t.data<float>();
    return;
  }
  buf_.resize(size_t(t.numel()));
  if (load) convert_elements(t.raw_data(), t.dtype(), buf_.data(), DType::Float32, buf_.size());
  ptr_ = buf_.data();
}

FloatOut::~FloatOut() {
  if (!buf_.empty()) convert_elements(buf_.data(), DType::Float32, tensor_.raw_data(), tensor_.dtype(), buf_.size());
}

void assert_float(const Tensor& t, const char* name) {
  MG_ASSERT(t.defined(), "{} is undefined", name);
  MG_ASSERT(t.device().is_host(), "{} is {}, the CPU kernels need a host tensor", name, t.str());
  MG_ASSERT(is_floating(t.dtype()), "{} is {}, expected a floating dtype", name, t.str());
}

void assert_fp32(const Tensor& t, const char* name) {
  assert_float(t, name);
  MG_ASSERT(t.dtype() == DType::Float32, "{} is {}, expected fp32", name, t.str());
}

void assert_numel(const Tensor& t, int64_t n, const char* name) {
  MG_ASSERT(t.defined() && t.numel() == n, "{} is {}, expected {} elements", name, t.defined() ? t.str() : "undefined",
            n);
}

int64_t rows_of(const Tensor& t, int64_t h, const char* name) {
  MG_ASSERT(t.defined() && t.dim() >= 1 && t.size(-1) == h, "{} is {}, expected last dimension {}", name,
            t.defined() ? t.str() : "undefined", h);
  return h == 0 ? 0 : t.numel() / h;
}

std::vector<int64_t> load_indices(const Tensor& t, const char* name) {
  MG_ASSERT(t.defined() && (t.dtype() == DType::Int32 || t.dtype() == DType::Int64), "{} is {}, expected int32/int64",
            name, t.defined() ? t.str() : "undefined");
  return t.to_ints();
}

void philox_uniforms(uint64_t seed, uint64_t offset, uint64_t start, int64_t n, float* out) {
  const uint32_t key[2] = {uint32_t(seed), uint32_t(seed >> 32)};
  uint64_t i = start;
  const uint64_t end = start + uint64_t(n);
  while (i < end) {
    const uint64_t block = i >> 2;
    const uint32_t ctr[4] = {uint32_t(block), uint32_t(block >> 32), uint32_t(offset), uint32_t(offset >> 32)};
    uint32_t r[4];
    philox4x32_10(ctr, key, r);
    for (uint64_t lane = i & 3; lane < 4 && i < end; ++lane, ++i) *out++ = float(r[lane] >> 8) * (1.0f / 16777216.0f);
  }
}

}  // namespace megatron::cpu

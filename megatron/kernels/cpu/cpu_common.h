// Helpers shared by the CPU reference kernels: fp32 views of any float tensor, index loading, the
// row count of a [..., h] tensor, and Philox uniforms generated a block at a time.
//
// Note [CPU storage conversion]: the reference computes in fp32. FloatIn hands a kernel a const
// float* for a tensor — the tensor's own memory when it is fp32 (no copy), else a converted
// buffer. FloatOut hands it a float* to write — again the tensor's memory when fp32, else a buffer
// converted back (round to nearest even) when the FloatOut goes out of scope. Because an input is
// converted before any output is written, an output may alias an input as long as the kernel reads
// each element before writing it (the in-place forms of dropout, add and cross_entropy_backward).
#pragma once

#include <cstdint>
#include <vector>

#include "megatron/runtime/tensor.h"

namespace megatron::cpu {

/// A read-only fp32 view of a float tensor (Note [CPU storage conversion]).
class FloatIn {
 public:
  explicit FloatIn(const Tensor& t);
  FloatIn(const FloatIn&) = delete;
  FloatIn& operator=(const FloatIn&) = delete;
  const float* data() const { return ptr_; }
  const float& operator[](int64_t i) const { return ptr_[i]; }

 private:
  std::vector<float> buf_;
  const float* ptr_ = nullptr;
};

/// A writable fp32 view of a float tensor, stored back on destruction (Note [CPU storage conversion]).
/// load = true starts from the tensor's current values (for read-modify-write kernels).
class FloatOut {
 public:
  explicit FloatOut(Tensor& t, bool load = false);
  ~FloatOut();
  FloatOut(const FloatOut&) = delete;
  FloatOut& operator=(const FloatOut&) = delete;
  float* data() { return ptr_; }
  float& operator[](int64_t i) { return ptr_[i]; }

 private:
  Tensor tensor_;
  std::vector<float> buf_;
  float* ptr_ = nullptr;
};

/// Asserts that t is a defined host tensor of a floating dtype.
void assert_float(const Tensor& t, const char* name);
/// Asserts that t is a defined host fp32 tensor (parameter gradients, saved statistics).
void assert_fp32(const Tensor& t, const char* name);
/// Asserts that t has n elements.
void assert_numel(const Tensor& t, int64_t n, const char* name);
/// The number of rows of t viewed as [N, h] (h must be its last dimension).
int64_t rows_of(const Tensor& t, int64_t h, const char* name);
/// The values of an int32/int64 index tensor (token ids, labels) as int64.
std::vector<int64_t> load_indices(const Tensor& t, const char* name);

/// Fills out[0..n) with philox_uniform(seed, offset, start + k), computing each Philox block once.
void philox_uniforms(uint64_t seed, uint64_t offset, uint64_t start, int64_t n, float* out);

}  // namespace megatron::cpu

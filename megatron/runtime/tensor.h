// Tensor: contiguous, row-major, a dtype, a device, shared storage and a byte offset.
// Views (reshape) and contiguous slices along the leading dimension share storage; there is no
// striding and no broadcasting engine — ops are specific kernels (DESIGN.md, "Tensors are simple").
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "megatron/runtime/allocator.h"
#include "megatron/runtime/check.h"
#include "megatron/runtime/dtype.h"

namespace megatron {

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);
int64_t shape_numel(const Shape& s);

class Tensor {
 public:
  Tensor() = default;

  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::cpu());
  /// Zero-filled (host: large tensors come from zero pages, paid for on first write).
  static Tensor zeros(const Shape& shape, DType dtype, Device device = Device::cpu());
  /// A host fp32 tensor from values (converted to `dtype`), then moved to `device`.
  static Tensor from_floats(const std::vector<float>& values, const Shape& shape, DType dtype = DType::Float32,
                            Device device = Device::cpu());
  static Tensor from_ints(const std::vector<int64_t>& values, const Shape& shape, DType dtype = DType::Int64,
                          Device device = Device::cpu());

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int dim() const { return int(shape_.size()); }
  /// Size of dimension d; negative d counts from the end.
  int64_t size(int d) const;
  int64_t numel() const { return shape_numel(shape_); }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device() : Device::cpu(); }
  size_t nbytes() const { return size_t(numel()) * size_of(dtype_); }
  const std::shared_ptr<Storage>& storage() const { return storage_; }

  void* raw_data() const {
    MG_ASSERT(defined(), "data of an undefined tensor");
    return static_cast<char*>(storage_->data()) + offset_;
  }
  /// Typed pointer; the dtype must match T (checked).
  template <typename T>
  T* data() const {
    MG_ASSERT(dtype_ == dtype_of<T>(), "tensor is {}, accessed as {}", to_string(dtype_),
              to_string(dtype_of<T>()));
    return static_cast<T*>(raw_data());
  }

  /// Same storage, another shape with the same numel; one dimension may be -1.
  Tensor view(const Shape& shape) const;
  /// Rows [start, end) of the leading dimension, sharing storage.
  Tensor slice(int64_t start, int64_t end) const;
  /// Flat elements [start, start+count) as a 1-D tensor sharing storage.
  Tensor flat_slice(int64_t start, int64_t count) const;

  /// A converted copy (a new tensor even when the dtype is the same).
  Tensor to(DType dtype) const;
  Tensor to(Device device) const;
  Tensor clone() const { return to(dtype_); }
  /// Copies `src` into this tensor: same numel, any dtype (converted), any device.
  void copy_from(const Tensor& src);
  void zero_();
  void fill_(float value);

  /// The values as host floats (converting dtype and copying from the device).
  std::vector<float> to_floats() const;
  std::vector<int64_t> to_ints() const;
  /// Element i as float (host tensors only) — for tests and small lookups.
  float item(int64_t i = 0) const;

  std::string str() const;  // "bf16[2, 3] on cpu"

 private:
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;  // bytes
  Shape shape_;
  DType dtype_ = DType::Float32;
};

}  // namespace megatron

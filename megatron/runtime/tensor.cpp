#include "megatron/runtime/tensor.h"

#include <cstring>

namespace megatron {

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  for (int64_t d : shape) MG_ASSERT(d >= 0, "negative dimension in {}", shape_str(shape));
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.storage_ = allocate(t.nbytes(), device);
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  if (device.type != DeviceType::CPU) {
    Tensor t = empty(shape, dtype, device);
    t.zero_();
    return t;
  }
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.storage_ = allocate_zeroed_host(t.nbytes());
  return t;
}

Tensor Tensor::from_floats(const std::vector<float>& values, const Shape& shape, DType dtype, Device device) {
  MG_ASSERT(int64_t(values.size()) == shape_numel(shape), "{} values for shape {}", values.size(), shape_str(shape));
  Tensor host = empty(shape, dtype);
  convert_elements(values.data(), DType::Float32, host.raw_data(), dtype, values.size());
  return device.is_host() ? host : host.to(device);
}

Tensor Tensor::from_ints(const std::vector<int64_t>& values, const Shape& shape, DType dtype, Device device) {
  MG_ASSERT(int64_t(values.size()) == shape_numel(shape), "{} values for shape {}", values.size(), shape_str(shape));
  Tensor host = empty(shape, dtype);
  convert_elements(values.data(), DType::Int64, host.raw_data(), dtype, values.size());
  return device.is_host() ? host : host.to(device);
}

int64_t Tensor::size(int d) const {
  int n = dim();
  if (d < 0) d += n;
  MG_ASSERT(d >= 0 && d < n, "dimension {} of a {}-d tensor", d, n);
  return shape_[size_t(d)];
}

Tensor Tensor::view(const Shape& shape) const {
  Shape s = shape;
  int infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      MG_ASSERT(infer < 0, "view {} has two -1 dimensions", shape_str(shape));
      infer = int(i);
    } else {
      known *= s[i];
    }
  }
  if (infer >= 0) {
    MG_ASSERT(known > 0 && numel() % known == 0, "cannot view {} as {}", shape_str(shape_), shape_str(shape));
    s[size_t(infer)] = numel() / known;
  }
  MG_ASSERT(shape_numel(s) == numel(), "cannot view {} as {}", shape_str(shape_), shape_str(shape));
  Tensor t = *this;
  t.shape_ = s;
  return t;
}

Tensor Tensor::slice(int64_t start, int64_t end) const {
  MG_ASSERT(dim() >= 1 && 0 <= start && start <= end && end <= shape_[0], "slice [{}, {}) of {}", start, end,
            shape_str(shape_));
  int64_t row = numel() / std::max<int64_t>(shape_[0], 1);
  Tensor t = *this;
  t.shape_[0] = end - start;
  t.offset_ = offset_ + size_t(start * row) * size_of(dtype_);
  return t;
}

Tensor Tensor::flat_slice(int64_t start, int64_t count) const {
  MG_ASSERT(start >= 0 && count >= 0 && start + count <= numel(), "flat slice [{}, +{}) of {}", start, count,
            shape_str(shape_));
  Tensor t = *this;
  t.shape_ = {count};
  t.offset_ = offset_ + size_t(start) * size_of(dtype_);
  return t;
}

Tensor Tensor::to(DType dtype) const {
  Tensor out = empty(shape_, dtype, device());
  out.copy_from(*this);
  return out;
}

Tensor Tensor::to(Device device) const {
  Tensor out = empty(shape_, dtype_, device);
  out.copy_from(*this);
  return out;
}

void Tensor::copy_from(const Tensor& src) {
  MG_ASSERT(src.numel() == numel(), "copy of {} into {}", src.str(), str());
  if (src.dtype() == dtype_) {
    copy_bytes(raw_data(), device(), src.raw_data(), src.device(), nbytes());
    return;
  }
  // Conversions between float types on one GPU run there; others on the host (a device tensor goes
  // through a host copy).
  if (device().is_cuda() && src.device() == device() && detail::cuda_hooks().convert &&
      detail::cuda_hooks().convert(src.raw_data(), src.dtype(), raw_data(), dtype_, size_t(numel()))) {
    return;
  }
  Tensor s = src.device().is_host() ? src : src.to(Device::cpu());
  if (device().is_host()) {
    convert_elements(s.raw_data(), s.dtype(), raw_data(), dtype_, size_t(numel()));
  } else {
    Tensor h = empty(shape_, dtype_);
    convert_elements(s.raw_data(), s.dtype(), h.raw_data(), dtype_, size_t(numel()));
    copy_bytes(raw_data(), device(), h.raw_data(), h.device(), nbytes());
  }
}

void Tensor::zero_() { fill_bytes(raw_data(), device(), 0, nbytes()); }

void Tensor::fill_(float value) {
  std::vector<float> v(size_t(numel()), value);
  copy_from(from_floats(v, shape_));
}

std::vector<float> Tensor::to_floats() const {
  Tensor h = device().is_host() ? *this : to(Device::cpu());
  std::vector<float> out(static_cast<size_t>(numel()));
  convert_elements(h.raw_data(), dtype_, out.data(), DType::Float32, out.size());
  return out;
}

std::vector<int64_t> Tensor::to_ints() const {
  Tensor h = device().is_host() ? *this : to(Device::cpu());
  std::vector<int64_t> out(static_cast<size_t>(numel()));
  convert_elements(h.raw_data(), dtype_, out.data(), DType::Int64, out.size());
  return out;
}

float Tensor::item(int64_t i) const {
  MG_ASSERT(device().is_host() && i >= 0 && i < numel(), "item({}) of {}", i, str());
  float v;
  convert_elements(static_cast<const char*>(raw_data()) + size_t(i) * size_of(dtype_), dtype_, &v, DType::Float32, 1);
  return v;
}

std::string Tensor::str() const {
  return fmt::format("{}{} on {}", to_string(dtype_), shape_str(shape_), device().str());
}

}  // namespace megatron

// Where memory lives and kernels run: {type, index}, as c10::Device.
#pragma once

#include <string>

#include <cstdint>

namespace megatron {

enum class DeviceType : uint8_t { CPU, CUDA, CUDAHost /* pinned host memory, readable by the CPU */ };

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  static Device cpu() { return {DeviceType::CPU, 0}; }
  static Device cuda(int i = 0) { return {DeviceType::CUDA, i}; }
  static Device pinned() { return {DeviceType::CUDAHost, 0}; }
  bool is_cuda() const { return type == DeviceType::CUDA; }
  /// Memory the CPU can read directly (plain or pinned host memory).
  bool is_host() const { return type != DeviceType::CUDA; }
  bool operator==(const Device&) const = default;
  std::string str() const {
    switch (type) {
      case DeviceType::CPU: return "cpu";
      case DeviceType::CUDA: return "cuda:" + std::to_string(index);
      case DeviceType::CUDAHost: return "pinned";
    }
    return "?";
  }
};

}  // namespace megatron

// Layout ops on CUDA against the CPU reference, byte for byte: transpose_01 over several dtypes and
// row sizes (including single elements and odd byte counts), and the grouped QKV split and merge
// for MHA, GQA and MQA with odd head sizes and unaligned views.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "megatron/kernels/cpu/cpu_ops.h"
#include "megatron/kernels/cuda/cuda_ops.h"
#include "megatron/runtime/allocator.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

using testing::random_tensor;

// Random values of any dtype (integers come out as small whole numbers).
Tensor random_any(const Shape& shape, uint64_t seed, DType dt) {
  if (is_floating(dt)) return random_tensor(shape, seed, 1.0f, dt);
  std::vector<int64_t> v(size_t(shape_numel(shape)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = int64_t(i * 37 + seed) % 101;
  return Tensor::from_ints(v, shape, dt);
}

// An output on the device filled with a value the op never produces, optionally one element into
// its allocation (so the copy must fall back to narrower units).
Tensor poisoned_output(const Shape& shape, DType dt, bool unaligned) {
  const int64_t n = shape_numel(shape);
  Tensor t = unaligned ? Tensor::empty({n + 1}, dt, Device::cuda(0)).flat_slice(1, n).view(shape)
                       : Tensor::empty(shape, dt, Device::cuda(0));
  t.fill_(is_floating(dt) ? std::numeric_limits<float>::quiet_NaN() : 201.0f);  // 201: outside random_any's range
  return t;
}

Tensor device_input(const Tensor& host, bool unaligned) {
  Tensor t = poisoned_output(host.shape(), host.dtype(), unaligned);
  t.copy_from(host);
  return t;
}

void expect_same_bytes(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  Tensor host = got.to(Device::cpu());
  EXPECT_EQ(std::memcmp(host.raw_data(), want.raw_data(), want.nbytes()), 0) << what << " differs";
}

class CudaLayout : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(CudaLayout, Transpose01MatchesCpu) {
  Context cpu_ctx;
  Context ctx(Device::cuda(0));
  const std::vector<Shape> shapes = {{1, 1},    {3, 5},       {37, 64},     {2, 3, 1},
                                     {5, 7, 3}, {4, 6, 2, 5}, {64, 8, 256}, {3, 300, 33}};
  uint64_t seed = 1;
  for (DType dt : {DType::Float32, DType::BFloat16, DType::Float16, DType::Int64, DType::Int32, DType::UInt8}) {
    for (const Shape& shape : shapes) {
      for (bool unaligned : {false, true}) {
        SCOPED_TRACE(std::string(to_string(dt)) + " " + shape_str(shape) + (unaligned ? " unaligned" : ""));
        Tensor x = random_any(shape, seed++, dt);
        Shape out_shape = shape;
        std::swap(out_shape[0], out_shape[1]);
        Tensor want = Tensor::empty(out_shape, dt);
        cpu::transpose_01(cpu_ctx, x, want);
        Tensor out = poisoned_output(out_shape, dt, unaligned);
        cuda::transpose_01(ctx, device_input(x, unaligned), out);
        ctx.synchronize();
        expect_same_bytes(out, want, "out");
      }
    }
  }
}

struct QkvCase {
  int64_t s, b, nq, ng, d;
  DType dtype;
  bool unaligned;
};

TEST_F(CudaLayout, QkvSplitAndMergeMatchCpu) {
  Context cpu_ctx;
  Context ctx(Device::cuda(0));
  const std::vector<QkvCase> cases = {
      {3, 2, 8, 2, 5, DType::Float32, false},    // GQA, odd head size
      {3, 2, 8, 2, 5, DType::BFloat16, true},    // unaligned, 10-byte heads
      {4, 1, 4, 4, 64, DType::BFloat16, false},  // MHA
      {2, 3, 6, 1, 32, DType::Float16, true},    // MQA, unaligned
      {16, 2, 12, 4, 128, DType::BFloat16, false}, {1, 1, 1, 1, 1, DType::Float32, false},
  };
  uint64_t seed = 50;
  for (const QkvCase& c : cases) {
    SCOPED_TRACE("s=" + std::to_string(c.s) + " b=" + std::to_string(c.b) + " nq=" + std::to_string(c.nq) +
                 " ng=" + std::to_string(c.ng) + " d=" + std::to_string(c.d) + " " + std::string(to_string(c.dtype)) +
                 (c.unaligned ? " unaligned" : ""));
    const Shape qkv_shape = {c.s, c.b, c.ng * (c.nq / c.ng + 2) * c.d};
    const Shape q_shape = {c.s, c.b, c.nq, c.d}, kv_shape = {c.s, c.b, c.ng, c.d};
    Tensor qkv = random_tensor(qkv_shape, seed++, 1.0f, c.dtype);
    Tensor q_ref = Tensor::empty(q_shape, c.dtype), k_ref = Tensor::empty(kv_shape, c.dtype);
    Tensor v_ref = Tensor::empty(kv_shape, c.dtype);
    cpu::qkv_split_forward(cpu_ctx, qkv, q_ref, k_ref, v_ref);
    Tensor q = poisoned_output(q_shape, c.dtype, c.unaligned), k = poisoned_output(kv_shape, c.dtype, false);
    Tensor v = poisoned_output(kv_shape, c.dtype, c.unaligned);
    cuda::qkv_split_forward(ctx, device_input(qkv, c.unaligned), q, k, v);
    ctx.synchronize();
    expect_same_bytes(q, q_ref, "q");
    expect_same_bytes(k, k_ref, "k");
    expect_same_bytes(v, v_ref, "v");

    Tensor gq = random_tensor(q_shape, seed++, 1.0f, c.dtype), gk = random_tensor(kv_shape, seed++, 1.0f, c.dtype);
    Tensor gv = random_tensor(kv_shape, seed++, 1.0f, c.dtype);
    Tensor gqkv_ref = Tensor::empty(qkv_shape, c.dtype);
    cpu::qkv_split_backward(cpu_ctx, gq, gk, gv, gqkv_ref);
    Tensor gqkv = poisoned_output(qkv_shape, c.dtype, c.unaligned);
    cuda::qkv_split_backward(ctx, device_input(gq, false), device_input(gk, c.unaligned), device_input(gv, false),
                             gqkv);
    ctx.synchronize();
    expect_same_bytes(gqkv, gqkv_ref, "grad_qkv");
  }
}

}  // namespace
}  // namespace megatron

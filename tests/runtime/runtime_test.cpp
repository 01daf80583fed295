// Runtime: dtypes and their conversions, tensors (views, slices, copies), the Philox generator,
// the context's side stream on the CPU (Note [Side stream]).
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "megatron/runtime/allocator.h"
#include "megatron/runtime/context.h"
#include "megatron/runtime/philox.h"
#include "megatron/runtime/tensor.h"

namespace megatron {
namespace {

TEST(DType, SizesAndNames) {
  EXPECT_EQ(size_of(DType::Float32), 4u);
  EXPECT_EQ(size_of(DType::BFloat16), 2u);
  EXPECT_EQ(size_of(DType::Float8E4M3), 1u);
  EXPECT_EQ(size_of(DType::Int64), 8u);
  EXPECT_EQ(to_string(DType::BFloat16), "bf16");
  EXPECT_EQ(safetensors_name(DType::Float16), "F16");
  EXPECT_EQ(dtype_from_string("BF16"), DType::BFloat16);
  EXPECT_EQ(dtype_from_string("int32"), DType::Int32);
  EXPECT_THROW(dtype_from_string("float33"), Error);
}

TEST(DType, BFloat16RoundsToNearestEven) {
  EXPECT_EQ(to_bf16(1.0f).bits, 0x3f80);
  EXPECT_EQ(to_float(to_bf16(3.140625f)), 3.140625f);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(to_float(to_bf16(1.0f + std::ldexp(1.0f, -8))), 1.0f);
  // 1 + 3·2^-8 is halfway between 1+2^-7 and 1+2^-6: ties to even (1 + 2^-6).
  EXPECT_EQ(to_float(to_bf16(1.0f + 3 * std::ldexp(1.0f, -8))), 1.0f + std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::isnan(to_float(to_bf16(NAN))));
  EXPECT_TRUE(std::isinf(to_float(to_bf16(INFINITY))));
}

TEST(DType, Float16RoundTrip) {
  for (float v : {0.0f, 1.0f, -2.5f, 65504.0f, 6.103515625e-05f /* smallest normal */, 5.9604645e-08f /* subnormal */}) {
    EXPECT_EQ(to_float(to_fp16(v)), v) << v;
  }
  EXPECT_EQ(to_fp16(1.0f).bits, 0x3c00);
  EXPECT_TRUE(std::isinf(to_float(to_fp16(70000.0f))));
  EXPECT_EQ(to_float(to_fp16(1.0f + std::ldexp(1.0f, -11))), 1.0f);  // tie to even
}

TEST(DType, Fp8Formats) {
  EXPECT_EQ(to_float(fp8_e4m3{0x7e}), 448.0f);  // largest e4m3
  EXPECT_EQ(to_float(to_fp8_e4m3(1000.0f)), 448.0f);  // saturates
  EXPECT_EQ(to_float(to_fp8_e4m3(0.5f)), 0.5f);
  EXPECT_EQ(to_float(fp8_e5m2{0x7b}), 57344.0f);  // largest e5m2
  EXPECT_EQ(to_float(to_fp8_e5m2(-3.0f)), -3.0f);
  EXPECT_EQ(to_float(fp8_e4m3{0x01}), std::ldexp(1.0f, -9));  // smallest subnormal
}

TEST(Tensor, ViewsAndSlicesShareStorage) {
  Tensor t = Tensor::from_floats({0, 1, 2, 3, 4, 5}, {3, 2});
  Tensor v = t.view({2, -1});
  EXPECT_EQ(v.shape(), (Shape{2, 3}));
  Tensor s = t.slice(1, 3);
  EXPECT_EQ(s.shape(), (Shape{2, 2}));
  EXPECT_EQ(s.item(0), 2.0f);
  s.fill_(7.0f);
  EXPECT_EQ(t.to_floats(), (std::vector<float>{0, 1, 7, 7, 7, 7}));
  EXPECT_EQ(t.flat_slice(1, 2).to_floats(), (std::vector<float>{1, 7}));
  EXPECT_THROW(t.view({4, 2}), InternalError);
}

TEST(Tensor, ConvertsBetweenDtypes) {
  Tensor t = Tensor::from_floats({1.5f, -2.0f, 3.0f}, {3}, DType::BFloat16);
  EXPECT_EQ(t.dtype(), DType::BFloat16);
  EXPECT_EQ(t.to(DType::Float32).to_floats(), (std::vector<float>{1.5f, -2.0f, 3.0f}));
  Tensor i = Tensor::from_ints({1, 2, 3}, {3}, DType::Int32);
  EXPECT_EQ(i.to_ints(), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_THROW(i.data<float>(), InternalError);
}

TEST(Allocator, TracksHostBytes) {
  size_t before = memory_stats(Device::cpu()).allocated;
  {
    Tensor t = Tensor::empty({1024}, DType::Float32);
    EXPECT_GE(memory_stats(Device::cpu()).allocated, before + 4096);
  }
  EXPECT_EQ(memory_stats(Device::cpu()).allocated, before);
}

// Known-answer vectors of Philox-4x32-10 from the Random123 distribution (kat_vectors).
TEST(Philox, KnownAnswers) {
  struct Case {
    uint32_t ctr[4], key[2], out[4];
  } cases[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
       {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (auto& c : cases) {
    uint32_t out[4];
    philox4x32_10(c.ctr, c.key, out);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(out[i], c.out[i]) << i;
  }
}

TEST(Philox, StreamsAreReproducibleAndDistinct) {
  RngState rng{42, 0};
  uint64_t a = rng.next_offset(), b = rng.next_offset();
  EXPECT_NE(a, b);
  EXPECT_EQ(philox_uniform(42, a, 17), philox_uniform(42, a, 17));
  EXPECT_NE(philox_uniform(42, a, 17), philox_uniform(42, b, 17));
  double sum = 0, sq = 0;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    float z = philox_normal(7, 3, uint64_t(i));
    sum += z;
    sq += double(z) * z;
  }
  EXPECT_NEAR(sum / n, 0.0, 0.03);
  EXPECT_NEAR(sq / n, 1.0, 0.05);
}

TEST(Context, CpuContextHasWorkspaceAndRng) {
  Context ctx(Device::cpu(), 99);
  EXPECT_FALSE(ctx.is_cuda());
  EXPECT_EQ(ctx.rng().seed, 99u);
  EXPECT_GE(ctx.workspace(100).nbytes(), 100u);
}

// The runtime's side stream on the CPU: run() is inline, join() runs the after-join work on the
// main context once, a second open SideStream is refused, and work dropped by an exception is not
// run.
TEST(SideStream, RunsInlineOnTheCpuAndDefersHostWorkToTheJoin) {
  Context ctx;
  EXPECT_FALSE(ctx.is_side());
  EXPECT_TRUE(ctx.side().is_side());
  EXPECT_EQ(&ctx.side().main(), &ctx);
  EXPECT_EQ(&ctx.side().rng(), &ctx.rng());
  int ran = 0;
  Context* seen = nullptr;
  {
    SideStream side(ctx);
    const int v = side.run([&](Context& s) {
      EXPECT_EQ(&s, &ctx.side());
      s.after_join([&](Context& main) { ++ran, seen = &main; });
      return 7;
    });
    EXPECT_EQ(v, 7);
    EXPECT_EQ(ran, 0);
    try {
      SideStream again(ctx);
      ADD_FAILURE() << "a second open SideStream was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("while one is open"), std::string::npos) << e.what();
    }
    side.join();
    EXPECT_EQ(ran, 1);
    EXPECT_EQ(seen, &ctx);
  }
  try {
    SideStream side(ctx);
    side.run([&](Context& s) { s.after_join([&](Context&) { ++ran; }); });
    throw std::runtime_error("unwound");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(ran, 1);
  SideStream reopened(ctx);  // the unwound one joined
  reopened.join();
}

}  // namespace
}  // namespace megatron

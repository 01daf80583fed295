// The FP8 formats and ops on the CPU against values computed here from the formats' definitions:
// every code's value, round-to-nearest-even at every tie, saturation, NaN; quantisation with
// scale, transpose and amax; dequantisation; current scaling's scale; block scales (of a whole
// tensor, and of a weight's shards); the GEMM.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "megatron/kernels/fp8_ops.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

using testing::error_of;
using testing::random_tensor;

struct Format {
  DType dtype;
  int exp_bits, man_bits, bias;
  double max;
};
const Format kE4M3{DType::Float8E4M3, 4, 3, 7, 448.0};
const Format kE5M2{DType::Float8E5M2, 5, 2, 15, 57344.0};

// The value of a code from the OCP definition (e4m3: no infinities, S.1111.111 is NaN; e5m2: the
// IEEE rules), written independently of runtime/dtype.cpp.
double definition_value(const Format& f, int code) {
  const int sign = code >> 7;
  const int e = (code >> f.man_bits) & ((1 << f.exp_bits) - 1);
  const int m = code & ((1 << f.man_bits) - 1);
  const int e_max = (1 << f.exp_bits) - 1;
  double v;
  if (f.dtype == DType::Float8E4M3 && e == e_max && m == (1 << f.man_bits) - 1) return std::nan("");
  if (f.dtype == DType::Float8E5M2 && e == e_max) {
    if (m != 0) return std::nan("");
    v = std::numeric_limits<double>::infinity();
  } else if (e == 0) {
    v = double(m) / double(1 << f.man_bits) * std::pow(2.0, 1 - f.bias);
  } else {
    v = (1.0 + double(m) / double(1 << f.man_bits)) * std::pow(2.0, e - f.bias);
  }
  return sign ? -v : v;
}

float decode(const Format& f, uint8_t b) {
  return f.dtype == DType::Float8E4M3 ? to_float(fp8_e4m3{b}) : to_float(fp8_e5m2{b});
}
uint8_t encode(const Format& f, float v) {
  return f.dtype == DType::Float8E4M3 ? to_fp8_e4m3(v).bits : to_fp8_e5m2(v).bits;
}

// The reference encoder of this test: the nearest finite code by exhaustive search, ties to the
// even code, magnitudes past max + half an ulp (and infinities) saturating, NaN to NaN.
uint8_t nearest_code(const Format& f, float x) {
  if (std::isnan(x)) return 0x7f;  // a NaN code (callers compare NaN-ness)
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(double(x));
  int best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c < 128; ++c) {
    const double v = definition_value(f, c);
    if (!std::isfinite(v)) continue;
    const double err = std::fabs(v - a);
    if (err < best_err || (err == best_err && c % 2 == 0)) {
      best_err = err;
      best = c;
    }
  }
  return uint8_t(sign | best);
}

Tensor fp32(const std::vector<float>& v) { return Tensor::from_floats(v, {int64_t(v.size())}); }
Tensor scalar(float v) { return fp32({v}); }
uint8_t byte_at(const Tensor& t, int64_t i) { return static_cast<const uint8_t*>(t.raw_data())[i]; }

TEST(Fp8Format, EveryCodeDecodesToItsDefinedValue) {
  for (const Format& f : {kE4M3, kE5M2}) {
    int nans = 0;
    for (int c = 0; c < 256; ++c) {
      const double want = definition_value(f, c);
      const float got = decode(f, uint8_t(c));
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got)) << to_string(f.dtype) << " code " << c;
        ++nans;
      } else {
        EXPECT_EQ(double(got), want) << to_string(f.dtype) << " code " << c;
      }
    }
    EXPECT_EQ(nans, f.dtype == DType::Float8E4M3 ? 2 : 6);
  }
  EXPECT_EQ(decode(kE4M3, 0x7e), 448.0f);
  EXPECT_EQ(decode(kE4M3, 0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(decode(kE4M3, 0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(decode(kE5M2, 0x7b), 57344.0f);
  EXPECT_EQ(decode(kE5M2, 0x01), std::ldexp(1.0f, -16));
  EXPECT_TRUE(std::isinf(decode(kE5M2, 0x7c)) && decode(kE5M2, 0xfc) < 0);
  EXPECT_EQ(fp8_max_of(DType::Float8E4M3), 448.0f);
  EXPECT_EQ(fp8_max_of(DType::Float8E5M2), 57344.0f);
}

TEST(Fp8Format, EncodingRoundTripsEveryFiniteCode) {
  for (const Format& f : {kE4M3, kE5M2}) {
    for (int c = 0; c < 256; ++c) {
      const float v = decode(f, uint8_t(c));
      if (!std::isfinite(v)) continue;
      EXPECT_EQ(int(encode(f, v)), c) << to_string(f.dtype) << " value " << v;
    }
  }
}

TEST(Fp8Format, TiesRoundToTheEvenCode) {
  for (const Format& f : {kE4M3, kE5M2}) {
    const int top = f.dtype == DType::Float8E4M3 ? 0x7e : 0x7b;
    for (int c = 0; c < top; ++c) {
      const double lo = definition_value(f, c), hi = definition_value(f, c + 1);
      const float mid = float((lo + hi) / 2);  // exact in fp32
      ASSERT_EQ(double(mid), (lo + hi) / 2);
      const int even = c % 2 == 0 ? c : c + 1;
      EXPECT_EQ(int(encode(f, mid)), even) << to_string(f.dtype) << " tie between codes " << c << " and " << c + 1;
      EXPECT_EQ(int(encode(f, -mid)), 0x80 | even);
      // just off the tie: the nearer code
      EXPECT_EQ(int(encode(f, std::nextafter(mid, 0.0f))), c);
      EXPECT_EQ(int(encode(f, std::nextafter(mid, 1e30f))), c + 1);
    }
  }
}

TEST(Fp8Format, SaturatesAndKeepsNaN) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (float v : {448.0f, 455.0f, 463.99f, 464.0f, 500.0f, 1e6f, FLT_MAX, inf}) {
    EXPECT_EQ(int(encode(kE4M3, v)), 0x7e) << v;
    EXPECT_EQ(int(encode(kE4M3, -v)), 0xfe) << v;
  }
  for (float v : {57344.0f, 61439.0f, 61440.0f, 1e9f, FLT_MAX, inf}) {
    EXPECT_EQ(int(encode(kE5M2, v)), 0x7b) << v;
    EXPECT_EQ(int(encode(kE5M2, -v)), 0xfb) << v;
  }
  for (const Format& f : {kE4M3, kE5M2}) {
    EXPECT_TRUE(std::isnan(decode(f, encode(f, nan))));
    EXPECT_TRUE(std::isnan(decode(f, encode(f, -nan))));
    EXPECT_EQ(encode(f, -nan) & 0x80, 0x80);  // NaN keeps its sign, as the GPU's conversion
    // half the smallest subnormal is a tie with zero: zero, with the sign
    const float half_min = float(definition_value(f, 1) / 2);
    EXPECT_EQ(int(encode(f, half_min)), 0x00);
    EXPECT_EQ(int(encode(f, -half_min)), 0x80);
    EXPECT_EQ(int(encode(f, std::nextafter(half_min, 1.0f))), 0x01);
  }
  EXPECT_EQ(int(encode(kE4M3, nan)), 0x7f);
}

TEST(Fp8Format, EncodingIsTheNearestCodeForRandomValues) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> expo(-22, 18);
  for (const Format& f : {kE4M3, kE5M2}) {
    for (int i = 0; i < 100000; ++i) {
      float v = std::ldexp(mant(rng), expo(rng));
      if (i % 2) v = -v;
      ASSERT_EQ(int(encode(f, v)), int(nearest_code(f, v))) << to_string(f.dtype) << " " << v;
    }
  }
}

TEST(Fp8Ops, QuantizeWritesCodesTransposeAmaxAndScaleInverse) {
  Context ctx;
  for (DType xt : {DType::Float32, DType::BFloat16}) {
    for (const Format& f : {kE4M3, kE5M2}) {
      const int64_t m = 37, k = 45;
      Tensor x = random_tensor({m, k}, 11, 30.0f, xt);
      const std::vector<float> xv = x.to_floats();
      const float s = 3.5f;
      Tensor q = Tensor::empty({m, k}, f.dtype), qt = Tensor::empty({k, m}, f.dtype);
      Tensor amax = scalar(0.0f), scale_inv = scalar(0.0f), scale = scalar(s);
      ops::fp8_quantize(ctx, x, scale, q, qt, amax, scale_inv);
      float want_amax = 0.0f;
      for (int64_t r = 0; r < m; ++r) {
        for (int64_t c = 0; c < k; ++c) {
          const float v = xv[size_t(r * k + c)];
          want_amax = std::max(want_amax, std::fabs(v));
          const uint8_t want = nearest_code(f, v * s);
          ASSERT_EQ(int(byte_at(q, r * k + c)), int(want)) << v;
          ASSERT_EQ(int(byte_at(qt, c * m + r)), int(want));
        }
      }
      EXPECT_EQ(amax.item(), want_amax);
      EXPECT_EQ(scale_inv.item(), 1.0f / s);
      // amax accumulates with what is there; q alone, without the other outputs
      Tensor big = scalar(1e6f), none;
      Tensor q2 = Tensor::empty({m, k}, f.dtype);
      ops::fp8_quantize(ctx, x, scale, q2, none, big, none);
      EXPECT_EQ(big.item(), 1e6f);
      EXPECT_EQ(std::memcmp(q.raw_data(), q2.raw_data(), size_t(m * k)), 0);
    }
  }
}

// fp8_quantize_dbias: fp8_quantize's outputs, and dbias += the column sums of x (fp32), onto what
// it held; a dbias of the wrong size is refused.
TEST(Fp8Ops, QuantizeDbiasAddsTheColumnSums) {
  Context ctx;
  for (DType xt : {DType::Float32, DType::BFloat16}) {
    const int64_t m = 29, k = 40;
    const Tensor x = random_tensor({m, k}, 21, 3.0f, xt);
    const std::vector<float> xv = x.to_floats();
    Tensor scale = scalar(2.0f), none;
    Tensor q = Tensor::empty({m, k}, DType::Float8E5M2), qt = Tensor::empty({k, m}, DType::Float8E5M2);
    Tensor q_ref = Tensor::empty({m, k}, DType::Float8E5M2), qt_ref = Tensor::empty({k, m}, DType::Float8E5M2);
    Tensor amax = scalar(0.0f), amax_ref = scalar(0.0f), si = scalar(0.0f), si_ref = scalar(0.0f);
    Tensor db = Tensor::from_floats(std::vector<float>(size_t(k), 0.5f), {k});
    ops::fp8_quantize_dbias(ctx, x, scale, q, qt, amax, si, db);
    ops::fp8_quantize(ctx, x, scale, q_ref, qt_ref, amax_ref, si_ref);
    EXPECT_EQ(std::memcmp(q.raw_data(), q_ref.raw_data(), size_t(m * k)), 0);
    EXPECT_EQ(std::memcmp(qt.raw_data(), qt_ref.raw_data(), size_t(m * k)), 0);
    EXPECT_EQ(amax.item(), amax_ref.item());
    EXPECT_EQ(si.item(), 0.5f);
    const std::vector<float> got = db.to_floats();
    for (int64_t c = 0; c < k; ++c) {
      double want = 0.5;
      for (int64_t r = 0; r < m; ++r) want += xv[size_t(r * k + c)];
      EXPECT_NEAR(got[size_t(c)], want, 1e-4) << "column " << c;
    }
    Tensor short_db = Tensor::zeros({k - 1}, DType::Float32);
    EXPECT_NE(error_of([&] { ops::fp8_quantize_dbias(ctx, x, scale, q, qt, none, none, short_db); })
                  .find("dbias must be fp32 [40]"),
              std::string::npos);
  }
}

// Note [Quantising inside the activation]: fp8_quantize_activation is swiglu_* / gelu_* into pre's
// dtype and then fp8_quantize (fp8_quantize_dbias with dbias): codes, the transposed copy, amax,
// scale_inv and the column sums.
TEST(Fp8Ops, QuantizeActivationIsTheActivationThenTheQuantisation) {
  Context ctx;
  for (Fp8Activation act : {Fp8Activation::Swiglu, Fp8Activation::Gelu}) {
    const bool swiglu = act == Fp8Activation::Swiglu;
    for (DType xt : {DType::Float32, DType::BFloat16}) {
      for (bool gradient : {false, true}) {
        SCOPED_TRACE(std::string(swiglu ? "swiglu " : "gelu ") + std::string(to_string(xt)) +
                     (gradient ? " gradient" : " activation"));
        const int64_t m = 29, f = 24, width = swiglu ? 2 * f : f;
        const Tensor pre = random_tensor({m, width}, 31, 3.0f, xt);
        const Tensor grad = gradient ? random_tensor({m, f}, 32, 0.5f, xt) : Tensor();
        const int64_t k = gradient ? width : f;
        Tensor x = Tensor::empty({m, k}, xt);
        if (swiglu && gradient) ops::swiglu_backward(ctx, grad, pre, x);
        if (swiglu && !gradient) ops::swiglu_forward(ctx, pre, x);
        if (!swiglu && gradient) ops::gelu_backward(ctx, grad, pre, x);
        if (!swiglu && !gradient) ops::gelu_forward(ctx, pre, x);
        const DType t = gradient ? DType::Float8E5M2 : DType::Float8E4M3;
        Tensor scale = scalar(4.0f), none;
        Tensor q = Tensor::empty({m, k}, t), qt = Tensor::empty({k, m}, t);
        Tensor q_ref = Tensor::empty({m, k}, t), qt_ref = Tensor::empty({k, m}, t);
        Tensor amax = scalar(0.0f), amax_ref = scalar(0.0f), si = scalar(0.0f), si_ref = scalar(0.0f);
        Tensor db = Tensor::zeros({k}, DType::Float32), db_ref = Tensor::zeros({k}, DType::Float32);
        Tensor no_db;
        ops::fp8_quantize_activation(ctx, act, pre, grad, scale, q, qt, amax, si, gradient ? db : no_db);
        if (gradient) {
          ops::fp8_quantize_dbias(ctx, x, scale, q_ref, qt_ref, amax_ref, si_ref, db_ref);
          EXPECT_EQ(db.to_floats(), db_ref.to_floats());
        } else {
          ops::fp8_quantize(ctx, x, scale, q_ref, qt_ref, amax_ref, si_ref);
        }
        EXPECT_EQ(std::memcmp(q.raw_data(), q_ref.raw_data(), size_t(m * k)), 0);
        EXPECT_EQ(std::memcmp(qt.raw_data(), qt_ref.raw_data(), size_t(m * k)), 0);
        EXPECT_GT(amax.item(), 0.0f);
        EXPECT_EQ(amax.item(), amax_ref.item());
        EXPECT_EQ(si.item(), 0.25f);
        Tensor amax_only = scalar(0.0f);
        ops::fp8_quantize_activation(ctx, act, pre, grad, scale, none, none, amax_only, none, none);
        EXPECT_EQ(amax_only.item(), amax_ref.item());
      }
    }
  }
  // the shapes, one line each
  const Tensor odd = random_tensor({4, 7}, 33, 1.0f);
  Tensor scale = scalar(1.0f), none;
  const Fp8Activation sw = Fp8Activation::Swiglu;
  EXPECT_NE(error_of([&] { ops::fp8_quantize_activation(ctx, sw, odd, none, scale, none, none, none, none, none); })
                .find("pre must be fp32, bf16 or fp16 [..., 2f] (SwiGLU)"),
            std::string::npos);
  const Tensor pre = random_tensor({4, 8}, 34, 1.0f), wrong_grad = random_tensor({4, 8}, 35, 1.0f);
  EXPECT_NE(
      error_of([&] { ops::fp8_quantize_activation(ctx, sw, pre, wrong_grad, scale, none, none, none, none, none); })
          .find("grad must be fp32 [4, 4]"),
      std::string::npos);
  Tensor q_wide = Tensor::empty({4, 8}, DType::Float8E4M3);
  EXPECT_NE(error_of([&] { ops::fp8_quantize_activation(ctx, sw, pre, none, scale, q_wide, none, none, none, none); })
                .find("q must be fp8 of x's shape [4, 4]"),
            std::string::npos);
}

// fp8_block_quantize_transposed is the transpose and then the 1x128 block quantisation (a ragged
// shape: partial tiles both ways), and refuses a scale grid of the untransposed layout.
TEST(Fp8Ops, BlockQuantizeTransposedIsTheTransposeThenTheBlocks) {
  Context ctx;
  for (DType xt : {DType::Float32, DType::BFloat16}) {
    const int64_t m = 300, k = 70;
    const Tensor x = random_tensor({m, k}, 41, 5.0f, xt);
    Tensor xt_ = Tensor::empty({k, m}, xt);
    ops::transpose_01(ctx, x, xt_);
    Tensor q = Tensor::empty({k, m}, DType::Float8E4M3), q_ref = Tensor::empty({k, m}, DType::Float8E4M3);
    Tensor si = Tensor::zeros(fp8_block_scale_shape(k, m, false), DType::Float32);
    Tensor si_ref = Tensor::zeros(fp8_block_scale_shape(k, m, false), DType::Float32);
    ops::fp8_block_quantize_transposed(ctx, x, true, q, si);
    ops::fp8_block_quantize(ctx, xt_, false, true, q_ref, si_ref);
    EXPECT_EQ(std::memcmp(q.raw_data(), q_ref.raw_data(), size_t(m * k)), 0);
    EXPECT_EQ(si.to_floats(), si_ref.to_floats());
    Tensor wrong = Tensor::zeros(fp8_block_scale_shape(m, k, false), DType::Float32);
    EXPECT_NE(error_of([&] { ops::fp8_block_quantize_transposed(ctx, x, true, q, wrong); })
                  .find("scale_inv must be fp32 [3, 72] for the 1x128 tiles of [70, 300]"),
              std::string::npos);
  }
}

// Note [Grouped quantisation]: each member's codes are its own scale's (the nearest code), its
// transposed copy is padded with zero codes up to its width, the amaxes and scale inverses are
// each member's; under current scaling each member's scale is fp8_max / its own amax (the amax
// overwritten, not accumulated) and the codes use it.
TEST(Fp8Ops, QuantizeGroupedQuantisesEachMemberWithItsOwnScale) {
  Context ctx;
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{37, 24}, {5, 16}, {64, 8}};
  const std::vector<int64_t> widths = {48, 16, 64};
  for (bool current : {false, true}) {
    for (const Format& f : {kE4M3, kE5M2}) {
      SCOPED_TRACE(std::string(current ? "current" : "given") + " scales, " + std::string(to_string(f.dtype)));
      std::vector<Tensor> x, scale, q, q_t, amax, scale_inv;
      for (size_t i = 0; i < shapes.size(); ++i) {
        const auto [m, k] = shapes[i];
        x.push_back(random_tensor({m, k}, 40 + i, float(1 << (3 * i)), DType::BFloat16));
        scale.push_back(scalar(0.5f + float(i)));
        q.push_back(Tensor::empty({m, k}, f.dtype));
        q_t.push_back(Tensor::empty({k, widths[i]}, f.dtype));
        amax.push_back(scalar(current ? 1e9f : 0.0f));
        scale_inv.push_back(scalar(0.0f));
      }
      ops::fp8_quantize_grouped(ctx, x, scale, q, q_t, amax, scale_inv, current, float(f.max));
      for (size_t i = 0; i < shapes.size(); ++i) {
        SCOPED_TRACE("member " + std::to_string(i));
        const auto [m, k] = shapes[i];
        const std::vector<float> xv = x[i].to_floats();
        float want_amax = 0.0f;
        for (float v : xv) want_amax = std::max(want_amax, std::fabs(v));
        EXPECT_EQ(amax[i].item(), want_amax);
        const float s = current ? float(f.max) / want_amax : 0.5f + float(i);
        EXPECT_EQ(scale[i].item(), s);
        EXPECT_EQ(scale_inv[i].item(), 1.0f / s);
        for (int64_t r = 0; r < widths[i]; ++r) {
          for (int64_t c = 0; c < k; ++c) {
            const uint8_t want = r < m ? nearest_code(f, xv[size_t(r * k + c)] * s) : 0;
            if (r < m) ASSERT_EQ(int(byte_at(q[i], r * k + c)), int(want));
            ASSERT_EQ(int(byte_at(q_t[i], c * widths[i] + r)), int(want)) << "q_t[" << c << ", " << r << "]";
          }
        }
      }
    }
  }
  // refused: a transposed copy narrower than the rows, and lists that do not match
  std::vector<Tensor> x{random_tensor({8, 16}, 1)}, s{scalar(1.0f)}, none, narrow{Tensor::empty({16, 4}, DType::Float8E4M3)};
  std::vector<Tensor> two{scalar(1.0f), scalar(1.0f)};
  EXPECT_NE(error_of([&] { ops::fp8_quantize_grouped(ctx, x, s, none, narrow, none, none, false, 448.0f); })
                .find("q_t must be fp8 [16, P >= 8]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ops::fp8_quantize_grouped(ctx, x, two, none, none, none, none, false, 448.0f); })
                .find("2 scales for 1 members"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ops::fp8_quantize_grouped(ctx, x, s, none, none, none, none, true, 448.0f); })
                .find("current scaling needs one each"),
            std::string::npos);
}

TEST(Fp8Ops, AmaxIgnoresNaNAndDequantizeScales) {
  Context ctx;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Tensor x = fp32({1.0f, -7.5f, nan, 2.0f});
  Tensor amax = scalar(100.0f);
  ops::fp8_amax(ctx, x, amax);  // overwrites
  EXPECT_EQ(amax.item(), 7.5f);
  Tensor q = Tensor::empty({4}, DType::Float8E4M3), none, a2 = scalar(0.0f);
  ops::fp8_quantize(ctx, x, scalar(2.0f), q, none, a2, none);
  EXPECT_EQ(a2.item(), 7.5f);
  EXPECT_EQ(int(byte_at(q, 2)), 0x7f);
  Tensor out = Tensor::empty({4}, DType::Float32);
  ops::fp8_dequantize(ctx, q, scalar(0.5f), out);
  const std::vector<float> o = out.to_floats();
  EXPECT_EQ(o[0], 1.0f);
  EXPECT_EQ(o[1], -7.5f);  // 15 is exact in e4m3
  EXPECT_TRUE(std::isnan(o[2]));
  EXPECT_EQ(o[3], 2.0f);
}

TEST(Fp8Ops, ScaleFromAmaxFollowsCurrentScaling) {
  Context ctx;
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  Tensor amax = fp32({0.0f, inf, nan, 1e-39f, 3.0f, 448.0f, 1000.0f});
  Tensor scale = Tensor::empty({7}, DType::Float32), scale_inv = Tensor::empty({7}, DType::Float32);
  ops::fp8_scale_from_amax(ctx, amax, 448.0f, false, scale, scale_inv);
  const std::vector<float> s = scale.to_floats(), si = scale_inv.to_floats();
  const std::vector<float> want = {1.0f, 1.0f, 1.0f, FLT_MAX, 448.0f / 3.0f, 1.0f, 0.448f};
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(s[i], want[i]) << i;
    EXPECT_EQ(si[i], 1.0f / want[i]) << i;
  }
  ops::fp8_scale_from_amax(ctx, amax, 448.0f, true, scale, scale_inv);
  const std::vector<float> p = scale.to_floats();
  const std::vector<float> want_pow2 = {1.0f, 1.0f, 1.0f, std::ldexp(1.0f, 127), 128.0f, 1.0f, 0.25f};
  for (size_t i = 0; i < want_pow2.size(); ++i) EXPECT_EQ(p[i], want_pow2[i]) << i;
}

// Block scales: each tile's scale from its own amax, written where the GEMM reads it.
TEST(Fp8Ops, BlockQuantizeScalesEachTile) {
  Context ctx;
  const int64_t m = 130, k = 300;
  std::vector<float> xv(size_t(m * k));
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < k; ++c) xv[size_t(r * k + c)] = nd(rng) * std::ldexp(1.0f, int(r % 7) - 3 + int(c / 128));
  for (int64_t c = 128; c < 256; ++c) xv[size_t(5 * k + c)] = 0.0f;  // an all-zero 1x128 tile
  Tensor x = Tensor::from_floats(xv, {m, k});
  for (bool tile_2d : {false, true}) {
    for (bool pow2 : {false, true}) {
      SCOPED_TRACE(std::string(tile_2d ? "128x128" : "1x128") + (pow2 ? " pow2" : " fp32"));
      const Shape ss = fp8_block_scale_shape(m, k, tile_2d);
      EXPECT_EQ(ss, tile_2d ? Shape({2, 4}) : Shape({3, 132}));
      Tensor q = Tensor::empty({m, k}, DType::Float8E4M3), si = Tensor::zeros(ss, DType::Float32);
      ops::fp8_block_quantize(ctx, x, tile_2d, pow2, q, si);
      const std::vector<float> sv = si.to_floats();
      const int64_t th = tile_2d ? 128 : 1;
      for (int64_t r0 = 0; r0 < m; r0 += th) {
        for (int64_t c0 = 0; c0 < k; c0 += 128) {
          float amax = 0.0f;
          for (int64_t r = r0; r < std::min(m, r0 + th); ++r)
            for (int64_t c = c0; c < std::min(k, c0 + 128); ++c) amax = std::max(amax, std::fabs(xv[size_t(r * k + c)]));
          float s = amax == 0.0f ? 1.0f : 448.0f / amax;
          if (pow2 && amax != 0.0f) {
            int e;
            std::frexp(s, &e);
            s = std::ldexp(1.0f, e - 1);
          }
          const float got_inv = tile_2d ? sv[size_t((r0 / 128) * ss[1] + c0 / 128)] : sv[size_t((c0 / 128) * ss[1] + r0)];
          ASSERT_EQ(got_inv, 1.0f / s) << "tile " << r0 << "," << c0;
          for (int64_t r = r0; r < std::min(m, r0 + th); ++r)
            for (int64_t c = c0; c < std::min(k, c0 + 128); ++c)
              ASSERT_EQ(int(byte_at(q, r * k + c)), int(nearest_code(kE4M3, xv[size_t(r * k + c)] * s)));
        }
      }
    }
  }
}

// A weight cut into shards anywhere (the distributed optimizer's cuts: mid-row, mid-tile, a tile
// across three shards, an empty shard): the shards' partial tile amaxes, maxed together as the
// all-reduce does, give each tile the whole weight's amax, and the shards quantised with the
// tiles' power-of-two scales are fp8_block_quantize's bytes of the whole weight; its scale
// inverses are the tiles'. For fp32 and bf16 masters.
TEST(Fp8Ops, BlockPartialShardsQuantiseAsTheWholeWeight) {
  Context ctx;
  const int64_t rows = 300, cols = 200;  // tiles 3 x 2, the last row and column of tiles partial
  std::vector<float> wv(size_t(rows * cols));
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) wv[size_t(r * cols + c)] = nd(rng) * std::ldexp(1.0f, int(r / 128) - 2 * int(c / 128));
  for (int64_t r = 256; r < rows; ++r)  // the tile (2, 1) all zeros: scale 1
    for (int64_t c = 128; c < cols; ++c) wv[size_t(r * cols + c)] = 0.0f;
  wv[size_t(130 * cols + 3)] = std::nanf("");  // NaN is ignored by the amax, as fp8_block_quantize's
  const std::vector<int64_t> cuts = {0, 77, 25600 + 130, 25600 + 130, 40000, 51234, rows * cols};
  for (DType dt : {DType::Float32, DType::BFloat16}) {
    SCOPED_TRACE(to_string(dt));
    const Tensor w = Tensor::from_floats(wv, {rows, cols}).to(dt);
    const Shape whole_shape = fp8_block_scale_shape(rows, cols, true);  // [3, 4]
    Tensor q_whole = Tensor::empty({rows, cols}, DType::Float8E4M3), si_whole = Tensor::zeros(whole_shape, DType::Float32);
    ops::fp8_block_quantize(ctx, w.to(DType::Float32), true, true, q_whole, si_whole);
    const Shape grid{4, 4};  // Fp8Param's padded grid
    Tensor amax = Tensor::zeros(grid, DType::Float32);
    const Tensor flat = w.view({-1});
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      Tensor part = Tensor::zeros(grid, DType::Float32);  // each rank's own grid, then the max
      ops::fp8_block_partial_amax(ctx, flat.flat_slice(cuts[i], cuts[i + 1] - cuts[i]), cuts[i], cols, part);
      std::vector<float> a = amax.to_floats(), b = part.to_floats();
      for (size_t j = 0; j < a.size(); ++j) a[j] = std::max(a[j], b[j]);
      amax = Tensor::from_floats(a, grid);
    }
    Tensor scale = Tensor::empty(grid, DType::Float32), scale_inv = Tensor::empty(grid, DType::Float32);
    ops::fp8_scale_from_amax(ctx, amax, 448.0f, true, scale, scale_inv);
    const std::vector<float> got_inv = scale_inv.to_floats(), want_inv = si_whole.to_floats();
    for (int64_t i = 0; i < 3; ++i)
      for (int64_t j = 0; j < 2; ++j)
        EXPECT_EQ(got_inv[size_t(i * 4 + j)], want_inv[size_t(i * whole_shape[1] + j)]) << "tile " << i << "," << j;
    EXPECT_EQ(got_inv[size_t(2 * 4 + 1)], 1.0f) << "the all-zero tile";
    Tensor q = Tensor::empty({rows * cols}, DType::Float8E4M3);
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      Tensor qs = q.flat_slice(cuts[i], cuts[i + 1] - cuts[i]);
      ops::fp8_block_partial_quantize(ctx, flat.flat_slice(cuts[i], cuts[i + 1] - cuts[i]), cuts[i], cols, scale, qs);
    }
    ASSERT_EQ(std::memcmp(q.raw_data(), q_whole.raw_data(), size_t(rows * cols)), 0);
  }
  // A shard past the grid, a grid too narrow, a q of another size: one line each.
  Tensor x = Tensor::zeros({100}, DType::Float32), small = Tensor::zeros({2, 4}, DType::Float32),
         narrow = Tensor::zeros({4, 1}, DType::Float32);
  Tensor q = Tensor::empty({99}, DType::Float8E4M3);
  EXPECT_NE(error_of([&] { ops::fp8_block_partial_amax(ctx, x, 256 * cols, cols, small); }).find("past the tile grid"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ops::fp8_block_partial_amax(ctx, x, 0, cols, narrow); }).find("fewer than"), std::string::npos);
  EXPECT_NE(error_of([&] { ops::fp8_block_partial_quantize(ctx, x, 0, cols, small, q); }).find("q must be fp8"),
            std::string::npos);
}

// The GEMM against a double-precision sum over the definition's values of the same codes.
void check_gemm(Fp8ScaleMode mode_a, Fp8ScaleMode mode_b, DType ta, DType tb, DType out_type, bool accumulate) {
  Context ctx;
  const int64_t m = 40, n = 24, k = 256;
  auto make = [&](int64_t rows, Fp8ScaleMode mode, DType t, uint64_t seed) {
    Tensor x = random_tensor({rows, k}, seed, 2.0f);
    Fp8Operand o;
    o.mode = mode;
    o.data = Tensor::empty({rows, k}, t);
    if (mode == Fp8ScaleMode::Tensor) {
      o.scale_inv = scalar(0.0f);
      Tensor none;
      ops::fp8_quantize(ctx, x, scalar(seed % 2 ? 16.0f : 0.75f), o.data, none, none, o.scale_inv);
    } else {
      o.scale_inv = Tensor::zeros(fp8_block_scale_shape(rows, k, mode == Fp8ScaleMode::Block128x128), DType::Float32);
      ops::fp8_block_quantize(ctx, x, mode == Fp8ScaleMode::Block128x128, false, o.data, o.scale_inv);
    }
    return o;
  };
  auto value = [&](const Fp8Operand& o, int64_t r, int64_t c) {
    const Format& f = o.data.dtype() == DType::Float8E4M3 ? kE4M3 : kE5M2;
    const std::vector<float> s = o.scale_inv.to_floats();
    double si = s[0];
    const int64_t ld = o.scale_inv.dim() == 2 ? o.scale_inv.size(1) : 0;
    if (o.mode == Fp8ScaleMode::Block1x128) si = s[size_t((c / 128) * ld + r)];
    if (o.mode == Fp8ScaleMode::Block128x128) si = s[size_t((r / 128) * ld + c / 128)];
    return definition_value(f, byte_at(o.data, r * k + c)) * si;
  };
  Fp8Operand a = make(m, mode_a, ta, 21), b = make(n, mode_b, tb, 22);
  Tensor out = accumulate ? Tensor::from_floats(std::vector<float>(size_t(m * n), 1.0f), {m, n}, out_type)
                          : Tensor::empty({m, n}, out_type);
  Tensor none;
  ops::fp8_gemm(ctx, a, b, none, out, accumulate, false);
  const std::vector<float> got = out.to_floats();
  double worst = 0, scale = 0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double want = accumulate ? 1.0 : 0.0;
      for (int64_t c = 0; c < k; ++c) want += value(a, i, c) * value(b, j, c);
      worst = std::max(worst, std::fabs(want - got[size_t(i * n + j)]));
      scale = std::max(scale, std::fabs(want));
    }
  }
  EXPECT_LE(worst / scale, out_type == DType::Float32 ? 1e-5 : 1e-2);
}

TEST(Fp8Ops, GemmIsTheProductOfTheDequantizedOperands) {
  check_gemm(Fp8ScaleMode::Tensor, Fp8ScaleMode::Tensor, DType::Float8E4M3, DType::Float8E4M3, DType::Float32, false);
  check_gemm(Fp8ScaleMode::Tensor, Fp8ScaleMode::Tensor, DType::Float8E5M2, DType::Float8E4M3, DType::BFloat16, false);
  check_gemm(Fp8ScaleMode::Tensor, Fp8ScaleMode::Tensor, DType::Float8E4M3, DType::Float8E5M2, DType::Float32, true);
  check_gemm(Fp8ScaleMode::Block1x128, Fp8ScaleMode::Block128x128, DType::Float8E4M3, DType::Float8E4M3,
             DType::BFloat16, false);
  check_gemm(Fp8ScaleMode::Block128x128, Fp8ScaleMode::Block1x128, DType::Float8E4M3, DType::Float8E4M3,
             DType::Float32, false);
  check_gemm(Fp8ScaleMode::Block1x128, Fp8ScaleMode::Block1x128, DType::Float8E5M2, DType::Float8E4M3,
             DType::Float32, true);
}

// The bias is added in fp32 before the one rounding into out.
TEST(Fp8Ops, GemmAddsTheBiasBeforeRounding) {
  Context ctx;
  const int64_t m = 8, n = 16, k = 32;
  Fp8Operand a{Tensor::empty({m, k}, DType::Float8E4M3), scalar(0.0f)}, b{Tensor::empty({n, k}, DType::Float8E4M3),
                                                                            scalar(0.0f)};
  Tensor none;
  ops::fp8_quantize(ctx, random_tensor({m, k}, 1, 3.0f), scalar(8.0f), a.data, none, none, a.scale_inv);
  ops::fp8_quantize(ctx, random_tensor({n, k}, 2, 3.0f), scalar(4.0f), b.data, none, none, b.scale_inv);
  for (DType bt : {DType::Float32, DType::BFloat16}) {
    Tensor bias = random_tensor({n}, 3, 5.0f, bt);
    Tensor plain = Tensor::empty({m, n}, DType::Float32), with32 = Tensor::empty({m, n}, DType::Float32);
    Tensor with16 = Tensor::empty({m, n}, DType::BFloat16);
    ops::fp8_gemm(ctx, a, b, none, plain, false, false);
    ops::fp8_gemm(ctx, a, b, bias, with32, false, false);
    ops::fp8_gemm(ctx, a, b, bias, with16, false, false);
    const std::vector<float> p = plain.to_floats(), w32 = with32.to_floats(), w16 = with16.to_floats(),
                             bv = bias.to_floats();
    for (int64_t i = 0; i < m * n; ++i) {
      const float want = p[size_t(i)] + bv[size_t(i % n)];
      EXPECT_EQ(w32[size_t(i)], want);
      EXPECT_EQ(w16[size_t(i)], to_float(to_bf16(want)));
    }
  }
  Tensor acc = Tensor::zeros({m, n}, DType::Float32), bias = Tensor::zeros({n}, DType::Float32);
  EXPECT_NE(error_of([&] { ops::fp8_gemm(ctx, a, b, bias, acc, true, false); }).find("not with accumulate"),
            std::string::npos);
}

TEST(Fp8Ops, GemmRefusesWhatCublasLtCannotRun) {
  Context ctx;
  auto op = [](int64_t rows, int64_t k, DType t, Fp8ScaleMode mode = Fp8ScaleMode::Tensor) {
    Fp8Operand o;
    o.data = Tensor::zeros({rows, k}, t);
    o.mode = mode;
    o.scale_inv = mode == Fp8ScaleMode::Tensor
                      ? scalar(1.0f)
                      : Tensor::zeros(fp8_block_scale_shape(rows, k, mode == Fp8ScaleMode::Block128x128), DType::Float32);
    return o;
  };
  Tensor out = Tensor::zeros({16, 16}, DType::Float32), out16 = Tensor::zeros({16, 16}, DType::BFloat16);
  auto e5 = op(16, 32, DType::Float8E5M2);
  EXPECT_NE(error_of([&] { ops::fp8_gemm(ctx, e5, e5, Tensor(), out, false, false); }).find("e5m2 x e5m2"), std::string::npos);
  auto b2 = op(16, 128, DType::Float8E4M3, Fp8ScaleMode::Block128x128);
  Tensor out_b = Tensor::zeros({16, 16}, DType::Float32);
  EXPECT_NE(error_of([&] { ops::fp8_gemm(ctx, b2, b2, Tensor(), out_b, false, false); }).find("both operands have 128x128"),
            std::string::npos);
  auto t = op(16, 32, DType::Float8E4M3), v = op(16, 32, DType::Float8E4M3, Fp8ScaleMode::Block1x128);
  EXPECT_NE(error_of([&] { ops::fp8_gemm(ctx, t, v, Tensor(), out, false, false); }).find("cannot be mixed"), std::string::npos);
  EXPECT_NE(error_of([&] { ops::fp8_gemm(ctx, t, t, Tensor(), out16, true, false); }).find("accumulating needs an fp32 out"),
            std::string::npos);
  auto k_other = op(16, 48, DType::Float8E4M3);
  EXPECT_NE(error_of([&] { ops::fp8_gemm(ctx, t, k_other, Tensor(), out, false, false); }).find("one K"), std::string::npos);
  // the CUDA alignment rule, checked the same way on every backend's entry
  std::string e = error_of([&] { ops::check_fp8_gemm(op(16, 40, DType::Float8E4M3), op(16, 40, DType::Float8E4M3),
                                                     Tensor(), out, false, true); });
  EXPECT_NE(e.find("multiple of 16"), std::string::npos) << e;
}

}  // namespace
}  // namespace megatron

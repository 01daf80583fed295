// One FP8 linear layer on the CPU (Note [FP8 linear layer]): forward and backward against the fp32
// linear math on the dequantised operands, for each recipe and format; the delayed recipe's scales
// across steps; the weight cache of a step's microbatches; and the FP8 result near
// the unquantised one; the activation's produced operands (Note [Produced tensors]) equal to the
// materialised ones.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "megatron/core/distributed/param_and_grad_buffer.h"
#include "megatron/core/tensor_parallel/fp8_linear.h"
#include "megatron/core/tensor_parallel/layers.h"
#include "megatron/kernels/cpu/cpu_ops.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

using testing::random_tensor;

constexpr int64_t kTokens = 192, kIn = 256, kOut = 384;

double rel_error(const Tensor& got, const Tensor& want) {
  const std::vector<float> g = got.to_floats(), w = want.to_floats();
  double worst = 0, scale = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    worst = std::max(worst, std::fabs(double(g[i]) - double(w[i])));
    scale = std::max(scale, std::fabs(double(w[i])));
  }
  return worst / std::max(scale, 1e-30);
}

// The dequantised copy of x [rows, cols] as the layer quantises it: per tensor with `scale`, or per
// tile (the block recipe's power-of-two scales).
Tensor dequantized(Context& ctx, const Tensor& x, DType t, float scale, Fp8Recipe recipe, bool tile_2d) {
  const int64_t rows = x.size(0), cols = x.size(1);
  Tensor q = Tensor::empty(x.shape(), t), out = Tensor::empty(x.shape(), DType::Float32), none;
  if (recipe != Fp8Recipe::Blockwise) {
    Tensor s = Tensor::from_floats({scale}, {1}), si = Tensor::from_floats({0.0f}, {1});
    cpu::fp8_quantize(ctx, x, s, q, none, none, si);
    cpu::fp8_dequantize(ctx, q, si, out);
    return out;
  }
  Tensor si = Tensor::zeros(fp8_block_scale_shape(rows, cols, tile_2d), DType::Float32);
  cpu::fp8_block_quantize(ctx, x, tile_2d, true, q, si);
  const std::vector<float> s = si.to_floats();
  const int64_t ld = si.size(1);
  std::vector<float> v(size_t(rows * cols));
  const uint8_t* qb = static_cast<const uint8_t*>(q.raw_data());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float inv = tile_2d ? s[size_t((r / 128) * ld + c / 128)] : s[size_t((c / 128) * ld + r)];
      const float d = t == DType::Float8E4M3 ? to_float(fp8_e4m3{qb[r * cols + c]}) : to_float(fp8_e5m2{qb[r * cols + c]});
      v[size_t(r * cols + c)] = d * inv;
    }
  }
  return Tensor::from_floats(v, x.shape());
}

Tensor transposed(Context& ctx, const Tensor& x) {
  Tensor t = Tensor::empty({x.size(1), x.size(0)}, x.dtype());
  cpu::transpose_01(ctx, x, t);
  return t;
}

struct Layer {
  ParamAndGradBuffer params{DType::Float32, Device::cpu()};
  Linear lin;
  Layer() : lin(params, "l", kIn, kOut, /*bias=*/true, ParamInit::Normal) {
    params.allocate();
    params.init_weights(3, 0.05f, 2, false);
    params.zero_grad();
    params.find("l.bias")->data.copy_from(random_tensor({kOut}, 9, 0.3f));
  }
  Parameter* w() { return params.find("l.weight"); }
  Parameter* b() { return params.find("l.bias"); }
};

Fp8Config fp8_config(Fp8Recipe recipe, const std::string& format) {
  Fp8Config c;
  c.format = format;
  c.recipe = recipe;
  return c;
}

void check_layer(Fp8Recipe recipe, const std::string& format) {
  SCOPED_TRACE(to_string(recipe) + " " + format);
  Context ctx;
  const Fp8Config c = fp8_config(recipe, format);
  Layer L;
  L.lin.enable_fp8(c, Device::cpu());
  ASSERT_NE(L.lin.fp8(), nullptr);
  const Tensor x = random_tensor({kTokens, kIn}, 1, 1.0f), dy = random_tensor({kTokens, kOut}, 2, 1e-2f);
  if (recipe == Fp8Recipe::Delayed) {  // one step for a history: the first step's scales are 1
    L.lin.forward(ctx, x);
    L.lin.backward(ctx, dy, x);
    L.lin.fp8()->update(ctx);
    L.params.zero_grad();
  }
  const Tensor y = L.lin.forward(ctx, x);
  const Tensor gx = L.lin.backward(ctx, dy, x);

  const DType fwd = c.forward_dtype(), bwd = c.backward_dtype();
  Fp8LinearState& s = *L.lin.fp8();
  auto sc = [&](bool backward, int i) {
    return recipe == Fp8Recipe::Blockwise ? 0.0f
                                          : (backward ? s.backward_scaling() : s.forward_scaling()).scale(i).item();
  };
  // The reference: fp32 linear math on the operands each GEMM saw (Note [FP8 linear layer]).
  const Tensor W = L.w()->data;
  const Tensor xq = dequantized(ctx, x, fwd, sc(false, 0), recipe, false);
  const Tensor wq = dequantized(ctx, W, fwd, sc(false, 1), recipe, true);
  Tensor y_ref = Tensor::empty({kTokens, kOut}, DType::Float32);
  cpu::linear_forward(ctx, xq, wq, L.b()->data, y_ref);
  EXPECT_LE(rel_error(y, y_ref), 1e-5);

  const Tensor gq = dequantized(ctx, dy, bwd, sc(true, 0), recipe, false);
  const Tensor wtq = recipe == Fp8Recipe::Blockwise ? transposed(ctx, dequantized(ctx, transposed(ctx, W), fwd, 0, recipe, true))
                                                    : wq;
  Tensor gx_ref = Tensor::empty({kTokens, kIn}, DType::Float32), none;
  cpu::linear_backward(ctx, gq, xq, wtq, gx_ref, none, none);
  EXPECT_LE(rel_error(gx, gx_ref), 1e-5);

  // weight gradient: dy_t and x_t (1x128 along the tokens for blockwise)
  Tensor gq_t = transposed(ctx, dequantized(ctx, transposed(ctx, dy), bwd, sc(true, 0), recipe, false));
  Tensor xq_t = transposed(ctx, dequantized(ctx, transposed(ctx, x), fwd, sc(false, 0), recipe, false));
  Tensor wg_ref = Tensor::zeros({kOut, kIn}, DType::Float32), bg_ref = Tensor::zeros({kOut}, DType::Float32);
  cpu::linear_backward(ctx, gq_t, xq_t, W, none, wg_ref, none);
  cpu::linear_backward(ctx, dy, x, W, none, none, bg_ref);  // the bias gradient from dy itself
  EXPECT_LE(rel_error(L.w()->main_grad, wg_ref), 1e-5);
  EXPECT_LE(rel_error(L.b()->main_grad, bg_ref), 1e-6);

  // and near the unquantised layer
  Tensor y32 = Tensor::empty({kTokens, kOut}, DType::Float32), gx32 = Tensor::empty({kTokens, kIn}, DType::Float32);
  Tensor wg32 = Tensor::zeros({kOut, kIn}, DType::Float32);
  cpu::linear_forward(ctx, x, W, L.b()->data, y32);
  cpu::linear_backward(ctx, dy, x, W, gx32, wg32, none);
  EXPECT_LE(rel_error(y, y32), 0.08);
  EXPECT_LE(rel_error(gx, gx32), bwd == DType::Float8E5M2 ? 0.2 : 0.08);
  EXPECT_LE(rel_error(L.w()->main_grad, wg32), bwd == DType::Float8E5M2 ? 0.2 : 0.08);
}

TEST(Fp8Linear, EachRecipeEqualsTheDequantizedFp32Math) {
  for (Fp8Recipe r : {Fp8Recipe::Delayed, Fp8Recipe::Tensorwise, Fp8Recipe::Blockwise}) {
    for (const char* f : {"e4m3", "hybrid"}) check_layer(r, f);
  }
}

TEST(Fp8Linear, DelayedScalesFollowTheLastStepsAmax) {
  Context ctx;
  const Fp8Config c = fp8_config(Fp8Recipe::Delayed, "hybrid");
  Layer L;
  L.lin.enable_fp8(c, Device::cpu());
  Fp8LinearState& s = *L.lin.fp8();
  float want_x = 1.0f, want_w = 1.0f, want_g = 1.0f;
  for (int step = 0; step < 3; ++step) {
    const Tensor x = random_tensor({kTokens, kIn}, uint64_t(10 + step), float(step + 1));
    const Tensor dy = random_tensor({kTokens, kOut}, uint64_t(20 + step), 1e-3f);
    EXPECT_EQ(s.forward_scaling().scale(0).item(), want_x) << step;
    EXPECT_EQ(s.forward_scaling().scale(1).item(), want_w) << step;
    EXPECT_EQ(s.backward_scaling().scale(0).item(), want_g) << step;
    const Tensor y = L.lin.forward(ctx, x);
    L.lin.backward(ctx, dy, x);
    Tensor y_ref = Tensor::empty({kTokens, kOut}, DType::Float32);
    cpu::linear_forward(ctx, dequantized(ctx, x, DType::Float8E4M3, want_x, c.recipe, false),
                        dequantized(ctx, L.w()->data, DType::Float8E4M3, want_w, c.recipe, true), L.b()->data, y_ref);
    EXPECT_LE(rel_error(y, y_ref), 1e-5) << step;
    s.update(ctx);
    auto amax = [](const Tensor& t) {
      float m = 0;
      for (float v : t.to_floats()) m = std::max(m, std::fabs(v));
      return m;
    };
    want_x = 448.0f / amax(x);
    want_w = 448.0f / amax(L.w()->data);
    want_g = 57344.0f / amax(dy);
  }
}

// Note [FP8 weight cache]: a step of three microbatches with the weight cache gives the outputs,
// input gradients, accumulated weight gradient and (delayed) amax history of the same step without
// it, bit for bit, for each recipe; the copies are made at the first forward and backward and
// dropped when the cache is turned off. In the middle of the step the weight changes under the
// cache without the layer seeing it — the cached copy is what the step uses — so the cache must
// be off whenever the weights change (the optimizer runs after finish_fp8_step).
TEST(Fp8Linear, WeightCacheGivesTheUncachedStep) {
  for (Fp8Recipe recipe : {Fp8Recipe::Delayed, Fp8Recipe::Tensorwise, Fp8Recipe::Blockwise}) {
    SCOPED_TRACE(to_string(recipe));
    Context ctx;
    const Fp8Config c = fp8_config(recipe, "hybrid");
    struct Run {
      std::vector<std::vector<float>> y, dx;
      std::vector<float> dw, history;
    };
    auto step = [&](bool cache) {
      Layer L;
      L.lin.enable_fp8(c, Device::cpu());
      Fp8LinearState& s = *L.lin.fp8();
      s.set_weight_cache(cache);
      Run r;
      for (int mb = 0; mb < 3; ++mb) {
        const Tensor x = random_tensor({kTokens, kIn}, uint64_t(30 + mb), 1.0f);
        const Tensor dy = random_tensor({kTokens, kOut}, uint64_t(40 + mb), 1e-3f);
        r.y.push_back(L.lin.forward(ctx, x).to_floats());
        EXPECT_EQ(s.has_cached_weight(), cache) << "after forward " << mb;
        r.dx.push_back(L.lin.backward(ctx, dy, x).to_floats());
      }
      r.dw = L.w()->main_grad.to_floats();
      if (recipe == Fp8Recipe::Delayed) r.history = s.forward_scaling().amax_history().to_floats();
      s.set_weight_cache(false);
      EXPECT_FALSE(s.has_cached_weight());
      return r;
    };
    const Run cached = step(true), plain = step(false);
    EXPECT_EQ(cached.y, plain.y);
    EXPECT_EQ(cached.dx, plain.dx);
    EXPECT_EQ(cached.dw, plain.dw);
    EXPECT_EQ(cached.history, plain.history);
  }
  // The cached copy is used as it is: a weight changed under the cache is not seen.
  Context ctx;
  const Fp8Config c = fp8_config(Fp8Recipe::Tensorwise, "e4m3");
  Layer L;
  L.lin.enable_fp8(c, Device::cpu());
  L.lin.fp8()->set_weight_cache(true);
  const Tensor x = random_tensor({kTokens, kIn}, 50, 1.0f);
  const std::vector<float> before = L.lin.forward(ctx, x).to_floats();
  L.w()->data.copy_from(random_tensor({kOut, kIn}, 51, 0.05f));
  EXPECT_EQ(L.lin.forward(ctx, x).to_floats(), before);
  L.lin.fp8()->set_weight_cache(false);
  EXPECT_NE(L.lin.forward(ctx, x).to_floats(), before);
}

// --no-fp8-wgrad (Fp8Config::wgrad false): the weight gradient is the unquantised layer's dyᵀ·x
// (the fp32 linear_backward, bit for bit), while the forward and the input gradient stay the FP8
// layer's, for each recipe.
TEST(Fp8Linear, NoFp8WgradRunsTheWeightGradientUnquantised) {
  for (Fp8Recipe recipe : {Fp8Recipe::Delayed, Fp8Recipe::Tensorwise, Fp8Recipe::Blockwise}) {
    SCOPED_TRACE(to_string(recipe));
    Context ctx;
    const Fp8Config c = fp8_config(recipe, "hybrid");
    const Tensor x = random_tensor({kTokens, kIn}, 60, 1.0f), dy = random_tensor({kTokens, kOut}, 61, 1e-3f);
    auto run = [&](bool wgrad, std::vector<float>& dx, std::vector<float>& dw, std::vector<float>& y) {
      Fp8Config k = c;
      k.wgrad = wgrad;
      Layer L;
      L.lin.enable_fp8(k, Device::cpu());
      y = L.lin.forward(ctx, x).to_floats();
      dx = L.lin.backward(ctx, dy, x).to_floats();
      dw = L.w()->main_grad.to_floats();
      Tensor want = Tensor::zeros({kOut, kIn}, DType::Float32), none;
      cpu::linear_backward(ctx, dy, x, L.w()->data, none, want, none);
      return want.to_floats();
    };
    std::vector<float> dx_fp8, dw_fp8, y_fp8, dx_hp, dw_hp, y_hp;
    run(true, dx_fp8, dw_fp8, y_fp8);
    const std::vector<float> unquantised = run(false, dx_hp, dw_hp, y_hp);
    EXPECT_EQ(dw_hp, unquantised);
    EXPECT_NE(dw_fp8, unquantised);
    EXPECT_EQ(dx_hp, dx_fp8);
    EXPECT_EQ(y_hp, y_fp8);
  }
}

// Note [Produced tensors]: an FP8 layer given the activation's output (fc2's input) or its input
// gradient (fc1's output gradient) as produced tensors gives the bits it gives for the
// materialised tensors — SwiGLU and GeLU, every recipe, with and without --no-fp8-wgrad, over two
// steps (the delayed recipe's second step quantises with the first one's amax).
TEST(Fp8Linear, ProducedActivationOperandsEqualTheMaterialisedOnes) {
  constexpr int64_t f = 128;
  for (Fp8Activation act : {Fp8Activation::Swiglu, Fp8Activation::Gelu}) {
    const bool swiglu = act == Fp8Activation::Swiglu;
    const int64_t width = swiglu ? 2 * f : f;  // fc1's output
    for (Fp8Recipe recipe : {Fp8Recipe::Delayed, Fp8Recipe::Tensorwise, Fp8Recipe::Blockwise}) {
      for (bool wgrad : {true, false}) {
        SCOPED_TRACE(std::string(swiglu ? "swiglu " : "gelu ") + to_string(recipe) + (wgrad ? "" : " --no-fp8-wgrad"));
        Context ctx;
        Fp8Config c = fp8_config(recipe, "hybrid");
        c.wgrad = wgrad;
        const Tensor fc1_out = random_tensor({kTokens, width}, 70, 2.0f);
        const Tensor x = random_tensor({kTokens, kIn}, 71, 1.0f);
        auto run = [&](bool produced) {
          std::vector<std::vector<float>> out;
          ParamAndGradBuffer params(DType::Float32, Device::cpu());
          Linear fc1(params, "fc1", kIn, width, /*bias=*/true, ParamInit::Normal);
          Linear fc2(params, "fc2", f, kOut, /*bias=*/true, ParamInit::Normal);
          params.allocate();
          params.init_weights(5, 0.05f, 2, false);
          params.zero_grad();
          fc1.enable_fp8(c, Device::cpu());
          fc2.enable_fp8(c, Device::cpu());
          Tensor a = Tensor::empty({kTokens, f}, DType::Float32);
          if (swiglu) {
            cpu::swiglu_forward(ctx, fc1_out, a);
          } else {
            cpu::gelu_forward(ctx, fc1_out, a);
          }
          const ProducedTensor act_in = produced ? ProducedTensor::activation(act, fc1_out) : ProducedTensor(a);
          for (int step = 0; step < 2; ++step) {
            const Tensor dy = random_tensor({kTokens, kOut}, 72 + step, 1e-2f);
            out.push_back(fc2.forward(ctx, act_in).to_floats());
            const Tensor grad_act = fc2.backward(ctx, dy, act_in);
            out.push_back(grad_act.to_floats());
            Tensor grad_fc1 = Tensor::empty(fc1_out.shape(), DType::Float32);
            if (swiglu) {
              cpu::swiglu_backward(ctx, grad_act, fc1_out, grad_fc1);
            } else {
              cpu::gelu_backward(ctx, grad_act, fc1_out, grad_fc1);
            }
            fc1.forward(ctx, x);
            const ProducedTensor g =
                produced ? ProducedTensor::activation_grad(act, grad_act, fc1_out) : ProducedTensor(grad_fc1);
            out.push_back(fc1.backward(ctx, g, x).to_floats());
            for (const char* name : {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}) {
              out.push_back(params.find(name)->main_grad.to_floats());
            }
            fc1.fp8()->update(ctx);
            fc2.fp8()->update(ctx);
          }
          return out;
        };
        const auto want = run(false), got = run(true);
        ASSERT_EQ(got.size(), want.size());
        for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], want[i]) << "output " << i;
      }
    }
  }
  // the bf16 GeLU epilogue fusions are not for FP8 layers
  ParamAndGradBuffer params(DType::Float32, Device::cpu());
  Linear fc1(params, "fc1", kIn, f, true, ParamInit::Normal);
  params.allocate();
  fc1.enable_fp8(fp8_config(Fp8Recipe::Delayed, "hybrid"), Device::cpu());
  Context ctx;
  Tensor pre;
  EXPECT_THROW(fc1.forward_gelu(ctx, random_tensor({kTokens, kIn}, 74, 1.0f), pre), std::exception);
}
}  // namespace
}  // namespace megatron

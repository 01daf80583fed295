// Dispatch of the FP8 ops (fp8_op_list.inc) to the CPU reference or the CUDA kernels, as ops.cpp
// does for op_list.inc (Note [Generated dispatch]), and the argument checks both backends share.
#include "megatron/kernels/fp8_ops.h"

#include <cmath>

#include "megatron/runtime/profiler.h"

namespace megatron {

float fp8_max_of(DType t) {
  switch (t) {
    case DType::Float8E4M3: return 448.0f;
    case DType::Float8E5M2: return 57344.0f;
    default: MG_CHECK(false, "fp8: {} is not an fp8 dtype (fp8_e4m3 or fp8_e5m2)", to_string(t));
  }
  return 0.0f;
}

Shape fp8_block_scale_shape(int64_t rows, int64_t cols, bool tile_2d) {
  auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  auto round_up4 = [](int64_t a) { return (a + 3) / 4 * 4; };
  if (tile_2d) return {ceil_div(rows, kFp8BlockLen), round_up4(ceil_div(cols, kFp8BlockLen))};
  return {ceil_div(cols, kFp8BlockLen), round_up4(rows)};
}

float Fp8DelayedParams::scaled_max() const { return fp8_max * std::pow(2.0f, float(-margin)); }

}  // namespace megatron

namespace megatron::ops {

namespace {
bool on_cuda(const Context& ctx, const char* op) {
#ifdef MEGATRON_WITH_CUDA_OPS
  (void)op;
  return ctx.is_cuda();
#else
  MG_CHECK(!ctx.is_cuda(), "op {} was asked to run on {} but this build has no CUDA kernels: run on the CPU", op,
           ctx.device().str());
  return false;
#endif
}

std::string str_of(const Tensor& t) { return t.defined() ? t.str() : std::string("undefined"); }

bool is_fp32_scalar(const Tensor& t, const Device& d) {
  return t.defined() && t.dtype() == DType::Float32 && t.numel() == 1 && t.device() == d;
}
}  // namespace

#ifdef MEGATRON_WITH_CUDA_OPS
#define MG_DISPATCH_CUDA(name, args) \
  if (on_cuda(ctx, #name)) return cuda::name args;
#else
#define MG_DISPATCH_CUDA(name, args) on_cuda(ctx, #name);
#endif
#define MG_OP_AS(ret, name, label, params, args) \
  ret name params {                              \
    ProfileScope profile(ctx, label);            \
    MG_DISPATCH_CUDA(name, args)                 \
    return cpu::name args;                       \
  }
#define MG_OP(ret, name, params, args) MG_OP_AS(ret, name, #name, params, args)
#include "megatron/kernels/fp8_op_list.inc"
#undef MG_OP
#undef MG_OP_AS
#undef MG_DISPATCH_CUDA

namespace {
// fp8_quantize's outputs for an x of `shape` on d (`op` names the caller in the message).
std::pair<int64_t, int64_t> check_quantize_outputs(const char* op, const Shape& shape, const Device& d,
                                                   const Tensor& scale, const Tensor& q, const Tensor& q_t,
                                                   const Tensor& amax, const Tensor& scale_inv) {
  const int64_t k = shape.empty() ? 1 : shape.back();
  int64_t numel = 1;
  for (int64_t s : shape) numel *= s;
  const int64_t m = k == 0 ? 0 : numel / k;
  MG_CHECK(is_fp32_scalar(scale, d), "{}: scale must be fp32 [1] beside x ({}), got {}", op, d.str(), str_of(scale));
  MG_CHECK(!q.defined() || (is_fp8(q.dtype()) && q.shape() == shape && q.device() == d),
           "{}: q must be fp8 of x's shape {} on {}, got {}", op, shape_str(shape), d.str(), q.str());
  const Shape transposed{k, m};
  MG_CHECK(!q_t.defined() || (is_fp8(q_t.dtype()) && q_t.shape() == transposed && q_t.device() == d),
           "{}: q_t must be fp8 [{}, {}] on {}, got {}", op, k, m, d.str(), q_t.str());
  MG_CHECK(!q.defined() || !q_t.defined() || q.dtype() == q_t.dtype(), "{}: q is {} but q_t {}", op,
           to_string(q.dtype()), to_string(q_t.dtype()));
  MG_CHECK(!amax.defined() || is_fp32_scalar(amax, d), "{}: amax must be fp32 [1] on {}, got {}", op, d.str(),
           amax.str());
  MG_CHECK(!scale_inv.defined() || is_fp32_scalar(scale_inv, d), "{}: scale_inv must be fp32 [1] on {}, got {}", op,
           d.str(), scale_inv.str());
  return {m, k};
}

bool is_float(const Tensor& t) {
  return t.defined() && (t.dtype() == DType::Float32 || t.dtype() == DType::BFloat16 || t.dtype() == DType::Float16);
}
}  // namespace

std::pair<int64_t, int64_t> check_fp8_quantize(const Tensor& x, const Tensor& scale, const Tensor& q,
                                               const Tensor& q_t, const Tensor& amax, const Tensor& scale_inv) {
  MG_CHECK(is_float(x), "fp8_quantize: x must be fp32, bf16 or fp16, got {}", str_of(x));
  return check_quantize_outputs("fp8_quantize", x.shape(), x.device(), scale, q, q_t, amax, scale_inv);
}

std::pair<int64_t, int64_t> check_fp8_quantize_activation(Fp8Activation act, const Tensor& pre, const Tensor& grad,
                                                          const Tensor& scale, const Tensor& q, const Tensor& q_t,
                                                          const Tensor& amax, const Tensor& scale_inv,
                                                          const Tensor& dbias) {
  const bool swiglu = act == Fp8Activation::Swiglu;
  MG_CHECK(is_float(pre) && pre.dim() >= 1 && (!swiglu || pre.size(-1) % 2 == 0),
           "fp8_quantize_activation: pre must be fp32, bf16 or fp16{}, got {}", swiglu ? " [..., 2f] (SwiGLU)" : "",
           str_of(pre));
  Shape out = pre.shape();
  if (swiglu) out.back() /= 2;
  MG_CHECK(!grad.defined() || (grad.dtype() == pre.dtype() && grad.shape() == out && grad.device() == pre.device()),
           "fp8_quantize_activation: grad must be {} {} on {} (the activation's output), got {}",
           to_string(pre.dtype()), shape_str(out), pre.device().str(), grad.str());
  const auto mk = check_quantize_outputs("fp8_quantize_activation", grad.defined() ? pre.shape() : out, pre.device(),
                                         scale, q, q_t, amax, scale_inv);
  MG_CHECK(!dbias.defined() ||
               (dbias.dtype() == DType::Float32 && dbias.numel() == mk.second && dbias.device() == pre.device()),
           "fp8_quantize_activation: dbias must be fp32 [{}] on {} or undefined, got {}", mk.second,
           pre.device().str(), dbias.str());
  return mk;
}

void fp8_quantize_member(Context& ctx, const Tensor& x, Tensor& scale, Tensor& q, Tensor& q_t, Tensor& amax,
                         Tensor& scale_inv, bool current_scaling, float fp8_max) {
  Tensor none;
  if (!current_scaling) {
    fp8_quantize(ctx, x, scale, q, q_t, amax, scale_inv);
    return;
  }
  fp8_amax(ctx, x, amax);  // Note [Current scaling]: the amax, its scale, then the codes
  fp8_scale_from_amax(ctx, amax, fp8_max, /*power_of_two_scales=*/false, scale, scale_inv);
  fp8_quantize(ctx, x, scale, q, q_t, none, none);
}

Tensor fp8_activation_values(Context& ctx, Fp8Activation act, const Tensor& pre, const Tensor& grad) {
  const bool swiglu = act == Fp8Activation::Swiglu;
  Shape shape = pre.shape();
  if (swiglu && !grad.defined()) shape.back() /= 2;
  Tensor x = Tensor::empty(shape, pre.dtype(), ctx.device());
  if (swiglu && grad.defined()) {
    swiglu_backward(ctx, grad, pre, x);
  } else if (swiglu) {
    swiglu_forward(ctx, pre, x);
  } else if (grad.defined()) {
    gelu_backward(ctx, grad, pre, x);
  } else {
    gelu_forward(ctx, pre, x);
  }
  return x;
}

std::pair<int64_t, int64_t> check_fp8_quantize_dbias(const Tensor& x, const Tensor& scale, const Tensor& q,
                                                     const Tensor& q_t, const Tensor& amax, const Tensor& scale_inv,
                                                     const Tensor& dbias) {
  const auto mk = check_fp8_quantize(x, scale, q, q_t, amax, scale_inv);
  MG_CHECK(dbias.defined() && dbias.dtype() == DType::Float32 && dbias.numel() == mk.second &&
               dbias.device() == x.device(),
           "fp8_quantize_dbias: dbias must be fp32 [{}] on {}, got {}", mk.second, x.device().str(), str_of(dbias));
  return mk;
}

std::pair<int64_t, int64_t> check_fp8_block_quantize(const Tensor& x, bool tile_2d, const Tensor& q,
                                                     const Tensor& scale_inv) {
  MG_CHECK(x.defined() && x.dim() == 2 &&
               (x.dtype() == DType::Float32 || x.dtype() == DType::BFloat16 || x.dtype() == DType::Float16),
           "fp8_block_quantize: x must be fp32, bf16 or fp16 [M, K], got {}", str_of(x));
  const int64_t m = x.size(0), k = x.size(1);
  MG_CHECK(q.defined() && is_fp8(q.dtype()) && q.shape() == x.shape() && q.device() == x.device(),
           "fp8_block_quantize: q must be fp8 {} on {}, got {}", shape_str(x.shape()), x.device().str(), str_of(q));
  const Shape ss = fp8_block_scale_shape(m, k, tile_2d);
  MG_CHECK(scale_inv.defined() && scale_inv.dtype() == DType::Float32 && scale_inv.shape() == ss &&
               scale_inv.device() == x.device(),
           "fp8_block_quantize: scale_inv must be fp32 {} for {} tiles of {}, got {}", shape_str(ss),
           tile_2d ? "128x128" : "1x128", shape_str(x.shape()), str_of(scale_inv));
  return {m, k};
}

std::pair<int64_t, int64_t> check_fp8_block_quantize_transposed(const Tensor& x, const Tensor& q_t,
                                                                const Tensor& scale_inv) {
  MG_CHECK(is_float(x) && x.dim() == 2, "fp8_block_quantize_transposed: x must be fp32, bf16 or fp16 [M, K], got {}",
           str_of(x));
  const int64_t m = x.size(0), k = x.size(1);
  const Shape t{k, m};
  MG_CHECK(q_t.defined() && is_fp8(q_t.dtype()) && q_t.shape() == t && q_t.device() == x.device(),
           "fp8_block_quantize_transposed: q_t must be fp8 {} on {}, got {}", shape_str(t), x.device().str(),
           str_of(q_t));
  const Shape ss = fp8_block_scale_shape(k, m, false);
  MG_CHECK(scale_inv.defined() && scale_inv.dtype() == DType::Float32 && scale_inv.shape() == ss &&
               scale_inv.device() == x.device(),
           "fp8_block_quantize_transposed: scale_inv must be fp32 {} for the 1x128 tiles of {}, got {}",
           shape_str(ss), shape_str(t), str_of(scale_inv));
  return {m, k};
}

void check_fp8_block_partial(const char* op, const Tensor& x, int64_t start, int64_t cols, const Tensor& grid,
                             const Tensor& q) {
  MG_CHECK(x.defined() && (x.dtype() == DType::Float32 || x.dtype() == DType::BFloat16 || x.dtype() == DType::Float16),
           "{}: x must be fp32, bf16 or fp16, got {}", op, str_of(x));
  MG_CHECK(start >= 0 && cols > 0, "{}: start ({}) must be >= 0 and cols ({}) > 0", op, start, cols);
  MG_CHECK(grid.defined() && grid.dtype() == DType::Float32 && grid.dim() == 2 && grid.device() == x.device(),
           "{}: the tile grid must be fp32 [R, ld] beside x ({}), got {}", op, x.device().str(), str_of(grid));
  MG_CHECK(grid.size(1) * kFp8BlockLen >= cols, "{}: the tile grid {} has fewer than ceil({} / {}) columns", op,
           shape_str(grid.shape()), cols, kFp8BlockLen);
  if (x.numel() > 0) {
    const int64_t last_row = (start + x.numel() - 1) / cols;
    MG_CHECK(last_row / kFp8BlockLen < grid.size(0), "{}: elements [{}, {}) of a weight {} wide reach row {}, past "
             "the tile grid {}", op, start, start + x.numel(), cols, last_row, shape_str(grid.shape()));
  }
  MG_CHECK(!q.defined() || (is_fp8(q.dtype()) && q.numel() == x.numel() && q.device() == x.device()),
           "{}: q must be fp8 of x's {} elements on {}, got {}", op, x.numel(), x.device().str(), str_of(q));
}

void check_fp8_gemm_grouped(const std::vector<Fp8Operand>& a, const std::vector<Fp8Operand>& b,
                            const std::vector<Tensor>& bias, const std::vector<Tensor>& out) {
  MG_CHECK(b.size() == a.size() && out.size() == a.size() && (bias.empty() || bias.size() == a.size()),
           "fp8_gemm_grouped: {} A, {} B, {} out and {} biases: one each per member (biases: none or one each)",
           a.size(), b.size(), out.size(), bias.size());
}

size_t check_fp8_quantize_grouped(const std::vector<Tensor>& x, const std::vector<Tensor>& scale,
                                  const std::vector<Tensor>& q, const std::vector<Tensor>& q_t,
                                  const std::vector<Tensor>& amax, const std::vector<Tensor>& scale_inv,
                                  bool current_scaling) {
  const size_t n = x.size();
  auto one_each = [n](const std::vector<Tensor>& v, const char* name, bool needed) {
    MG_CHECK(v.size() == n || (v.empty() && !needed), "fp8_quantize_grouped: {} {} for {} members{}", v.size(), name,
             n, needed ? " (current scaling needs one each)" : " (give none or one each)");
  };
  one_each(scale, "scales", true);
  one_each(q, "q", false);
  one_each(q_t, "q_t", false);
  one_each(amax, "amaxes", current_scaling);
  one_each(scale_inv, "scale_invs", current_scaling);
  Tensor none;
  for (size_t i = 0; i < n; ++i) {
    MG_CHECK(is_float(x[i]) && x[i].dim() == 2 && x[i].size(0) > 0 && x[i].dtype() == x[0].dtype(),
             "fp8_quantize_grouped: member {}'s x must be {} [M > 0, K] like member 0's, got {}", i,
             to_string(x[0].dtype()), str_of(x[i]));
    const int64_t m = x[i].size(0), k = x[i].size(1);
    const Tensor& qt = q_t.empty() ? none : q_t[i];
    MG_CHECK(!qt.defined() || (is_fp8(qt.dtype()) && qt.dim() == 2 && qt.size(0) == k && qt.size(1) >= m &&
                               qt.device() == x[i].device()),
             "fp8_quantize_grouped: member {}'s q_t must be fp8 [{}, P >= {}] on {}, got {}", i, k, m,
             x[i].device().str(), str_of(qt));
    const Tensor& qi = q.empty() ? none : q[i];
    MG_CHECK(!qi.defined() || !qt.defined() || qi.dtype() == qt.dtype(), "fp8_quantize_grouped: q is {} but q_t {}",
             to_string(qi.dtype()), to_string(qt.dtype()));
    check_quantize_outputs("fp8_quantize_grouped", x[i].shape(), x[i].device(), scale[i], qi, none,
                           amax.empty() ? none : amax[i], scale_inv.empty() ? none : scale_inv[i]);
  }
  return n;
}

std::pair<int64_t, int64_t> check_fp8_delayed_scale_update(const Tensor& amax_history, const Tensor& scale) {
  MG_CHECK(amax_history.defined() && amax_history.dtype() == DType::Float32 && amax_history.dim() == 2 &&
               amax_history.size(0) >= 1,
           "fp8_delayed_scale_update: amax_history must be fp32 [L >= 1, n], got {}", str_of(amax_history));
  const int64_t n = amax_history.size(1);
  MG_CHECK(scale.defined() && scale.dtype() == DType::Float32 && scale.numel() == n &&
               scale.device() == amax_history.device(),
           "fp8_delayed_scale_update: scale must be fp32 [{}] beside the history, got {}", n, str_of(scale));
  return {amax_history.size(0), n};
}

void check_fp8_gemm(const Fp8Operand& a, const Fp8Operand& b, const Tensor& bias, const Tensor& out, bool accumulate,
                    bool cuda) {
  auto check_operand = [](const Fp8Operand& o, const char* name) {
    MG_CHECK(o.data.defined() && o.data.dim() == 2 && is_fp8(o.data.dtype()),
             "fp8_gemm: {} must be fp8 [rows, K], got {}", name, str_of(o.data));
    Shape want{1};
    if (o.mode != Fp8ScaleMode::Tensor) {
      want = fp8_block_scale_shape(o.data.size(0), o.data.size(1), o.mode == Fp8ScaleMode::Block128x128);
    }
    MG_CHECK(o.scale_inv.defined() && o.scale_inv.dtype() == DType::Float32 && o.scale_inv.shape() == want &&
                 o.scale_inv.device() == o.data.device(),
             "fp8_gemm: {}'s scale_inv must be fp32 {} on {}, got {}", name, shape_str(want), o.data.device().str(),
             str_of(o.scale_inv));
  };
  check_operand(a, "A");
  check_operand(b, "B");
  const int64_t m = a.data.size(0), k = a.data.size(1), n = b.data.size(0);
  MG_CHECK(b.data.size(1) == k, "fp8_gemm: A is {} and B {}: both must be [rows, K] with one K (out = A·Bᵀ)",
           a.data.str(), b.data.str());
  MG_CHECK(a.data.device() == b.data.device(), "fp8_gemm: A is on {} and B on {}", a.data.device().str(),
           b.data.device().str());
  MG_CHECK(!(a.data.dtype() == DType::Float8E5M2 && b.data.dtype() == DType::Float8E5M2),
           "fp8_gemm: e5m2 x e5m2 has no kernel (cuBLASLt takes e4m3 x e4m3, e4m3 x e5m2, e5m2 x e4m3)");
  MG_CHECK((a.mode == Fp8ScaleMode::Tensor) == (b.mode == Fp8ScaleMode::Tensor),
           "fp8_gemm: per-tensor and block scales cannot be mixed in one GEMM");
  MG_CHECK(!(a.mode == Fp8ScaleMode::Block128x128 && b.mode == Fp8ScaleMode::Block128x128),
           "fp8_gemm: both operands have 128x128 block scales; cuBLASLt takes 1x128 x 1x128, 1x128 x 128x128 or "
           "128x128 x 1x128");
  const Shape out_shape{m, n};
  MG_CHECK(out.defined() && out.shape() == out_shape && out.device() == a.data.device() &&
               (out.dtype() == DType::BFloat16 || out.dtype() == DType::Float32),
           "fp8_gemm: out must be bf16 or fp32 [{}, {}] on {}, got {}", m, n, a.data.device().str(), str_of(out));
  MG_CHECK(!accumulate || out.dtype() == DType::Float32, "fp8_gemm: accumulating needs an fp32 out, got {}",
           out.str());
  MG_CHECK(!bias.defined() || (!accumulate && bias.numel() == n && bias.device() == out.device() &&
                               (bias.dtype() == DType::BFloat16 || bias.dtype() == DType::Float32)),
           "fp8_gemm: the bias must be bf16 or fp32 [{}] beside out, and not with accumulate; got {}", n, bias.str());
  if (cuda) {
    MG_CHECK(k % 16 == 0 && n % 8 == 0,
             "fp8_gemm on CUDA: K = {} must be a multiple of 16 and N = {} of 8 (cuBLASLt's FP8 alignment); pad the "
             "hidden sizes (or the token count, for the weight gradient)",
             k, n);
    if (a.mode != Fp8ScaleMode::Tensor) {
      MG_CHECK(m % 8 == 0, "fp8_gemm on CUDA: block-scaled M = {} must be a multiple of 8", m);
    }
  }
}

}  // namespace megatron::ops

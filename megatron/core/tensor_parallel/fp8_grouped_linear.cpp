// Several FP8 linear layers over row blocks of one tensor (fp8_grouped_linear.h, Note [Grouped FP8
// linear layers]).
#include "megatron/core/tensor_parallel/fp8_grouped_linear.h"

#include "megatron/kernels/ops.h"

namespace megatron {

namespace {

// The layers with rows: which, and their blocks [start, start + count) of the rows.
struct Blocks {
  std::vector<Fp8LinearState*> layers;
  std::vector<size_t> index;  // into the caller's per-layer lists
  std::vector<int64_t> start, count;
};

Blocks blocks_of(const std::vector<Fp8LinearState*>& layers, const std::vector<int64_t>& rows, int64_t total) {
  MG_CHECK(rows.size() == layers.size(), "{} row counts for {} grouped FP8 layers", rows.size(), layers.size());
  Blocks b;
  int64_t start = 0;
  for (size_t e = 0; e < layers.size(); ++e) {
    MG_CHECK(rows[e] >= 0, "grouped FP8 layer {} has {} rows", e, rows[e]);
    if (rows[e] > 0) {
      MG_ASSERT(layers[e], "grouped FP8 layer {} has no FP8 state", e);
      MG_CHECK(layers[e]->config().recipe != Fp8Recipe::Blockwise,
               "grouped FP8 layers take the per-tensor recipes (delayed, tensorwise), not blockwise");
      b.layers.push_back(layers[e]);
      b.index.push_back(e);
      b.start.push_back(start);
      b.count.push_back(rows[e]);
    }
    start += rows[e];
  }
  MG_CHECK(start == total, "the grouped FP8 layers' row counts sum to {} for {} rows", start, total);
  return b;
}

std::vector<Tensor> row_blocks(const Blocks& b, const Tensor& x) {
  std::vector<Tensor> out;
  for (size_t j = 0; j < b.start.size(); ++j) out.push_back(x.slice(b.start[j], b.start[j] + b.count[j]));
  return out;
}

// Each block's transposed operand [cols, rows padded], side by side in one buffer.
std::vector<Tensor> padded_transposed_blocks(Context& ctx, const Blocks& b, int64_t cols, DType dtype) {
  int64_t total = 0;
  for (int64_t n : b.count) total += cols * fp8_group_padded_rows(n);
  const Tensor all = Tensor::empty({total}, dtype, ctx.device());
  std::vector<Tensor> out;
  int64_t offset = 0;
  for (int64_t n : b.count) {
    out.push_back(all.flat_slice(offset, cols * fp8_group_padded_rows(n)).view({cols, fp8_group_padded_rows(n)}));
    offset += cols * fp8_group_padded_rows(n);
  }
  return out;
}

// Member j = xs[j] quantised with tensor `index` of ls[j]'s forward (or, backward, gradient) state
// into qs[j] / qts[j] (either list empty) — as Fp8TensorScaling::quantize of each — in one grouped
// pass. again: with the scale as it stands, recording nothing.
void quantize_members(Context& ctx, const std::vector<Fp8LinearState*>& ls, bool backward, int64_t index,
                      const std::vector<Tensor>& xs, std::vector<Tensor>& qs, std::vector<Tensor>& qts, bool again) {
  std::vector<Tensor> scales, amaxes, scale_invs;
  for (Fp8LinearState* l : ls) {
    Fp8TensorScaling& s = backward ? l->backward_scaling() : l->forward_scaling();
    scales.push_back(s.scale(index));
    if (!again) {
      amaxes.push_back(s.amax(index));
      scale_invs.push_back(s.scale_inv(index));
    }
  }
  const Fp8TensorScaling& s0 = backward ? ls[0]->backward_scaling() : ls[0]->forward_scaling();
  const bool current = !again && s0.recipe() == Fp8Recipe::Tensorwise;
  ops::fp8_quantize_grouped(ctx, xs, scales, qs, qts, amaxes, scale_invs, current, fp8_max_of(s0.dtype()));
}

// The layers' weight operands (transposed: for the input gradient): ready ones as they are (Note
// [FP8 weight cache], Note [FP8 parameters]), the others from one grouped pass — tensor 1 of the
// forward state; the transposed copy with the scale its forward set, as the single layer's. A
// forward pass also makes the transposed copy of the layers that keep it (cache, kept transposes):
// one pass over those weights a step.
std::vector<Fp8Operand> weight_operands(Context& ctx, const std::vector<Fp8LinearState*>& ls,
                                        const std::vector<Tensor>& weights, bool transposed) {
  std::vector<Fp8Operand> out(ls.size());
  std::vector<Fp8LinearState*> to_quantize;
  std::vector<Tensor> xs, qs, qts;
  std::vector<size_t> at;
  std::vector<bool> with_t;
  int64_t numel = 0, numel_t = 0;
  for (size_t j = 0; j < ls.size(); ++j) {
    out[j] = ls[j]->ready_weight_operand(ctx, weights[j], transposed);
    if (out[j].data.defined()) continue;
    const bool t = transposed || ls[j]->wants_transposed_in_forward();
    if (!transposed) numel += weights[j].numel();
    if (t) numel_t += weights[j].numel();
    with_t.push_back(t);
    to_quantize.push_back(ls[j]);
    xs.push_back(weights[j]);
    at.push_back(j);
  }
  if (to_quantize.empty()) return out;
  // the copies as slices of one buffer each: one allocation for the pass, not one per weight
  const DType t = to_quantize[0]->config().forward_dtype();
  const Tensor all = numel > 0 ? Tensor::empty({numel}, t, ctx.device()) : Tensor();
  const Tensor all_t = numel_t > 0 ? Tensor::empty({numel_t}, t, ctx.device()) : Tensor();
  int64_t offset = 0, offset_t = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const Tensor& w = xs[i];
    if (!transposed) {
      qs.push_back(all.flat_slice(offset, w.numel()).view(w.shape()));
      offset += w.numel();
    }
    qts.push_back(with_t[i] ? all_t.flat_slice(offset_t, w.numel()).view({w.size(1), w.size(0)}) : Tensor());
    if (with_t[i]) offset_t += w.numel();
  }
  quantize_members(ctx, to_quantize, false, 1, xs, qs, qts, /*again=*/transposed);
  for (size_t i = 0; i < to_quantize.size(); ++i) {
    const Tensor& scale_inv = to_quantize[i]->forward_scaling().scale_inv(1);
    Fp8Operand& o = out[at[i]];
    o = {transposed ? qts[i] : qs[i], scale_inv};
    to_quantize[i]->offer_weight_operand(o, transposed);
    if (!transposed && with_t[i]) to_quantize[i]->offer_weight_operand({qts[i], scale_inv}, true);
  }
  return out;
}

std::vector<Tensor> pick(const std::vector<Tensor>& v, const Blocks& b) {
  std::vector<Tensor> out;
  for (size_t e : b.index) out.push_back(v[e]);
  return out;
}

}  // namespace

void fp8_grouped_forward(Context& ctx, const std::vector<Fp8LinearState*>& layers, const Tensor& x,
                         const std::vector<int64_t>& rows, const std::vector<Tensor>& weights,
                         const std::vector<Tensor>& biases, Tensor& y) {
  const Blocks b = blocks_of(layers, rows, x.size(0));
  MG_CHECK(weights.size() == layers.size() && (biases.empty() || biases.size() == layers.size()),
           "{} weights and {} biases for {} grouped FP8 layers", weights.size(), biases.size(), layers.size());
  if (b.layers.empty()) return;
  const std::vector<Tensor> xs = row_blocks(b, x);
  std::vector<Tensor> none, qs = row_blocks(b, Tensor::empty(x.shape(), b.layers[0]->config().forward_dtype(), ctx.device()));
  quantize_members(ctx, b.layers, false, 0, xs, qs, none, /*again=*/false);
  const std::vector<Fp8Operand> qw = weight_operands(ctx, b.layers, pick(weights, b), false);
  std::vector<Fp8Operand> qx;
  for (size_t j = 0; j < b.layers.size(); ++j) qx.push_back({qs[j], b.layers[j]->forward_scaling().scale_inv(0)});
  std::vector<Tensor> ys = row_blocks(b, y);
  const std::vector<Tensor> bs = biases.empty() ? std::vector<Tensor>() : pick(biases, b);
  // Note [FP8 GEMM accumulation]: fast accumulation in the forward GEMM
  ops::fp8_gemm_grouped(ctx, qx, qw, bs, ys, false, /*fast_accumulation=*/true, /*rows_in_k=*/false);
}

void fp8_grouped_backward(Context& ctx, const std::vector<Fp8LinearState*>& layers, const Tensor& grad_out,
                          const Tensor& x, const std::vector<int64_t>& rows, const std::vector<Tensor>& weights,
                          Tensor& grad_in, std::vector<Tensor>& weight_grads, std::vector<Tensor>& bias_grads) {
  const Blocks b = blocks_of(layers, rows, x.size(0));
  MG_CHECK(weights.size() == layers.size() && (weight_grads.empty() || weight_grads.size() == layers.size()) &&
               (bias_grads.empty() || bias_grads.size() == layers.size()),
           "{} weights, {} weight and {} bias gradients for {} grouped FP8 layers", weights.size(),
           weight_grads.size(), bias_grads.size(), layers.size());
  if (b.layers.empty()) return;
  const Fp8Config& c = b.layers[0]->config();
  const int64_t in = x.size(1), out = grad_out.size(1);
  const std::vector<Tensor> gs = row_blocks(b, grad_out), xs = row_blocks(b, x), ws = pick(weights, b);
  const bool fp8_wgrad = !weight_grads.empty() && c.wgrad;
  Tensor none;
  // dy: one pass for both copies
  std::vector<Tensor> qg, qg_t, no_list;
  if (grad_in.defined()) qg = row_blocks(b, Tensor::empty(grad_out.shape(), c.backward_dtype(), ctx.device()));
  if (fp8_wgrad) qg_t = padded_transposed_blocks(ctx, b, out, c.backward_dtype());
  if (!qg.empty() || !qg_t.empty()) quantize_members(ctx, b.layers, true, 0, gs, qg, qg_t, /*again=*/false);
  for (size_t j = 0; !bias_grads.empty() && j < b.layers.size(); ++j) {  // in dy's own precision
    Tensor& bg = bias_grads[b.index[j]];
    if (bg.defined()) ops::linear_backward(ctx, gs[j], xs[j], ws[j], none, none, bg);
  }
  if (grad_in.defined()) {
    const std::vector<Fp8Operand> qw_t = weight_operands(ctx, b.layers, ws, true);
    std::vector<Fp8Operand> g;
    for (size_t j = 0; j < b.layers.size(); ++j) g.push_back({qg[j], b.layers[j]->backward_scaling().scale_inv(0)});
    std::vector<Tensor> gis = row_blocks(b, grad_in);
    ops::fp8_gemm_grouped(ctx, g, qw_t, no_list, gis, false, false, /*rows_in_k=*/false);
  }
  if (weight_grads.empty()) return;
  if (!c.wgrad) {  // --no-fp8-wgrad: dyᵀ·x as the bf16 layer's
    for (size_t j = 0; j < b.layers.size(); ++j)
      ops::linear_backward(ctx, gs[j], xs[j], ws[j], none, weight_grads[b.index[j]], none);
    return;
  }
  // x's transposed blocks: delayed with the step's scale (the forward's codes transposed), current
  // scaling from x's amax again (another microbatch may have rescaled it since)
  std::vector<Tensor> qx_t = padded_transposed_blocks(ctx, b, in, c.forward_dtype());
  quantize_members(ctx, b.layers, false, 0, xs, no_list, qx_t, /*again=*/c.recipe == Fp8Recipe::Delayed);
  std::vector<Fp8Operand> g_t, x_t;
  for (size_t j = 0; j < b.layers.size(); ++j) {
    g_t.push_back({qg_t[j], b.layers[j]->backward_scaling().scale_inv(0)});
    x_t.push_back({qx_t[j], b.layers[j]->forward_scaling().scale_inv(0)});
  }
  std::vector<Tensor> wgs = pick(weight_grads, b);
  ops::fp8_gemm_grouped(ctx, g_t, x_t, no_list, wgs, true, false, /*rows_in_k=*/true);
}

}  // namespace megatron

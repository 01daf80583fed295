#include "megatron/core/transformer/moe/experts.h"

#include <fmt/format.h>

#include "megatron/core/tensor_parallel/fp8_grouped_linear.h"
#include "megatron/kernels/ops.h"
#include "megatron/runtime/allocator.h"

namespace megatron::moe {

namespace {
// The biases of the experts (all or none have one) and their gradient buffers, for the grouped
// bias op (Note [Grouped experts with biases]); empty when the layer has none.
std::vector<Tensor> bias_data(const std::vector<Parameter*>& b) {
  std::vector<Tensor> out;
  if (!b.empty() && b.front())
    for (const Parameter* p : b) out.push_back(p->data);
  return out;
}
std::vector<Tensor> bias_grads(const std::vector<Parameter*>& b) {
  std::vector<Tensor> out;
  if (!b.empty() && b.front())
    for (const Parameter* p : b) out.push_back(p->main_grad);
  return out;
}

// Rows [row, row + n) of x as a [padded, cols] tensor whose rows after n are zeros (the slice itself
// when padded == n): Megatron's Fp8Padding of one expert's block (Note [FP8 experts]).
Tensor padded_rows(Context& ctx, const Tensor& x, int64_t row, int64_t n, int64_t padded) {
  if (padded == n) return x.slice(row, row + n);
  Tensor out = Tensor::empty({padded, x.size(1)}, x.dtype(), ctx.device());
  ops::copy_rows(ctx, x, row, out, 0, n);
  Tensor tail = out.slice(n, padded);
  fill_bytes(tail.raw_data(), ctx.device(), 0, tail.nbytes(), ctx.stream());
  return out;
}

// The parameters' data (undefined where a parameter is null: experts without biases).
std::vector<Tensor> data_of(const std::vector<Parameter*>& ps) {
  std::vector<Tensor> out;
  for (const Parameter* p : ps) out.push_back(p ? p->data : Tensor());
  return out;
}

}  // namespace

SequentialMLP::SequentialMLP(const TransformerConfig& config, int num_local_experts, int first_expert,
                             int64_t ffn_hidden_size, ParamAndGradBuffer& params, const std::string& prefix,
                             const ProcessGroupCollection& pg, bool grouped)
    : act_(MlpActivation::from_config(config)),
      swiglu_(config.gated_linear_unit),
      grouped_(grouped),
      hidden_(config.hidden_size) {
  Communicator* etp = multi_rank(pg.expt_tp);
  MG_CHECK(ffn_hidden_size % group_size(etp) == 0,
           "--moe-ffn-hidden-size ({}) must be divisible by --expert-tensor-parallel-size ({})", ffn_hidden_size,
           group_size(etp));
  ffn_ = ffn_hidden_size / group_size(etp);
  const int glu = swiglu_ ? 2 : 1;
  const size_t first_param = params.parameters().size();
  for (int e = 0; e < num_local_experts; ++e) {
    const std::string name = fmt::format("{}.local_experts.{}", prefix, first_expert + e);
    layers_.push_back(std::make_unique<Linear>(params, name + ".linear_fc1", config.hidden_size, glu * ffn_hidden_size,
                                               config.add_bias_linear, ParamInit::Normal, ParallelMode::ExpertColumn,
                                               etp, false, glu));
    layers_.push_back(std::make_unique<Linear>(params, name + ".linear_fc2", ffn_hidden_size, config.hidden_size,
                                               false, ParamInit::ScaledNormal, ParallelMode::ExpertRow, etp, false));
    fc1_.push_back(params.find(name + ".linear_fc1.weight"));
    fc1_bias_.push_back(config.add_bias_linear ? params.find(name + ".linear_fc1.bias") : nullptr);
    fc2_.push_back(params.find(name + ".linear_fc2.weight"));
    Parameter* bias = nullptr;
    if (config.add_bias_linear) {
      MG_CHECK(!etp, "expert biases need --expert-tensor-parallel-size 1 (as in Megatron)");
      bias = params.add(name + ".linear_fc2.bias", {config.hidden_size}, /*no_weight_decay=*/true, ParamInit::Zeros);
    }
    fc2_bias_.push_back(bias);
    MG_ASSERT(fc1_.back() && fc2_.back() && (!config.add_bias_linear || fc1_bias_.back()),
              "the experts' linear layers of {} are not registered under their names", name);
  }
  // Each expert's gradient sums the tokens of every data-parallel rank that routed to it; it
  // reduces over the ranks holding the same experts (Note [Buffers per reduction group]).
  for (size_t i = first_param; i < params.parameters().size(); ++i) {
    params.parameters()[i]->reduce_group = GradReduceGroup::ExpertData;
  }
}

void SequentialMLP::enable_fp8(const Fp8Config& config, Device device, std::vector<Linear*>& fp8_linears) {
  MG_CHECK(config.recipe != Fp8Recipe::Blockwise || (hidden_ % kFp8BlockLen == 0 && ffn_ % kFp8BlockLen == 0),
           "--fp8-recipe blockwise needs --hidden-size ({}) and the experts' width per expert-tensor-parallel rank "
           "(--moe-ffn-hidden-size / --expert-tensor-parallel-size = {}) to be multiples of the {} block",
           hidden_, ffn_, kFp8BlockLen);
  for (auto& l : layers_) {
    l->enable_fp8(config, device);
    fp8_linears.push_back(l.get());
  }
  fp8_ = true;
  fp8_recipe_ = config.recipe;
}

Fp8LinearState* SequentialMLP::fp8_state(int e, int fc) const {
  MG_ASSERT(e >= 0 && e < num_local_experts() && (fc == 1 || fc == 2), "expert {} fc{}", e, fc);
  return layers_[size_t(2 * e + fc - 1)]->fp8();
}

std::vector<Fp8LinearState*> SequentialMLP::fp8_states(int fc) const {
  std::vector<Fp8LinearState*> out;
  for (int e = 0; e < num_local_experts(); ++e) out.push_back(fp8_state(e, fc));
  return out;
}

// Note [FP8 experts]
void SequentialMLP::fp8_forward(Context& ctx, int fc, const std::vector<Parameter*>& w,
                                const std::vector<Parameter*>& b, const Tensor& x, const std::vector<int64_t>& rows,
                                Tensor& y) const {
  int64_t row = 0;
  for (size_t e = 0; e < w.size(); ++e) {
    const int64_t n = rows[e], padded = fp8_group_padded_rows(n);
    if (n == 0) continue;
    const Tensor xe = padded_rows(ctx, x, row, n, padded);
    Tensor ye = padded == n ? y.slice(row, row + n) : Tensor::empty({padded, y.size(1)}, y.dtype(), ctx.device());
    fp8_state(int(e), fc)->forward(ctx, xe, w[e]->data, b[e] ? b[e]->data : Tensor(), ye);
    if (padded != n) ops::copy_rows(ctx, ye, 0, y, row, n);
    row += n;
  }
}

void SequentialMLP::fp8_backward(Context& ctx, int fc, const std::vector<Parameter*>& w,
                                 const std::vector<Parameter*>& b, const Tensor& grad_out, const Tensor& x,
                                 const std::vector<int64_t>& rows, Tensor& grad_in) const {
  int64_t row = 0;
  for (size_t e = 0; e < w.size(); ++e) {
    const int64_t n = rows[e], padded = fp8_group_padded_rows(n);
    if (n == 0) continue;
    const Tensor ge = padded_rows(ctx, grad_out, row, n, padded), xe = padded_rows(ctx, x, row, n, padded);
    Tensor gi, none;
    if (grad_in.defined()) {
      gi = padded == n ? grad_in.slice(row, row + n)
                       : Tensor::empty({padded, grad_in.size(1)}, grad_in.dtype(), ctx.device());
    }
    fp8_state(int(e), fc)->backward(ctx, ge, xe, w[e]->data, gi, w[e]->main_grad, b[e] ? b[e]->main_grad : none);
    if (gi.defined() && padded != n) ops::copy_rows(ctx, gi, 0, grad_in, row, n);
    row += n;
  }
}

void SequentialMLP::linear_forward(Context& ctx, int fc, const std::vector<Parameter*>& w,
                                   const std::vector<Parameter*>& b, const Tensor& x, const std::vector<int64_t>& rows,
                                   Tensor& y) const {
  if (fp8_ && fp8_grouped()) {
    fp8_grouped_forward(ctx, fp8_states(fc), x, rows, data_of(w), data_of(b), y);
    return;
  }
  if (fp8_) {
    fp8_forward(ctx, fc, w, b, x, rows, y);
    return;
  }
  if (grouped_) {
    std::vector<Tensor> weights;
    for (const Parameter* p : w) weights.push_back(p->data);
    ops::moe_grouped_linear_forward(ctx, x, weights, rows, y);
    if (const auto biases = bias_data(b); !biases.empty()) ops::moe_grouped_bias_forward(ctx, y, biases, rows, Tensor());
    return;
  }
  int64_t row = 0;
  for (size_t e = 0; e < w.size(); ++e) {
    const int64_t n = rows[e];
    if (n == 0) continue;
    Tensor ye = y.slice(row, row + n);
    ops::linear_forward(ctx, x.slice(row, row + n), w[e]->data, b[e] ? b[e]->data : Tensor(), ye);
    row += n;
  }
}

void SequentialMLP::linear_backward(Context& ctx, int fc, const std::vector<Parameter*>& w,
                                    const std::vector<Parameter*>& b, const Tensor& grad_out, const Tensor& x,
                                    const std::vector<int64_t>& rows, Tensor& grad_in) const {
  if (fp8_ && fp8_grouped()) {
    std::vector<Tensor> wg, bg;
    for (size_t e = 0; e < w.size(); ++e) {
      wg.push_back(w[e]->main_grad);
      bg.push_back(b[e] ? b[e]->main_grad : Tensor());
    }
    fp8_grouped_backward(ctx, fp8_states(fc), grad_out, x, rows, data_of(w), grad_in, wg, bg);
  } else if (fp8_) {
    fp8_backward(ctx, fc, w, b, grad_out, x, rows, grad_in);
  } else if (grouped_) {
    std::vector<Tensor> weights, grads;
    for (Parameter* p : w) {
      weights.push_back(p->data);
      grads.push_back(p->main_grad);
    }
    ops::moe_grouped_linear_backward(ctx, grad_out, x, weights, rows, grad_in, grads);
    if (const auto biases = bias_data(b); !biases.empty()) {
      Tensor none;
      ops::moe_grouped_bias_backward(ctx, grad_out, biases, rows, Tensor(), bias_grads(b), none);
    }
  } else {
    int64_t row = 0;
    for (size_t e = 0; e < w.size(); ++e) {
      const int64_t n = rows[e];
      if (n == 0) continue;
      Tensor gi = grad_in.defined() ? grad_in.slice(row, row + n) : Tensor(), none;
      ops::linear_backward(ctx, grad_out.slice(row, row + n), x.slice(row, row + n), w[e]->data, gi, w[e]->main_grad,
                           b[e] ? b[e]->main_grad : none);
      row += n;
    }
  }
  for (size_t e = 0; e < w.size(); ++e) {
    notify_grad_accumulated(ctx, w[e]);
    notify_grad_accumulated(ctx, b[e]);
  }
}

Tensor SequentialMLP::forward(Context& ctx, const Tensor& x, const Tensor& probs,
                              const std::vector<int64_t>& tokens_per_expert, Saved& saved) const {
  MG_CHECK(tokens_per_expert.size() == fc1_.size(), "{} expert row counts for {} local experts",
           tokens_per_expert.size(), fc1_.size());
  int64_t total = 0;
  for (int64_t n : tokens_per_expert) total += n;
  const int64_t n_rows = x.size(0), h = x.size(1);
  MG_CHECK(total == n_rows, "the experts' row counts sum to {} for {} dispatched rows", total, n_rows);
  saved.x = x;
  saved.probs = probs;
  saved.tokens_per_expert = tokens_per_expert;
  saved.fc1 = Tensor::empty({n_rows, (swiglu_ ? 2 : 1) * ffn_}, x.dtype(), ctx.device());
  linear_forward(ctx, 1, fc1_, fc1_bias_, x, tokens_per_expert, saved.fc1);
  Tensor act = Tensor::empty({n_rows, ffn_}, x.dtype(), ctx.device());
  act_.forward(ctx, saved.fc1, act);
  saved.scaled = Tensor::empty({n_rows, ffn_}, x.dtype(), ctx.device());
  ops::moe_scale_rows_forward(ctx, act, probs, saved.scaled);
  act = Tensor();
  Tensor out = Tensor::empty({n_rows, h}, x.dtype(), ctx.device());
  const std::vector<Parameter*> no_bias(fc2_.size(), nullptr);
  linear_forward(ctx, 2, fc2_, no_bias, saved.scaled, tokens_per_expert, out);
  // + p · b2 (Note [Grouped experts with biases]), sequential or grouped
  if (const auto b2 = bias_data(fc2_bias_); !b2.empty())
    ops::moe_grouped_bias_forward(ctx, out, b2, tokens_per_expert, probs);
  return out;
}

Tensor SequentialMLP::backward(Context& ctx, const Tensor& grad_out, Saved& saved, Tensor& grad_probs) const {
  const int64_t n_rows = grad_out.size(0), h = grad_out.size(1);
  const std::vector<int64_t>& rows = saved.tokens_per_expert;
  // y = W2 · s + p · b2 with s = p · act(fc1)
  Tensor grad_scaled = Tensor::empty({n_rows, ffn_}, grad_out.dtype(), ctx.device());
  const std::vector<Parameter*> no_bias(fc2_.size(), nullptr);
  linear_backward(ctx, 2, fc2_, no_bias, grad_out, saved.scaled, rows, grad_scaled);
  saved.scaled = Tensor();
  Tensor act = Tensor::empty({n_rows, ffn_}, saved.fc1.dtype(), ctx.device());  // recomputed, not kept
  act_.forward(ctx, saved.fc1, act);
  Tensor grad_act = Tensor::empty(act.shape(), act.dtype(), ctx.device());
  grad_probs = Tensor::empty({n_rows}, DType::Float32, ctx.device());
  ops::moe_scale_rows_backward(ctx, grad_scaled, act, saved.probs, grad_act, grad_probs);
  act = Tensor();
  grad_scaled = Tensor();
  if (const auto b2 = bias_data(fc2_bias_); !b2.empty()) {  // dp += <dy, b2>; db2 += Σ_n p[n] · dy[n]
    ops::moe_grouped_bias_backward(ctx, grad_out, b2, rows, saved.probs, bias_grads(fc2_bias_), grad_probs);
    for (Parameter* p : fc2_bias_) notify_grad_accumulated(ctx, p);
  }
  Tensor grad_fc1 = Tensor::empty(saved.fc1.shape(), saved.fc1.dtype(), ctx.device());
  act_.backward(ctx, grad_act, saved.fc1, grad_fc1);
  grad_act = Tensor();
  Tensor grad_x = Tensor::empty({n_rows, h}, grad_out.dtype(), ctx.device());
  linear_backward(ctx, 1, fc1_, fc1_bias_, grad_fc1, saved.x, rows, grad_x);
  saved = Saved{};
  return grad_x;
}

}  // namespace megatron::moe

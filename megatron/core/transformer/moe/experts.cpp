#include "megatron/core/transformer/moe/experts.h"

#include <fmt/format.h>

#include "megatron/kernels/ops.h"

namespace megatron::moe {

namespace {
// out[n, :] = p[n] · x[n, :] in fp32, rounded to x's dtype (Megatron multiplies the bf16
// activation by the fp32 probabilities and casts back).
Tensor scale_rows(const Tensor& x, const Tensor& p) {
  const int64_t n = x.size(0), f = x.size(1);
  std::vector<float> v = x.to_floats();
  const std::vector<float> pv = p.to_floats();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < f; ++c) v[size_t(r * f + c)] *= pv[size_t(r)];
  return Tensor::from_floats(v, {n, f}, x.dtype());
}
// Σ_c a[n, c] · b[n, c] per row, fp32.
std::vector<float> row_dots(const Tensor& a, const Tensor& b) {
  const int64_t n = a.size(0), f = a.size(1);
  const std::vector<float> av = a.to_floats(), bv = b.to_floats();
  std::vector<float> out(size_t(n), 0.0f);
  for (int64_t r = 0; r < n; ++r) {
    double s = 0;
    for (int64_t c = 0; c < f; ++c) s += double(av[size_t(r * f + c)]) * bv[size_t(r * f + c)];
    out[size_t(r)] = float(s);
  }
  return out;
}
}  // namespace

SequentialMLP::SequentialMLP(const TransformerConfig& config, int num_local_experts, int first_expert,
                             int64_t ffn_hidden_size, ParamAndGradBuffer& params, const std::string& prefix,
                             const ProcessGroupCollection& pg)
    : swiglu_(config.gated_linear_unit) {
  Communicator* etp = multi_rank(pg.expt_tp);
  MG_CHECK(ffn_hidden_size % group_size(etp) == 0,
           "--moe-ffn-hidden-size ({}) must be divisible by --expert-tensor-parallel-size ({})", ffn_hidden_size,
           group_size(etp));
  ffn_ = ffn_hidden_size / group_size(etp);
  const int glu = swiglu_ ? 2 : 1;
  const size_t first_param = params.parameters().size();
  for (int e = 0; e < num_local_experts; ++e) {
    const std::string name = fmt::format("{}.local_experts.{}", prefix, first_expert + e);
    fc1_.push_back(std::make_unique<Linear>(params, name + ".linear_fc1", config.hidden_size, glu * ffn_hidden_size,
                                            config.add_bias_linear, ParamInit::Normal, ParallelMode::ExpertColumn, etp,
                                            false, glu));
    fc2_.push_back(std::make_unique<Linear>(params, name + ".linear_fc2", ffn_hidden_size, config.hidden_size, false,
                                            ParamInit::ScaledNormal, ParallelMode::ExpertRow, etp, false));
    Parameter* bias = nullptr;
    if (config.add_bias_linear) {
      MG_CHECK(!etp, "expert biases need --expert-tensor-parallel-size 1 (as in Megatron)");
      bias = params.add(name + ".linear_fc2.bias", {config.hidden_size}, /*no_weight_decay=*/true, ParamInit::Zeros);
    }
    fc2_bias_.push_back(bias);
  }
  // Each expert's gradient sums the tokens of every data-parallel rank that routed to it; it
  // reduces over the ranks holding the same experts (Note [Buffers per reduction group]).
  for (size_t i = first_param; i < params.parameters().size(); ++i) {
    params.parameters()[i]->reduce_group = GradReduceGroup::ExpertData;
  }
}

Tensor SequentialMLP::forward(Context& ctx, const Tensor& x, const Tensor& probs,
                              const std::vector<int64_t>& tokens_per_expert, Saved& saved) const {
  MG_CHECK(tokens_per_expert.size() == fc1_.size(), "{} expert row counts for {} local experts",
           tokens_per_expert.size(), fc1_.size());
  const int64_t n_rows = x.size(0), h = x.size(1);
  saved.x = x;
  saved.probs = probs;
  saved.tokens_per_expert = tokens_per_expert;
  saved.fc1 = Tensor::empty({n_rows, (swiglu_ ? 2 : 1) * ffn_}, x.dtype(), ctx.device());
  saved.scaled = Tensor::empty({n_rows, ffn_}, x.dtype(), ctx.device());
  Tensor out = Tensor::empty({n_rows, h}, x.dtype(), ctx.device());
  int64_t row = 0;
  for (size_t e = 0; e < fc1_.size(); ++e) {
    const int64_t n = tokens_per_expert[e];
    if (n == 0) continue;
    const Tensor xe = x.slice(row, row + n), pe = probs.slice(row, row + n);
    Tensor fc1 = saved.fc1.slice(row, row + n);
    fc1.copy_from(fc1_[e]->forward(ctx, xe));
    Tensor act = Tensor::empty({n, ffn_}, x.dtype(), ctx.device());
    if (swiglu_) {
      ops::swiglu_forward(ctx, fc1, act);
    } else {
      ops::gelu_forward(ctx, fc1, act);
    }
    Tensor scaled = saved.scaled.slice(row, row + n);
    scaled.copy_from(scale_rows(act, pe));
    Tensor y = fc2_[e]->forward(ctx, scaled);
    if (fc2_bias_[e]) {  // + p · b2
      Tensor b = Tensor::empty({n, h}, x.dtype(), ctx.device());
      ops::linear_forward(ctx, pe.view({n, 1}).to(x.dtype()), fc2_bias_[e]->data.view({h, 1}), Tensor(), b);
      ops::add(ctx, y, b, y);
    }
    out.slice(row, row + n).copy_from(y);
    row += n;
  }
  MG_CHECK(row == n_rows, "the experts' row counts sum to {} for {} dispatched rows", row, n_rows);
  return out;
}

Tensor SequentialMLP::backward(Context& ctx, const Tensor& grad_out, Saved& saved, Tensor& grad_probs) const {
  const int64_t n_rows = grad_out.size(0), h = grad_out.size(1);
  Tensor grad_x = Tensor::empty({n_rows, h}, grad_out.dtype(), ctx.device());
  std::vector<float> gp(size_t(n_rows), 0.0f);
  int64_t row = 0;
  for (size_t e = 0; e < fc1_.size(); ++e) {
    const int64_t n = saved.tokens_per_expert[e];
    if (n == 0) continue;
    const Tensor g = grad_out.slice(row, row + n), pe = saved.probs.slice(row, row + n);
    const Tensor fc1 = saved.fc1.slice(row, row + n);
    // y = W2 · s + p · b2, s = p · act
    const Tensor grad_scaled = fc2_[e]->backward(ctx, g, saved.scaled.slice(row, row + n));
    Tensor act = Tensor::empty({n, ffn_}, fc1.dtype(), ctx.device());
    if (swiglu_) {
      ops::swiglu_forward(ctx, fc1, act);
    } else {
      ops::gelu_forward(ctx, fc1, act);
    }
    std::vector<float> dp = row_dots(grad_scaled, act);
    if (Parameter* b2 = fc2_bias_[e]) {  // dp += <dy, b2>; db2 += Σ_n p[n] · dy[n]
      const std::vector<float> gv = g.to_floats(), bv = b2->data.to_floats(), pv = pe.to_floats();
      std::vector<float> db(size_t(h), 0.0f);
      for (int64_t r = 0; r < n; ++r) {
        double s = 0;
        for (int64_t c = 0; c < h; ++c) {
          s += double(gv[size_t(r * h + c)]) * bv[size_t(c)];
          db[size_t(c)] += pv[size_t(r)] * gv[size_t(r * h + c)];
        }
        dp[size_t(r)] += float(s);
      }
      ops::add(ctx, b2->main_grad, Tensor::from_floats(db, {h}), b2->main_grad);
      notify_grad_accumulated(ctx, b2);
    }
    std::copy(dp.begin(), dp.end(), gp.begin() + row);
    const Tensor grad_act = scale_rows(grad_scaled, pe);
    Tensor grad_fc1 = Tensor::empty(fc1.shape(), fc1.dtype(), ctx.device());
    if (swiglu_) {
      ops::swiglu_backward(ctx, grad_act, fc1, grad_fc1);
    } else {
      ops::gelu_backward(ctx, grad_act, fc1, grad_fc1);
    }
    grad_x.slice(row, row + n).copy_from(fc1_[e]->backward(ctx, grad_fc1, saved.x.slice(row, row + n)));
    row += n;
  }
  grad_probs = Tensor::from_floats(gp, {n_rows});
  saved = Saved{};
  return grad_x;
}

}  // namespace megatron::moe

// What the golden tests share (golden_test.cpp: the dense fixtures; moe_golden_test.cpp and
// arch_golden_test.cpp: HF model folders): a GPTModel built from HF weights through the converter's
// mapping, one forward/backward of the mean loss, and the checks against an <model>_io.safetensors
// (logits, loss, every gradient, the 3-step AdamW trajectory). Tolerances are those the fixture
// READMEs state (fp32 on CPU).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <string>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "megatron/core/models/gpt/hf_mapping.h"
#include "megatron/core/optimizer/optimizer.h"
#include "megatron/kernels/ops.h"

namespace megatron::testing {

// max |a - b| / max |b|: the error relative to the tensor's scale.
inline double scaled_error(const Tensor& a, const Tensor& b) {
  std::vector<float> x = a.to_floats(), y = b.to_floats();
  EXPECT_EQ(x.size(), y.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
    diff = std::max(diff, std::fabs(double(x[i]) - double(y[i])));
    scale = std::max(scale, std::fabs(double(y[i])));
  }
  return diff / std::max(scale, 1e-30);
}

struct Golden {
  HFModelInfo info;
  std::unique_ptr<GPTModel> model;
  std::unique_ptr<safetensors::File> io_file;
  Tensor tokens, labels;
  std::function<Tensor(const std::string&)> buffer_source;  // the HF weights, for the buffers' check

  /// `config`: info.config as the test runs it (dropout off, ...); get_hf reads the HF weights.
  Golden(HFModelInfo hf_info, const TransformerConfig& config, const std::function<Tensor(const std::string&)>& get_hf,
         const std::string& io_path, const std::string& source)
      : info(std::move(hf_info)) {
    io_file = std::make_unique<safetensors::File>(io_path);
    model = std::make_unique<GPTModel>(config);
    load_model_state_dict(*model, hf_to_megatron(info, get_hf), source);
    buffer_source = get_hf;
    tokens = io_file->read("tokens");
    labels = io_file->read("labels");
  }

  // One forward and backward of the mean loss over all tokens; returns the loss.
  float step(Context& ctx, GPTModel::Stash& stash, Tensor* logits_bsv = nullptr) {
    Tensor losses = model->forward(ctx, tokens, Tensor(), labels, stash);
    Tensor sums = Tensor::empty({2}, DType::Float32);
    ops::masked_loss_sums(ctx, losses.view({-1}), Tensor(), sums);
    const float count = sums.item(1);
    if (logits_bsv) {
      *logits_bsv = Tensor::empty({tokens.size(0), tokens.size(1), stash.logits.size(2)}, DType::Float32);
      ops::transpose_01(ctx, stash.logits, *logits_bsv);
    }
    Tensor grad = Tensor::empty({losses.numel()}, DType::Float32);
    ops::masked_loss_backward(ctx, Tensor(), 1.0f / count, grad);
    model->backward(ctx, grad.view(losses.shape()), stash);
    return sums.item(0) / count;
  }

  struct GradientReport {
    double logits_error = 0, loss_error = 0, worst_grad = 0;
    int checked = 0;
  };
  /// Logits and loss within 1e-5, every gradient within 1e-4 of its tensor's scale (HF names).
  GradientReport check_logits_loss_gradients() {
    Context ctx;
    GPTModel::Stash stash;
    Tensor logits;
    model->params().zero_grad();
    const float loss = step(ctx, stash, &logits);
    GradientReport r;
    r.logits_error = scaled_error(logits, io_file->read("logits"));
    EXPECT_LE(r.logits_error, 1e-5);
    const float ref_loss = io_file->read("loss").item(0);
    EXPECT_NEAR(loss, ref_loss, 1e-5 * std::fabs(ref_loss)) << "loss";
    r.loss_error = std::fabs(loss - ref_loss) / std::fabs(ref_loss);
    TensorMap grads = megatron_to_hf(info, model_grad_dict(*model));
    // The model's buffers (DeepSeek-V3's e_score_correction_bias: Megatron's expert bias) have no
    // gradient; the io file may still list them under grad. (the DeepSeek-V3 fixture writes the buffer
    // itself there). They are checked as loaded instead: the buffer must hold the HF tensor.
    TensorMap with_buffers = model_state_dict(*model);
    with_buffers.merge(model_buffer_dict(*model));
    const TensorMap exported = megatron_to_hf(info, with_buffers);
    for (const std::string& name : io_file->names()) {
      if (name.rfind("grad.", 0) != 0) continue;
      const std::string param = name.substr(5);
      if (!grads.count(param) && exported.count(param) && buffer_source && buffer_source(param).defined()) {
        EXPECT_EQ(exported.at(param).to_floats(), buffer_source(param).to_floats()) << param << " (a buffer)";
        continue;
      }
      EXPECT_TRUE(grads.count(param)) << param;
      if (!grads.count(param)) continue;
      const double e = scaled_error(grads[param], io_file->read(name));
      EXPECT_LE(e, 1e-4) << param;
      r.worst_grad = std::max(r.worst_grad, e);
      ++r.checked;
    }
    EXPECT_EQ(r.checked, int(grads.size())) << "every parameter has a reference gradient";
    return r;
  }

  struct AdamReport {
    size_t undetermined = 0, total = 0;
    double worst_loss = 0;
    double worst_weight = 0;  // the worst tensor's min(error / norm, 0.1 · error / change): 1e-5 passes
  };
  /// The losses before each of the io file's AdamW steps (lr 1e-3, betas 0.9/0.95, eps 1e-8, wd
  /// 0.1 on 2-D weights) within 1e-5, and the weights after them (Note [Adam's undetermined elements]).
  AdamReport check_adamw_trajectory() {
    Context ctx;
    OptimizerConfig oc;
    oc.lr = 1e-3;
    oc.adam_beta1 = 0.9;
    oc.adam_beta2 = 0.95;
    oc.adam_eps = 1e-8;
    oc.weight_decay = 0.1;
    oc.clip_grad = 0.0;
    std::vector<Parameter> params;
    for (Parameter* p : model->params().parameters()) {
      params.push_back(*p);
      // The fixtures decay the HF tensors that are 2-D. HF GPT-OSS stacks each layer's expert biases
      // into [E, n] tensors (gate_up_proj_bias, down_proj_bias), so they decay there, while Megatron
      // leaves biases undecayed: the optimizer here follows the fixture.
      if (info.model_type == "gpt_oss" && p->name.find(".local_experts.") != std::string::npos &&
          p->name.ends_with(".bias"))
        params.back().no_weight_decay = false;
    }
    AdamOptimizer opt(params, oc);
    opt.set_lr(1e-3);
    opt.set_weight_decay(0.1);
    AdamReport report;
    const TensorMap initial = megatron_to_hf(info, model_state_dict(*model));
    std::vector<float> ref_losses = io_file->read("adam_losses").to_floats();
    for (size_t it = 0; it < ref_losses.size(); ++it) {
      model->params().zero_grad();
      GPTModel::Stash stash;
      const float loss = step(ctx, stash);
      EXPECT_NEAR(loss, ref_losses[it], 1e-5 * std::fabs(ref_losses[it])) << "loss before step " << it + 1;
      report.worst_loss = std::max(report.worst_loss, std::fabs(double(loss) - ref_losses[it]) / std::fabs(ref_losses[it]));
      EXPECT_TRUE(opt.step(ctx).update_successful);
    }
    // Note [Adam's undetermined elements]: Adam's step m/(sqrt(v)+eps) is ~±lr whatever the size
    // of the gradient, and where |g| is within a few orders of eps it depends on g's exact value
    // (d step/dg ~ eps/(|g|+eps)² ~ 1e6 at |g| ~ 1e-7), so rounding-level gradient differences
    // between two fp32 implementations move those elements visibly. Two kinds exist: the key bias,
    // whose gradient is exactly zero in exact arithmetic (softmax ignores a score shift shared by
    // all keys), so both sides hold rounding noise; and elements with |g| < 100·eps. Those are held
    // to Adam's bound (|Δ| <= lr per step); every other element enters the comparison: the L2
    // error relative to the tensor's norm, within 1e-5, or relative to the norm of the tensor's
    // change over the steps, within 1e-4 (the gradients' tolerance). The second matters for
    // tensors that start at zero (HF's q/k/v biases): their norm is their change, a few lr, and a
    // sign change of the gradient between steps makes m/sqrt(v) amplify rounding differences.
    const double steps = double(ref_losses.size());
    const int64_t h = info.config.hidden_size;
    TensorMap weights = megatron_to_hf(info, model_state_dict(*model));
    for (const auto& [name, w] : weights) {
      std::vector<float> ours = w.to_floats(), ref = io_file->read("after3." + name).to_floats();
      std::vector<float> grad0 = io_file->read("grad." + name).to_floats(), before = initial.at(name).to_floats();
      auto ends_with = [&](const char* suffix) {
        return name.size() >= strlen(suffix) && name.compare(name.size() - strlen(suffix), strlen(suffix), suffix) == 0;
      };
      double diff2 = 0, ref2 = 0, change2 = 0;
      for (size_t i = 0; i < ref.size(); ++i) {
        const double diff = double(ours[i]) - double(ref[i]);
        const bool key_bias =
            ends_with("k_proj.bias") || (ends_with("attn.c_attn.bias") && int64_t(i) >= h && int64_t(i) < 2 * h);
        if (key_bias || (grad0[i] != 0.0f && std::fabs(grad0[i]) < 100 * oc.adam_eps)) {
          ++report.undetermined;
          EXPECT_LE(std::fabs(diff), 1.1 * oc.lr * steps) << name << "[" << i << "]";
          continue;
        }
        diff2 += diff * diff;
        ref2 += double(ref[i]) * ref[i];
        change2 += (double(ref[i]) - before[i]) * (double(ref[i]) - before[i]);
      }
      report.total += ref.size();
      const double e = std::sqrt(diff2 / std::max(ref2, 1e-300)), of_change = std::sqrt(diff2 / std::max(change2, 1e-300));
      EXPECT_TRUE(e <= 1e-5 || of_change <= 1e-4)
          << name << ": L2 error " << e << " of the weights' norm, " << of_change << " of their change's";
      report.worst_weight = std::max(report.worst_weight, std::min(e, 0.1 * of_change));
    }
    EXPECT_LE(report.undetermined, report.total / 200)
        << "more undetermined elements than a fixture of this size should have";
    return report;
  }
};

/// An HF folder `<dir>/<name>/` with `<dir>/<name>_io.safetensors` beside it, read through the
/// converter's path (HFFolder, config_from_hf, hf_to_megatron) into a Golden. The io files' loss is
/// the mean cross entropy alone and the reference ran in eval mode: dropout, the aux losses and the
/// z-loss are off.
struct FolderGolden {
  std::unique_ptr<HFFolder> folder;
  std::unique_ptr<Golden> golden;
  std::string io_name;
  FolderGolden(const std::string& dir, const std::string& name) {
    folder = std::make_unique<HFFolder>(dir + "/" + name);
    HFModelInfo info = config_from_hf(*folder, /*make_vocab_size_divisible_by=*/1);  // logits as HF's
    TransformerConfig c = info.config;
    c.hidden_dropout = c.attention_dropout = 0.0f;
    c.moe_aux_loss_coeff.assign(c.moe_router_load_balancing_type.size(), 0.0f);
    c.moe_z_loss_coeff = 0.0f;
    io_name = name + "_io.safetensors";
    golden = std::make_unique<Golden>(
        info, c, [&](const std::string& n) { return folder->get(n); }, dir + "/" + io_name, folder->dir());
  }
};

}  // namespace megatron::testing

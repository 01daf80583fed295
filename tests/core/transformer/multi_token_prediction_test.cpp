// Multi-token prediction (multi_token_prediction.h, Note [MTP loss] in gpt_model.cpp): Megatron's
// parameter names and the decoder's layer spec in the MTP layer; the MTP loss against a computation
// written here from the definition (the shifted tokens' embeddings, [enorm(e); hnorm(h)], eh_proj,
// the layer, the final norm, the shared output head, the shifted labels and loss mask); the main
// loss unchanged by MTP; finite-difference gradients of the whole training objective (main loss
// plus the scaled MTP losses) for tied and untied embeddings; and the refused combinations (also
// the HuggingFace export, whose model types have no MTP modules).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>

#include "megatron/core/models/gpt/gpt_model.h"
#include "megatron/core/models/gpt/hf_mapping.h"
#include "megatron/core/transformer/aux_loss_tracker.h"
#include "megatron/kernels/ops.h"
#include "megatron/runtime/philox.h"
#include "tests/core/model_test_util.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

// GPT style (LayerNorm with biases, learned positions, tied embeddings) or Llama style (RMSNorm,
// RoPE, SwiGLU, no biases, untied output layer).
TransformerConfig tiny_config(bool llama, int mtp_layers) {
  TransformerConfig c;
  c.num_layers = 2;
  c.hidden_size = 16;
  c.num_attention_heads = 2;
  c.ffn_hidden_size = 24;
  c.vocab_size = 30;
  c.make_vocab_size_divisible_by = 32;
  c.max_position_embeddings = 16;
  c.hidden_dropout = c.attention_dropout = 0.0f;
  c.mtp_num_layers = mtp_layers;
  c.mtp_loss_scaling_factor = 0.3f;
  if (llama) {
    testing::use_llama_layers(c);
  }
  return c;
}

// A loss mask [b, s] with a few zeros (as --eod-mask-loss leaves them).
Tensor some_mask(int64_t b, int64_t s) {
  std::vector<float> m(size_t(b * s), 1.0f);
  m[2] = m[size_t(s) + 5] = m[size_t(s) - 1] = 0.0f;
  return Tensor::from_floats(m, {b, s});
}

// Megatron's initialisation, then the norms away from 1 and 0 (a pure function of the name).
void init(GPTModel& model) {
  model.init_weights(1234);
  for (Parameter* p : model.params().parameters()) {
    const bool norm = p->name.find("norm") != std::string::npos;
    if (!norm) continue;
    const bool bias = p->name.find(".bias") != std::string::npos;
    std::vector<float> v(size_t(p->data.numel()));
    const uint64_t key = std::hash<std::string>{}(p->name);
    for (size_t i = 0; i < v.size(); ++i) {
      const float u = float(philox_element(key, 0, i) % 1000) / 1000.0f;
      v[i] = bias ? 0.2f * (u - 0.5f) : 0.6f + 0.8f * u;
    }
    p->data.copy_from(Tensor::from_floats(v, p->data.shape()));
  }
}

std::vector<double> host(const Tensor& t) {
  std::vector<float> f = t.to_floats();
  return {f.begin(), f.end()};
}

// A norm over the last dimension of rows [n, h] (LayerNorm with bias, or RMSNorm), in double.
std::vector<double> norm_rows(const std::vector<double>& x, int64_t n, int64_t h, const std::vector<double>& w,
                              const std::vector<double>* bias, bool rms, double eps) {
  std::vector<double> out(x.size());
  for (int64_t r = 0; r < n; ++r) {
    const double* row = x.data() + r * h;
    double mean = 0, var = 0;
    if (!rms) {
      for (int64_t j = 0; j < h; ++j) mean += row[j];
      mean /= double(h);
    }
    for (int64_t j = 0; j < h; ++j) var += (row[j] - mean) * (row[j] - mean);
    const double rstd = 1.0 / std::sqrt(var / double(h) + eps);
    for (int64_t j = 0; j < h; ++j) out[size_t(r * h + j)] = (row[j] - mean) * rstd * w[size_t(j)] + (bias ? (*bias)[size_t(j)] : 0.0);
  }
  return out;
}

// Megatron's roll_tensor(x, -1) along the sequence of a [b, s] tensor: x[:, j + 1], 0 at the end.
std::vector<double> roll(const std::vector<double>& x, int64_t b, int64_t s) {
  std::vector<double> out(x.size(), 0.0);
  for (int64_t i = 0; i < b; ++i)
    for (int64_t j = 0; j + 1 < s; ++j) out[size_t(i * s + j)] = x[size_t(i * s + j + 1)];
  return out;
}

double param_value(const GPTModel& m, const std::string& name, size_t i) {
  const Parameter* p = m.params().find(name);
  return p ? double(p->data.to_floats()[i]) : 0.0;
}

// The model's MTP losses as the tracker reports them for one microbatch, by depth.
std::vector<double> mtp_losses(AuxLossTracker& tracker) {
  Context ctx;
  std::vector<double> out;
  for (const auto& [name, value] : tracker.report(ctx, nullptr, nullptr, 1)) {
    if (name.rfind("mtp_", 0) == 0) out.push_back(value);
  }
  return out;
}

TEST(MultiTokenPrediction, ParametersFollowMegatronCore) {
  for (bool llama : {false, true}) {
    GPTModel model(tiny_config(llama, 2));
    const int64_t h = model.config().hidden_size;
    for (int k = 0; k < 2; ++k) {
      const std::string p = fmt::format("mtp.layers.{}.", k);
      for (const char* norm : {"enorm", "hnorm", "final_layernorm"}) {
        ASSERT_NE(model.params().find(p + norm + ".weight"), nullptr) << p << norm;
        EXPECT_EQ(model.params().find(p + norm + ".bias") != nullptr, !llama) << p << norm;
      }
      const Parameter* eh = model.params().find(p + "eh_proj.weight");
      ASSERT_NE(eh, nullptr);
      EXPECT_EQ(eh->data.shape(), Shape({h, 2 * h}));
      EXPECT_EQ(model.params().find(p + "eh_proj.bias"), nullptr);
      EXPECT_NE(model.params().find(p + "transformer_layer.self_attention.linear_qkv.weight"), nullptr);
      EXPECT_NE(model.params().find(p + "transformer_layer.mlp.linear_fc2.weight"), nullptr);
    }
    EXPECT_EQ(model.params().find("mtp.layers.2.enorm.weight"), nullptr);
    // One set of embeddings and one output head, shared with the main model.
    EXPECT_EQ(model.params().find("output_layer.weight") != nullptr, llama);
  }
  // Megatron's get_gpt_mtp_block_spec: the decoder's last layer spec — an MoE layer when it is one.
  TransformerConfig c = tiny_config(true, 1);
  c.num_moe_experts = 4;
  c.moe_router_topk = 2;
  c.moe_layer_freq = "([0]+[1]*1)";
  GPTModel moe(c);
  EXPECT_EQ(moe.params().find("decoder.layers.0.mlp.router.weight"), nullptr);
  EXPECT_NE(moe.params().find("mtp.layers.0.transformer_layer.mlp.router.weight"), nullptr);
  c.moe_layer_freq = "([1]+[0]*1)";
  GPTModel dense_last(c);
  EXPECT_EQ(dense_last.params().find("mtp.layers.0.transformer_layer.mlp.router.weight"), nullptr);
  EXPECT_NE(dense_last.params().find("mtp.layers.0.transformer_layer.mlp.linear_fc1.weight"), nullptr);
}

// The MTP loss of depth 1 through the definition: the decoder's final-normed output h (the
// decoder run directly on the embeddings), the embeddings of the tokens shifted by one,
// x = eh_proj([enorm(e); hnorm(h)]), the MTP transformer layer, the final norm, the tied output
// head, and the masked mean of the cross entropy against the labels shifted by one.
TEST(MultiTokenPrediction, LossEqualsTheDefinition) {
  const TransformerConfig cfg = tiny_config(false, 1);
  GPTModel model(cfg);
  init(model);
  const TransformerConfig& c = model.config();
  const int64_t b = 2, s = 8, h = c.hidden_size, v = c.padded_vocab_size;
  const Tensor tokens = testing::random_ids(b, s, c.vocab_size, 1), labels = testing::random_ids(b, s, c.vocab_size, 2);
  const Tensor mask = some_mask(b, s);
  AuxLossTracker tracker;
  model.set_aux_loss_tracker(&tracker);
  Context ctx;
  GPTModel::Stash stash;
  const Tensor losses = model.forward(ctx, tokens, Tensor(), labels, stash, Tensor(), mask);
  const std::vector<double> got = mtp_losses(tracker);
  ASSERT_EQ(got.size(), 1u);

  // The main loss is the model's without MTP (same parameters by name).
  TransformerConfig plain_cfg = cfg;
  plain_cfg.mtp_num_layers = 0;
  GPTModel plain(plain_cfg);
  for (Parameter* p : plain.params().parameters()) p->data.copy_from(model.params().find(p->name)->data);
  GPTModel::Stash plain_stash;
  EXPECT_EQ(host(plain.forward(ctx, tokens, Tensor(), labels, plain_stash)), host(losses));

  auto embed = [&](const std::vector<int64_t>& ids, const std::vector<int64_t>& pos) {  // [s, b, h]
    const std::vector<double> w = host(model.params().find("embedding.word_embeddings.weight")->data);
    const std::vector<double> p = host(model.params().find("embedding.position_embeddings.weight")->data);
    std::vector<double> out(size_t(s * b * h));
    for (int64_t j = 0; j < s; ++j)
      for (int64_t i = 0; i < b; ++i)
        for (int64_t k = 0; k < h; ++k)
          out[size_t((j * b + i) * h + k)] = w[size_t(ids[size_t(i * s + j)] * h + k)] + p[size_t(pos[size_t(i * s + j)] * h + k)];
    return out;
  };
  auto to_tensor = [&](const std::vector<double>& x, const Shape& shape) {
    return Tensor::from_floats(std::vector<float>(x.begin(), x.end()), shape);
  };
  std::vector<int64_t> ids(size_t(b * s)), pos(size_t(b * s));
  const std::vector<float> tf = tokens.to_floats();
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int64_t(tf[i]), pos[i] = int64_t(i % size_t(s));
  // The decoder's output h on the unshifted tokens.
  TransformerBlock::Saved dec_saved;
  const std::vector<double> hidden =
      host(model.decoder().forward(ctx, to_tensor(embed(ids, pos), {s, b, h}), AttentionInputs{}, 0, dec_saved));
  // The tokens and positions shifted by one (0 at the end).
  std::vector<int64_t> ids1(ids.size(), 0), pos1(pos.size(), 0);
  for (int64_t i = 0; i < b; ++i)
    for (int64_t j = 0; j + 1 < s; ++j) ids1[size_t(i * s + j)] = ids[size_t(i * s + j + 1)], pos1[size_t(i * s + j)] = j + 1;
  const std::vector<double> e = embed(ids1, pos1);
  auto P = [&](const std::string& n) { return host(model.params().find("mtp.layers.0." + n)->data); };
  const double eps = c.layernorm_epsilon;
  const std::vector<double> ew = P("enorm.weight"), eb = P("enorm.bias"), hw = P("hnorm.weight"), hb = P("hnorm.bias");
  const std::vector<double> en = norm_rows(e, s * b, h, ew, &eb, false, eps);
  const std::vector<double> hn = norm_rows(hidden, s * b, h, hw, &hb, false, eps);
  const std::vector<double> proj = P("eh_proj.weight");  // [h, 2h]
  std::vector<double> x(size_t(s * b * h));
  for (int64_t r = 0; r < s * b; ++r)
    for (int64_t o = 0; o < h; ++o) {
      double acc = 0;
      for (int64_t k = 0; k < h; ++k) acc += proj[size_t(o * 2 * h + k)] * en[size_t(r * h + k)];
      for (int64_t k = 0; k < h; ++k) acc += proj[size_t(o * 2 * h + h + k)] * hn[size_t(r * h + k)];
      x[size_t(r * h + o)] = acc;
    }
  TransformerLayer::Saved layer_saved;
  const std::vector<double> y = host(model.mtp_layers()[0]->transformer_layer().forward(
      ctx, to_tensor(x, {s, b, h}), AttentionInputs{}, 0, true, layer_saved));
  const std::vector<double> fw = P("final_layernorm.weight"), fb = P("final_layernorm.bias");
  const std::vector<double> hk = norm_rows(y, s * b, h, fw, &fb, false, eps);
  const std::vector<double> out_w = host(model.params().find("embedding.word_embeddings.weight")->data);  // tied
  const std::vector<double> mask1 = roll(host(mask), b, s), labels1 = roll(host(labels), b, s);
  double loss_sum = 0, count = 0;
  for (int64_t j = 0; j < s; ++j)
    for (int64_t i = 0; i < b; ++i) {
      std::vector<double> logits(static_cast<size_t>(v), 0.0);
      double mx = -1e300;
      for (int64_t t = 0; t < v; ++t) {
        double acc = 0;
        for (int64_t k = 0; k < h; ++k) acc += out_w[size_t(t * h + k)] * hk[size_t((j * b + i) * h + k)];
        logits[size_t(t)] = acc;
        mx = std::max(mx, acc);
      }
      double se = 0;
      for (double l : logits) se += std::exp(l - mx);
      const double ce = mx + std::log(se) - logits[size_t(labels1[size_t(i * s + j)])];
      loss_sum += mask1[size_t(i * s + j)] * ce;
      count += mask1[size_t(i * s + j)];
    }
  const double want = loss_sum / count;
  EXPECT_NEAR(got[0], want, 1e-5 * std::abs(want));
  // The last position of every row is shifted out, and the three masked tokens one place earlier.
  EXPECT_EQ(count, double(b * (s - 1) - 3));
}

// The training objective J = Σ losses·R + (mtp_loss_scaling_factor / D)·Σ_k L_k: its gradient from
// backward (the tracker's backward scale 1) against central differences, for a few elements of
// every MTP parameter, of the shared embeddings and output head, and of a decoder layer.
struct FdCase {
  std::string name;
  bool llama;
  int depths;
};
void PrintTo(const FdCase& c, std::ostream* os) { *os << c.name; }
class MtpGradients : public ::testing::TestWithParam<FdCase> {};

TEST_P(MtpGradients, MatchFiniteDifferences) {
  GPTModel model(tiny_config(GetParam().llama, GetParam().depths));
  init(model);
  const TransformerConfig& c = model.config();
  const int64_t b = 2, s = 8;
  const Tensor tokens = testing::random_ids(b, s, c.vocab_size, 1), labels = testing::random_ids(b, s, c.vocab_size, 2);
  const Tensor mask = some_mask(b, s);
  const Tensor upstream = testing::random_tensor({b, s}, 77, 1.0f, DType::Float32);
  AuxLossTracker tracker;
  model.set_aux_loss_tracker(&tracker);
  tracker.set_backward_scale(1.0f);
  Context ctx;
  auto objective = [&] {
    GPTModel::Stash stash;
    const std::vector<double> l = host(model.forward(ctx, tokens, Tensor(), labels, stash, Tensor(), mask));
    const std::vector<double> r = host(upstream);
    double j = 0;
    for (size_t i = 0; i < l.size(); ++i) j += l[i] * r[i];
    double mtp = 0;
    for (double v : mtp_losses(tracker)) mtp += v;
    return j + double(c.mtp_loss_scaling_factor) / double(c.mtp_num_layers) * mtp;
  };
  model.params().zero_grad();
  GPTModel::Stash stash;
  model.forward(ctx, tokens, Tensor(), labels, stash, Tensor(), mask);
  tracker.clear();
  model.backward(ctx, upstream, stash);

  const double eps = 3e-3, rtol = 2e-2, atol = 3e-4;  // fp32: smaller steps drown in rounding, larger in curvature
  int checked = 0, failures = 0;
  const std::vector<float> tf = tokens.to_floats();
  for (Parameter* p : model.params().parameters()) {
    const bool mtp = p->name.rfind("mtp.", 0) == 0;
    const bool shared = p->name.find("word_embeddings") != std::string::npos || p->name == "output_layer.weight";
    const bool decoder = p->name.rfind("decoder.layers.1.self_attention.linear_qkv.weight", 0) == 0;
    if (!mtp && !shared && !decoder) continue;
    const std::vector<float> analytic = p->main_grad.to_floats();
    std::vector<int64_t> elems;
    const int64_t n = p->data.numel();
    if (p->name.find("word_embeddings") != std::string::npos) {
      const int64_t h = c.hidden_size;  // rows of tokens that occur (others have no gradient from the input side)
      for (int t : {3, 9}) elems.push_back(int64_t(tf[size_t(t)]) * h + t % h);
    } else {
      for (int64_t i : {int64_t(0), n / 3, n / 2 + 1, n - 1}) elems.push_back(i);
    }
    float* x = p->data.data<float>();
    for (int64_t i : elems) {
      const float saved = x[i];
      x[i] = saved + float(eps);
      const double plus = objective();
      x[i] = saved - float(eps);
      const double minus = objective();
      x[i] = saved;
      const double fd = (plus - minus) / (2 * eps), a = analytic[size_t(i)];
      ++checked;
      if (std::abs(fd - a) > atol + rtol * std::max(std::abs(fd), std::abs(a)) && ++failures <= 10) {
        ADD_FAILURE() << p->name << "[" << i << "]: analytic " << a << " vs finite difference " << fd;
      }
    }
  }
  EXPECT_EQ(failures, 0);
  EXPECT_GT(checked, 40);
}

INSTANTIATE_TEST_SUITE_P(Styles, MtpGradients,
                         ::testing::Values(FdCase{"gpt_tied_1", false, 1}, FdCase{"llama_untied_2", true, 2}),
                         [](const ::testing::TestParamInfo<FdCase>& i) { return i.param.name; });

// Evaluation passes report no MTP loss (Megatron logs it in training only); the gradient's scale
// follows the tracker's backward scale (the main loss's).
TEST(MultiTokenPrediction, EvaluationReportsNothingAndTheScaleFollowsTheTracker) {
  GPTModel model(tiny_config(true, 1));
  init(model);
  const TransformerConfig& c = model.config();
  const Tensor tokens = testing::random_ids(2, 8, c.vocab_size, 1), labels = testing::random_ids(2, 8, c.vocab_size, 2);
  AuxLossTracker tracker;
  model.set_aux_loss_tracker(&tracker);
  Context ctx;
  tracker.set_evaluating(true);
  GPTModel::Stash eval_stash;
  model.forward(ctx, tokens, Tensor(), labels, eval_stash);
  for (const auto& [name, value] : tracker.report(ctx, nullptr, nullptr, 1)) {
    if (name == "mtp_1 loss") EXPECT_EQ(tracker.last_per_layer().at(name).size(), 0u);
  }
  tracker.set_evaluating(false);
  const Parameter* eh = model.params().find("mtp.layers.0.eh_proj.weight");
  std::vector<float> grads[2];
  for (int i = 0; i < 2; ++i) {
    tracker.set_backward_scale(i == 0 ? 1.0f : 4.0f);
    model.params().zero_grad();
    GPTModel::Stash stash;
    Tensor losses = model.forward(ctx, tokens, Tensor(), labels, stash);
    model.backward(ctx, Tensor::zeros(losses.shape(), DType::Float32), stash);  // the MTP term alone
    grads[i] = eh->main_grad.to_floats();
  }
  double norm = 0;
  for (size_t i = 0; i < grads[0].size(); ++i) {
    EXPECT_NEAR(grads[1][i], 4.0f * grads[0][i], 1e-5f * (1.0f + std::abs(grads[1][i])));
    norm += std::abs(grads[0][i]);
  }
  EXPECT_GT(norm, 0.0);
}

// Every parameter accumulates its gradient as many times per microbatch as
// repeated_accumulations() says (the data-parallel wrapper launches a bucket's reduction after the
// last one): the embeddings and output head once more per MTP depth.
TEST(MultiTokenPrediction, RepeatedAccumulationsAreCounted) {
  struct Counter : GradHook {
    std::map<std::string, int> n;
    void grad_accumulated(Context&, Parameter& p) override { ++n[p.name]; }
  };
  for (bool llama : {false, true}) {
    TransformerConfig c = tiny_config(llama, 2);
    c.share_embeddings_and_output_weights = !llama;
    GPTModel model(c);
    init(model);
    Counter counter;
    for (Parameter* p : model.params().parameters()) p->grad_hook = &counter;
    Context ctx;
    GPTModel::Stash stash;
    Tensor losses = model.forward(ctx, testing::random_ids(2, 8, 30, 1), Tensor(), testing::random_ids(2, 8, 30, 2), stash);
    model.backward(ctx, Tensor::zeros(losses.shape(), DType::Float32), stash);
    std::map<std::string, int> expected;
    for (Parameter* p : model.params().parameters()) expected[p->name] = 1;
    for (const auto& [p, times] : model.repeated_accumulations()) expected[p->name] = times;
    EXPECT_EQ(counter.n, expected);
    EXPECT_EQ(expected.at("embedding.word_embeddings.weight"), llama ? 3 : 6);  // embedding 1 + 2 (+ head 1 + 2)
    if (llama) EXPECT_EQ(expected.at("output_layer.weight"), 3);
    if (!llama) EXPECT_EQ(expected.at("embedding.position_embeddings.weight"), 3);
  }
}

TEST(MultiTokenPrediction, UnsupportedCombinationsAreRefused) {
  TransformerConfig c = tiny_config(true, -1);
  testing::expect_one_line_error([&] { c.finalize(); }, "--mtp-num-layers must be a positive number");
  c = tiny_config(true, 1);
  c.context_parallel_size = 2;
  testing::expect_one_line_error([&] { c.finalize(); }, "--mtp-num-layers with --context-parallel-size 2 is not supported");
  c = tiny_config(false, 1);
  c.pipeline_model_parallel_size = 2;
  testing::expect_one_line_error([&] { c.finalize(); }, "--mtp-num-layers with learned absolute position embeddings");
  c = tiny_config(true, 1);
  c.mtp_loss_scaling_factor = -1.0f;
  testing::expect_one_line_error([&] { c.finalize(); }, "--mtp-loss-scaling-factor");
  // The HF types the converter writes have no MTP modules: refused, not dropped.
  c = tiny_config(true, 1);
  c.finalize();
  testing::expect_one_line_error([&] { hf_config_from_megatron(c); }, "--mtp-num-layers 1 has no HuggingFace export");
}

}  // namespace
}  // namespace megatron

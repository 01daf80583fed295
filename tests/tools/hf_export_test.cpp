// tools/convert_checkpoint --from megatron on checkpoints trained here, one per model flag that
// changes how the export is written (Note [Which HF model a checkpoint exports as] in
// hf_config.cpp): each export (a) converts back (--from hf) to a checkpoint whose logits equal the
// original's within 1e-5, and (b) loaded by transformers' AutoModelForCausalLM gives megatron.cpp's
// log-probabilities within 1e-5 (tests/tools/hf_export_check.py; a test of its own, skipped with the
// reason where torch or transformers cannot be imported: $MEGATRON_HF_PYTHON, else python3). Flags HF
// cannot express are refused in one line, before anything is written.
#include <fmt/format.h>

#include <cmath>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "megatron/core/models/gpt/hf_mapping.h"
#include "megatron/core/tokenizers/tokenizer.h"
#include "megatron/training/checkpointing.h"
#include "tests/functional/run_util.h"

namespace megatron::testing {
namespace {

const int kVocab = 100;  // the runs without a tokenizer (--vocab-size; padded to 128)

std::vector<std::string> tokenizer_flags(const std::string& kind) {
  const std::string d = fs::absolute(data_fixtures_dir()).string();
  if (kind == "gpt2") {
    return {"--tokenizer-type",         "GPT2BPETokenizer", "--vocab-file",
            d + "/tok-gpt2/vocab.json", "--merge-file",     d + "/tok-gpt2/merges.txt"};
  }
  if (kind == "llama3bpe")
    return {"--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", d + "/tok-llama3bpe"};
  return {"--vocab-size", std::to_string(kVocab)};
}

// A GeLU model (exports as GPT-2) or a SwiGLU one (Llama family), trained 2 steps on mock data with
// a large step so that every weight, norm weights included, moves away from its initial value.
std::vector<std::string> model_flags(bool llama) {
  std::vector<std::string> f = {"--num-layers",
                                "2",
                                "--hidden-size",
                                "64",
                                "--num-attention-heads",
                                "4",
                                "--seq-length",
                                "16",
                                "--max-position-embeddings",
                                "16",
                                "--micro-batch-size",
                                "2",
                                "--train-iters",
                                "2",
                                "--lr",
                                "2e-2",
                                "--init-method-std",
                                "0.1",
                                "--hidden-dropout",
                                "0",
                                "--attention-dropout",
                                "0",
                                "--mock-data",
                                "--eval-iters",
                                "0",
                                "--device",
                                "cpu",
                                "--save",
                                "ckpt",
                                "--save-interval",
                                "2"};
  if (llama) {
    f = concat(f, {"--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type",
                   "rope", "--group-query-attention", "--num-query-groups", "2"});
  }
  return f;
}

struct Case {
  std::string name;
  bool llama;
  std::string tokenizer;  // gpt2 | llama3bpe | none
  std::vector<std::string> flags;
  std::string model_type;  // what the export must be
  std::string dtype = "float32";
  std::vector<std::string> export_flags = {};
};

std::ostream& operator<<(std::ostream& os, const Case& c) { return os << c.name; }

// The logits [b, s, v] of checkpoint `ckpt` on `tokens` [b, s], on the unpadded vocabulary v (a run
// with a tokenizer records none: its tokenizer's, as the HF config says), computed in fp32 without
// dropout (a bf16 checkpoint's weights load into fp32 exactly).
Tensor checkpoint_logits(const fs::path& ckpt, const Tensor& tokens, int vocab) {
  Arguments args;
  apply_checkpoint_args(args, ckpt.string());
  if (args.vocab_size == 0) args.vocab_size = vocab;
  args.no_load_rng = args.no_load_optim = true;
  if (args.max_position_embeddings == 0) args.max_position_embeddings = args.seq_length;
  TransformerConfig config = transformer_config_from_args(args, args.vocab_size);
  config.hidden_dropout = config.attention_dropout = 0.0f;
  GPTModel model(config);
  Checkpointer ck(args);
  Context ctx;
  EXPECT_TRUE(ck.load(ctx, ckpt.string(), model, nullptr, nullptr).has_value()) << ckpt;
  Tensor logits = model.forward_logits(ctx, tokens, Tensor());  // [s, b, vp]
  const int64_t s = logits.size(0), b = logits.size(1), vp = logits.size(2), v = config.vocab_size;
  const std::vector<float> all = logits.to_floats();
  std::vector<float> out(size_t(b * s * v));
  for (int64_t i = 0; i < b; ++i)
    for (int64_t j = 0; j < s; ++j)
      for (int64_t k = 0; k < v; ++k) out[size_t((i * s + j) * v + k)] = all[size_t((j * b + i) * vp + k)];
  return Tensor::from_floats(out, {b, s, v});
}

// The Python interpreter that has torch and transformers, or "" with the reason in `why`.
std::string hf_python(std::string& why) {
  const char* env = std::getenv("MEGATRON_HF_PYTHON");
  const std::string python = env && *env ? env : "python3";
  RunResult r = run({python, "-c", "import torch, transformers, safetensors"}, fs::current_path());
  if (r.exit_code == 0) return python;
  why = fmt::format(
      "{} cannot import torch/transformers/safetensors (set MEGATRON_HF_PYTHON to an interpreter "
      "that can): the comparison with transformers did not run",
      python);
  return "";
}

class HFExport : public ::testing::TestWithParam<Case> {};

// Trains the case's checkpoint in dir/ckpt and exports it to dir/hf; returns the HF config after
// checking what every export of the case must hold (type, dtype, tying, progress lines).
nlohmann::json train_and_export(const Case& c, const fs::path& dir) {
  RunResult train = run(
      concat(concat({bin("pretrain_gpt")}, model_flags(c.llama)), concat(tokenizer_flags(c.tokenizer), c.flags)), dir);
  EXPECT_EQ(train.exit_code, 0) << train.output;
  RunResult out = run(
      concat({bin("convert_checkpoint"), "--from", "megatron", "--load", "ckpt", "--save", "hf"}, c.export_flags), dir);
  EXPECT_EQ(out.exit_code, 0) << out.output;
  if (out.exit_code != 0) return {};
  EXPECT_NE(out.output.find("[convert] writing HF tensors:"), std::string::npos) << out.output;
  const nlohmann::json config = nlohmann::json::parse(read_file(dir / "hf/config.json"));
  EXPECT_EQ(config.at("model_type"), c.model_type);
  EXPECT_EQ(config.at("torch_dtype"), c.dtype);
  const bool untied =
      std::find(c.flags.begin(), c.flags.end(), "--untie-embeddings-and-output-weights") != c.flags.end();
  EXPECT_EQ(config.at("tie_word_embeddings"), !untied);
  HFFolder hf((dir / "hf").string());
  const std::vector<std::string> names = hf.tensor_names();
  EXPECT_EQ(std::find(names.begin(), names.end(), "lm_head.weight") != names.end(), untied);
  // The weights in the run's dtype (bf16 stays bf16; the norms of --apply-layernorm-1p stay fp32:
  // Note [Exporting zero-centered norms]; the fp32 expert biases too), sharded with its index past --max-shard-size, and the
  // tokenizer's files and ids beside them.
  const bool one_p = std::find(c.flags.begin(), c.flags.end(), "--apply-layernorm-1p") != c.flags.end();
  for (const std::string& n : names) {
    const bool norm = n.find("norm.weight") != std::string::npos || n.find("ln_") != std::string::npos;
    const bool fp32_buffer = n.find("e_score_correction_bias") != std::string::npos;  // a buffer, fp32 in training
    const DType want = (one_p && norm && n.find("bias") == std::string::npos) || fp32_buffer ? DType::Float32
                       : c.dtype == "bfloat16"                              ? DType::BFloat16
                                                                            : DType::Float32;
    EXPECT_EQ(hf.dtype(n), want) << c.name << ": " << n;
  }
  EXPECT_EQ(fs::exists(dir / "hf/model.safetensors.index.json"), !c.export_flags.empty()) << c.name;
  if (c.tokenizer != "none") {
    const nlohmann::json generation = nlohmann::json::parse(read_file(dir / "hf/generation_config.json"));
    EXPECT_TRUE(generation.contains("eos_token_id")) << generation.dump();
    for (const char* f : c.tokenizer == "gpt2" ? std::vector<const char*>{"vocab.json", "merges.txt", "tokenizer_config.json"}
                                                : std::vector<const char*>{"tokenizer.json"})
      EXPECT_TRUE(fs::exists(dir / "hf" / f)) << c.name << ": " << f;
  }
  return config;
}

// Two sequences of 16 token ids below `vocab`, [2, 16].
std::vector<int64_t> sample_ids(int64_t vocab) {
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < 2 * 16; ++i) ids.push_back((i * 7919 + 13) % vocab);
  return ids;
}

// (a) Back through megatron.cpp (--from hf): the re-imported checkpoint computes what the original does.
TEST_P(HFExport, ReimportedExportComputesTheSame) {
  const Case& c = GetParam();
  ScratchDir dir("hf_export_" + c.name);
  const nlohmann::json config = train_and_export(c, dir.path);
  ASSERT_FALSE(config.empty());
  RunResult in = run({bin("convert_checkpoint"), "--from", "hf", "--load", "hf", "--save", "ckpt2"}, dir.path);
  ASSERT_EQ(in.exit_code, 0) << in.output;
  const int64_t vocab = config.at("vocab_size").get<int64_t>();
  const Tensor tokens = Tensor::from_ints(sample_ids(vocab), {2, 16});
  const Tensor ours = checkpoint_logits(dir.path / "ckpt", tokens, int(vocab));
  const Tensor back = checkpoint_logits(dir.path / "ckpt2", tokens, int(vocab));
  const double error = max_abs_error(back.to_floats(), ours.to_floats());
  EXPECT_LE(error, 1e-5) << c.name;
  std::printf("hf_export %s: %s, %s weights; re-imported max |d logit| %.2e\n", c.name.c_str(), c.model_type.c_str(),
              c.dtype.c_str(), error);
}

// (b) transformers' AutoModelForCausalLM on the exported folder gives our log-probabilities, and its
// AutoTokenizer (the copied files) our ids.
TEST_P(HFExport, TransformersGivesOurLogProbabilities) {
  const Case& c = GetParam();
  std::string why;
  const std::string python = hf_python(why);
  if (python.empty()) GTEST_SKIP() << why;
  ScratchDir dir("hf_export_py_" + c.name);
  const nlohmann::json config = train_and_export(c, dir.path);
  ASSERT_FALSE(config.empty());
  const int64_t vocab = config.at("vocab_size").get<int64_t>();
  const std::vector<int64_t> ids = sample_ids(vocab);
  const Tensor ours = checkpoint_logits(dir.path / "ckpt", Tensor::from_ints(ids, {2, 16}), int(vocab));
  std::vector<float> token_values(ids.begin(), ids.end());
  safetensors::write((dir.path / "ours.safetensors").string(),
                     {{"tokens", Tensor::from_floats(token_values, {2, 16})}, {"logits", ours}});
  RunResult check =
      run({python, fs::absolute(fs::path(MEGATRON_SOURCE_DIR) / "tests/tools/hf_export_check.py").string(), "hf",
           "ours.safetensors", "--tol", "1e-5", "--dtype", c.dtype},
          dir.path);
  std::printf("hf_export %s:\n%s", c.name.c_str(), check.output.c_str());
  EXPECT_EQ(check.exit_code, 0) << check.output;
  if (c.tokenizer == "none") return;
  // The copied tokenizer is the run's: HF's ids for the sample equal ours (its eos equals
  // generation_config.json's: hf_export_check.py checks that).
  TokenizerArgs t;
  const std::vector<std::string> tf = tokenizer_flags(c.tokenizer);
  t.tokenizer_type = tf[1];
  if (c.tokenizer == "gpt2") {
    t.vocab_file = tf[3], t.merge_file = tf[5];
  } else {
    t.tokenizer_model = tf[3];
  }
  const std::vector<int64_t> sample = build_tokenizer(t)->tokenize("To be, or not to be");
  std::string list = "[";
  for (size_t i = 0; i < sample.size(); ++i) list += (i ? ", " : "") + std::to_string(sample[i]);
  list += "]";
  EXPECT_NE(check.output.find("ids " + list), std::string::npos) << "ours: " << list << "\n" << check.output;
}

const Case kCases[] = {
    {"gpt2_untied", false, "gpt2", {"--untie-embeddings-and-output-weights"}, "gpt2"},
    {"gpt2_layernorm_1p", false, "none", {"--apply-layernorm-1p"}, "gpt2"},
    {"gpt2_no_bias_no_positions",
     false,
     "none",
     {"--disable-bias-linear", "--add-qkv-bias", "--position-embedding-type", "none"},
     "gpt2"},
    {"llama_layernorm_1p_bf16", true, "llama3bpe", {"--apply-layernorm-1p", "--bf16"}, "llama", "bfloat16"},
    {"llama_rotary_interleaved",
     true,
     "none",
     {"--rotary-interleaved", "--untie-embeddings-and-output-weights"},
     "llama"},
    {"qwen2_qkv_bias", true, "llama3bpe", {"--add-qkv-bias", "--rotary-base", "1000000"}, "qwen2"},
    {"qwen3_qk_layernorm", true, "none", {"--qk-layernorm", "--untie-embeddings-and-output-weights"}, "qwen3"},
    {"qwen3_interleaved_1p_bf16_sharded",
     true,
     "none",
     {"--qk-layernorm", "--rotary-interleaved", "--apply-layernorm-1p", "--bf16"},
     "qwen3",
     "bfloat16",
     {"--max-shard-size", "40KB"}},
    {"mixtral_interleaved_1p",
     true,
     "none",
     {"--rotary-interleaved", "--apply-layernorm-1p", "--num-experts", "4", "--moe-router-topk", "2",
      "--untie-embeddings-and-output-weights"},
     "mixtral"},
    // GPT-OSS's pieces (Note [HF GPT-OSS]): on the GPT-2 flags (linear biases on), RMSNorm, RoPE, GQA,
    // every layer MoE with the clamped quick-GeGLU experts, sinks and a window on alternate layers.
    {"gpt_oss_sinks_windows",
     false,
     "none",
     {"--normalization", "RMSNorm", "--position-embedding-type", "rope", "--group-query-attention",
      "--num-query-groups", "2", "--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value", "7.0",
      "--softmax-type", "learnable", "--window-size", "3,0", "--window-attn-skip-freq", "2", "--num-experts", "4",
      "--moe-router-topk", "2", "--untie-embeddings-and-output-weights"},
     "gpt_oss"},
    // Multi-latent attention with DeepSeek-V3's MoE (Note [HF DeepSeek-V3]): exported with HF's
    // interleaved rope rows (Note [Importing DeepSeek's interleaved RoPE]) and its expert biases.
    {"deepseek_v3_mla_moe",
     true,
     "none",
     {"--num-query-groups", "4", "--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16",
      "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--qk-layernorm",
      "--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings", "8", "--mscale", "1",
      "--mscale-all-dim", "1", "--num-experts", "4", "--moe-layer-freq", "([0]+[1])", "--moe-ffn-hidden-size", "32",
      "--moe-shared-expert-intermediate-size", "32", "--moe-router-topk", "2", "--moe-router-score-function",
      "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
      "--moe-router-group-score-topk", "2", "--moe-router-topk-scaling-factor", "2.5",
      "--untie-embeddings-and-output-weights", "--norm-epsilon", "1e-6"},
     "deepseek_v3"},
};

INSTANTIATE_TEST_SUITE_P(Flags, HFExport, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return info.param.name; });

// A sharded export (above --max-shard-size) lists every tensor in model.safetensors.index.json, and
// a bf16 run's weights are bf16 in the files (the --apply-layernorm-1p norms excepted: fp32, Note
// [Exporting zero-centered norms]).
TEST(HFExport, ShardedBf16ExportKeepsTheRunsDtype) {
  ScratchDir dir("hf_export_sharded");
  RunResult train = run(concat(concat({bin("pretrain_gpt")}, model_flags(true)),
                               {"--vocab-size", "100", "--bf16", "--apply-layernorm-1p"}),
                        dir.path);
  ASSERT_EQ(train.exit_code, 0) << train.output;
  RunResult out = run(
      {bin("convert_checkpoint"), "--from", "megatron", "--load", "ckpt", "--save", "hf", "--max-shard-size", "40KB"},
      dir.path);
  ASSERT_EQ(out.exit_code, 0) << out.output;
  ASSERT_TRUE(fs::exists(dir.path / "hf/model.safetensors.index.json")) << out.output;
  EXPECT_FALSE(fs::exists(dir.path / "hf/model.safetensors"));
  const nlohmann::json index = nlohmann::json::parse(read_file(dir.path / "hf/model.safetensors.index.json"));
  int bf16 = 0, fp32 = 0;
  for (const auto& [name, file] : index.at("weight_map").items()) {
    safetensors::File f((dir.path / "hf" / file.get<std::string>()).string());
    const DType dtype = f.read(name).dtype();
    const bool norm = name.ends_with("norm.weight");
    EXPECT_EQ(dtype, norm ? DType::Float32 : DType::BFloat16) << name;
    (dtype == DType::BFloat16 ? bf16 : fp32)++;
  }
  EXPECT_GT(bf16, 0);
  EXPECT_GT(fp32, 0);
  // Progress is reported per file as it is written.
  EXPECT_NE(out.output.find("[convert] writing HF tensors:"), std::string::npos) << out.output;
}

// What HF cannot express is refused in one line naming the flag, before anything is written.
TEST(HFExport, InexpressibleFlagsAreRefusedInOneLine) {
  struct Refusal {
    bool llama;
    std::vector<std::string> flags;
    std::string says;
  };
  const std::vector<Refusal> refusals = {
      {true, {"--rotary-percent", "0.5"}, "--rotary-percent 0.5 has no HuggingFace export"},
      {true, {"--qk-layernorm", "--add-qkv-bias"}, "--add-qkv-bias with --qk-layernorm has no HuggingFace export"},
      {false, {"--position-embedding-type", "rope"}, "--position-embedding-type rope with a GeLU MLP"},
      {false, {"--normalization", "RMSNorm"}, "--normalization RMSNorm with a GeLU MLP"},
      {false, {"--group-query-attention", "--num-query-groups", "2"}, "--group-query-attention has no HuggingFace"},
      {true,
       {"--num-query-groups", "4", "--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "8",
        "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--qk-layernorm", "--num-experts", "4",
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"},
       "--norm-epsilon 1e-05 has no DeepSeek-V3 export"},
  };
  for (const Refusal& r : refusals) {
    ScratchDir dir("hf_export_refused");
    RunResult train =
        run(concat(concat({bin("pretrain_gpt")}, model_flags(r.llama)), concat({"--vocab-size", "100"}, r.flags)),
            dir.path);
    ASSERT_EQ(train.exit_code, 0) << train.output;
    RunResult out = run({bin("convert_checkpoint"), "--from", "megatron", "--load", "ckpt", "--save", "hf"}, dir.path);
    EXPECT_NE(out.exit_code, 0) << out.output;
    EXPECT_NE(out.output.find(r.says), std::string::npos) << out.output;
    EXPECT_EQ(std::count(out.output.begin(), out.output.end(), '\n'), 1) << out.output;
    EXPECT_FALSE(fs::exists(dir.path / "hf")) << "nothing is written for a refused export";
    std::printf("refused: %s", out.output.c_str());
  }
  // Linear biases with SwiGLU (Megatron's default without --disable-bias-linear).
  ScratchDir dir("hf_export_refused_bias");
  std::vector<std::string> flags = model_flags(true);
  flags.erase(std::find(flags.begin(), flags.end(), "--disable-bias-linear"));
  RunResult train = run(concat(concat({bin("pretrain_gpt")}, flags), {"--vocab-size", "100"}), dir.path);
  ASSERT_EQ(train.exit_code, 0) << train.output;
  RunResult out = run({bin("convert_checkpoint"), "--from", "megatron", "--load", "ckpt", "--save", "hf"}, dir.path);
  EXPECT_NE(out.exit_code, 0);
  EXPECT_NE(out.output.find("--disable-bias-linear"), std::string::npos) << out.output;
  EXPECT_EQ(std::count(out.output.begin(), out.output.end(), '\n'), 1) << out.output;
}

}  // namespace
}  // namespace megatron::testing

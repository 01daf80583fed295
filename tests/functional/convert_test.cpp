// tools/convert_checkpoint: HF -> megatron.cpp -> HF is exact, and the converted fixture models
// loaded into GPTModel give the fixture logits (GPT-2, Llama, Qwen3, and the MoE folders Mixtral,
// Qwen2-MoE, Qwen3-MoE, sharded both ways); a --qk-layernorm model trained here exports as Qwen3; a
// bf16 folder stays bf16 both ways and its checkpoint trains as an fp32 one of the same values.
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <set>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "megatron/core/models/gpt/hf_mapping.h"
#include "megatron/training/checkpointing.h"
#include "tests/functional/run_util.h"

namespace megatron::testing {
namespace {

// The converted checkpoint `ckpt`, loaded as pretrain_gpt would (its args into `args`), run on the
// io file's tokens: max |logits - io logits| relative to the io logits' scale. Ours has the padded
// vocabulary vp >= the fixture's v; the padded columns are not compared.
double checkpoint_logits_error(const fs::path& ckpt, const fs::path& io_path, Arguments& args) {
  apply_checkpoint_args(args, ckpt.string());
  TransformerConfig config = transformer_config_from_args(args, args.vocab_size);
  config.hidden_dropout = config.attention_dropout = 0.0f;
  GPTModel model(config);
  Checkpointer ck(args);
  Context ctx;
  EXPECT_TRUE(ck.load(ctx, ckpt.string(), model, nullptr, nullptr).has_value());
  safetensors::File io(io_path.string());
  Tensor logits = model.forward_logits(ctx, io.read("tokens"), Tensor());             // [s, b, V]
  std::vector<float> ours = logits.to_floats(), ref = io.read("logits").to_floats();  // ref [b, s, V]
  const int64_t s = logits.size(0), b = logits.size(1), v = io.read("logits").size(2), vp = logits.size(2);
  double worst = 0, scale = 0;
  for (int64_t i = 0; i < b; ++i)
    for (int64_t j = 0; j < s; ++j)
      for (int64_t k = 0; k < v; ++k) {
        const double r = ref[size_t((i * s + j) * v + k)];
        worst = std::max(worst, std::fabs(double(ours[size_t((j * b + i) * vp + k)]) - r));
        scale = std::max(scale, std::fabs(r));
      }
  return worst / scale;
}

class Convert : public ::testing::TestWithParam<std::string> {};

TEST_P(Convert, RoundTripIsExactAndLogitsMatch) {
  ScratchDir dir("convert_" + GetParam());
  const fs::path fixtures = fs::absolute(golden_fixture_dir_of(GetParam()));
  safetensors::File src((fixtures / (GetParam() + "_model.safetensors")).string());
  // An HF folder: config.json + model.safetensors.
  fs::create_directories(dir.path / "hf");
  fs::copy_file(fixtures / (GetParam() + "_model.safetensors"), dir.path / "hf/model.safetensors");
  std::ofstream(dir.path / "hf/config.json") << src.metadata().at("config");

  RunResult to = run({bin("convert_checkpoint"), "--from", "hf", "--load", "hf", "--save", "ckpt"}, dir.path);
  ASSERT_EQ(to.exit_code, 0) << to.output;
  EXPECT_EQ(read_file(dir.path / "ckpt/latest_checkpointed_iteration.txt"), "release");
  RunResult back =
      run({bin("convert_checkpoint"), "--from", "megatron", "--load", "ckpt", "--save", "hf_back"}, dir.path);
  ASSERT_EQ(back.exit_code, 0) << back.output;
  safetensors::File out((dir.path / "hf_back/model.safetensors").string());
  ASSERT_EQ(out.names(), src.names());
  for (const std::string& n : src.names()) EXPECT_EQ(out.read(n).to_floats(), src.read(n).to_floats()) << n;
  EXPECT_EQ(nlohmann::json::parse(read_file(dir.path / "hf_back/config.json")),
            nlohmann::json::parse(src.metadata().at("config")));

  // The converted checkpoint, loaded as pretrain_gpt would, gives the fixture's logits.
  Arguments args;
  const double error =
      checkpoint_logits_error(dir.path / "ckpt", fixtures / (GetParam() + "_io.safetensors"), args);
  const nlohmann::json hf_config = nlohmann::json::parse(src.metadata().at("config"));
  EXPECT_EQ(args.qk_layernorm, hf_config.value("model_type", "") == "qwen3") << "Qwen3's q_norm/k_norm are --qk-layernorm";
  EXPECT_LE(error, 1e-5);
  std::printf("convert %s: HF -> megatron.cpp -> HF exact over %zu tensors, logits within %.2e\n", GetParam().c_str(),
              src.names().size(), error);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Convert, ::testing::ValuesIn(golden_fixture_models()),
                         [](const auto& info) { return info.param; });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(Convert);

// The dtypes of the tensors of a converted checkpoint's model file (one file: a conversion writes one).
std::set<std::string> checkpoint_dtypes(const fs::path& ckpt) {
  std::set<std::string> dtypes;
  for (const auto& e : fs::directory_iterator(ckpt / "release")) {
    if (e.path().extension() != ".safetensors") continue;
    safetensors::File f(e.path().string());
    for (const std::string& n : f.names()) dtypes.insert(std::string(to_string(f.entry(n).dtype)));
  }
  return dtypes;
}

// Note [Converted weights' dtype]: a bf16 HF folder imports as a bf16 checkpoint (fp32 with --fp32),
// which exports back to the same bf16 bytes; and the bf16 checkpoint trains as the fp32 one of the
// same values does (the fp32 main parameters built from the loaded weights), in an fp32 run and a
// --bf16 one: the same losses, digit for digit.
TEST(Convert, Bf16FolderKeepsItsDtypeAndTrainsAsFp32Would) {
  ScratchDir dir("convert_bf16");
  const fs::path fixtures = fs::absolute(golden_fixture_dir_of("llama"));
  if (!fs::exists(fixtures / "llama_model.safetensors")) GTEST_SKIP() << "no llama fixture";
  safetensors::File src((fixtures / "llama_model.safetensors").string());
  fs::create_directories(dir.path / "hf");
  fs::copy_file(fixtures / "llama_model.safetensors", dir.path / "hf/model.safetensors");
  std::ofstream(dir.path / "hf/config.json") << src.metadata().at("config");
  // The fp32 fixture rounded to bf16 (--bf16), exported: a bf16 HF folder.
  auto convert = [&](std::vector<std::string> args) {
    RunResult r = run(concat({bin("convert_checkpoint")}, args), dir.path);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return r.output;
  };
  convert({"--from", "hf", "--load", "hf", "--save", "ckpt_rounded", "--bf16"});
  EXPECT_EQ(checkpoint_dtypes(dir.path / "ckpt_rounded"), std::set<std::string>{"bf16"});
  convert({"--from", "megatron", "--load", "ckpt_rounded", "--save", "hf_bf16"});
  EXPECT_EQ(nlohmann::json::parse(read_file(dir.path / "hf_bf16/config.json")).at("torch_dtype"), "bfloat16");

  const std::string log = convert({"--from", "hf", "--load", "hf_bf16", "--save", "ckpt_bf16"});
  EXPECT_NE(log.find("weights written in bfloat16 (the folder's tensors"), std::string::npos) << log;
  EXPECT_EQ(checkpoint_dtypes(dir.path / "ckpt_bf16"), std::set<std::string>{"bf16"});
  EXPECT_TRUE(nlohmann::json::parse(read_file(dir.path / "ckpt_bf16/release/metadata.json")).at("args").at("bf16"));
  convert({"--from", "hf", "--load", "hf_bf16", "--save", "ckpt_fp32", "--fp32"});
  EXPECT_EQ(checkpoint_dtypes(dir.path / "ckpt_fp32"), std::set<std::string>{"fp32"});
  // bf16 stays bf16 on the way back, byte for byte.
  convert({"--from", "megatron", "--load", "ckpt_bf16", "--save", "hf_back"});
  safetensors::File a((dir.path / "hf_bf16/model.safetensors").string()), b((dir.path / "hf_back/model.safetensors").string());
  ASSERT_EQ(a.names(), b.names());
  for (const std::string& n : a.names()) {
    const Tensor ta = a.read(n), tb = b.read(n);
    EXPECT_EQ(tb.dtype(), DType::BFloat16) << n;
    EXPECT_TRUE(ta.dtype() == tb.dtype() && std::memcmp(ta.raw_data(), tb.raw_data(), ta.nbytes()) == 0) << n;
  }
  // A folder mixing dtypes (bf16 weights, the final norm fp32 with values bf16 cannot hold) keeps
  // each tensor's: the checkpoint records bf16, holds that norm in fp32, and exports it all back.
  {
    std::vector<std::pair<std::string, Tensor>> mixed;
    for (const std::string& n : a.names()) mixed.emplace_back(n, n == "model.norm.weight" ? src.read(n) : a.read(n));
    fs::create_directories(dir.path / "hf_mixed");
    fs::copy_file(dir.path / "hf_bf16/config.json", dir.path / "hf_mixed/config.json");
    safetensors::write((dir.path / "hf_mixed/model.safetensors").string(), mixed, {{"format", "pt"}});
    const std::string mixed_log = convert({"--from", "hf", "--load", "hf_mixed", "--save", "ckpt_mixed"});
    EXPECT_NE(mixed_log.find("weights written in bfloat16, 1 tensor(s) in float32"), std::string::npos) << mixed_log;
    EXPECT_EQ(checkpoint_dtypes(dir.path / "ckpt_mixed"), (std::set<std::string>{"bf16", "fp32"}));
    convert({"--from", "megatron", "--load", "ckpt_mixed", "--save", "hf_mixed_back"});
    EXPECT_EQ(read_file(dir.path / "hf_mixed_back/model.safetensors"), read_file(dir.path / "hf_mixed/model.safetensors"))
        << "byte for byte";
  }
  RunResult both = run({bin("convert_checkpoint"), "--from", "hf", "--load", "hf", "--save", "x", "--bf16", "--fp32"},
                       dir.path);
  EXPECT_NE(both.exit_code, 0);
  EXPECT_NE(both.output.find("excludes"), std::string::npos) << both.output;

  const std::string vocab = std::to_string(nlohmann::json::parse(src.metadata().at("config")).at("vocab_size").get<int>());
  auto losses = [&](const std::string& ckpt, bool bf16) {
    std::vector<std::string> argv = {bin("pretrain_gpt"), "--use-checkpoint-args", "--load", ckpt, "--micro-batch-size",
                                     "2", "--seq-length", "16", "--train-iters", "3", "--lr", "1e-3", "--mock-data",
                                     "--vocab-size", vocab, "--hidden-dropout", "0", "--attention-dropout", "0",
                                     "--log-interval", "1", "--eval-iters", "0", "--device", "cpu"};
    if (bf16) argv.push_back("--bf16");
    RunResult r = run(argv, dir.path);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("successfully loaded checkpoint from " + ckpt), std::string::npos) << r.output;
    return field_values(r.output, "lm loss");
  };
  for (const bool bf16 : {false, true}) {
    const std::vector<std::string> from_bf16 = losses("ckpt_bf16", bf16), from_fp32 = losses("ckpt_fp32", bf16);
    ASSERT_EQ(from_bf16.size(), 3u);
    EXPECT_EQ(from_bf16, from_fp32) << (bf16 ? "--bf16 run" : "fp32 run");
    std::printf("convert: a bf16 checkpoint trains as its fp32 copy (%s run): lm loss %s -> %s\n",
                bf16 ? "--bf16" : "fp32", from_bf16.front().c_str(), from_bf16.back().c_str());
  }
}

// A model trained here with --qk-layernorm (no HF config in its checkpoint) exports as Qwen3, and
// that export goes through megatron.cpp and back unchanged.
TEST(Convert, QkLayernormCheckpointExportsAsQwen3) {
  ScratchDir dir("convert_qk");
  const std::vector<std::string> flags = {"--num-layers",
                                          "2",
                                          "--hidden-size",
                                          "64",
                                          "--num-attention-heads",
                                          "4",
                                          "--group-query-attention",
                                          "--num-query-groups",
                                          "2",
                                          "--seq-length",
                                          "32",
                                          "--qk-layernorm",
                                          "--normalization",
                                          "RMSNorm",
                                          "--swiglu",
                                          "--disable-bias-linear",
                                          "--position-embedding-type",
                                          "rope",
                                          "--untie-embeddings-and-output-weights",
                                          "--micro-batch-size",
                                          "2",
                                          "--train-iters",
                                          "2",
                                          "--lr",
                                          "1e-3",
                                          "--mock-data",
                                          "--vocab-size",
                                          "100",
                                          "--eval-iters",
                                          "1",
                                          "--device",
                                          "cpu",
                                          "--save",
                                          "ckpt",
                                          "--save-interval",
                                          "2"};
  RunResult train = run(concat({bin("pretrain_gpt")}, flags), dir.path);
  ASSERT_EQ(train.exit_code, 0) << train.output;
  RunResult to_hf = run({bin("convert_checkpoint"), "--from", "megatron", "--load", "ckpt", "--save", "hf"}, dir.path);
  ASSERT_EQ(to_hf.exit_code, 0) << to_hf.output;
  const nlohmann::json config = nlohmann::json::parse(read_file(dir.path / "hf/config.json"));
  EXPECT_EQ(config.at("model_type"), "qwen3");
  EXPECT_EQ(config.at("architectures"), nlohmann::json({"Qwen3ForCausalLM"}));
  safetensors::File hf((dir.path / "hf/model.safetensors").string());
  const auto names = hf.names();
  EXPECT_NE(std::find(names.begin(), names.end(), "model.layers.1.self_attn.k_norm.weight"), names.end());
  RunResult in = run({bin("convert_checkpoint"), "--from", "hf", "--load", "hf", "--save", "ckpt2"}, dir.path);
  ASSERT_EQ(in.exit_code, 0) << in.output;
  RunResult out = run({bin("convert_checkpoint"), "--from", "megatron", "--load", "ckpt2", "--save", "hf2"}, dir.path);
  ASSERT_EQ(out.exit_code, 0) << out.output;
  safetensors::File again((dir.path / "hf2/model.safetensors").string());
  ASSERT_EQ(again.names(), names);
  for (const std::string& n : names) EXPECT_EQ(again.read(n).to_floats(), hf.read(n).to_floats()) << n;
  EXPECT_EQ(nlohmann::json::parse(read_file(dir.path / "hf2/config.json")), config);
}

// The mixture-of-experts HF folders (Mixtral, Qwen2-MoE, Qwen3-MoE; one tensor per expert): HF ->
// megatron.cpp -> HF is exact, through sharded files both ways (the source split over two shards
// listed in model.safetensors.index.json; the export written with a small --max-shard-size), the
// config comes back unchanged, and the checkpoint loaded as pretrain_gpt would gives the io
// file's logits.
class ConvertMoE : public ::testing::TestWithParam<std::string> {};

TEST_P(ConvertMoE, ShardedRoundTripIsExactAndLogitsMatch) {
  ScratchDir dir("convert_moe_" + GetParam());
  const fs::path src_dir = fs::absolute(moe_fixtures_dir()) / GetParam();
  safetensors::File src((src_dir / "model.safetensors").string());
  const std::vector<std::string> names = src.names();
  // The source as two shards and an index, as the Hub stores large models.
  fs::create_directories(dir.path / "hf");
  fs::copy_file(src_dir / "config.json", dir.path / "hf/config.json");
  std::vector<std::pair<std::string, Tensor>> shard[2];
  nlohmann::json weight_map;
  for (size_t i = 0; i < names.size(); ++i) {
    const int k = i < names.size() / 2 ? 0 : 1;
    shard[k].emplace_back(names[i], src.read(names[i]));
    weight_map[names[i]] = fmt::format("model-{:05d}-of-00002.safetensors", k + 1);
  }
  for (int k = 0; k < 2; ++k)
    safetensors::write((dir.path / fmt::format("hf/model-{:05d}-of-00002.safetensors", k + 1)).string(), shard[k],
                       {{"format", "pt"}});
  std::ofstream(dir.path / "hf/model.safetensors.index.json") << nlohmann::json{{"weight_map", weight_map}}.dump();

  RunResult to = run({bin("convert_checkpoint"), "--from", "hf", "--load", "hf", "--save", "ckpt"}, dir.path);
  ASSERT_EQ(to.exit_code, 0) << to.output;
  RunResult back = run({bin("convert_checkpoint"), "--from", "megatron", "--load", "ckpt", "--save", "hf_back",
                        "--max-shard-size", "200KB"},
                       dir.path);
  ASSERT_EQ(back.exit_code, 0) << back.output;
  ASSERT_TRUE(fs::exists(dir.path / "hf_back/model.safetensors.index.json")) << "a 200KB shard limit shards the export";
  HFFolder out((dir.path / "hf_back").string());
  ASSERT_EQ(out.tensor_names(), names);
  for (const std::string& n : names) EXPECT_EQ(out.get(n).to_floats(), src.read(n).to_floats()) << n;
  const nlohmann::json hf_config = HFFolder(src_dir.string()).config();
  EXPECT_EQ(out.config(), hf_config);

  Arguments args;
  const double error = checkpoint_logits_error(
      dir.path / "ckpt", fs::absolute(moe_fixtures_dir()) / (GetParam() + "_io.safetensors"), args);
  EXPECT_EQ(args.num_experts, config_from_hf(hf_config).config.num_moe_experts);
  EXPECT_LE(error, 1e-5);
  std::printf("convert %s: HF (2 shards) -> megatron.cpp -> HF (sharded) exact over %zu tensors, logits within %.2e\n",
              GetParam().c_str(), names.size(), error);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ConvertMoE, ::testing::ValuesIn(moe_model_fixtures()),
                         [](const auto& info) { return info.param; });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(ConvertMoE);

// GPT-OSS (Note [HF GPT-OSS]): HF -> megatron.cpp -> HF is exact over every tensor (the stacked,
// interleaved expert tensors included), the export's config reads back as the same model, and the
// checkpoint loaded as pretrain_gpt would gives the io file's logits.
TEST(Convert, GptOssRoundTripIsExactAndLogitsMatch) {
  ScratchDir dir("convert_gpt_oss");
  const fs::path src_dir = fs::absolute(arch_fixtures_dir()) / "gpt_oss";
  RunResult to = run({bin("convert_checkpoint"), "--from", "hf", "--load", src_dir.string(), "--save", "ckpt"}, dir.path);
  ASSERT_EQ(to.exit_code, 0) << to.output;
  RunResult back = run({bin("convert_checkpoint"), "--from", "megatron", "--load", "ckpt", "--save", "hf"}, dir.path);
  ASSERT_EQ(back.exit_code, 0) << back.output;
  HFFolder src(src_dir.string()), out((dir.path / "hf").string());
  ASSERT_EQ(out.tensor_names(), src.tensor_names());
  for (const std::string& n : src.tensor_names()) EXPECT_EQ(out.get(n).to_floats(), src.get(n).to_floats()) << n;
  const TransformerConfig want = config_from_hf(src.config()).config, got = config_from_hf(out.config()).config;
  EXPECT_EQ(got.window_attn_pattern, want.window_attn_pattern);
  EXPECT_EQ(got.window_size_left, want.window_size_left);
  EXPECT_EQ(got.yarn_correction_range_round_to_int, want.yarn_correction_range_round_to_int);
  EXPECT_EQ(got.activation_func_clamp_value, want.activation_func_clamp_value);
  Arguments args;
  const double error =
      checkpoint_logits_error(dir.path / "ckpt", fs::absolute(arch_fixtures_dir()) / "gpt_oss_io.safetensors", args);
  EXPECT_EQ(args.softmax_type, "learnable");
  EXPECT_EQ(args.window_size, "7,0");
  EXPECT_LE(error, 1e-5);
  std::printf("convert gpt_oss: HF -> megatron.cpp -> HF exact over %zu tensors, logits within %.2e\n",
              src.tensor_names().size(), error);
}

// MoE models trained here (no HF config in their checkpoints) export as the HF type with their
// options — Qwen2-MoE for a gated shared expert with pre-softmax routing, Qwen3-MoE for
// --qk-layernorm with a dense first layer, Mixtral otherwise — and that export goes through
// megatron.cpp and back unchanged.
TEST(Convert, MoECheckpointsExportAsTheirHFType) {
  struct Case {
    std::string type, name_in_export;
    std::vector<std::string> flags;
  };
  const std::vector<Case> cases = {
      {"mixtral", "model.layers.1.block_sparse_moe.experts.3.w3.weight", {}},
      {"qwen2_moe",
       "model.layers.1.mlp.shared_expert_gate.weight",
       {"--add-qkv-bias", "--moe-router-pre-softmax", "--moe-shared-expert-intermediate-size", "32",
        "--moe-shared-expert-gate"}},
      {"qwen3_moe",
       "model.layers.0.mlp.gate_proj.weight",
       {"--qk-layernorm", "--moe-layer-freq", "([0]+[1]*1)", "--moe-ffn-hidden-size", "32"}},
  };
  for (const Case& c : cases) {
    ScratchDir dir("convert_moe_export_" + c.type);
    const std::vector<std::string> flags = {
        "--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--seq-length", "16", "--normalization", "RMSNorm",
        "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
        "--untie-embeddings-and-output-weights", "--num-experts", "4", "--moe-router-topk", "2",
        "--moe-aux-loss-coeff", "1e-2", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
        "--mock-data", "--vocab-size", "100", "--eval-iters", "1", "--device", "cpu", "--save", "ckpt",
        "--save-interval", "2"};
    RunResult train = run(concat(concat({bin("pretrain_gpt")}, flags), c.flags), dir.path);
    ASSERT_EQ(train.exit_code, 0) << c.type << ": " << train.output;
    RunResult to_hf = run({bin("convert_checkpoint"), "--from", "megatron", "--load", "ckpt", "--save", "hf"}, dir.path);
    ASSERT_EQ(to_hf.exit_code, 0) << to_hf.output;
    const nlohmann::json config = nlohmann::json::parse(read_file(dir.path / "hf/config.json"));
    EXPECT_EQ(config.at("model_type"), c.type);
    EXPECT_EQ(config.at("router_aux_loss_coef"), 1e-2f) << c.type;
    HFFolder hf((dir.path / "hf").string());
    const std::vector<std::string> names = hf.tensor_names();
    EXPECT_NE(std::find(names.begin(), names.end(), c.name_in_export), names.end()) << c.type;
    RunResult in = run({bin("convert_checkpoint"), "--from", "hf", "--load", "hf", "--save", "ckpt2"}, dir.path);
    ASSERT_EQ(in.exit_code, 0) << in.output;
    RunResult out = run({bin("convert_checkpoint"), "--from", "megatron", "--load", "ckpt2", "--save", "hf2"}, dir.path);
    ASSERT_EQ(out.exit_code, 0) << out.output;
    HFFolder again((dir.path / "hf2").string());
    ASSERT_EQ(again.tensor_names(), names);
    for (const std::string& n : names) EXPECT_EQ(again.get(n).to_floats(), hf.get(n).to_floats()) << n;
    EXPECT_EQ(again.config(), config);
    std::printf("convert: an MoE checkpoint trained here exports as %s (%zu tensors) and round-trips exactly\n",
                c.type.c_str(), names.size());
  }
}

// Every HF MoE fixture converts to a checkpoint pretrain_gpt resumes from (--use-checkpoint-args:
// the model flags come from the checkpoint) and trains on, with the router's load-balancing loss on,
// saving its own checkpoint. (The converted weights' exactness is the golden tests'.)
TEST(Convert, ConvertedMoEFixturesResumeTraining) {
  if (moe_model_fixtures().empty()) GTEST_SKIP() << "no MoE fixtures";
  for (const std::string& model : moe_model_fixtures()) {
    ScratchDir dir("convert_moe_resume_" + model);
    const fs::path hf = fs::absolute(moe_fixtures_dir()) / model;
    RunResult in = run({bin("convert_checkpoint"), "--from", "hf", "--load", hf.string(), "--save", "ckpt"}, dir.path);
    ASSERT_EQ(in.exit_code, 0) << in.output;
    const nlohmann::json config = nlohmann::json::parse(read_file(hf / "config.json"));
    RunResult r = run({bin("pretrain_gpt"), "--use-checkpoint-args", "--load", "ckpt", "--save", "ckpt",
                       "--micro-batch-size", "2", "--seq-length", "16", "--train-iters", "6", "--lr", "1e-3",
                       "--mock-data", "--vocab-size", std::to_string(config.at("vocab_size").get<int>()),
                       "--hidden-dropout", "0", "--attention-dropout", "0", "--moe-aux-loss-coeff", "1e-2",
                       "--log-interval", "1", "--eval-iters", "0", "--device", "cpu"},
                      dir.path);
    ASSERT_EQ(r.exit_code, 0) << model << ": " << r.output;
    EXPECT_NE(r.output.find("successfully loaded checkpoint from ckpt"), std::string::npos) << r.output;
    const std::vector<std::string> lm = field_values(r.output, "lm loss"), lb = field_values(r.output, "load_balancing_loss");
    ASSERT_EQ(lm.size(), 6u) << r.output;
    ASSERT_EQ(lb.size(), 6u) << r.output;
    for (const std::string& v : lm) EXPECT_TRUE(std::isfinite(std::stod(v))) << model << ": " << v;
    EXPECT_EQ(read_file(dir.path / "ckpt/latest_checkpointed_iteration.txt"), "6");
    std::printf("convert: %s resumes training from its converted checkpoint: lm loss %s -> %s, load_balancing_loss %s\n",
                model.c_str(), lm.front().c_str(), lm.back().c_str(), lb.back().c_str());
  }
}

// A folder missing one expert's tensor: the converter says which, in one line.
TEST(Convert, MissingExpertTensorIsNamed) {
  if (moe_model_fixtures().empty()) GTEST_SKIP() << "no MoE fixtures";
  ScratchDir dir("convert_moe_missing");
  const fs::path src_dir = fs::absolute(moe_fixtures_dir()) / "mixtral";
  safetensors::File src((src_dir / "model.safetensors").string());
  fs::create_directories(dir.path / "hf");
  fs::copy_file(src_dir / "config.json", dir.path / "hf/config.json");
  std::vector<std::pair<std::string, Tensor>> kept;
  const std::string dropped = "model.layers.1.block_sparse_moe.experts.2.w3.weight";
  for (const std::string& n : src.names())
    if (n != dropped) kept.emplace_back(n, src.read(n));
  safetensors::write((dir.path / "hf/model.safetensors").string(), kept, {{"format", "pt"}});
  RunResult r = run({bin("convert_checkpoint"), "--from", "hf", "--load", "hf", "--save", "ckpt"}, dir.path);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("has no tensor '" + dropped + "'"), std::string::npos) << r.output;
}

// The other way round: an HF folder holding a tensor its config does not describe (an expert
// beyond num_local_experts) is refused with the tensor's name, not converted without it.
TEST(Convert, TensorTheConfigDoesNotUseIsNamed) {
  if (moe_model_fixtures().empty()) GTEST_SKIP() << "no MoE fixtures";
  ScratchDir dir("convert_moe_extra");
  const fs::path src_dir = fs::absolute(moe_fixtures_dir()) / "mixtral";
  safetensors::File src((src_dir / "model.safetensors").string());
  fs::create_directories(dir.path / "hf");
  fs::copy_file(src_dir / "config.json", dir.path / "hf/config.json");
  std::vector<std::pair<std::string, Tensor>> all;
  for (const std::string& n : src.names()) all.emplace_back(n, src.read(n));
  const std::string extra = "model.layers.1.block_sparse_moe.experts.99.w1.weight";
  all.emplace_back(extra, src.read("model.layers.1.block_sparse_moe.experts.0.w1.weight"));
  safetensors::write((dir.path / "hf/model.safetensors").string(), all, {{"format", "pt"}});
  RunResult r = run({bin("convert_checkpoint"), "--from", "hf", "--load", "hf", "--save", "ckpt"}, dir.path);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("has tensor '" + extra + "' that a mixtral model of its config.json does not use"),
            std::string::npos)
      << r.output;
}

TEST(Convert, MissingFilesAreClearErrors) {
  ScratchDir dir("convert_bad");
  fs::create_directories(dir.path / "hf");
  RunResult r = run({bin("convert_checkpoint"), "--from", "hf", "--load", "hf", "--save", "out"}, dir.path);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("config.json"), std::string::npos) << r.output;
  RunResult m = run({bin("convert_checkpoint"), "--from", "megatron", "--load", "nothing", "--save", "out"}, dir.path);
  EXPECT_NE(m.exit_code, 0);
  EXPECT_NE(m.output.find("no checkpoint"), std::string::npos) << m.output;
}

}  // namespace
}  // namespace megatron::testing

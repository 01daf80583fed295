// tools/convert_checkpoint streams (Note [Streaming conversion]): converting a bf16 folder both ways
// peaks, in the child's resident set (wait4's ru_maxrss), at no more than 1.5x its largest tensor (as
// stored: bf16 stays bf16, Note [Converted weights' dtype]) above the converter's own baseline, which is
// measured by converting a tiny Llama folder; and the round trip is exact, byte for byte.
//   - a 1.24B-parameter bf16 Llama (Llama-3.2-1B's shape: 128256 x 2048 tied embedding, 16 layers,
//     2048 hidden, 8192 FFN, 32 heads, 8 KV heads; 2.47 GB), the largest tensor the 525 MB embedding;
//   - a one-layer GPT-2 whose largest tensors are Conv1D weights (c_fc, 210 MB), which both
//     directions transpose (in row blocks: transposed() in hf_util.h);
//   - a DeepSeek-V3 with an MTP layer and a 1M-token vocabulary, whose embedding and output head
//     (256 MB each) the HF folder stores twice (the MTP depth's copies: compared a chunk at a time).
// The folders are generated tensor by tensor (a xorshift per element), so the whole test takes about a
// minute on two cores, most of it writing and fsyncing ~7.5 GB.
#include <fmt/format.h>
#include <malloc.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fcntl.h>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "megatron/core/models/gpt/hf_mapping.h"
#include "tests/functional/run_util.h"
#include "tests/test_util.h"

namespace megatron::testing {
namespace {

struct Measured {
  int exit_code = -1;
  int64_t peak_rss = 0;  // bytes
  std::string output;
};

// Runs argv in cwd as a direct child and returns its exit code and peak resident set. The peak
// includes the pages the child shares with this process between fork and exec, so the heap is
// trimmed first and the baseline is measured before any test allocates (baseline()).
Measured run_measured(const std::vector<std::string>& argv, const fs::path& cwd) {
  const fs::path log = cwd / "child.log";
  Measured m;
  ::malloc_trim(0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1), ::dup2(fd, 2);
    if (::chdir(cwd.c_str()) != 0) ::_exit(127);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  int status = 0;
  struct rusage usage {};
  ::wait4(pid, &status, 0, &usage);
  m.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  m.peak_rss = int64_t(usage.ru_maxrss) * 1024;
  m.output = read_file(log);
  return m;
}

using Specs = std::vector<safetensors::Writer::Spec>;

// An HF folder: config.json and model.safetensors holding `specs` in bf16 with deterministic
// pseudo-random values (|x| in [2^-7, 2^-6)), written tensor by tensor; a spec whose name is in
// `copy_of` gets the bytes of the tensor named there (DeepSeek's MTP copies). Returns the bytes of
// the largest tensor.
int64_t write_folder(const fs::path& dir, const std::string& config, const Specs& specs,
                     const std::map<std::string, std::string>& copy_of = {}) {
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << config;
  safetensors::Writer writer((dir / "model.safetensors").string(), specs, {{"format", "pt"}});
  std::map<std::string, uint32_t> seed_of;
  int64_t largest = 0;
  for (const safetensors::Writer::Spec& s : specs) {
    const std::string& source = copy_of.count(s.name) ? copy_of.at(s.name) : s.name;
    const uint32_t seed = seed_of.emplace(source, uint32_t(0x9e3779b9u * (seed_of.size() + 1))).first->second;
    Tensor t = Tensor::empty(s.shape, DType::BFloat16);
    auto* bits = static_cast<uint16_t*>(t.raw_data());
    uint32_t state = seed | 1;
    for (int64_t i = 0; i < t.numel(); ++i) {
      state ^= state << 13, state ^= state >> 17, state ^= state << 5;
      bits[i] = uint16_t(0x3c00 + (state & 0x3ff) + ((state >> 10) & 1) * 0x8000);
    }
    writer.put(s.name, {t});
    largest = std::max<int64_t>(largest, int64_t(t.nbytes()));
  }
  writer.commit();
  return largest;
}

// A Llama-type folder (tied embeddings when `tied`: no lm_head, as transformers saves them).
int64_t write_llama_folder(const fs::path& dir, int64_t vocab, int64_t h, int64_t layers, int64_t heads, int64_t groups,
                           int64_t ffn, bool tied) {
  const int64_t d = h / heads;
  const std::string config = fmt::format(
      R"({{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": {}, "intermediate_size": {},
"num_hidden_layers": {}, "num_attention_heads": {}, "num_key_value_heads": {}, "head_dim": {}, "vocab_size": {},
"max_position_embeddings": 256, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": {},
"hidden_act": "silu", "torch_dtype": "bfloat16"}})",
      h, ffn, layers, heads, groups, d, vocab, tied);
  Specs specs = {{"model.embed_tokens.weight", DType::BFloat16, {vocab, h}}, {"model.norm.weight", DType::BFloat16, {h}}};
  if (!tied) specs.push_back({"lm_head.weight", DType::BFloat16, {vocab, h}});
  for (int64_t i = 0; i < layers; ++i) {
    auto p = [&](const char* rest) { return fmt::format("model.layers.{}.{}", i, rest); };
    for (const auto& [name, shape] : std::vector<std::pair<std::string, Shape>>{
             {p("input_layernorm.weight"), {h}},
             {p("post_attention_layernorm.weight"), {h}},
             {p("self_attn.q_proj.weight"), {heads * d, h}},
             {p("self_attn.k_proj.weight"), {groups * d, h}},
             {p("self_attn.v_proj.weight"), {groups * d, h}},
             {p("self_attn.o_proj.weight"), {h, heads * d}},
             {p("mlp.gate_proj.weight"), {ffn, h}},
             {p("mlp.up_proj.weight"), {ffn, h}},
             {p("mlp.down_proj.weight"), {h, ffn}}})
      specs.push_back({name, DType::BFloat16, shape});
  }
  return write_folder(dir, config, specs);
}

// A GPT-2 folder (Conv1D weights [in, out]; tied embeddings).
int64_t write_gpt2_folder(const fs::path& dir, int64_t vocab, int64_t h, int64_t layers, int64_t heads) {
  const std::string config = fmt::format(
      R"({{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": {}, "n_layer": {}, "n_head": {},
"n_inner": null, "n_positions": 64, "vocab_size": {}, "layer_norm_epsilon": 1e-05,
"activation_function": "gelu_new", "torch_dtype": "bfloat16"}})",
      h, layers, heads, vocab);
  Specs specs = {{"transformer.wte.weight", DType::BFloat16, {vocab, h}},
                 {"transformer.wpe.weight", DType::BFloat16, {64, h}},
                 {"transformer.ln_f.weight", DType::BFloat16, {h}},
                 {"transformer.ln_f.bias", DType::BFloat16, {h}}};
  for (int64_t i = 0; i < layers; ++i) {
    auto p = [&](const char* rest) { return fmt::format("transformer.h.{}.{}", i, rest); };
    for (const auto& [name, shape] : std::vector<std::pair<std::string, Shape>>{{p("ln_1.weight"), {h}},
                                                                                {p("ln_1.bias"), {h}},
                                                                                {p("attn.c_attn.weight"), {h, 3 * h}},
                                                                                {p("attn.c_attn.bias"), {3 * h}},
                                                                                {p("attn.c_proj.weight"), {h, h}},
                                                                                {p("attn.c_proj.bias"), {h}},
                                                                                {p("ln_2.weight"), {h}},
                                                                                {p("ln_2.bias"), {h}},
                                                                                {p("mlp.c_fc.weight"), {h, 4 * h}},
                                                                                {p("mlp.c_fc.bias"), {4 * h}},
                                                                                {p("mlp.c_proj.weight"), {4 * h, h}},
                                                                                {p("mlp.c_proj.bias"), {h}}})
      specs.push_back({name, DType::BFloat16, shape});
  }
  return write_folder(dir, config, specs);
}

// Every tensor of the two HF folders, byte for byte, in the same dtype (bf16 stays bf16).
void expect_same_weights(const fs::path& a, const fs::path& b) {
  HFFolder fa(a.string()), fb(b.string());
  ASSERT_EQ(fa.tensor_names(), fb.tensor_names());
  for (const std::string& n : fa.tensor_names()) {
    const Tensor ta = fa.read(n), tb = fb.read(n);
    ASSERT_EQ(ta.shape(), tb.shape()) << n;
    EXPECT_EQ(tb.dtype(), ta.dtype()) << n;
    EXPECT_TRUE(ta.dtype() == tb.dtype() && std::memcmp(ta.raw_data(), tb.raw_data(), ta.nbytes()) == 0) << n;
  }
}

struct Peaks {
  int64_t to_ours = 0, to_hf = 0;
};

// HF folder `hf` -> `ckpt` -> `hf_back` under dir, each direction's peak RSS.
Peaks convert_both_ways(const fs::path& dir) {
  Measured to = run_measured({bin("convert_checkpoint"), "--from", "hf", "--load", "hf", "--save", "ckpt"}, dir);
  EXPECT_EQ(to.exit_code, 0) << to.output;
  EXPECT_NE(to.output.find("weights written in bfloat16"), std::string::npos) << to.output;
  Measured back =
      run_measured({bin("convert_checkpoint"), "--from", "megatron", "--load", "ckpt", "--save", "hf_back"}, dir);
  EXPECT_EQ(back.exit_code, 0) << back.output;
  expect_same_weights(dir / "hf", dir / "hf_back");
  return {to.peak_rss, back.peak_rss};
}

// The converter's baseline: the binary, its libraries and the bookkeeping of a tiny model.
const Peaks& baseline() {
  static const Peaks base = [] {
    ScratchDir tiny("convert_memory_tiny");
    write_llama_folder(tiny.path / "hf", 259, 64, 2, 4, 2, 176, false);
    return convert_both_ways(tiny.path);
  }();
  return base;
}

// The bound both ways: 1.5 x the largest tensor above the baseline, plus 48 MB (a 16 MB conversion
// chunk, a 4 MiB transpose block, the pages at chunk edges and malloc's slack).
void expect_bounded(const char* what, int64_t largest, const Peaks& peak) {
  const Peaks& base = baseline();
  const int64_t margin = int64_t(48) << 20;
  const double mb = 1e6;
  std::printf("[convert memory] %s: largest tensor %.1f MB; peak RSS hf->ours %.1f MB (baseline %.1f), ours->hf "
              "%.1f MB (baseline %.1f); bound 1.5 x largest + baseline + %.0f MB\n",
              what, largest / mb, peak.to_ours / mb, base.to_ours / mb, peak.to_hf / mb, base.to_hf / mb, margin / mb);
  EXPECT_LE(peak.to_ours, largest * 3 / 2 + base.to_ours + margin) << what;
  EXPECT_LE(peak.to_hf, largest * 3 / 2 + base.to_hf + margin) << what;
}

TEST(ConvertMemory, OneBillionParameterLlamaIsBoundedByItsLargestTensor) {
  baseline();  // first, while this process is small
  ScratchDir dir("convert_memory_1b");
  const int64_t largest = write_llama_folder(dir.path / "hf", 128256, 2048, 16, 32, 8, 8192, true);
  EXPECT_EQ(largest, int64_t(128256) * 2048 * 2);
  expect_bounded("1.24B-parameter Llama", largest, convert_both_ways(dir.path));
}

TEST(ConvertMemory, Gpt2TransposesAreWrittenInBlocks) {
  baseline();  // first, while this process is small
  ScratchDir dir("convert_memory_gpt2");
  const int64_t largest = write_gpt2_folder(dir.path / "hf", 1024, 5120, 1, 40);
  EXPECT_EQ(largest, int64_t(5120) * 4 * 5120 * 2);  // c_fc and c_proj
  expect_bounded("GPT-2, 210 MB Conv1D weights", largest, convert_both_ways(dir.path));
}

// A DeepSeek-V3 folder with one MTP depth: the DeepSeek-V3 fixture's config and tensors (multi-latent
// attention, a dense layer then MoE layers with the expert bias), its vocabulary 1M so that the
// embedding, the output head and the MTP depth's copies of both are the largest tensors, and the MTP
// layer (model.layers.3: a MoE layer's tensors and enorm, hnorm, eh_proj, shared_head) added.
TEST(ConvertMemory, DeepSeekMtpCopiesAreComparedInChunks) {
  const fs::path fixture = fs::absolute(arch_fixtures_dir()) / "deepseek_v3";
  if (!fs::exists(fixture / "config.json")) GTEST_SKIP() << "no DeepSeek-V3 fixture";
  baseline();  // first, while this process is small
  ScratchDir dir("convert_memory_deepseek");
  HFFolder src(fixture.string());
  nlohmann::json config = src.config();
  const int64_t vocab = 1000000, h = config.at("hidden_size").get<int64_t>();
  const int layers = config.at("num_hidden_layers").get<int>();
  config["vocab_size"] = vocab;
  config["num_nextn_predict_layers"] = 1;
  config["dtype"] = "bfloat16";
  Specs specs;
  const std::string last = fmt::format("model.layers.{}.", layers - 1), mtp = fmt::format("model.layers.{}.", layers);
  for (const std::string& n : src.tensor_names()) {
    Shape shape = src.shape(n);
    if (n == "model.embed_tokens.weight" || n == "lm_head.weight") shape[0] = vocab;
    specs.push_back({n, DType::BFloat16, shape});
    if (n.rfind(last, 0) == 0) specs.push_back({mtp + n.substr(last.size()), DType::BFloat16, shape});
  }
  for (const auto& [name, shape] : std::vector<std::pair<std::string, Shape>>{{"enorm.weight", {h}},
                                                                              {"hnorm.weight", {h}},
                                                                              {"eh_proj.weight", {h, 2 * h}},
                                                                              {"shared_head.norm.weight", {h}},
                                                                              {"embed_tokens.weight", {vocab, h}},
                                                                              {"shared_head.head.weight", {vocab, h}}})
    specs.push_back({mtp + name, DType::BFloat16, shape});
  const int64_t largest = write_folder(dir.path / "hf", config.dump(2), specs,
                                       {{mtp + "embed_tokens.weight", "model.embed_tokens.weight"},
                                        {mtp + "shared_head.head.weight", "lm_head.weight"}});
  EXPECT_EQ(largest, vocab * h * 2);
  const Peaks peak = convert_both_ways(dir.path);
  EXPECT_NE(read_file(dir.path / "ckpt/release/metadata.json").find("mtp.layers.0.eh_proj.weight"), std::string::npos)
      << "the MTP layer was imported";
  expect_bounded("DeepSeek-V3 with MTP, 1M vocabulary", largest, peak);
}

}  // namespace
}  // namespace megatron::testing

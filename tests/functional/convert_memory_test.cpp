// tools/convert_checkpoint streams (Note [Streaming conversion]): converting a ~300 MB bf16 Llama
// folder both ways peaks, in the child's resident set (wait4's ru_maxrss), at no more than 1.5x its
// largest tensor (the padded fp32 embedding) above the converter's own baseline, which is measured
// by converting a tiny folder of the same architecture; and the round trip is exact.
#include <fmt/format.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fcntl.h>

#include "megatron/core/dist_checkpointing/safetensors.h"
#include "tests/functional/run_util.h"

namespace megatron::testing {
namespace {

struct Measured {
  int exit_code = -1;
  int64_t peak_rss = 0;  // bytes
  std::string output;
};

// Runs argv in cwd as a direct child and returns its exit code and peak resident set.
Measured run_measured(const std::vector<std::string>& argv, const fs::path& cwd) {
  const fs::path log = cwd / "child.log";
  Measured m;
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

// A Llama-type HF folder in bf16 with deterministic pseudo-random weights, written tensor by tensor.
// Returns the bytes of its largest tensor as the converter holds it (fp32, vocabulary padded to 128).
int64_t write_llama_folder(const fs::path& dir, int64_t vocab, int64_t h, int64_t layers, int64_t heads, int64_t groups,
                           int64_t ffn) {
  fs::create_directories(dir);
  const int64_t d = h / heads;
  std::ofstream(dir / "config.json") << fmt::format(
      R"({{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": {}, "intermediate_size": {},
"num_hidden_layers": {}, "num_attention_heads": {}, "num_key_value_heads": {}, "vocab_size": {},
"max_position_embeddings": 256, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": false,
"hidden_act": "silu", "torch_dtype": "bfloat16"}})",
      h, ffn, layers, heads, groups, vocab);
  std::vector<safetensors::Writer::Spec> specs = {{"model.embed_tokens.weight", DType::BFloat16, {vocab, h}},
                                                  {"lm_head.weight", DType::BFloat16, {vocab, h}},
                                                  {"model.norm.weight", DType::BFloat16, {h}}};
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
  safetensors::Writer writer((dir / "model.safetensors").string(), specs, {{"format", "pt"}});
  uint32_t state = 12345;
  for (const safetensors::Writer::Spec& s : specs) {
    Tensor t = Tensor::empty(s.shape, DType::BFloat16);
    auto* bits = static_cast<uint16_t*>(t.raw_data());
    for (int64_t i = 0; i < t.numel(); ++i) {
      state ^= state << 13, state ^= state >> 17, state ^= state << 5;
      bits[i] = uint16_t(0x3c00 + (state & 0x3ff) + ((state >> 10) & 1) * 0x8000);  // |x| in [2^-7, 2^-6)
    }
    writer.put(s.name, {t});
  }
  writer.commit();
  const int64_t padded = (vocab + 127) / 128 * 128;
  return padded * h * 4;
}

// Every tensor of the two HF weight files, value for value. The import writes an fp32 checkpoint (as
// it always has) and the export keeps the checkpoint's dtype, so bf16 comes back as the same values in fp32.
void expect_same_weights(const fs::path& a, const fs::path& b) {
  safetensors::File fa(a.string()), fb(b.string());
  ASSERT_EQ(fa.names(), fb.names());
  for (const std::string& n : fa.names()) {
    ASSERT_EQ(fa.entry(n).shape, fb.entry(n).shape) << n;
    const Tensor ta = fa.read(n, DType::Float32), tb = fb.read(n, DType::Float32);
    EXPECT_EQ(std::memcmp(ta.raw_data(), tb.raw_data(), ta.nbytes()), 0) << n;
  }
}

struct Peaks {
  int64_t to_ours = 0, to_hf = 0;
};

Peaks convert_both_ways(const fs::path& dir) {
  Peaks p;
  Measured to = run_measured({bin("convert_checkpoint"), "--from", "hf", "--load", "hf", "--save", "ckpt"}, dir);
  EXPECT_EQ(to.exit_code, 0) << to.output;
  EXPECT_NE(to.output.find("reading HF tensors"), std::string::npos) << to.output;
  Measured back =
      run_measured({bin("convert_checkpoint"), "--from", "megatron", "--load", "ckpt", "--save", "hf_back"}, dir);
  EXPECT_EQ(back.exit_code, 0) << back.output;
  EXPECT_NE(back.output.find("writing HF tensors"), std::string::npos) << back.output;
  expect_same_weights(dir / "hf/model.safetensors", dir / "hf_back/model.safetensors");
  return {to.peak_rss, back.peak_rss};
}

TEST(ConvertMemory, PeakIsBoundedByTheLargestTensorAndTheRoundTripIsExact) {
  ScratchDir tiny("convert_memory_tiny"), big("convert_memory_big");
  write_llama_folder(tiny.path / "hf", 259, 64, 2, 4, 2, 176);
  const Peaks base = convert_both_ways(tiny.path);
  // ~155M parameters, 310 MB of bf16: the fp32 checkpoint is 620 MB; largest tensor the padded embedding.
  const int64_t largest = write_llama_folder(big.path / "hf", 32003, 1024, 8, 16, 4, 2816);
  const Peaks peak = convert_both_ways(big.path);
  // The constant: the converter's baseline (binary, libraries, the planning pass's bookkeeping; the
  // tiny conversion's peak) plus 48 MB: a 16 MB conversion chunk, the pages at chunk edges and malloc's slack.
  const int64_t margin = int64_t(48) << 20;
  const double mb = 1e6;
  std::printf("[convert memory] largest tensor %.1f MB; peak RSS hf->ours %.1f MB (baseline %.1f), ours->hf %.1f MB "
              "(baseline %.1f); bound 1.5 x largest + baseline + %.0f MB\n",
              largest / mb, peak.to_ours / mb, base.to_ours / mb, peak.to_hf / mb, base.to_hf / mb, margin / mb);
  EXPECT_LE(peak.to_ours, largest * 3 / 2 + base.to_ours + margin);
  EXPECT_LE(peak.to_hf, largest * 3 / 2 + base.to_hf + margin);
}

}  // namespace
}  // namespace megatron::testing

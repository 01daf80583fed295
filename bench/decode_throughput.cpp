// decode_throughput: generation throughput of the InferenceEngine (KV cache, the engine behind
// tools/generate and the text generation server) for a GPT or Llama-style shape with random
// weights. The counterpart of bench/hf_generate_reference.py (HF transformers generate with a
// static cache); both measure the same way:
//   prefill: a batch of `batch` prompts of --prompt random tokens, generating one token each;
//            prefill_tokens_per_s = batch · prompt / that time.
//   decode:  the same prompts, generating --new-tokens greedily (no stop token);
//            decode_tokens_per_s = batch · (new - 1) / (that time - the prefill time).
// Times are medians over --repeats runs after one warmup run. One JSON line per (model, batch).
//
//   build/bench/decode_throughput --preset gpt-1.3B --batch 1,32 [--prompt 512 --new-tokens 128]
//   build/bench/decode_throughput --preset tiny --device cpu --batch 1,2 --prompt 16 --new-tokens 8
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>

#include "bench/bench_models.h"
#include "megatron/core/inference/generation.h"
#include "megatron/core/models/gpt/gpt_model.h"
#include "megatron/runtime/profiler.h"
#include "megatron/runtime/philox.h"
#include "megatron/training/training.h"

using namespace megatron;

namespace {
struct Preset {
  int layers, hidden, heads, vocab;
  bool llama = false;  // GQA, SwiGLU, RMSNorm, RoPE, no biases; embeddings tied as Llama-3.2-1B's
  int groups = 0, ffn = 0;
};
// The shapes of bench/hf_generate_reference.py.
const std::map<std::string, Preset> kPresets = {
    {"gpt-1.3B", {24, 2048, 16, 50304}},
    {"llama-1B", {16, 2048, 32, 128256, true, 8, 8192}},
    {"tiny", {2, 128, 4, 1024}},
    {"llama-tiny", {2, 128, 4, 1024, true, 2, 256}},
};

std::vector<int> parse_ints(const std::string& s) {
  std::vector<int> out;
  for (size_t at = 0; at < s.size();) {
    const size_t comma = std::min(s.find(',', at), s.size());
    out.push_back(std::stoi(s.substr(at, comma - at)));
    at = comma + 1;
  }
  return out;
}
}  // namespace

int main(int argc, char** argv) {
  try {
    std::string preset = "tiny", device = "auto", dtype = "bf16", batches = "1,32";
    int prompt = 512, new_tokens = 128, repeats = 3;
    bool profile = false;
    CLI::App app("InferenceEngine prefill and decode throughput");
    app.add_option("--preset", preset, "Model shape: gpt-1.3B, llama-1B, tiny, llama-tiny")->capture_default_str();
    app.add_option("--batch", batches, "Batch sizes, comma-separated")->capture_default_str();
    app.add_option("--prompt", prompt, "Prompt tokens per sequence")->capture_default_str();
    app.add_option("--new-tokens", new_tokens, "Tokens generated per sequence (greedy)")->capture_default_str();
    app.add_option("--repeats", repeats, "Timed runs per measurement (median; one warmup run first)")
        ->capture_default_str();
    app.add_option("--device", device, "auto, cpu or cuda")->capture_default_str();
    app.add_option("--dtype", dtype, "bf16 or fp32")->check(CLI::IsMember({"bf16", "fp32"}))->capture_default_str();
    app.add_flag("--profile", profile, "After timing, one more generation with per-op timing, eager (no decode graphs): the op table on stderr");
    CLI11_PARSE(app, argc, argv);
    auto it = kPresets.find(preset);
    MG_CHECK(it != kPresets.end(), "unknown preset '{}': use gpt-1.3B, llama-1B, tiny or llama-tiny", preset);
    MG_CHECK(prompt >= 1 && new_tokens >= 2 && repeats >= 1, "need --prompt >= 1, --new-tokens >= 2, --repeats >= 1");
    const Preset p = it->second;
    const std::vector<int> batch_sizes = parse_ints(batches);
    const int max_batch = *std::max_element(batch_sizes.begin(), batch_sizes.end());

    Arguments a;
    a.num_layers = p.layers;
    a.hidden_size = p.hidden;
    a.num_attention_heads = p.heads;
    a.seq_length = prompt + new_tokens;
    a.max_position_embeddings = std::max(2048, prompt + new_tokens);
    a.micro_batch_size = a.global_batch_size = 1;
    a.train_iters = 1;
    a.lr = 1e-4;
    a.mock_data = true;
    a.hidden_dropout = a.attention_dropout = 0.0f;
    a.bf16 = dtype == "bf16";
    a.make_vocab_size_divisible_by = 128;
    if (p.llama) bench::set_llama_style(a, p.groups, p.ffn, 500000.0f);  // embeddings tied, as Llama-3.2-1B
    validate_args(a);
    Context ctx(select_device(device), 1234);
    TransformerConfig config = transformer_config_from_args(a, p.vocab);
    config.inference_only = true;  // the weights alone, as the server's model
    GPTModel model(config, ctx.device());
    model.init_weights(1234);

    auto now = [] { return std::chrono::steady_clock::now(); };
    for (int batch : batch_sizes) {
      MG_CHECK(batch >= 1, "--batch sizes must be positive");
      InferenceEngine engine(model, ctx, p.vocab, {.max_batch_size = batch, .max_sequence_length = prompt + new_tokens});
      std::vector<GenerationRequest> requests(static_cast<size_t>(batch));
      for (int b = 0; b < batch; ++b) {
        GenerationRequest& r = requests[size_t(b)];
        for (int i = 0; i < prompt; ++i) r.prompt.push_back(int64_t(philox_element(7, uint64_t(b), uint64_t(i)) % uint64_t(p.vocab)));
        r.sampling.greedy = true;
      }
      // Median seconds of generating `n` tokens for every request; checks every request got them.
      auto time_generate = [&](int n) {
        for (GenerationRequest& r : requests) r.max_new_tokens = n;
        std::vector<double> times;
        for (int rep = 0; rep <= repeats; ++rep) {
          ctx.synchronize();
          const auto t0 = now();
          std::vector<GenerationResult> results = engine.generate(requests);
          ctx.synchronize();
          if (rep > 0) times.push_back(std::chrono::duration<double>(now() - t0).count());
          for (const GenerationResult& g : results)
            MG_ASSERT(int(g.tokens.size()) == n, "a request generated {} tokens, not {}", g.tokens.size(), n);
        }
        std::sort(times.begin(), times.end());
        return times[times.size() / 2];
      };
      reset_peak_memory_stats(ctx.device());
      const double prefill_s = time_generate(1);
      const double total_s = time_generate(new_tokens);
      // Not positive only when the timings are noise (a tiny smoke run): null.
      const double decode_s = total_s - prefill_s;
      const std::string decode_tps = decode_s > 0 ? fmt::format("{:.1f}", double(batch) * (new_tokens - 1) / decode_s) : "null";
      MemoryStats m = memory_stats(ctx.device());
      std::printf("%s\n",
                  fmt::format("{{\"system\": \"megatron.cpp\", \"model\": \"{}\", \"device\": \"{}\", \"dtype\": \"{}\", "
                              "\"batch\": {}, \"prompt\": {}, \"new_tokens\": {}, \"params\": {}, "
                              "\"prefill_tokens_per_s\": {:.1f}, \"decode_tokens_per_s\": {}, "
                              "\"prefill_s\": {:.4f}, \"generate_s\": {:.4f}, \"peak_mem_GiB\": {:.3f}}}",
                              preset, ctx.device().str(), dtype, batch, prompt, new_tokens, model.params().numel(),
                              double(batch) * prompt / prefill_s, decode_tps,
                              prefill_s, total_s, double(m.peak_allocated) / double(1ull << 30))
                      .c_str());
      std::fflush(stdout);
      if (profile) {  // one more generation, each op bracketed by events: where a step's time goes
        for (GenerationRequest& r : requests) r.max_new_tokens = new_tokens;
        // Eagerly (no decode graphs): a graph's kernels are not bracketed op by op.
        InferenceEngine eager(model, ctx, p.vocab,
                              {.max_batch_size = batch, .max_sequence_length = prompt + new_tokens, .cuda_graphs = false});
        eager.generate(requests);  // its warmup
        OpProfiler profiler;
        ctx.synchronize();
        ctx.set_profiler(&profiler);
        const auto t0 = now();
        eager.generate(requests);
        ctx.synchronize();
        const double wall_ms = std::chrono::duration<double, std::milli>(now() - t0).count();
        ctx.set_profiler(nullptr);
        std::fprintf(stderr, "== %s batch %d: one generation of %d tokens (prefill + %d decode steps)\n%s\n",
                     preset.c_str(), batch, new_tokens, new_tokens - 1,
                     format_op_table(profiler.collect(ctx), wall_ms, new_tokens, 30).c_str());
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

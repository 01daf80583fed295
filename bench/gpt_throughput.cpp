// gpt_throughput: training-step throughput of a GPT (or Llama-style) model on random tokens — the
// same step pretrain_gpt runs (forward, backward, Adam on fp32 masters) — for the shapes of
// ../shared/BENCHMARKS.md. One JSON line per run: tokens/s, TFLOP/s (Megatron's formula), MFU
// against 989 TFLOP/s, median step time, peak memory.
//
//   build/bench/gpt_throughput --preset gpt-1.3B [--steps 20 --warmup 5 --device cuda --dtype bf16]
//   build/bench/gpt_throughput --preset llama-1B --seq 32768 --micro-batch-size 1 --doc-mean 2048
//   build/bench/gpt_throughput --preset gpt-1.3B --fp8-format hybrid --fp8-recipe delayed
//
// With --fp8-format the attention and MLP linear layers run in FP8 (Note [FP8 layers]) and each step
// ends with the recipe's scale update, as pretrain_gpt's; "fp8_tflops" is the FLOPs those GEMMs
// carry per second ("linear_flop_share" of Megatron's count; the rest runs in bf16).
//
// --doc-mean N packs documents into each sequence (Note [Packed sequences]): lengths
// N/2 + (((i + 1) · 2654435761) mod 2^32) mod N for document i of the run (row r starts at
// i = 1000·r), the last one cut at the sequence's end — the lengths bench/pytorch_reference.py
// --doc-mean draws, so both attend within the same documents. The FLOPs stay Megatron's formula
// (causal attention over the whole sequence); compare tokens/s.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>

#include "bench/bench_models.h"
#include "megatron/core/models/gpt/gpt_model.h"
#include "megatron/core/optimizer/optimizer.h"
#include "megatron/kernels/ops.h"
#include "megatron/runtime/cuda_graph.h"
#include "megatron/runtime/profiler.h"
#include "megatron/training/training.h"
#include "megatron/training/training_log.h"

using namespace megatron;

namespace {
struct Preset {
  int layers, hidden, heads, seq, mbs;
  bool llama = false;  // GQA, SwiGLU, RMSNorm, RoPE, no biases, untied output layer
  int groups = 0, ffn = 0;
  int vocab = 0;  // 0: --vocab
  float rotary_base = 10000.0f;
  int experts = 0, topk = 0, moe_ffn = 0;  // MoE in every layer (0: dense)
};
const std::map<std::string, Preset> kPresets = {
    {"gpt2-124M", {12, 768, 12, 1024, 32}},
    {"gpt2-350M", {24, 1024, 16, 1024, 16}},
    {"gpt-1.3B", {24, 2048, 16, 2048, 8}},
    {"gpt2-1.5B", {48, 1600, 25, 1024, 8}},
    {"gpt-2.7B", {32, 2560, 32, 2048, 8}},
    // Llama-3.2-1B-like (untied output layer), as bench/pytorch_reference.py --preset llama-1B.
    {"llama-1B", {16, 2048, 32, 4096, 2, true, 8, 8192, 128256, 500000.0f}},
    // Eight layers of Llama-3-8B's shape (h 4096, 32 heads, 8 groups, ffn 14336) with its vocabulary: the
    // long-context memory statement's larger shape (the whole 8B's weights and Adam state exceed one H200).
    {"llama-8B-layers", {8, 4096, 32, 8192, 1, true, 8, 14336, 128256, 500000.0f}},
    {"tiny", {2, 128, 4, 128, 4}},
    {"llama-tiny", {2, 128, 4, 128, 4, true, 2, 256, 0, 500000.0f}},
    // Mixtral-style MoE in every layer, as ../shared/bench/pytorch_moe_reference.py's presets: dropless
    // softmax top-k routing, no aux loss, SwiGLU experts.
    {"mixtral-small", {16, 2048, 16, 4096, 2, true, 8, 4096, 32000, 10000.0f, 8, 2, 4096}},
    // Fine-grained experts (DeepSeek/Qwen3-MoE-like): 64 experts of 1024, top-6.
    {"moe-fine-64x6", {8, 2048, 32, 4096, 1, true, 4, 1024, 32000, 10000.0f, 64, 6, 1024}},
    {"moe-tiny", {2, 256, 4, 256, 2, true, 2, 512, 1024, 10000.0f, 4, 2, 512}},
};
}  // namespace

int main(int argc, char** argv) {
  try {
    std::string preset = "tiny", device = "auto", dtype = "bf16";
    int steps = 10, warmup = 3, vocab = 50257, mbs = 0, seq = 0, doc_mean = 0, layers = 0, micro_batches = 1;
    std::string recompute, fp8_format, fp8_recipe = "delayed";
    bool profile = false, cuda_graph = false, deterministic = false, grouped_gemm = false, shared_overlap = false;
    int shared_ffn = 0;
    CLI::App app("GPT training-step throughput");
    app.add_option("--preset", preset, "Model shape")->capture_default_str();
    app.add_option("--steps", steps, "Timed steps")->capture_default_str();
    app.add_option("--warmup", warmup, "Untimed steps first")->capture_default_str();
    app.add_option("--device", device, "auto, cpu or cuda")->capture_default_str();
    app.add_option("--dtype", dtype, "bf16 or fp32")->capture_default_str();
    CLI::Option* vocab_opt =
        app.add_option("--vocab", vocab, "Vocabulary size (padded to 128; Llama presets default to their own)")
            ->capture_default_str();
    app.add_option("--micro-batch-size", mbs, "Micro-batch size (default: the preset's)");
    app.add_option("--seq", seq, "Sequence length (default: the preset's)");
    app.add_option("--micro-batches", micro_batches,
                   "Microbatches a step (gradient accumulation; with FP8 the weights are quantised once a step: "
                   "Note [FP8 weight cache])")
        ->capture_default_str();
    app.add_option("--layers", layers, "Number of layers (default: the preset's)");
    app.add_option("--doc-mean", doc_mean, "Pack documents of about this mean length into each sequence");
    app.add_option("--recompute", recompute, "Activation recomputation: full (uniform, every layer) or selective")
        ->check(CLI::IsMember({"full", "selective"}));
    app.add_flag("--profile", profile, "After timing, one more step with per-op timing (CUDA events): JSON lines");
    app.add_flag("--cuda-graph", cuda_graph,
                 "Forward and backward as one CUDA graph, captured after the warmup steps (the optimizer eager)");
    app.add_flag("--deterministic", deterministic, "Deterministic algorithms (Megatron's --deterministic-mode)");
    app.add_flag("--moe-grouped-gemm", grouped_gemm, "MoE presets: the experts' GEMMs grouped (--moe-grouped-gemm)");
    app.add_option("--fp8-format", fp8_format, "FP8 GEMMs: e4m3 or hybrid (default: off)");
    app.add_option("--fp8-recipe", fp8_recipe, "delayed, tensorwise or blockwise")->capture_default_str();
    app.add_option("--moe-shared-expert-intermediate-size", shared_ffn, "MoE presets: shared experts of this size");
    app.add_flag("--moe-shared-expert-overlap", shared_overlap,
                 "MoE presets: the shared experts on the side stream (with the alltoall dispatcher)");
    CLI11_PARSE(app, argc, argv);
    MG_CHECK(!(cuda_graph && profile), "--profile times ops one by one: drop --cuda-graph");
    MG_CHECK(micro_batches >= 1 && ((!cuda_graph && !profile) || micro_batches == 1),
             "--micro-batches must be at least 1, and 1 with --cuda-graph (one graph is one microbatch) or --profile "
             "(its phases are one microbatch's), got {}",
             micro_batches);
    MG_CHECK(!cuda_graph || warmup >= 1, "--cuda-graph needs --warmup >= 1 (the eager steps build the plans)");
    auto it = kPresets.find(preset);
    MG_CHECK(it != kPresets.end(), "unknown preset '{}'", preset);
    Preset p = it->second;
    if (mbs > 0) p.mbs = mbs;
    if (seq > 0) p.seq = seq;
    if (layers > 0) p.layers = layers;
    if (p.vocab > 0 && vocab_opt->count() == 0) vocab = p.vocab;

    Arguments a;
    a.num_layers = p.layers;
    a.hidden_size = p.hidden;
    a.num_attention_heads = p.heads;
    a.seq_length = p.seq;
    a.max_position_embeddings = p.seq;
    a.micro_batch_size = p.mbs;
    a.global_batch_size = p.mbs;
    a.train_iters = steps + warmup;
    a.lr = 1e-4;
    a.mock_data = true;
    a.hidden_dropout = a.attention_dropout = 0.0f;
    a.bf16 = dtype == "bf16";
    if (p.llama) {
      bench::set_llama_style(a, p.groups, p.ffn, p.rotary_base);
      a.untie_embeddings_and_output_weights = true;
    }
    if (!recompute.empty()) {
      a.recompute_granularity = recompute;
      if (recompute == "full") a.recompute_method = "uniform", a.recompute_num_layers = 1;
    }
    if (p.experts > 0) {
      a.num_experts = p.experts;
      a.moe_router_topk = p.topk;
      a.moe_ffn_hidden_size = p.moe_ffn;
      a.moe_grouped_gemm = grouped_gemm;
      a.moe_shared_expert_intermediate_size = shared_ffn;
      a.moe_shared_expert_overlap = shared_overlap;
      if (shared_ffn > 0) a.moe_token_dispatcher_type = "alltoall";  // the overlap needs it: both runs use it
    }
    a.fp8_format = fp8_format;
    a.fp8_recipe = fp8_recipe;
    validate_args(a);
    Context ctx(select_device(device), 1234);
    ctx.set_deterministic(deterministic);
    TransformerConfig config = transformer_config_from_args(a, vocab);
    GPTModel model(config, ctx.device());
    model.init_weights(1234);
    std::vector<Parameter> params;
    for (Parameter* q : model.params().parameters()) params.push_back(*q);
    OptimizerConfig oc;
    oc.lr = 1e-4;
    oc.bf16 = a.bf16;
    AdamOptimizer optimizer(params, oc);
    optimizer.set_grad_buffer(model.params().grad_buffer());
    optimizer.set_lr(1e-4);
    optimizer.set_weight_decay(0.01);

    std::vector<int64_t> ids(size_t(p.mbs) * p.seq), labels(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      ids[i] = int64_t(philox_element(7, 0, i) % uint64_t(vocab));
      labels[i] = int64_t(philox_element(7, 1, i) % uint64_t(vocab));
    }
    Tensor tokens = Tensor::from_ints(ids, {p.mbs, p.seq}, DType::Int64, ctx.device());
    Tensor targets = Tensor::from_ints(labels, {p.mbs, p.seq}, DType::Int64, ctx.device());
    Tensor positions = default_position_ids(p.mbs, p.seq).to(ctx.device());
    Tensor cu_seqlens;  // --doc-mean: the documents of each row
    int64_t documents = 0;
    if (doc_mean > 0) {
      std::vector<std::vector<int64_t>> rows(static_cast<size_t>(p.mbs));
      size_t n = 0;
      for (int r = 0; r < p.mbs; ++r) {
        std::vector<int64_t>& cu = rows[size_t(r)];
        cu.push_back(0);
        for (uint64_t i = uint64_t(r) * 1000; cu.back() < p.seq; ++i) {
          const int64_t len = doc_mean / 2 + int64_t((((i + 1) * 2654435761ull) % 4294967296ull) % uint64_t(doc_mean));
          cu.push_back(std::min<int64_t>(cu.back() + std::max<int64_t>(len, 1), p.seq));
        }
        n = std::max(n, cu.size() - 1);
        documents += int64_t(cu.size()) - 1;
      }
      std::vector<int64_t> flat;
      for (auto& cu : rows) {
        cu.resize(n + 1, p.seq);
        flat.insert(flat.end(), cu.begin(), cu.end());
      }
      cu_seqlens = Tensor::from_ints(flat, {p.mbs, int64_t(n + 1)}, DType::Int32);
    }
    Tensor sums = Tensor::empty({2}, DType::Float32, ctx.device());
    Tensor grad = Tensor::empty({int64_t(ids.size())}, DType::Float32, ctx.device());

    // One training step; `phase` (if given) is called after each of its phases: zero_grad,
    // forward (with the loss gradient), backward, optimizer. With --cuda-graph the forward and
    // backward passes are one graph, recorded at the first step after the warmup.
    CudaGraph graph;
    auto step = [&](const std::function<void()>& phase, bool use_graph) {
      auto mark = [&] {
        if (phase) phase();
      };
      model.params().zero_grad();
      mark();
      auto forward_backward = [&] {
        GPTModel::Stash stash;
        Tensor losses = model.forward(ctx, tokens, positions, targets, stash, cu_seqlens);
        ops::masked_loss_sums(ctx, losses.view({-1}), Tensor(), sums);
        ops::masked_loss_backward(ctx, Tensor(), 1.0f / float(ids.size()), grad);
        mark();
        model.backward(ctx, grad.view(losses.shape()), stash);
      };
      if (use_graph) {
        if (!graph.captured()) graph.capture(ctx, forward_backward);
        graph.replay(ctx);
      } else {
        model.begin_fp8_step(micro_batches > 1, true);  // Note [FP8 weight cache], as pretrain_gpt
        for (int m = 0; m < micro_batches; ++m) forward_backward();
      }
      mark();
      model.finish_fp8_step(ctx);
      optimizer.step(ctx);
      mark();
    };
    auto now = [] { return std::chrono::steady_clock::now(); };
    auto ms_since = [&](auto t0) { return std::chrono::duration<double, std::milli>(now() - t0).count(); };

    std::vector<double> times;
    double loss = 0;
    reset_peak_memory_stats(ctx.device());
    for (int s = 0; s < warmup + steps; ++s) {
      ctx.synchronize();
      const auto t0 = now();
      step({}, cuda_graph && s >= warmup);
      ctx.synchronize();
      if (s >= warmup) times.push_back(ms_since(t0) / 1000.0);
      if (s == warmup + steps - 1) {
        auto h = sums.to_floats();
        loss = h[0] / h[1];
      }
    }
    if (profile) {  // one step with the device synchronised between its phases (wall ms each)
      std::vector<double> phase_ms;
      ctx.synchronize();
      auto t = now();
      step(
          [&] {
            ctx.synchronize();
            phase_ms.push_back(ms_since(t));
            t = now();
          },
          false);
      std::printf("{\"bench\": \"step_phases\", \"preset\": \"%s\", \"zero_grad_ms\": %.2f, \"forward_ms\": %.2f, "
                  "\"backward_ms\": %.2f, \"optimizer_ms\": %.2f}\n",
                  preset.c_str(), phase_ms[0], phase_ms[1], phase_ms[2], phase_ms[3]);
    }
    if (profile) {  // one more step, each op bracketed by events: where the step's time goes
      OpProfiler profiler;
      ctx.set_profiler(&profiler);
      ctx.synchronize();
      const auto t0 = now();
      step({}, false);
      ctx.synchronize();
      const double step_ms = ms_since(t0);
      ctx.set_profiler(nullptr);
      std::vector<std::pair<std::string, OpProfiler::Entry>> rows;
      double total = 0;
      for (auto& [op, e] : profiler.collect(ctx)) rows.emplace_back(op, e), total += e.ms;
      std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
      for (const auto& [op, e] : rows) {
        std::printf("%s\n",
                    fmt::format("{{\"bench\": \"op_profile\", \"preset\": \"{}\", \"op\": \"{}\", \"ms\": {:.3f}, "
                                "\"host_ms\": {:.3f}, \"calls\": {}, \"share\": {:.4f}}}",
                                preset, op, e.ms, e.host_ms, e.calls, e.ms / step_ms)
                        .c_str());
      }
      std::printf("%s\n",
                  fmt::format("{{\"bench\": \"op_profile\", \"preset\": \"{}\", \"op\": \"(between ops: launch "
                              "gaps, host work, syncs)\", \"ms\": {:.3f}, \"share\": {:.4f}, \"step_ms\": {:.3f}}}",
                              preset, step_ms - total, (step_ms - total) / step_ms, step_ms)
                      .c_str());
    }
    std::sort(times.begin(), times.end());
    const double median = times[times.size() / 2];
    const double tokens_per_step = double(p.mbs) * p.seq * micro_batches;
    const double flops = num_floating_point_operations(a, config.padded_vocab_size, p.mbs) * micro_batches;
    // The FLOPs of the linear layers of attention and MLP (the GEMMs that run in FP8 with
    // --fp8-format; dense layers): 6 per weight per token (forward, input and weight gradients).
    double linear_flops = 0;
    if (p.experts == 0) {
      const double h = config.hidden_size, d = config.kv_channels, ffn = config.ffn_hidden_size;
      const double qkv = d * (config.num_attention_heads + 2.0 * config.num_query_groups);
      const double weights = h * qkv + config.num_attention_heads * d * h +
                             h * ffn * (config.gated_linear_unit ? 2.0 : 1.0) + ffn * h;
      linear_flops = 6.0 * weights * tokens_per_step * config.num_layers;
    }
    MemoryStats m = memory_stats(ctx.device());
    std::printf(
        "%s\n",
        fmt::format("{{\"bench\": \"gpt_throughput\", \"impl\": \"megatron.cpp\", \"preset\": \"{}\", "
                    "\"device\": \"{}\", \"dtype\": \"{}\", \"layers\": {}, \"seq\": {}, \"mbs\": {}, \"micro_batches\": {}, "
                    "\"vocab\": {}, \"params\": {}, "
                    "\"tokens_per_s\": {:.1f}, "
                    "\"tflops\": {:.2f}, \"mfu\": {:.4f}, \"step_ms\": {:.2f}, \"peak_mem_gb\": {:.3f}, "
                    "\"cuda_graph\": {}, \"deterministic\": {}, \"graph_mem_gb\": {:.3f}, \"loss\": {:.6f}, "
                    "\"experts\": {}, \"topk\": {}, \"grouped_gemm\": {}, \"doc_mean\": {}, \"documents\": {}, "
                    "\"shared_ffn\": {}, \"shared_overlap\": {}, "
                    "\"recompute\": \"{}\", \"fp8_format\": \"{}\", \"fp8_recipe\": \"{}\", "
                    "\"linear_flop_share\": {:.4f}, \"fp8_tflops\": {:.2f}}}",
                    preset, ctx.device().str(), dtype, p.layers, p.seq, p.mbs, micro_batches, config.padded_vocab_size, model.params().numel(),
                    tokens_per_step / median, flops / median / 1e12, flops / median / 989e12, median * 1e3,
                    double(m.peak_allocated) / 1e9, cuda_graph, deterministic, double(CudaGraph::memory_bytes(ctx.device())) / 1e9,
                    loss, p.experts, p.topk, grouped_gemm, doc_mean, documents, shared_ffn, shared_overlap, recompute,
                    fp8_format, fp8_format.empty() ? "" : fp8_recipe, linear_flops / flops,
                    fp8_format.empty() ? 0.0 : linear_flops / median / 1e12)
            .c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

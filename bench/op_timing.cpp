// op_timing: the time of single ops at a model's shapes on the GPU (median of repeated calls,
// synchronised), to find where an op's time goes beyond what gpt_throughput --profile shows.
// One JSON line per measurement.
//
//   build/bench/op_timing [--tokens 16384 --hidden 2048 --vocab 50304 --reps 20]
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>

#include "megatron/kernels/ops.h"
#include "megatron/runtime/philox.h"
#include "megatron/training/training.h"

using namespace megatron;

namespace {
double median_ms(Context& ctx, int reps, const std::function<void()>& f) {
  f();  // warm-up (allocations, plans)
  ctx.synchronize();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    ctx.synchronize();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}
}  // namespace

int main(int argc, char** argv) {
  try {
    int64_t b = 8, s = 2048, h = 2048, vocab = 50304;
    int reps = 20;
    int64_t grad_numel = 1315819520;  // GPT 1.3B
    std::string device = "auto";
    CLI::App app("Single-op timing");
    app.add_option("--batch", b)->capture_default_str();
    app.add_option("--seq", s)->capture_default_str();
    app.add_option("--hidden", h)->capture_default_str();
    app.add_option("--vocab", vocab)->capture_default_str();
    app.add_option("--reps", reps)->capture_default_str();
    app.add_option("--grad-numel", grad_numel, "Elements of the grad_stats buffer")->capture_default_str();
    app.add_option("--device", device)->capture_default_str();
    CLI11_PARSE(app, argc, argv);
    Context ctx(select_device(device), 1);
    const Device d = ctx.device();
    std::vector<int64_t> ids(size_t(b * s)), pos(size_t(b * s));
    for (int64_t i = 0; i < b * s; ++i) {
      ids[size_t(i)] = int64_t(philox_element(3, 0, uint64_t(i)) % uint64_t(vocab));
      pos[size_t(i)] = i % s;
    }
    Tensor tokens = Tensor::from_ints(ids, {b, s}, DType::Int64, d);
    Tensor positions = Tensor::from_ints(pos, {b, s}, DType::Int64, d);
    Tensor grad = Tensor::zeros({s, b, h}, DType::BFloat16, d);
    Tensor word_grad = Tensor::zeros({vocab, h}, DType::Float32, d);
    Tensor pos_grad = Tensor::zeros({s, h}, DType::Float32, d);
    Tensor none;
    auto report = [&](const char* what, double ms) {
      std::printf("{\"bench\": \"op_timing\", \"op\": \"%s\", \"tokens\": %lld, \"hidden\": %lld, \"ms\": %.3f}\n", what,
                  static_cast<long long>(b * s), static_cast<long long>(h), ms);
      std::fflush(stdout);
    };
    report("embedding_backward words+positions",
           median_ms(ctx, reps, [&] { ops::embedding_backward(ctx, tokens, positions, grad, word_grad, pos_grad); }));
    report("embedding_backward words",
           median_ms(ctx, reps, [&] { ops::embedding_backward(ctx, tokens, none, grad, word_grad, none); }));
    report("embedding_backward positions",
           median_ms(ctx, reps, [&] { ops::embedding_backward(ctx, positions, none, grad, pos_grad, none); }));
    report("vocab_parallel_embedding_backward words", median_ms(ctx, reps, [&] {
             ops::vocab_parallel_embedding_backward(ctx, tokens, grad, 0, word_grad);
           }));
    Tensor out = Tensor::empty({s, b, h}, DType::BFloat16, d);
    Tensor word = Tensor::zeros({vocab, h}, DType::BFloat16, d), posw = Tensor::zeros({s, h}, DType::BFloat16, d);
    report("embedding_forward words+positions",
           median_ms(ctx, reps, [&] { ops::embedding_forward(ctx, tokens, positions, word, posw, out); }));
    report("zero word grad (memset)", median_ms(ctx, reps, [&] { word_grad.zero_(); }));
    {  // the gradient norm / inf check over a whole model's fp32 gradients
      const int64_t n = grad_numel;
      Tensor g = Tensor::zeros({n}, DType::Float32, d);
      g.fill_(0.001f);
      std::printf("{\"bench\": \"op_timing\", \"op\": \"grad_stats\", \"numel\": %lld, \"ms\": %.3f}\n",
                  static_cast<long long>(n), median_ms(ctx, reps, [&] { ops::grad_stats(ctx, g); }));
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

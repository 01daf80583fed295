// comm_bandwidth: NCCL bandwidth through our Communicator, nccl-tests' way. One rank per GPU (every
// visible GPU, or --gpus N), the ranks as threads of this process; for each operation and message
// size the median time of --iters back-to-back operations (after --warmup), and the algorithm and
// bus bandwidth as nccl-tests defines them: algbw = bytes / time, busbw = algbw * 2(n-1)/n for
// all-reduce and * (n-1)/n for reduce-scatter and all-gather, where bytes is the larger buffer (the
// reduce-scatter input, the all-gather output). One JSON line per measurement.
//
//   build/bench/comm_bandwidth [--gpus 8 --min-bytes 1M --max-bytes 1G --iters 20 --warmup 5]
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <thread>

#include "megatron/core/comm/comm_detail.h"
#include "megatron/core/comm/communicator.h"
#include "megatron/runtime/context.h"
#include "megatron/runtime/device.h"

using namespace megatron;

int main(int argc, char** argv) {
#ifndef MEGATRON_WITH_CUDA
  (void)argc;
  (void)argv;
  std::fprintf(stderr, "comm_bandwidth: this build has no CUDA; rebuild with -DMEGATRON_CUDA=ON\n");
  return 1;
#else
  try {
    int gpus = 0, iters = 20, warmup = 5;
    std::string min_s = "1M", max_s = "1G";
    CLI::App app{"NCCL bus bandwidth through the Communicator"};
    app.add_option("--gpus", gpus, "Ranks (one per GPU; default: every visible GPU)");
    app.add_option("--min-bytes", min_s, "Smallest message (K/M/G suffixes)");
    app.add_option("--max-bytes", max_s, "Largest message (K/M/G suffixes)");
    app.add_option("--iters", iters, "Timed operations per size");
    app.add_option("--warmup", warmup, "Untimed operations per size");
    CLI11_PARSE(app, argc, argv);
    auto parse_bytes = [](const std::string& s) {
      size_t end = 0;
      double v = std::stod(s, &end);
      const std::string unit = s.substr(end);
      const double scale = unit == "K" ? 1024.0 : unit == "M" ? 1048576.0 : unit == "G" ? 1073741824.0 : 1.0;
      if (!unit.empty() && scale == 1.0) throw std::invalid_argument("size '" + s + "': use a K, M or G suffix");
      return int64_t(v * scale);
    };
    const int64_t min_bytes = parse_bytes(min_s), max_bytes = parse_bytes(max_s);
    const int visible = cuda_device_count();
    if (gpus == 0) gpus = visible;
    MG_CHECK(gpus >= 2 && gpus <= visible, "--gpus {}: need 2 to {} (the visible GPUs)", gpus, visible);
    MG_CHECK(iters >= 1 && warmup >= 0, "--iters must be at least 1 and --warmup at least 0");

    const std::vector<char> id = comm_detail::nccl_unique_id();
    std::barrier sync(gpus);
    auto rank_main = [&](int r) {
      auto world = comm_detail::make_nccl_world(r, gpus, Device::cuda(r), id, std::chrono::minutes(5));
      Context ctx(Device::cuda(r));
      const int n = gpus;
      for (const char* op : {"all_reduce", "reduce_scatter", "all_gather"}) {
        for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
          const int64_t numel = bytes / 4 / n * n;  // fp32, divisible into n blocks
          Tensor big = Tensor::zeros({numel}, DType::Float32, ctx.device());
          Tensor part = Tensor::zeros({numel / n}, DType::Float32, ctx.device());
          auto issue = [&] {
            std::string o = op;
            if (o == "all_reduce") world->all_reduce(ctx, big)->wait();
            else if (o == "reduce_scatter") world->reduce_scatter(ctx, big, part)->wait();
            else world->all_gather(ctx, part, big)->wait();
          };
          for (int i = 0; i < warmup; ++i) issue();
          ctx.synchronize();
          sync.arrive_and_wait();
          const auto t0 = std::chrono::steady_clock::now();
          for (int i = 0; i < iters; ++i) issue();
          ctx.synchronize();
          const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
          sync.arrive_and_wait();
          if (r == 0) {
            const double b = double(numel) * 4, algbw = b / s / 1e9;
            const double factor = std::string(op) == "all_reduce" ? 2.0 * (n - 1) / n : double(n - 1) / n;
            std::printf("{\"bench\": \"comm_bandwidth\", \"backend\": \"nccl\", \"op\": \"%s\", \"ranks\": %d, "
                        "\"bytes\": %lld, \"time_us\": %.1f, \"algbw_GBps\": %.2f, \"busbw_GBps\": %.2f}\n",
                        op, n, static_cast<long long>(b), s * 1e6, algbw, algbw * factor);
            std::fflush(stdout);
          }
        }
      }
    };
    std::vector<std::thread> threads;
    for (int r = 0; r < gpus; ++r) {
      threads.emplace_back([&, r] {
        try {
          rank_main(r);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "comm_bandwidth: rank %d: %s\n", r, e.what());
          std::fflush(stderr);
          std::_Exit(1);  // the other ranks would wait for this one forever
        }
      });
    }
    for (auto& t : threads) t.join();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "comm_bandwidth: %s\n", e.what());
    return 1;
  }
#endif
}

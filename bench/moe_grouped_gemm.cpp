// moe_grouped_gemm: the experts' grouped GEMM (ops::moe_grouped_linear_*, a loop of cuBLASLt GEMMs
// on one stream) against cuBLAS's cublasGemmGroupedBatchedEx and against one dense GEMM of the same
// total size (ops::linear_*), in bf16 with fp32 accumulation, for the fc1 shape of each preset:
//   mixtral: 8 experts, hidden 2048, ffn 4096, 32768 tokens · top-2 rows split unevenly
//   fine:    64 experts, hidden 2048, ffn 1408, 32768 tokens · top-6 rows split unevenly
// Rows per expert ∝ exp(0.6·z) (z normal, fixed seed): a skewed but realistic split. For each GEMM
// (forward y = x·Wᵀ, input gradient, weight gradient accumulated into fp32) one JSON line: the median
// time of --reps runs (CUDA events) and TFLOP/s. cublasGemmGroupedBatchedEx takes one C type for
// every operand pair: its weight-gradient form (bf16 A/B into an fp32 C) is tried and its status
// reported.
//
//   build/bench/moe_grouped_gemm [--preset mixtral|fine|all --tokens 32768 --reps 20]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "megatron/kernels/ops.h"
#include "megatron/runtime/philox.h"
#include "megatron/runtime/tensor.h"

#ifdef MEGATRON_WITH_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "megatron/runtime/cuda/cuda_check.h"
#endif

using namespace megatron;

#ifdef MEGATRON_WITH_CUDA
namespace {

double median_ms(const std::function<void()>& f, int reps, cudaStream_t stream) {
  cudaEvent_t t0, t1;
  CUDA_CHECK(cudaEventCreate(&t0));
  CUDA_CHECK(cudaEventCreate(&t1));
  f();  // warm-up (plans, heuristics)
  f();
  std::vector<float> ms;
  for (int r = 0; r < reps; ++r) {
    CUDA_CHECK(cudaEventRecord(t0, stream));
    f();
    CUDA_CHECK(cudaEventRecord(t1, stream));
    CUDA_CHECK(cudaEventSynchronize(t1));
    float x = 0;
    CUDA_CHECK(cudaEventElapsedTime(&x, t0, t1));
    ms.push_back(x);
  }
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

Tensor random_bf16(const Shape& shape, uint64_t seed, float std) {
  std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = std * philox_normal(seed, 0, i);
  return Tensor::from_floats(v, shape, DType::BFloat16).to(Device::cuda(0));
}

std::vector<int64_t> uneven_rows(int64_t total, int e, uint64_t seed) {
  std::vector<double> w(static_cast<size_t>(e));
  double sum = 0;
  for (int i = 0; i < e; ++i) sum += w[size_t(i)] = std::exp(0.6 * philox_normal(seed, 0, uint64_t(i)));
  std::vector<int64_t> rows(static_cast<size_t>(e));
  int64_t used = 0;
  for (int i = 0; i < e; ++i) used += rows[size_t(i)] = int64_t(double(total) * w[size_t(i)] / sum);
  rows.back() += total - used;
  return rows;
}

void report(const char* preset, const char* gemm, const char* impl, int e, int64_t n, int64_t in, int64_t out,
            double ms, int min_rows, int max_rows, const char* status = "ok") {
  const double tflops = ms > 0 ? 2.0 * double(n) * double(in) * double(out) / (ms * 1e-3) / 1e12 : 0.0;
  std::printf("{\"bench\": \"moe_grouped_gemm\", \"preset\": \"%s\", \"gemm\": \"%s\", \"impl\": \"%s\", "
              "\"experts\": %d, \"rows\": %lld, \"in\": %lld, \"out\": %lld, \"rows_min\": %d, \"rows_max\": %d, "
              "\"ms\": %.4f, \"tflops\": %.1f, \"status\": \"%s\"}\n",
              preset, gemm, impl, e, (long long)n, (long long)in, (long long)out, min_rows, max_rows, ms, tflops,
              status);
  std::fflush(stdout);
}

// cublasGemmGroupedBatchedEx over the experts (group e = one problem): returns the status of one call.
struct GroupedBatched {
  cublasHandle_t handle = nullptr;
  std::vector<cublasOperation_t> ta, tb;
  std::vector<int> m, n, k, lda, ldb, ldc, size;
  std::vector<float> alpha, beta;
  void** dev_ptrs = nullptr;  // [3·E] A, B, C pointers on the device
  int groups = 0;

  cublasStatus_t run(cudaDataType_t at, cudaDataType_t ct) {
    return cublasGemmGroupedBatchedEx(handle, ta.data(), tb.data(), m.data(), n.data(), k.data(), alpha.data(),
                                      (const void* const*)dev_ptrs, at, lda.data(),
                                      (const void* const*)(dev_ptrs + groups), at, ldb.data(), beta.data(),
                                      dev_ptrs + 2 * groups, ct, ldc.data(), groups, size.data(), CUBLAS_COMPUTE_32F);
  }
};

void run_preset(const char* preset, int e, int64_t hidden, int64_t ffn, int64_t rows_total, int reps) {
  Context ctx(Device::cuda(0));
  const cudaStream_t stream = static_cast<cudaStream_t>(ctx.stream());
  const std::vector<int64_t> rows = uneven_rows(rows_total, e, 17);
  const int min_rows = int(*std::min_element(rows.begin(), rows.end()));
  const int max_rows = int(*std::max_element(rows.begin(), rows.end()));
  const int64_t in = hidden, out = ffn, n = rows_total;
  std::vector<Tensor> w, wg;
  for (int i = 0; i < e; ++i) {
    w.push_back(random_bf16({out, in}, 100 + uint64_t(i), 0.02f));
    wg.push_back(Tensor::zeros({out, in}, DType::Float32, Device::cuda(0)));
  }
  const Tensor x = random_bf16({n, in}, 1, 1.0f), dy = random_bf16({n, out}, 2, 1.0f);
  Tensor y = Tensor::empty({n, out}, DType::BFloat16, Device::cuda(0));
  Tensor dx = Tensor::empty({n, in}, DType::BFloat16, Device::cuda(0));
  Tensor none;
  std::vector<Tensor> no_grads;

  // ours: the loop of cuBLASLt GEMMs
  report(preset, "forward", "cublaslt_loop", e, n, in, out,
         median_ms([&] { ops::moe_grouped_linear_forward(ctx, x, w, rows, y); }, reps, stream), min_rows, max_rows);
  report(preset, "grad_in", "cublaslt_loop", e, n, in, out,
         median_ms([&] { ops::moe_grouped_linear_backward(ctx, dy, x, w, rows, dx, no_grads); }, reps, stream),
         min_rows, max_rows);
  report(preset, "weight_grad", "cublaslt_loop", e, n, in, out,
         median_ms([&] { ops::moe_grouped_linear_backward(ctx, dy, x, w, rows, none, wg); }, reps, stream), min_rows,
         max_rows);

  // one dense GEMM of the same total size
  const Tensor w_dense = random_bf16({out, in}, 99, 0.02f);
  Tensor wg_dense = Tensor::zeros({out, in}, DType::Float32, Device::cuda(0));
  report(preset, "forward", "dense", 1, n, in, out,
         median_ms([&] { ops::linear_forward(ctx, x, w_dense, Tensor(), y); }, reps, stream), int(n), int(n));
  report(preset, "grad_in", "dense", 1, n, in, out,
         median_ms([&] { ops::linear_backward(ctx, dy, x, w_dense, dx, none, none); }, reps, stream), int(n), int(n));
  report(preset, "weight_grad", "dense", 1, n, in, out,
         median_ms([&] { ops::linear_backward(ctx, dy, x, w_dense, none, wg_dense, none); }, reps, stream), int(n),
         int(n));

  // cublasGemmGroupedBatchedEx (column-major: Note [Row-major GEMMs on cuBLASLt] in linear.cu)
  GroupedBatched g;
  if (cublasCreate(&g.handle) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "moe_grouped_gemm: cublasCreate failed\n");
    return;
  }
  cublasSetStream(g.handle, stream);
  cublasSetWorkspace(g.handle, ctx.workspace(size_t(32) << 20).raw_data(), size_t(32) << 20);
  g.groups = e;
  CUDA_CHECK(cudaMalloc(&g.dev_ptrs, sizeof(void*) * 3 * size_t(e)));
  auto setup = [&](cublasOperation_t ta, cublasOperation_t tb, auto mk, const Tensor& a, const Tensor* as,
                   int64_t a_row, const Tensor& b, int64_t b_row, const Tensor* cs, const Tensor& c, int64_t c_row,
                   float beta) {
    g.ta.assign(size_t(e), ta);
    g.tb.assign(size_t(e), tb);
    g.m.clear(), g.n.clear(), g.k.clear(), g.lda.clear(), g.ldb.clear(), g.ldc.clear();
    g.size.assign(size_t(e), 1);
    g.alpha.assign(size_t(e), 1.0f);
    g.beta.assign(size_t(e), beta);
    std::vector<void*> ptrs(3 * size_t(e));
    int64_t r0 = 0;
    for (int i = 0; i < e; ++i) {
      const auto [m, nn, k, lda, ldb, ldc] = mk(rows[size_t(i)]);
      g.m.push_back(int(m)), g.n.push_back(int(nn)), g.k.push_back(int(k));
      g.lda.push_back(int(lda)), g.ldb.push_back(int(ldb)), g.ldc.push_back(int(ldc));
      auto row_ptr = [&](const Tensor& t, int64_t row_elems) {
        return static_cast<void*>(static_cast<char*>(t.raw_data()) + r0 * row_elems * int64_t(size_of(t.dtype())));
      };
      ptrs[size_t(i)] = as ? as[i].raw_data() : row_ptr(a, a_row);
      ptrs[size_t(e + i)] = row_ptr(b, b_row);
      ptrs[size_t(2 * e + i)] = cs ? cs[i].raw_data() : row_ptr(c, c_row);
      r0 += rows[size_t(i)];
    }
    CUDA_CHECK(cudaMemcpy(g.dev_ptrs, ptrs.data(), sizeof(void*) * ptrs.size(), cudaMemcpyHostToDevice));
  };
  using Dims = std::array<int64_t, 6>;
  // forward: yᵀ [out × n_e] = W(T) · xᵀ
  setup(CUBLAS_OP_T, CUBLAS_OP_N, [&](int64_t r) { return Dims{out, r, in, in, in, out}; }, x, w.data(), 0, x, in,
        nullptr, y, out, 0.0f);
  cublasStatus_t st = g.run(CUDA_R_16BF, CUDA_R_16BF);
  report(preset, "forward", "cublas_grouped_batched", e, n, in, out,
         st == CUBLAS_STATUS_SUCCESS ? median_ms([&] { g.run(CUDA_R_16BF, CUDA_R_16BF); }, reps, stream) : 0.0,
         min_rows, max_rows, cublasGetStatusString(st));
  // grad_in: dxᵀ [in × n_e] = W(N) · dyᵀ
  setup(CUBLAS_OP_N, CUBLAS_OP_N, [&](int64_t r) { return Dims{in, r, out, in, out, in}; }, x, w.data(), 0, dy, out,
        nullptr, dx, in, 0.0f);
  st = g.run(CUDA_R_16BF, CUDA_R_16BF);
  report(preset, "grad_in", "cublas_grouped_batched", e, n, in, out,
         st == CUBLAS_STATUS_SUCCESS ? median_ms([&] { g.run(CUDA_R_16BF, CUDA_R_16BF); }, reps, stream) : 0.0,
         min_rows, max_rows, cublasGetStatusString(st));
  // weight_grad: dWᵀ [in × out] += xᵀ(N) · dy(T), fp32 C (A = x rows, B = dy rows)
  setup(CUBLAS_OP_N, CUBLAS_OP_T, [&](int64_t r) { return Dims{in, out, r, in, out, in}; }, x, nullptr, in, dy, out,
        wg.data(), x, 0, 1.0f);
  st = g.run(CUDA_R_16BF, CUDA_R_32F);
  report(preset, "weight_grad", "cublas_grouped_batched", e, n, in, out,
         st == CUBLAS_STATUS_SUCCESS ? median_ms([&] { g.run(CUDA_R_16BF, CUDA_R_32F); }, reps, stream) : 0.0,
         min_rows, max_rows, cublasGetStatusString(st));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaFree(g.dev_ptrs);
  cublasDestroy(g.handle);
}

}  // namespace
#endif

int main(int argc, char** argv) {
#ifndef MEGATRON_WITH_CUDA
  (void)argc;
  (void)argv;
  std::fprintf(stderr, "moe_grouped_gemm: this build has no CUDA; rebuild with -DMEGATRON_CUDA=ON\n");
  return 1;
#else
  std::string preset = "all";
  int64_t tokens = 32768;
  int reps = 20;
  CLI::App app{"The experts' grouped GEMM against cuBLAS's grouped GEMM and one dense GEMM"};
  app.add_option("--preset", preset, "mixtral, fine or all");
  app.add_option("--tokens", tokens, "Tokens routed (rows = tokens x top-k)");
  app.add_option("--reps", reps, "Timed runs per GEMM");
  CLI11_PARSE(app, argc, argv);
  if (preset == "mixtral" || preset == "all") run_preset("mixtral", 8, 2048, 4096, tokens * 2, reps);
  if (preset == "fine" || preset == "all") run_preset("fine", 64, 2048, 1408, tokens * 6, reps);
  return 0;
#endif
}

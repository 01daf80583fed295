// gemm_algos: does another cuBLASLt algorithm beat the heuristic's first choice (what linear.cu
// runs) on a model's GEMMs? For each GEMM of one layer and the output layer — forward (TN),
// input gradient (NN), weight gradient into fp32 with beta 1 (NT), Note [Row-major GEMMs on
// cuBLASLt] — every algorithm the heuristic offers (up to --algos) is timed (median of --reps
// with CUDA events). One JSON line per GEMM: the first choice's time, the best time and which rank
// it had. A measurement for deciding whether autotuning would pay; nothing here is used in training.
//
//   build/bench/gemm_algos [--tokens 16384 --hidden 2048 --ffn 8192 --vocab 50304 --algos 16 --reps 10]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#ifdef MEGATRON_WITH_CUDA
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "megatron/runtime/cuda/cuda_check.h"
#endif

#ifdef MEGATRON_WITH_CUDA
// n bf16 values uniform in [-1, 1) (zeros would flatter the timings: less switching, higher clocks).
void fill_random_bf16(void* dst, size_t n) {
  std::vector<__nv_bfloat16> host(n);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (size_t i = 0; i < n; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    host[i] = __float2bfloat16(float(x >> 40) / float(1 << 23) - 1.0f);
  }
  CUDA_CHECK(cudaMemcpy(dst, host.data(), n * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
}
#endif

int main(int argc, char** argv) {
#ifndef MEGATRON_WITH_CUDA
  (void)argc;
  (void)argv;
  std::fprintf(stderr, "gemm_algos: this build has no CUDA; rebuild with -DMEGATRON_CUDA=ON\n");
  return 1;
#else
  int64_t tokens = 16384, hidden = 2048, ffn = 8192, vocab = 50304;
  int algos = 16, reps = 10;
  CLI::App app{"cuBLASLt algorithms against the heuristic's first choice"};
  app.add_option("--tokens", tokens, "Rows of the activations (micro-batch x sequence)");
  app.add_option("--hidden", hidden, "Hidden size");
  app.add_option("--ffn", ffn, "MLP hidden size");
  app.add_option("--vocab", vocab, "Padded vocabulary");
  app.add_option("--algos", algos, "Algorithms to ask the heuristic for");
  app.add_option("--reps", reps, "Timed runs per algorithm");
  CLI11_PARSE(app, argc, argv);

  struct Shape {
    std::string name;
    int64_t out, in;
  };
  const std::vector<Shape> layers = {{"qkv", 3 * hidden, hidden},
                                     {"proj", hidden, hidden},
                                     {"fc1", ffn, hidden},
                                     {"fc2", hidden, ffn},
                                     {"logits", vocab, hidden}};
  cublasLtHandle_t lt;
  if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "gemm_algos: cublasLtCreate failed\n");
    return 1;
  }
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  const size_t ws_bytes = size_t(32) << 20;
  void* ws = nullptr;
  CUDA_CHECK(cudaMalloc(&ws, ws_bytes));
  cudaEvent_t t0, t1;
  CUDA_CHECK(cudaEventCreate(&t0));
  CUDA_CHECK(cudaEventCreate(&t1));

  for (const Shape& l : layers) {
    // The three products of the layer (column-major view of our row-major tensors).
    struct Gemm {
      const char* kind;
      cublasOperation_t ta, tb;
      int64_t m, n, k, lda, ldb, ldd;
      cudaDataType_t dt;
      float beta;
    };
    const Gemm gemms[] = {
        {"forward", CUBLAS_OP_T, CUBLAS_OP_N, l.out, tokens, l.in, l.in, l.in, l.out, CUDA_R_16BF, 0.0f},
        {"grad_in", CUBLAS_OP_N, CUBLAS_OP_N, l.in, tokens, l.out, l.in, l.out, l.in, CUDA_R_16BF, 0.0f},
        {"weight_grad", CUBLAS_OP_N, CUBLAS_OP_T, l.in, l.out, tokens, l.in, l.out, l.in, CUDA_R_32F, 1.0f},
    };
    for (const Gemm& g : gemms) {
      const int64_t a_rows = g.ta == CUBLAS_OP_N ? g.m : g.k, a_cols = g.ta == CUBLAS_OP_N ? g.k : g.m;
      const int64_t b_rows = g.tb == CUBLAS_OP_N ? g.k : g.n, b_cols = g.tb == CUBLAS_OP_N ? g.n : g.k;
      void *a = nullptr, *b = nullptr, *d = nullptr;
      const size_t d_elem = g.dt == CUDA_R_32F ? 4 : 2;
      CUDA_CHECK(cudaMalloc(&a, size_t(a_rows * a_cols) * 2));
      CUDA_CHECK(cudaMalloc(&b, size_t(b_rows * b_cols) * 2));
      CUDA_CHECK(cudaMalloc(&d, size_t(g.m * g.n) * d_elem));
      fill_random_bf16(a, size_t(a_rows * a_cols));
      fill_random_bf16(b, size_t(b_rows * b_cols));
      CUDA_CHECK(cudaMemset(d, 0, size_t(g.m * g.n) * d_elem));
      cublasLtMatmulDesc_t desc;
      cublasLtMatrixLayout_t la, lb, ld;
      cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &g.ta, sizeof(g.ta));
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &g.tb, sizeof(g.tb));
      cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, uint64_t(a_rows), uint64_t(a_cols), g.lda);
      cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, uint64_t(b_rows), uint64_t(b_cols), g.ldb);
      cublasLtMatrixLayoutCreate(&ld, g.dt, uint64_t(g.m), uint64_t(g.n), g.ldd);
      cublasLtMatmulPreference_t pref;
      cublasLtMatmulPreferenceCreate(&pref);
      const uint64_t max_ws = ws_bytes;
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof(max_ws));
      std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<size_t>(algos));
      int found = 0;
      cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, algos, results.data(), &found);
      const float alpha = 1.0f;
      std::vector<double> ms;
      for (int i = 0; i < found; ++i) {
        auto run = [&] {
          return cublasLtMatmul(lt, desc, &alpha, a, la, b, lb, &g.beta, d, ld, d, ld, &results[size_t(i)].algo, ws,
                                results[size_t(i)].workspaceSize, stream);
        };
        if (run() != CUBLAS_STATUS_SUCCESS) {
          ms.push_back(1e30);
          continue;
        }
        std::vector<float> t;
        for (int r = 0; r < reps; ++r) {
          CUDA_CHECK(cudaEventRecord(t0, stream));
          run();
          CUDA_CHECK(cudaEventRecord(t1, stream));
          CUDA_CHECK(cudaEventSynchronize(t1));
          float x = 0;
          CUDA_CHECK(cudaEventElapsedTime(&x, t0, t1));
          t.push_back(x);
        }
        std::sort(t.begin(), t.end());
        ms.push_back(t[t.size() / 2]);
      }
      if (found > 0) {
        const size_t best = size_t(std::min_element(ms.begin(), ms.end()) - ms.begin());
        const double flops = 2.0 * double(g.m) * double(g.n) * double(g.k);
        std::printf("{\"bench\": \"gemm_algos\", \"gemm\": \"%s.%s\", \"m\": %lld, \"n\": %lld, \"k\": %lld, "
                    "\"algos\": %d, \"first_ms\": %.4f, \"best_ms\": %.4f, \"best_rank\": %zu, \"first_tflops\": "
                    "%.1f, \"best_tflops\": %.1f, \"gain\": %.4f}\n",
                    l.name.c_str(), g.kind, static_cast<long long>(g.m), static_cast<long long>(g.n),
                    static_cast<long long>(g.k), found, ms[0], ms[best], best, flops / ms[0] / 1e9,
                    flops / ms[best] / 1e9, ms[0] / ms[best] - 1.0);
        std::fflush(stdout);
      }
      cublasLtMatmulPreferenceDestroy(pref);
      cublasLtMatrixLayoutDestroy(la);
      cublasLtMatrixLayoutDestroy(lb);
      cublasLtMatrixLayoutDestroy(ld);
      cublasLtMatmulDescDestroy(desc);
      cudaFree(a);
      cudaFree(b);
      cudaFree(d);
    }
  }
  cudaFree(ws);
  cublasLtDestroy(lt);
  return 0;
#endif
}

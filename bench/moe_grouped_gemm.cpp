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
// With --fp8: the experts' FP8 work at the same shape (hybrid: e4m3 forward, e5m2 gradients) — each
// grouped quantisation pass the grouped FP8 layers make (Note [Grouped FP8 linear layers]), as ms and
// GB/s of the bytes it must move, and the three fp8_gemm_grouped GEMMs; for these and the bf16 loop
// also the host's enqueue time per GEMM (host_us: the loop's wall time on the host, the GPU idle
// before it), which bounds the loop when the GEMMs are small. With --bare-cublaslt: the host time of
// a bare loop of cublasLtMatmul calls at the shape's mean row count (bf16, one plan made beforehand;
// cuBLASLt's own cost per call, below ours), from one host thread and from 2, 4 and 8 threads each
// with its own stream and descriptors (whether spreading the loop over threads would lift the bound).
//
//   build/bench/moe_grouped_gemm [--preset mixtral|fine|all --tokens 32768 --ffn 0 --reps 20 --fp8 --bare-cublaslt]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <chrono>

#include "megatron/core/tensor_parallel/fp8_grouped_linear.h"
#include "megatron/kernels/ops.h"
#include "megatron/runtime/philox.h"
#include "megatron/runtime/tensor.h"

#ifdef MEGATRON_WITH_CUDA
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <thread>

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

// The host's time to enqueue f (µs), median of reps, the GPU drained before each.
double host_us(const std::function<void()>& f, int reps, cudaStream_t stream) {
  std::vector<double> us;
  for (int r = 0; r < reps; ++r) {
    CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto t0 = std::chrono::steady_clock::now();
    f();
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
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

void report_host(const char* preset, const char* what, const char* impl, int calls, double us) {
  std::printf("{\"bench\": \"moe_grouped_gemm\", \"preset\": \"%s\", \"gemm\": \"%s\", \"impl\": \"%s\", "
              "\"calls\": %d, \"host_us\": %.1f, \"host_us_per_call\": %.2f}\n",
              preset, what, impl, calls, us, us / calls);
  std::fflush(stdout);
}

void report_pass(const char* preset, const char* pass, int members, double bytes, double ms) {
  std::printf("{\"bench\": \"moe_fp8_quantize\", \"preset\": \"%s\", \"pass\": \"%s\", \"members\": %d, "
              "\"gbytes\": %.3f, \"ms\": %.4f, \"gb_per_s\": %.0f}\n",
              preset, pass, members, bytes / 1e9, ms, bytes / 1e9 / (ms * 1e-3));
  std::fflush(stdout);
}

// The experts' FP8 work at the shape (--fp8): the grouped quantisation passes and GEMMs, hybrid.
void run_fp8(Context& ctx, const char* preset, const std::vector<int64_t>& rows, const std::vector<Tensor>& w,
             std::vector<Tensor>& wg, const Tensor& x, const Tensor& dy, int reps) {
  const cudaStream_t stream = static_cast<cudaStream_t>(ctx.stream());
  const int e = int(w.size());
  const int64_t in = x.size(1), out = dy.size(1), n = x.size(0);
  const Device dev = Device::cuda(0);
  const DType f = DType::Float8E4M3, g = DType::Float8E5M2;
  auto scalars = [&](float v) {
    std::vector<Tensor> t;
    for (int i = 0; i < e; ++i) t.push_back(Tensor::from_floats({v}, {1}, DType::Float32).to(dev));
    return t;
  };
  std::vector<Tensor> s_w = scalars(64.f), s_x = scalars(64.f), s_g = scalars(1024.f);
  std::vector<Tensor> a_w = scalars(0.f), a_x = scalars(0.f), a_g = scalars(0.f);
  std::vector<Tensor> i_w = scalars(1.f), i_x = scalars(1.f), i_g = scalars(1.f), none;
  std::vector<Tensor> xs, dys, q_x, q_g, qt_x, qt_g, q_w, qt_w;
  int64_t r0 = 0, padded_total = 0;
  for (int i = 0; i < e; ++i) {
    const int64_t r = rows[size_t(i)];
    xs.push_back(x.slice(r0, r0 + r));
    dys.push_back(dy.slice(r0, r0 + r));
    q_x.push_back(Tensor::empty({r, in}, f, dev));
    q_g.push_back(Tensor::empty({r, out}, g, dev));
    qt_x.push_back(Tensor::empty({in, fp8_group_padded_rows(r)}, f, dev));
    qt_g.push_back(Tensor::empty({out, fp8_group_padded_rows(r)}, g, dev));
    q_w.push_back(Tensor::empty({out, in}, f, dev));
    qt_w.push_back(Tensor::empty({in, out}, f, dev));
    r0 += r;
    padded_total += fp8_group_padded_rows(r);
  }
  const double wn = double(e) * double(in) * double(out), xn = double(n) * double(in), gn = double(n) * double(out);
  const double xpad = double(padded_total) * double(in), gpad = double(padded_total) * double(out);
  auto pass = [&](const char* name, double bytes, const std::function<void()>& fn) {
    report_pass(preset, name, e, bytes, median_ms(fn, reps, stream));
  };
  // the weights: forward copy (delayed: the step's scale, recording the amax), the transposed copy
  // ("again": no amax), both at once, and current scaling's two passes for the forward copy
  pass("weights q (delayed)", wn * 3,
       [&] { ops::fp8_quantize_grouped(ctx, w, s_w, q_w, none, a_w, none, false, 448.f); });
  pass("weights q_t (again)", wn * 3,
       [&] { ops::fp8_quantize_grouped(ctx, w, s_w, none, qt_w, none, none, false, 448.f); });
  pass("weights q + q_t (delayed)", wn * 4,
       [&] { ops::fp8_quantize_grouped(ctx, w, s_w, q_w, qt_w, a_w, none, false, 448.f); });
  pass("weights q (current)", wn * 5,
       [&] { ops::fp8_quantize_grouped(ctx, w, s_w, q_w, none, a_w, i_w, true, 448.f); });
  // the activations: x's forward copy, dy's two copies, x's transposed copy for the weight gradient
  pass("x q (delayed)", xn * 3, [&] { ops::fp8_quantize_grouped(ctx, xs, s_x, q_x, none, a_x, none, false, 448.f); });
  pass("dy q + q_t (delayed)", gn * 2 + gn + gpad,
       [&] { ops::fp8_quantize_grouped(ctx, dys, s_g, q_g, qt_g, a_g, none, false, 57344.f); });
  pass("x q_t (again)", xn * 2 + xpad,
       [&] { ops::fp8_quantize_grouped(ctx, xs, s_x, none, qt_x, none, none, false, 448.f); });

  // the GEMMs on those operands: per expert y = x·Wᵀ, dx = dy·W (W_t), dW += dy_tᵀ·x_t
  std::vector<Fp8Operand> ox, ow, og, owt, ogt, oxt;
  std::vector<Tensor> ys, dxs, no_bias;
  Tensor y = Tensor::empty({n, out}, DType::BFloat16, dev), dx = Tensor::empty({n, in}, DType::BFloat16, dev);
  r0 = 0;
  for (int i = 0; i < e; ++i) {
    const int64_t r = rows[size_t(i)];
    ox.push_back({q_x[size_t(i)], i_x[size_t(i)]});
    ow.push_back({q_w[size_t(i)], i_w[size_t(i)]});
    og.push_back({q_g[size_t(i)], i_g[size_t(i)]});
    owt.push_back({qt_w[size_t(i)], i_w[size_t(i)]});
    ogt.push_back({qt_g[size_t(i)], i_g[size_t(i)]});
    oxt.push_back({qt_x[size_t(i)], i_x[size_t(i)]});
    ys.push_back(y.slice(r0, r0 + r));
    dxs.push_back(dx.slice(r0, r0 + r));
    r0 += r;
  }
  const int min_rows = int(*std::min_element(rows.begin(), rows.end()));
  const int max_rows = int(*std::max_element(rows.begin(), rows.end()));
  const std::function<void()> gemms[3] = {
      [&] { ops::fp8_gemm_grouped(ctx, ox, ow, no_bias, ys, false, true, false); },
      [&] { ops::fp8_gemm_grouped(ctx, og, owt, no_bias, dxs, false, false, false); },
      [&] { ops::fp8_gemm_grouped(ctx, ogt, oxt, no_bias, wg, true, false, true); }};
  const char* names[3] = {"forward", "grad_in", "weight_grad"};
  for (int k = 0; k < 3; ++k) {
    report(preset, names[k], "fp8_grouped", e, n, in, out, median_ms(gemms[k], reps, stream), min_rows, max_rows);
    report_host(preset, names[k], "fp8_grouped", e, host_us(gemms[k], reps, stream));
  }
}

// --bare-cublaslt: e GEMMs [rows, in] x [out, in]^T -> [rows, out] in bf16 through cublasLtMatmul alone.
void run_bare_cublaslt(const char* preset, int e, int64_t rows, int64_t in, int64_t out, int reps) {
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
    cublasLtMatmulAlgo_t algo{};
    size_t ws = 0;
  };
  cublasLtHandle_t handle = nullptr;
  if (cublasLtCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "moe_grouped_gemm: cublasLtCreate failed\n");
    return;
  }
  constexpr size_t kWs = size_t(32) << 20;
  auto make = [&] {  // column-major: C [out x rows] = W^T(T) [out x in] . x^T [in x rows]
    Plan p;
    cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
    cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
    cublasLtMatrixLayoutCreate(&p.la, CUDA_R_16BF, uint64_t(in), uint64_t(out), in);
    cublasLtMatrixLayoutCreate(&p.lb, CUDA_R_16BF, uint64_t(in), uint64_t(rows), in);
    cublasLtMatrixLayoutCreate(&p.lc, CUDA_R_16BF, uint64_t(out), uint64_t(rows), out);
    cublasLtMatmulPreference_t pref = nullptr;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kWs, sizeof(kWs));
    cublasLtMatmulHeuristicResult_t r{};
    int found = 0;
    cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.la, p.lb, p.lc, p.lc, pref, 1, &r, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    p.algo = r.algo;
    p.ws = r.workspaceSize;
    return p;
  };
  const Device dev = Device::cuda(0);
  const Tensor w = Tensor::zeros({int64_t(e), out, in}, DType::BFloat16, dev);
  const Tensor x = Tensor::zeros({rows, in}, DType::BFloat16, dev);
  const Tensor y = Tensor::empty({int64_t(e), rows, out}, DType::BFloat16, dev);
  const Tensor ws = Tensor::empty({int64_t(8 * kWs)}, DType::UInt8, dev);
  std::vector<cudaStream_t> streams(8);
  for (auto& st : streams) CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const float alpha = 1.0f, beta = 0.0f;
  auto call = [&](const Plan& p, int i, int lane) {
    const char* wp = static_cast<const char*>(w.raw_data()) + size_t(i) * size_t(out * in) * 2;
    char* yp = static_cast<char*>(y.raw_data()) + size_t(i) * size_t(rows * out) * 2;
    cublasLtMatmul(handle, p.desc, &alpha, wp, p.la, x.raw_data(), p.lb, &beta, yp, p.lc, yp, p.lc, &p.algo,
                   static_cast<char*>(ws.raw_data()) + size_t(lane) * kWs, p.ws, streams[size_t(lane)]);
  };
  for (int threads : {1, 2, 4, 8}) {
    std::vector<Plan> plans;
    for (int t = 0; t < threads; ++t) plans.push_back(make());
    for (int i = 0; i < e; ++i) call(plans[size_t(i % threads)], i, i % threads);  // warm-up
    std::vector<double> us;
    for (int r = 0; r < reps; ++r) {
      CUDA_CHECK(cudaDeviceSynchronize());
      const auto t0 = std::chrono::steady_clock::now();
      if (threads == 1) {
        for (int i = 0; i < e; ++i) call(plans[0], i, 0);
      } else {
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t)
          pool.emplace_back([&, t] { for (int i = t; i < e; i += threads) call(plans[size_t(t)], i, t); });
        for (auto& th : pool) th.join();
      }
      us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    std::sort(us.begin(), us.end());
    std::printf("{\"bench\": \"cublaslt_host\", \"preset\": \"%s\", \"gemms\": %d, \"m\": %lld, \"n\": %lld, "
                "\"k\": %lld, \"threads\": %d, \"host_us\": %.1f, \"host_us_per_call\": %.2f}\n",
                preset, e, (long long)rows, (long long)out, (long long)in, threads, us[us.size() / 2],
                us[us.size() / 2] / e);
    std::fflush(stdout);
    for (Plan& p : plans) {
      cublasLtMatrixLayoutDestroy(p.la);
      cublasLtMatrixLayoutDestroy(p.lb);
      cublasLtMatrixLayoutDestroy(p.lc);
      cublasLtMatmulDescDestroy(p.desc);
    }
  }
  for (auto& st : streams) cudaStreamDestroy(st);
  cublasLtDestroy(handle);
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

void run_preset(const char* preset, int e, int64_t hidden, int64_t ffn, int64_t rows_total, int reps, bool fp8,
                bool bare) {
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
  report_host(preset, "forward", "cublaslt_loop", e,
              host_us([&] { ops::moe_grouped_linear_forward(ctx, x, w, rows, y); }, reps, stream));
  report_host(preset, "weight_grad", "cublaslt_loop", e,
              host_us([&] { ops::moe_grouped_linear_backward(ctx, dy, x, w, rows, none, wg); }, reps, stream));
  if (fp8) run_fp8(ctx, preset, rows, w, wg, x, dy, reps);
  if (bare) run_bare_cublaslt(preset, e, rows_total / e, in, out, reps);

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
  int64_t ffn = 0;
  int reps = 20;
  bool fp8 = false, bare = false;
  CLI::App app{"The experts' grouped GEMM against cuBLAS's grouped GEMM and one dense GEMM"};
  app.add_option("--preset", preset, "mixtral, fine or all");
  app.add_option("--tokens", tokens, "Tokens routed (rows = tokens x top-k)");
  app.add_option("--ffn", ffn, "The experts' ffn size (0: the preset's)");
  app.add_option("--reps", reps, "Timed runs per GEMM");
  app.add_flag("--fp8", fp8, "Also the experts' FP8 passes and GEMMs (hybrid)");
  app.add_flag("--bare-cublaslt", bare, "Also the host time of a bare cublasLtMatmul loop, from 1 to 8 threads");
  CLI11_PARSE(app, argc, argv);
  if (preset == "mixtral" || preset == "all") {
    run_preset("mixtral", 8, 2048, ffn > 0 ? ffn : 4096, tokens * 2, reps, fp8, bare);
  }
  if (preset == "fine" || preset == "all") {
    run_preset("fine", 64, 2048, ffn > 0 ? ffn : 1408, tokens * 6, reps, fp8, bare);
  }
  return 0;
#endif
}

// The FP8 GEMM on the GPU (fp8_ops.h's fp8_gemm): cuBLASLt's FP8 matmul in the TN form (Note [FP8
// GEMM layouts]) with device scale pointers, per tensor or per block (Note [FP8 block scaling]),
// one plan per shape, types, modes and alignments, cached per device and handle.
#include <cuda_fp8.h>

#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "megatron/kernels/cuda/cuda_common.cuh"
#include "megatron/kernels/cuda/fp8_common.cuh"
#include "megatron/kernels/fp8_ops.h"

namespace megatron::cuda {

namespace {

// out = acc + bias per row, rounded once (out may be acc itself).
template <typename T, typename B>
__global__ void add_bias_kernel(const float* acc, const B* __restrict__ bias, int64_t rows, int64_t cols, T* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * cols;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = store_float<T>(acc[i] + load_float(bias[i % cols]));
  }
}


constexpr size_t kFp8WorkspaceBytes = size_t(32) << 20;

cudaDataType_t fp8_cuda_type(DType t) { return t == DType::Float8E4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }

cublasLtMatmulMatrixScale_t scale_mode(Fp8ScaleMode m) {
  switch (m) {
    case Fp8ScaleMode::Tensor: return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    case Fp8ScaleMode::Block1x128: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case Fp8ScaleMode::Block128x128: return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  }
  return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
}

// (device, handle, m, n, k, A type, B type, D type, A mode, B mode, accumulate, fast accumulation,
//  bias type (-1: none),
//  alignments of A, B, D, of the two scale_inv pointers and of the bias). The heuristic reads the
//  pointers set in the descriptor (scales, bias) for their alignment, so a plan made for one
//  alignment is refused ("not supported") at cublasLtMatmul for a less aligned pointer.
using Fp8GemmKey = std::tuple<int, void*, int64_t, int64_t, int64_t, int, int, int, int, int, bool, bool, int,
                              uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t>;

struct Fp8GemmPlan {
  std::mutex mu;  // guards the scale-pointer attributes between set and enqueue
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
  ~Fp8GemmPlan() {
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (ld) cublasLtMatrixLayoutDestroy(ld);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

struct Fp8PlanCache {
  std::mutex mu;
  std::map<Fp8GemmKey, std::shared_ptr<Fp8GemmPlan>> plans;
};

// Leaked on purpose, as linear.cu's cache: plans must outlive every Context.
Fp8PlanCache& fp8_plan_cache() {
  static auto* cache = new Fp8PlanCache;
  return *cache;
}

// In cuBLASLt's column-major terms (Note [FP8 GEMM layouts]): its A is our B [N, K] (K×N, ld K,
// transposed: op(A) is N×K), its B our A [M, K] (K×M, ld K, not transposed), its D our out [M, N]
// (N×M, ld N). So its A scale is our B's and its B scale our A's.
// m and k: the plan's problem (Note [Plans for varying row counts]: a bucket's, for grouped GEMMs).
std::shared_ptr<Fp8GemmPlan> make_fp8_plan(cublasLtHandle_t handle, const Fp8Operand& a, const Fp8Operand& b,
                                           const Tensor& bias, const Tensor& out, bool accumulate,
                                           bool fast_accumulation, int64_t m, int64_t k) {
  const int64_t n = b.data.size(0);
  auto plan = std::make_shared<Fp8GemmPlan>();
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  // Note [FP8 GEMM accumulation]: fast accumulation (FAST_ACCUM = 1) keeps the Hopper FP8 MMA's
  // reduced-precision accumulator across the whole K loop; off, cuBLASLt promotes partial sums to
  // full fp32 every few K steps (TE's use_split_accumulator, which its recipes use for the
  // backward GEMMs and block scaling requires). Off, the GEMM stays within fp32-accumulation
  // tolerance of the CPU product; the linear layer's forward GEMM asks for it on with the
  // per-tensor recipes, as TE's recipes do (fp8_gemm_fprop: use_split_accumulator=False).
  const int8_t fast_accum = fast_accumulation && a.mode == Fp8ScaleMode::Tensor && b.mode == Fp8ScaleMode::Tensor ? 1 : 0;
  CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum, sizeof(fast_accum)));
  const cublasLtMatmulMatrixScale_t mode_a = scale_mode(b.mode), mode_b = scale_mode(a.mode);
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a, sizeof(mode_a)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b, sizeof(mode_b)));
  const void* sa = b.scale_inv.raw_data();
  const void* sb = a.scale_inv.raw_data();
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)));
  if (bias.defined()) {  // Note [FP8 GEMM bias]
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bias_type = CUDA_R_16BF;
    const void* bp = bias.raw_data();
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                                sizeof(bias_type)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof(bp)));
  }
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->la, fp8_cuda_type(b.data.dtype()), uint64_t(k), uint64_t(n), k));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->lb, fp8_cuda_type(a.data.dtype()), uint64_t(k), uint64_t(m), k));
  const cudaDataType_t dt = out.dtype() == DType::Float32 ? CUDA_R_32F : CUDA_R_16BF;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->ld, dt, uint64_t(n), uint64_t(m), n));

  // cuBLASLt's A is our b (Note [FP8 GEMM layouts])
  cublasLtMatmulPreference_t pref = matmul_preference(kFp8WorkspaceBytes, alignment_of(b.data.raw_data()),
                                                      alignment_of(a.data.raw_data()), alignment_of(out.raw_data()));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->la, plan->lb, plan->ld, plan->ld,
                                                           pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  MG_CHECK(st == CUBLAS_STATUS_SUCCESS && found > 0,
           "fp8_gemm: cuBLASLt has no FP8 kernel for M={} N={} K={} ({} x {} -> {}, scales {} x {}{}): {} — FP8 "
           "GEMMs need a Hopper (sm_90) or newer GPU and CUDA 12.9+ for block scales",
           m, n, k, to_string(a.data.dtype()), to_string(b.data.dtype()), to_string(out.dtype()), int(a.mode),
           int(b.mode), accumulate ? ", accumulating" : "",
           cublasLtGetStatusString(st == CUBLAS_STATUS_SUCCESS ? CUBLAS_STATUS_NOT_SUPPORTED : st));
  plan->algo = result.algo;
  plan->workspace = result.workspaceSize;
  return plan;
}

// Note [Plans for varying row counts] (cuda/linear.cu) for the FP8 GEMM: the dimension holding the
// rows of a grouped layer's block.
enum class Varying { None, M, K };

void run_fp8_gemm(Context& ctx, const Fp8Operand& a, const Fp8Operand& b, const Tensor& bias, Tensor& out,
                  bool accumulate, bool fast_accumulation, Varying varying) {
  ops::check_fp8_gemm(a, b, bias, out, accumulate, /*cuda=*/true);
  check_on_gpu({&a.data, &a.scale_inv, &b.data, &b.scale_inv, &bias, &out}, "fp8_gemm");
  const int64_t m = a.data.size(0), k = a.data.size(1), n = b.data.size(0);
  if (m == 0 || n == 0) return;
  MG_CHECK(k > 0, "fp8_gemm: K = 0");
  // Note [FP8 GEMM bias]: a bf16 bias on a bf16 out is cuBLASLt's BIAS epilogue (added to the fp32
  // accumulator, then one rounding — what the CPU does — with no extra pass); other combinations
  // (an fp32 out or bias) take the product in fp32 (out itself when fp32), then one kernel adds the
  // bias and rounds once.
  const bool bias_epilogue = bias.defined() && bias.dtype() == DType::BFloat16 && out.dtype() == DType::BFloat16 &&
                             !accumulate && alignment_of(bias.raw_data()) >= 16;
  if (bias.defined() && !bias_epilogue) {
    Tensor acc = out.dtype() == DType::Float32 ? out : Tensor::empty(out.shape(), DType::Float32, out.device());
    Tensor none;
    run_fp8_gemm(ctx, a, b, none, acc, false, fast_accumulation, varying);
    dispatch_float(out.dtype(), [&]<typename T>() {
      dispatch_float(bias.dtype(), [&]<typename B>() {
        add_bias_kernel<T, B><<<grid_for(m * n), kBlockSize, 0, stream_of(ctx)>>>(f32_ptr(acc), dev_ptr<const B>(bias),
                                                                                 m, n, dev_ptr<T>(out));
      });
    });
    CUDA_CHECK(cudaGetLastError());
    return;
  }
  auto handle = static_cast<cublasLtHandle_t>(ctx.cublaslt_handle());
  MG_ASSERT(handle != nullptr, "fp8_gemm on CUDA needs a CUDA Context (no cuBLASLt handle)");
  const int64_t plan_m = varying == Varying::M ? row_bucket(m) : m, plan_k = varying == Varying::K ? row_bucket(k) : k;
  const bool exact = plan_m == m && plan_k == k;
  const Fp8GemmKey key{ctx.device().index, ctx.cublaslt_handle(), plan_m, n, plan_k, int(a.data.dtype()), int(b.data.dtype()),
                       int(out.dtype()), int(a.mode), int(b.mode), accumulate, fast_accumulation,
                       bias_epilogue ? int(bias.dtype()) : -1, alignment_of(a.data.raw_data()),
                       alignment_of(b.data.raw_data()), alignment_of(out.raw_data()),
                       alignment_of(a.scale_inv.raw_data()), alignment_of(b.scale_inv.raw_data()),
                       bias_epilogue ? alignment_of(bias.raw_data()) : 0u};
  std::shared_ptr<Fp8GemmPlan> plan;
  {
    Fp8PlanCache& cache = fp8_plan_cache();
    std::lock_guard<std::mutex> lock(cache.mu);
    auto it = cache.plans.find(key);
    if (it == cache.plans.end()) {
      if (cache.plans.size() >= 4096) cache.plans.clear();
      it = cache.plans
               .emplace(key, make_fp8_plan(handle, a, b, bias_epilogue ? bias : Tensor(), out, accumulate,
                                           fast_accumulation, plan_m, plan_k))
               .first;
    }
    plan = it->second;
  }
  Tensor ws = ctx.workspace(kFp8WorkspaceBytes);
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  std::unique_lock<std::mutex> lock(plan->mu);
  const void* sa = b.scale_inv.raw_data();
  const void* sb = a.scale_inv.raw_data();
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)));
  if (bias_epilogue) {
    const void* bp = bias.raw_data();
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof(bp)));
  }
  if (exact) {
    CUBLAS_CHECK(cublasLtMatmul(handle, plan->desc, &alpha, b.data.raw_data(), plan->la, a.data.raw_data(), plan->lb,
                                &beta, out.raw_data(), plan->ld, out.raw_data(), plan->ld, &plan->algo, ws.raw_data(),
                                plan->workspace, stream_of(ctx)));
    return;
  }
  // the bucket's algorithm on layouts of the true sizes (Note [FP8 GEMM layouts]: ours are cuBLASLt's B and A)
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, fp8_cuda_type(b.data.dtype()), uint64_t(k), uint64_t(n), k));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, fp8_cuda_type(a.data.dtype()), uint64_t(k), uint64_t(m), k));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ld, out.dtype() == DType::Float32 ? CUDA_R_32F : CUDA_R_16BF, uint64_t(n),
                                          uint64_t(m), n));
  const cublasStatus_t st = cublasLtMatmul(handle, plan->desc, &alpha, b.data.raw_data(), la, a.data.raw_data(), lb,
                                           &beta, out.raw_data(), ld, out.raw_data(), ld, &plan->algo, ws.raw_data(),
                                           plan->workspace, stream_of(ctx));
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(ld);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE) {  // the exact plan instead
    lock.unlock();
    run_fp8_gemm(ctx, a, b, bias, out, accumulate, fast_accumulation, Varying::None);
    return;
  }
  CUBLAS_CHECK(st);
}

}  // namespace

void fp8_gemm(Context& ctx, const Fp8Operand& a, const Fp8Operand& b, const Tensor& bias, Tensor& out,
              bool accumulate, bool fast_accumulation) {
  run_fp8_gemm(ctx, a, b, bias, out, accumulate, fast_accumulation, Varying::None);
}

void fp8_gemm_grouped(Context& ctx, const std::vector<Fp8Operand>& a, const std::vector<Fp8Operand>& b,
                      const std::vector<Tensor>& bias, std::vector<Tensor>& out, bool accumulate,
                      bool fast_accumulation, bool rows_in_k) {
  ops::check_fp8_gemm_grouped(a, b, bias, out);
  for (size_t i = 0; i < a.size(); ++i) {
    run_fp8_gemm(ctx, a[i], b[i], bias.empty() ? Tensor() : bias[i], out[i], accumulate, fast_accumulation,
                 rows_in_k ? Varying::K : Varying::M);
  }
}

}  // namespace megatron::cuda

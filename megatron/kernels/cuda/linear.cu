// Linear layer y = x·Wᵀ + b on cuBLASLt, the CUDA fast path of kernels/cpu/linear.cpp.
//
// Note [Row-major GEMMs on cuBLASLt]: cuBLASLt is column-major; a row-major [R, C] tensor is a
// column-major C×R matrix with ld = C. So each row-major product is computed transposed:
//   forward      yᵀ [out×N]  = Wᵀ-as-stored(T) · xᵀ(N)      m=out n=N k=in   "TN", bias epilogue
//   grad_in      dxᵀ [in×N]  = W-as-stored(N) · dyᵀ(N)      m=in  n=N k=out  "NN"
//   weight_grad  dWᵀ [in×out] += xᵀ(N) · dy(T)              m=in  n=out k=N  "NT", beta = 1, C=D fp32
// The bias epilogue is used when the bias has y's dtype and is 16-byte aligned; otherwise the GEMM
// writes fp32 (for a 16-bit y) and a small kernel adds the bias and rounds once.
// Compute type is CUBLAS_COMPUTE_32F throughout (no TF32, so fp32 matches the CPU to ~1e-6), with
// bf16/fp16 A/B and a bf16/fp16/fp32 D. The weight gradient accumulates straight into the fp32
// main_grad with bf16 operands (Megatron's gradient-accumulation fusion). The bias gradient is a
// deterministic two-stage column sum in fp32 added into bias_grad (cuBLASLt's BGRAD epilogues
// overwrite instead of accumulating).
//
// Note [GeLU in the GEMM epilogue]: for bf16/fp16 the MLP's GeLU runs inside cuBLASLt's GEMMs, as
// Megatron's bias_gelu fusion: fc1 with GELU_AUX(_BIAS) writes gelu(x·Wᵀ + b) and the
// pre-activation (the aux output, kept for backward); fc2's input gradient with DGELU multiplies
// its fp32 accumulator by gelu'(pre) before the single rounding. cuBLASLt's GeLU is the tanh
// approximation, ours. fp32 (tests, golden fixtures) and shapes whose leading dimension is not a
// multiple of 8 take the unfused path (GEMM, then the elementwise kernel).
// Descriptors, layouts and the heuristic's algorithm are cached per (device, handle, shape,
// dtypes, transposes, epilogue, pointer alignments): the heuristic depends on the alignments, so
// a tensor slice at an odd offset gets its own entry.
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "megatron/kernels/cuda/cuda_common.cuh"
#include "megatron/kernels/cuda/cuda_ops.h"

namespace megatron::cuda {

namespace {

constexpr size_t kCublasWorkspaceBytes = size_t(32) << 20;

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::Float32:
      return CUDA_R_32F;
    case DType::BFloat16:
      return CUDA_R_16BF;
    case DType::Float16:
      return CUDA_R_16F;
    default:
      MG_CHECK(false, "linear on CUDA: dtype {} is not supported (use fp32, bf16 or fp16)", to_string(t));
  }
  return CUDA_R_32F;
}

// One GEMM D = alpha·op(A)·op(B) + beta·D in column-major terms (C aliases D).
struct Gemm {
  cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  cudaDataType_t at = CUDA_R_32F;
  int64_t lda = 0;
  const void* b = nullptr;
  cudaDataType_t bt = CUDA_R_32F;
  int64_t ldb = 0;
  void* d = nullptr;
  cudaDataType_t dt = CUDA_R_32F;
  int64_t ldd = 0;
  float beta = 0.0f;
  const void* bias = nullptr;  // non-null: the epilogue adds a bias of type dt
  enum Epilogue { Plain, GeluAux, DGelu } epilogue = Plain;  // GeluAux writes aux = pre-activation, DGelu reads it
  void* aux = nullptr;
  int64_t aux_ld = 0;
};

using GemmKey = std::tuple<int, void*, int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int,
                           bool, uint32_t, uint32_t, uint32_t, uint32_t, int, int64_t, uint32_t>;

struct GemmPlan {
  std::mutex mu;  // guards the bias pointer attribute between set and enqueue
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
  ~GemmPlan() {  // host objects only: a GEMM already enqueued does not need them
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (ld) cublasLtMatrixLayoutDestroy(ld);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

// The cache is bounded: past kMaxPlans entries it starts over (a plan in use stays alive through its
// shared_ptr). The experts' varying row counts share plans by bucket (Note [Plans for varying row
// counts]).
constexpr size_t kMaxPlans = 4096;

struct PlanCache {
  std::mutex mu;
  std::map<GemmKey, std::shared_ptr<GemmPlan>> plans;
};

// Leaked on purpose: the plans must outlive every Context, and cuBLASLt may be unloaded before
// static destructors run.
PlanCache& plan_cache() {
  static auto* cache = new PlanCache;
  return *cache;
}

cublasLtMatrixLayout_t make_layout(cudaDataType_t t, cublasOperation_t op, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t l = nullptr;
  if (op == CUBLAS_OP_N) {
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, t, uint64_t(rows), uint64_t(cols), ld));
  } else {
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, t, uint64_t(cols), uint64_t(rows), ld));
  }
  return l;
}

std::shared_ptr<GemmPlan> make_plan(cublasLtHandle_t handle, const Gemm& g) {
  auto plan = std::make_shared<GemmPlan>();
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &g.ta, sizeof(g.ta)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &g.tb, sizeof(g.tb)));
  cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT;
  switch (g.epilogue) {
    case Gemm::Plain: epi = g.bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT; break;
    case Gemm::GeluAux: epi = g.bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX; break;
    case Gemm::DGelu: epi = CUBLASLT_EPILOGUE_DGELU; break;
  }
  if (epi != CUBLASLT_EPILOGUE_DEFAULT) {
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
  }
  if (g.bias != nullptr) {
    // The heuristic reads the bias pointer's value for its alignment.
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)));
  }
  if (g.epilogue != Gemm::Plain) {
    const int32_t aux_type = int32_t(g.dt);
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &g.aux,
                                                sizeof(g.aux)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &g.aux_ld,
                                                sizeof(g.aux_ld)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &aux_type,
                                                sizeof(aux_type)));
  }
  plan->la = make_layout(g.at, g.ta, g.m, g.k, g.lda);  // op(A) is m×k
  plan->lb = make_layout(g.bt, g.tb, g.k, g.n, g.ldb);  // op(B) is k×n
  plan->ld = make_layout(g.dt, CUBLAS_OP_N, g.m, g.n, g.ldd);

  cublasLtMatmulPreference_t pref =
      matmul_preference(kCublasWorkspaceBytes, alignment_of(g.a), alignment_of(g.b), alignment_of(g.d));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->la, plan->lb, plan->ld, plan->ld,
                                                           pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    int dev = -1;
    cudaGetDevice(&dev);
    mg_library_failure("cuBLAS", "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__,
                       std::string(cublasLtGetStatusString(st == CUBLAS_STATUS_SUCCESS ? CUBLAS_STATUS_NOT_SUPPORTED
                                                                                       : st)) +
                           " (no algorithm for m=" + std::to_string(g.m) + " n=" + std::to_string(g.n) +
                           " k=" + std::to_string(g.k) + ")",
                       dev);
  }
  plan->algo = result.algo;
  plan->workspace = result.workspaceSize;
  return plan;
}

// Note [Plans for varying row counts]: the experts' GEMMs see new row counts at every step, and a
// plan per count would make every GEMM pay cuBLASLt's heuristic on the host (about as long as the
// GEMM itself for fine-grained experts). Inside moe_grouped_linear_* (RowBucketScope), the row
// count — the GEMM's n (forward, input gradient) or k (weight gradient) — is rounded up to a power
// of two for the plan's key and its heuristic; the call uses layouts of the true sizes, made per
// call. If cuBLASLt refuses the bucket's algorithm for the true size, the exact plan is made.
thread_local int64_t t_varying_rows = 0;

void run_gemm(Context& ctx, const Gemm& g_in) {
  auto handle = static_cast<cublasLtHandle_t>(ctx.cublaslt_handle());
  MG_ASSERT(handle != nullptr, "linear on CUDA needs a CUDA Context (no cuBLASLt handle)");
  Gemm g = g_in;  // the plan's problem: the bucketed sizes when the rows vary
  const bool flexible = t_varying_rows > 0 && (g.n == t_varying_rows || g.k == t_varying_rows);
  if (flexible) {
    if (g.n == t_varying_rows) g.n = row_bucket(g.n);
    if (g.k == t_varying_rows) g.k = row_bucket(g.k);
  }
  const uint32_t bias_align = g.bias != nullptr ? alignment_of(g.bias) : 0u;
  const GemmKey key{ctx.device().index, ctx.cublaslt_handle(), int(g.ta), int(g.tb), g.m, g.n, g.k, g.lda, g.ldb,
                    g.ldd, int(g.at), int(g.bt), int(g.dt), g.bias != nullptr, alignment_of(g.a), alignment_of(g.b),
                    alignment_of(g.d), bias_align, int(g.epilogue), g.aux_ld,
                    g.aux != nullptr ? alignment_of(g.aux) : 0u};
  std::shared_ptr<GemmPlan> plan;
  {
    PlanCache& cache = plan_cache();
    std::lock_guard<std::mutex> lock(cache.mu);
    auto it = cache.plans.find(key);
    if (it == cache.plans.end()) {
      if (cache.plans.size() >= kMaxPlans) cache.plans.clear();
      it = cache.plans.emplace(key, make_plan(handle, g)).first;
    }
    plan = it->second;
  }
  Tensor ws = ctx.workspace(kCublasWorkspaceBytes);
  const float alpha = 1.0f;
  auto enqueue = [&](GemmPlan& p, cublasLtMatrixLayout_t la, cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t ld) {
    std::lock_guard<std::mutex> lock(p.mu);
    if (g_in.bias != nullptr) {
      CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g_in.bias, sizeof(g_in.bias)));
    }
    if (g_in.aux != nullptr) {
      CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &g_in.aux, sizeof(g_in.aux)));
    }
    return cublasLtMatmul(handle, p.desc, &alpha, g_in.a, la, g_in.b, lb, &g_in.beta, g_in.d, ld, g_in.d, ld, &p.algo,
                          ws.raw_data(), p.workspace, stream_of(ctx));
  };
  if (!flexible) {
    CUBLAS_CHECK(enqueue(*plan, plan->la, plan->lb, plan->ld));
    return;
  }
  cublasLtMatrixLayout_t la = make_layout(g_in.at, g_in.ta, g_in.m, g_in.k, g_in.lda);
  cublasLtMatrixLayout_t lb = make_layout(g_in.bt, g_in.tb, g_in.k, g_in.n, g_in.ldb);
  cublasLtMatrixLayout_t ld = make_layout(g_in.dt, CUBLAS_OP_N, g_in.m, g_in.n, g_in.ldd);
  cublasStatus_t st = enqueue(*plan, la, lb, ld);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(ld);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE) {  // the exact plan instead
    const int64_t rows = t_varying_rows;
    t_varying_rows = 0;
    run_gemm(ctx, g_in);
    t_varying_rows = rows;
    return;
  }
  CUBLAS_CHECK(st);
}

// Marks the GEMMs of one expert's row block (Note [Plans for varying row counts]).
struct RowBucketScope {
  explicit RowBucketScope(int64_t rows) : saved(t_varying_rows) { t_varying_rows = rows; }
  ~RowBucketScope() { t_varying_rows = saved; }
  int64_t saved;
};

// ---- small kernels: bias add (when not fused) and the bias-gradient column sums ----------------

// y = src + bias per row, rounded once into y's type (src is y itself, or an fp32 GEMM result).
template <typename S, typename T, typename B>
__global__ void add_bias_rows_kernel(const S* src, T* y, const B* bias, int64_t rows, int64_t cols) {
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    y[i] = store_float<T>(load_float(src[i]) + load_float(bias[i % cols]));
  }
}

constexpr int kSumCols = 32, kSumRows = 8;

// Stage 1: block (x, y) sums column block x over row split y. With one split it adds straight into
// bias_grad; otherwise it writes partial[y·cols + c] for stage 2. Each thread sums V consecutive
// columns (one 16-byte load per row where V > 1: Note [Vectorised column sums]).
template <typename T, int V>
__global__ void column_sums_kernel(const T* dy, int64_t rows, int64_t cols, int64_t rows_per_split, float* partial,
                                   float* bias_grad) {
  __shared__ float sh[kSumRows][kSumCols * V + 1];
  const int64_t c = (int64_t(blockIdx.x) * kSumCols + threadIdx.x) * V;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_split;
  const int64_t r1 = min(rows, r0 + rows_per_split);
  float s[V];
#pragma unroll
  for (int e = 0; e < V; ++e) s[e] = 0.0f;
  if (c < cols) {
#pragma unroll 4
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kSumRows) {
      if constexpr (V == 1) {
        s[0] += load_float(dy[r * cols + c]);
      } else {
        const uint4 raw = *reinterpret_cast<const uint4*>(dy + r * cols + c);
        const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int e = 0; e < V; ++e) s[e] += load_float(v[e]);
      }
    }
  }
#pragma unroll
  for (int e = 0; e < V; ++e) sh[threadIdx.y][threadIdx.x * V + e] = s[e];
  __syncthreads();
  // the block's columns, one per thread of the first rows of threads
  const int tid = int(threadIdx.y * kSumCols + threadIdx.x);
  for (int j = tid; j < kSumCols * V; j += kSumCols * kSumRows) {
    const int64_t cj = int64_t(blockIdx.x) * kSumCols * V + j;
    if (cj >= cols) continue;
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < kSumRows; ++i) total += sh[i][j];
    if (partial != nullptr) {
      partial[int64_t(blockIdx.y) * cols + cj] = total;
    } else {
      bias_grad[cj] += total;
    }
  }
}

// Stage 2: bias_grad[c] += Σ_splits partial[s·cols + c], in split order (deterministic).
__global__ void column_sums_finish_kernel(const float* partial, int splits, int64_t cols, float* bias_grad) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= cols) return;
  float total = 0.0f;
  for (int s = 0; s < splits; ++s) total += partial[int64_t(s) * cols + c];
  bias_grad[c] += total;
}

// Note [Vectorised column sums]: the bias gradient reads all of dy, so it moves 16 bytes per
// thread and row (V = 8 bf16/fp16 or 4 fp32 columns) when the columns are a multiple of V and dy
// is 16-byte aligned; a warp then reads 512 consecutive bytes of a row (2-byte loads of 32
// columns used a fifth of the memory bandwidth). The sums stay deterministic: each thread its
// rows in order, the block's rows of threads in order, then the splits in order.
void bias_grad_accumulate(Context& ctx, const Tensor& dy, int64_t rows, int64_t cols, Tensor& bias_grad) {
  dispatch_float(dy.dtype(), [&]<typename T>() {
    constexpr int kV = int(16 / sizeof(T));
    const bool vec = cols % kV == 0 && reinterpret_cast<uintptr_t>(dy.raw_data()) % 16 == 0;
    const int64_t block_cols = int64_t(kSumCols) * (vec ? kV : 1);
    const int64_t col_blocks = (cols + block_cols - 1) / block_cols;
    const int64_t max_splits = std::max<int64_t>(1, (rows + 63) / 64);
    const int64_t splits = std::clamp<int64_t>(2048 / col_blocks, 1, std::min<int64_t>(max_splits, 65535));
    const int64_t rows_per_split = (rows + splits - 1) / splits;
    float* partial = nullptr;
    Tensor ws;
    if (splits > 1) {
      ws = ctx.workspace(size_t(splits * cols) * sizeof(float));
      partial = static_cast<float*>(ws.raw_data());
    }
    float* db = dev_ptr<float>(bias_grad);
    const dim3 grid{unsigned(col_blocks), unsigned(splits)}, block{kSumCols, kSumRows};
    if (vec) {
      column_sums_kernel<T, kV><<<grid, block, 0, stream_of(ctx)>>>(dev_ptr<const T>(dy), rows, cols,
                                                                    rows_per_split, partial, db);
    } else {
      column_sums_kernel<T, 1><<<grid, block, 0, stream_of(ctx)>>>(dev_ptr<const T>(dy), rows, cols, rows_per_split,
                                                                   partial, db);
    }
    CUDA_CHECK_LAUNCH();
    if (splits > 1) {
      column_sums_finish_kernel<<<unsigned((cols + kBlockSize - 1) / kBlockSize), kBlockSize, 0, stream_of(ctx)>>>(
          partial, int(splits), cols, db);
      CUDA_CHECK_LAUNCH();
    }
  });
}

// y = src + bias; src undefined means y itself.
void add_bias_rows(Context& ctx, const Tensor& src, Tensor& y, const Tensor& bias, int64_t rows, int64_t cols) {
  dispatch_float(y.dtype(), [&]<typename T>() {
    dispatch_float(bias.dtype(), [&]<typename B>() {
      const unsigned grid = grid_for(rows * cols);
      if (src.defined()) {
        add_bias_rows_kernel<float, T, B><<<grid, kBlockSize, 0, stream_of(ctx)>>>(
            dev_ptr<const float>(src), dev_ptr<T>(y), dev_ptr<const B>(bias), rows, cols);
      } else {
        add_bias_rows_kernel<T, T, B><<<grid, kBlockSize, 0, stream_of(ctx)>>>(dev_ptr<const T>(y), dev_ptr<T>(y),
                                                                                dev_ptr<const B>(bias), rows, cols);
      }
    });
  });
  CUDA_CHECK_LAUNCH();
}

// ---- shape checks ---------------------------------------------------------------------------------

struct LinearDims {
  int64_t n = 0, in = 0, out = 0;
};

int64_t rows_of(const Tensor& t, int64_t h, const char* name) {
  MG_ASSERT(t.dim() >= 1 && t.size(-1) == h, "{} is {}, expected a last dimension of {}", name, t.str(), h);
  int64_t rows = 1;
  for (int i = 0; i + 1 < t.dim(); ++i) rows *= t.size(i);
  return rows;
}

LinearDims linear_dims(const Tensor& x, const Tensor& weight) {
  check_float_cuda(weight, "weight");
  MG_ASSERT(weight.dim() == 2, "weight must be [out, in], got {}", weight.str());
  check_float_cuda(x, "x");
  LinearDims d;
  d.out = weight.size(0);
  d.in = weight.size(1);
  d.n = rows_of(x, d.in, "x");
  return d;
}

void check_output_type(DType operands, const Tensor& out, const char* name) {
  MG_CHECK(out.dtype() == operands || out.dtype() == DType::Float32,
           "linear on CUDA: {} is {} but the operands are {} (use the operand dtype or fp32)", name,
           to_string(out.dtype()), to_string(operands));
}

// D = op(A)·op(B) in cuBLASLt's column-major terms (m × n, inner k), each matrix's type its tensor's.
Gemm make_gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, const Tensor& a,
               int64_t lda, const Tensor& b, int64_t ldb, const Tensor& d, int64_t ldd) {
  Gemm g;
  g.ta = ta;
  g.tb = tb;
  g.m = m;
  g.n = n;
  g.k = k;
  g.a = a.raw_data();
  g.at = cuda_type(a.dtype());
  g.lda = lda;
  g.b = b.raw_data();
  g.bt = cuda_type(b.dtype());
  g.ldb = ldb;
  g.d = d.raw_data();
  g.dt = cuda_type(d.dtype());
  g.ldd = ldd;
  return g;
}

// The products of Note [Row-major GEMMs on cuBLASLt]: forward y = x·Wᵀ, grad_in = grad_out·W and
// weight_grad (+)= grad_outᵀ·x.
Gemm forward_gemm(const LinearDims& d, const Tensor& x, const Tensor& weight, const Tensor& y) {
  return make_gemm(CUBLAS_OP_T, CUBLAS_OP_N, d.out, d.n, d.in, weight, d.in, x, d.in, y, d.out);
}

Gemm grad_in_gemm(const LinearDims& d, const Tensor& grad_out, const Tensor& weight, const Tensor& grad_in) {
  return make_gemm(CUBLAS_OP_N, CUBLAS_OP_N, d.in, d.n, d.out, weight, d.in, grad_out, d.out, grad_in, d.in);
}

Gemm weight_grad_gemm(const LinearDims& d, const Tensor& grad_out, const Tensor& x, const Tensor& weight_grad) {
  return make_gemm(CUBLAS_OP_N, CUBLAS_OP_T, d.in, d.out, d.n, x, d.in, grad_out, d.out, weight_grad, d.in);
}

}  // namespace

void linear_forward(Context& ctx, const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y) {
  const LinearDims d = linear_dims(x, weight);
  check_float_cuda(y, "y");
  MG_ASSERT(rows_of(y, d.out, "y") == d.n, "y is {}, expected {} rows of {}", y.str(), d.n, d.out);
  MG_CHECK(x.dtype() == weight.dtype(), "linear on CUDA: x is {} but weight is {} (they must match)",
           to_string(x.dtype()), to_string(weight.dtype()));
  check_output_type(x.dtype(), y, "y");
  if (bias.defined()) {
    check_float_cuda(bias, "bias");
    MG_ASSERT(bias.numel() == d.out, "bias is {}, expected {} elements", bias.str(), d.out);
  }
  if (d.n == 0 || d.out == 0) return;
  // cuBLASLt's bias epilogue wants the bias in D's type and (in practice) 16-byte aligned. Otherwise
  // a 16-bit y goes through an fp32 GEMM result, so the bias add still rounds only once.
  const bool fuse_bias =
      bias.defined() && bias.dtype() == y.dtype() && alignment_of(bias.raw_data()) >= 16 && d.in > 0;
  const bool via_fp32 = bias.defined() && !fuse_bias && y.dtype() != DType::Float32 && d.in > 0;
  Tensor acc = via_fp32 ? Tensor::empty({d.n, d.out}, DType::Float32, y.device()) : Tensor();
  Tensor& gemm_out = via_fp32 ? acc : y;
  if (d.in == 0) {
    CUDA_CHECK(cudaMemsetAsync(y.raw_data(), 0, y.nbytes(), stream_of(ctx)));
  } else {
    Gemm g = forward_gemm(d, x, weight, gemm_out);
    g.bias = fuse_bias ? bias.raw_data() : nullptr;
    run_gemm(ctx, g);
  }
  if (bias.defined() && !fuse_bias) add_bias_rows(ctx, acc, y, bias, d.n, d.out);
}

void linear_backward(Context& ctx, const Tensor& grad_out, const Tensor& x, const Tensor& weight, Tensor& grad_in,
                     Tensor& weight_grad, Tensor& bias_grad) {
  const LinearDims d = linear_dims(x, weight);
  check_float_cuda(grad_out, "grad_out");
  MG_ASSERT(rows_of(grad_out, d.out, "grad_out") == d.n, "grad_out is {}, expected {} rows of {}", grad_out.str(),
            d.n, d.out);
  if (grad_in.defined()) {
    check_float_cuda(grad_in, "grad_in");
    MG_ASSERT(grad_in.numel() == d.n * d.in, "grad_in is {}, expected {} elements", grad_in.str(), d.n * d.in);
    if (d.out == 0) {
      CUDA_CHECK(cudaMemsetAsync(grad_in.raw_data(), 0, grad_in.nbytes(), stream_of(ctx)));
    } else if (d.n > 0 && d.in > 0) {
      MG_CHECK(grad_out.dtype() == weight.dtype(), "linear_backward on CUDA: grad_out is {} but weight is {}",
               to_string(grad_out.dtype()), to_string(weight.dtype()));
      check_output_type(grad_out.dtype(), grad_in, "grad_in");
      run_gemm(ctx, grad_in_gemm(d, grad_out, weight, grad_in));
    }
  }
  if (weight_grad.defined()) {
    check_float_cuda(weight_grad, "weight_grad");
    MG_ASSERT(weight_grad.dtype() == DType::Float32, "weight_grad must be fp32, got {}", weight_grad.str());
    MG_ASSERT(weight_grad.numel() == d.out * d.in, "weight_grad is {}, expected {} elements", weight_grad.str(),
              d.out * d.in);
    if (d.n > 0 && d.in > 0 && d.out > 0) {
      MG_CHECK(grad_out.dtype() == x.dtype(), "linear_backward on CUDA: grad_out is {} but x is {}",
               to_string(grad_out.dtype()), to_string(x.dtype()));
      Gemm g = weight_grad_gemm(d, grad_out, x, weight_grad);
      g.beta = 1.0f;  // accumulated into the fp32 main grad
      run_gemm(ctx, g);
    }
  }
  if (bias_grad.defined()) {
    check_float_cuda(bias_grad, "bias_grad");
    MG_ASSERT(bias_grad.dtype() == DType::Float32, "bias_grad must be fp32, got {}", bias_grad.str());
    MG_ASSERT(bias_grad.numel() == d.out, "bias_grad is {}, expected {} elements", bias_grad.str(), d.out);
    if (d.n > 0 && d.out > 0) bias_grad_accumulate(ctx, grad_out, d.n, d.out, bias_grad);
  }
}

// Note [GeLU in the GEMM epilogue].
static bool gelu_epilogue_applies(DType dt, int64_t ld, std::initializer_list<const Tensor*> tensors) {
  if (dt != DType::BFloat16 && dt != DType::Float16) return false;
  if (ld % 8 != 0) return false;
  for (const Tensor* t : tensors) {
    if (t->dtype() != dt || alignment_of(t->raw_data()) < 16) return false;
  }
  return true;
}

void linear_gelu_forward(Context& ctx, const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& pre,
                         Tensor& out) {
  const LinearDims d = linear_dims(x, weight);
  check_float_cuda(pre, "pre");
  check_float_cuda(out, "out");
  MG_ASSERT(rows_of(pre, d.out, "pre") == d.n && rows_of(out, d.out, "out") == d.n,
            "pre is {} and out is {}, expected {} rows of {}", pre.str(), out.str(), d.n, d.out);
  bool fused = d.n > 0 && d.in > 0 && d.out > 0 && x.dtype() == weight.dtype() &&
               gelu_epilogue_applies(x.dtype(), d.out, {&weight, &pre, &out});
  if (fused && bias.defined()) fused = bias.numel() == d.out && gelu_epilogue_applies(x.dtype(), 8, {&bias});
  if (!fused) {
    linear_forward(ctx, x, weight, bias, pre);
    gelu_forward(ctx, pre, out);
    return;
  }
  Gemm g = forward_gemm(d, x, weight, out);
  g.bias = bias.defined() ? bias.raw_data() : nullptr;
  g.epilogue = Gemm::GeluAux;
  g.aux = pre.raw_data();
  g.aux_ld = d.out;
  run_gemm(ctx, g);
}

void linear_dgelu_backward(Context& ctx, const Tensor& grad_out, const Tensor& weight, const Tensor& pre,
                           Tensor& grad_pre) {
  const LinearDims d = linear_dims(pre, weight);  // pre [N, in] is the linear's input
  check_float_cuda(grad_out, "grad_out");
  check_float_cuda(grad_pre, "grad_pre");
  MG_ASSERT(rows_of(grad_out, d.out, "grad_out") == d.n && rows_of(grad_pre, d.in, "grad_pre") == d.n,
            "grad_out is {} and grad_pre is {}, expected {} rows of {} and of {}", grad_out.str(), grad_pre.str(), d.n,
            d.out, d.in);
  const bool fused = d.n > 0 && d.in > 0 && d.out > 0 &&
                     gelu_epilogue_applies(weight.dtype(), d.in, {&grad_out, &pre, &grad_pre});
  if (!fused) {
    Tensor none;
    linear_backward(ctx, grad_out, pre, weight, grad_pre, none, none);
    gelu_backward(ctx, grad_pre, pre, grad_pre);
    return;
  }
  Gemm g = grad_in_gemm(d, grad_out, weight, grad_pre);
  g.epilogue = Gemm::DGelu;
  g.aux = pre.raw_data();
  g.aux_ld = d.in;
  run_gemm(ctx, g);
}

// ---- the grouped GEMM of the experts --------------------------------------------------------------
// A loop of cuBLASLt GEMMs on the Context's stream, one per expert with rows, each linear_forward /
// linear_backward's GEMM over the expert's row block. Chosen by measurement (bench/moe_grouped_gemm,
// H200, bf16, bench/results/h200_moe_grouped_gemm.jsonl): for 8 experts × [4096, 2048] over 65536
// uneven rows the loop runs at 775 / 778 / 761 TFLOP/s (forward / input grad / weight grad), the
// dense GEMM of the same size at 779 / 767 / 695; for 64 experts × [1408, 2048] over 196608 rows, 653
// / 633 / 541 against dense 761 / 671 / 635. cuBLAS 13.0's cublasGemmGroupedBatchedEx ran at 294 /
// 315 and 286 / 295 TFLOP/s and refuses bf16 operands into an fp32 C (the weight gradient into
// main_grad: CUBLAS_STATUS_NOT_SUPPORTED); cuBLASLt 13.0 has no grouped matmul and CUTLASS is not
// on this machine. What the loop leaves on the table is the small experts' tail (fine-grained MoE).

void moe_grouped_linear_forward(Context& ctx, const Tensor& x, const std::vector<Tensor>& weights,
                                const std::vector<int64_t>& rows_per_expert, Tensor& y) {
  const std::vector<int64_t> starts = ops::moe_expert_row_starts(rows_per_expert, weights.size(), x.size(0));
  for (size_t e = 0; e < weights.size(); ++e) {
    if (rows_per_expert[e] == 0) continue;
    Tensor ye = y.slice(starts[e], starts[e + 1]);
    RowBucketScope bucket(rows_per_expert[e]);
    linear_forward(ctx, x.slice(starts[e], starts[e + 1]), weights[e], Tensor(), ye);
  }
}

void moe_grouped_linear_backward(Context& ctx, const Tensor& grad_out, const Tensor& x,
                                 const std::vector<Tensor>& weights, const std::vector<int64_t>& rows_per_expert,
                                 Tensor& grad_in, std::vector<Tensor>& weight_grads) {
  const std::vector<int64_t> starts = ops::moe_expert_row_starts(rows_per_expert, weights.size(), x.size(0));
  MG_ASSERT(weight_grads.empty() || weight_grads.size() == weights.size(), "{} weight gradients for {} experts",
            weight_grads.size(), weights.size());
  for (size_t e = 0; e < weights.size(); ++e) {
    if (rows_per_expert[e] == 0) continue;
    Tensor gi = grad_in.defined() ? grad_in.slice(starts[e], starts[e + 1]) : Tensor();
    Tensor wg = weight_grads.empty() ? Tensor() : weight_grads[e];
    Tensor none;
    RowBucketScope bucket(rows_per_expert[e]);
    linear_backward(ctx, grad_out.slice(starts[e], starts[e + 1]), x.slice(starts[e], starts[e + 1]), weights[e], gi,
                    wg, none);
  }
}

}  // namespace megatron::cuda

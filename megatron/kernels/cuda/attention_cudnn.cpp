// cuDNN fused flash attention (bf16, fp16) through the cudnn-frontend Graph API, targeting
// cudnn-frontend 1.x (built against 1.32 with cuDNN 9.19). Host code only, compiled by g++: the
// frontend is heavy and this file is its one user. attention.cu checks shapes and dtypes and falls
// back to its row-wise kernels when this file says false.
//
// Layout: our q/out/dq are [s, b, nq, d] and k/v/dk/dv [s, b, ng, d] (sequence-first). cuDNN wants
// logical dims [b, h, s, d]; we give it those dims with the strides of our memory,
// {h·d, d, b·h·d, 1}, so nothing is transposed. GQA is native: k/v declare ng heads, and cuDNN sums
// dK/dV over the nq/ng query heads of each group. The causal mask is the top-left diagonal band
// with right bound 0 (key j <= query i); CausalWithOffset (sq queries, sk keys) is the top-left band
// with right bound q_offset - k_offset (key j <= query i + that), which cuDNN takes when it is not
// negative (no row then goes without keys): a negative shift runs the row-wise kernels.
//
// Note [Documents on cuDNN]: the Documents mask (causal within each document of cu_seqlens) is
// cuDNN's variable-length attention: every document is a batch entry of its own, b·n of them for
// b batch rows of n documents (entry bi·n + t is document t of row bi), with
//  * ragged offsets (int64, in elements) to the document's first row: (cu[t]·b + bi)·(elements per
//    (position, batch row)) in q, k, v, out and their gradients, bi·nq·s + cu[t] in lse. cuDNN
//    replaces the batch stride by the offset and keeps our other strides, so the sequence stride
//    stays b·h·d and nothing is packed or copied;
//  * seq_len_q = seq_len_kv = the document's length, with the padding mask on, so the top-left
//    causal band applies within each document and an empty document computes nothing;
//  * the sequence dimension declared as s, a bound on every document's length.
// The index is written by a kernel (attention.cu) into the workspace before each call, from
// cu_seqlens on the device: nothing waits for the GPU, and the graph depends only on (b, n, s).
// With b = 1 the layout is THD exactly (Megatron's packed sequences) and the frontend is told the
// total token count (max_total_seq_len = s) to size its workspace; with b > 1 the rows of different
// documents interleave and it keeps its dense bound b·n·s.
//
// Fused QKV (attention_forward_qkv, MHA): q, k and v are not copied out of the QKV projection's
// output [s, b, nq·3·d] (per head: its query, key, value) but declared as strided views of it:
// head h's q at element h·3d of a token row, k at h·3d + d, v at h·3d + 2d, with strides
// {3·nq·d, 3·d, b·3·nq·d, 1} for [b, h, s, d] (Transformer Engine's "sbh3d"). The backward writes
// dQ, dK, dV through the same strides into grad_qkv. O, dO and the stats keep their own layout.
//
// Stats: with generate_stats, cuDNN returns "Stats" [b, h, s, 1] fp32 = max_j S_ij +
// ln Σ_j exp(S_ij - max), S = attn_scale·Q·Kᵀ after the mask: the natural-log log-sum-exp of the
// scaled scores, exactly our lse [b, nq, s] (contiguous, so the same memory with strides
// {nq·s, s, 1, 1}). Its backward consumes the same definition, so an lse from the row-wise kernels
// feeds cuDNN's backward and vice versa.
//
// Note [Value heads of another width on the GPU]: multi-latent attention has query/key heads of d
// channels and value heads of dv != d (DeepSeek-V3: 192 and 128). cuDNN's SDPA takes that on Hopper:
// v, o, dO and dV are declared with dv, q, k, dQ and dK with d (GraphKey carries both). Packed
// documents share one ragged-offset array between k and v, so dv != d with documents is declined
// and runs on the row-wise kernels (attention.cu), which take both widths (AttnDims::dv), as they
// do for fp32.
//
// Note [Attention dropout on the GPU]: cuDNN draws its dropout mask with its own Philox, keyed by
// the (seed, offset) we pass as device int64 scalars, over its own element order. The mask is a
// pure function of (seed, offset), so cuDNN's backward regenerates its forward's mask, but it does
// NOT match the CPU reference's mask (Note [Random stream layout]); with dropout the two backends
// agree only in distribution. The row-wise kernels in attention.cu do reproduce the CPU's mask. A
// forward and its backward must therefore take the same path: with dropout > 0, cuDNN is used only
// when it supports both directions, and misaligned pointers are an error instead of a fallback.
// The fused-QKV graphs (strided q/k/v) take the same (seed, offset) and are expected to draw the
// same mask as the split graphs (tests/gpu/attention_qkv_test.cpp checks it on the device).
//
// Graphs: building one costs milliseconds to seconds (heuristics, plan compilation), so each is
// built once per configuration and cached; see GraphKey. attn_scale and the dropout probability are
// baked into the graph, so they are part of the key.
#if defined(MEGATRON_WITH_CUDA)

#include <cudnn.h>
#include <nvrtc.h>

// Note [NVRTC for cudnn-frontend]: cudnn-frontend 1.32's headers carry an experimental SM100
// RmsNorm+SiLU engine that compiles kernels with NVRTC, so every user of the Graph API references
// nvrtc* symbols, although only that engine (built for RmsNorm+SiLU graphs, never for SDPA) calls
// them. The megatron target does not link libnvrtc, so these references are weak: unresolved they
// are null and never called here; once CMake links CUDA::nvrtc they bind to the real functions.
#pragma weak nvrtcCreateProgram
#pragma weak nvrtcCompileProgram
#pragma weak nvrtcDestroyProgram
#pragma weak nvrtcGetProgramLogSize
#pragma weak nvrtcGetProgramLog
#pragma weak nvrtcGetCUBINSize
#pragma weak nvrtcGetCUBIN

#include <cudnn_frontend.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <exception>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "megatron/kernels/cuda/attention.h"
#include "megatron/runtime/cuda/cuda_check.h"

// The library check for cudnn-frontend calls: an error becomes megatron::Error with the
// frontend's message (runtime/check.h).
#define CUDNN_FE_CHECK(stmt)                                                                              \
  do {                                                                                                    \
    ::cudnn_frontend::error_t mg_fe_err_ = (stmt);                                                        \
    if (mg_fe_err_.is_bad()) [[unlikely]] {                                                               \
      int mg_dev_ = -1;                                                                                   \
      cudaGetDevice(&mg_dev_);                                                                            \
      ::megatron::mg_library_failure("cuDNN frontend", #stmt, __FILE__, __LINE__, mg_fe_err_.get_message(), \
                                     mg_dev_);                                                            \
    }                                                                                                     \
  } while (0)

namespace megatron::cuda {

namespace {

namespace fe = cudnn_frontend;

// Tensor uids of the graphs' variant packs.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kSeed, kOffset, kGradO, kGradQ, kGradK, kGradV };
// The Documents mask's index tensors (Note [Documents on cuDNN]).
enum DocumentUid : int64_t { kSeqLenQ = kGradV + 1, kSeqLenKV, kRaggedQ, kRaggedK, kRaggedO, kRaggedStats };

// The cuDNN kernels move q/k/v/o with 16-byte vector loads: every pointer must be 16-byte aligned.
constexpr uintptr_t kAlignment = 16;
// The dropout seed and offset live at the start of the workspace, 16 bytes apart (each tensor is
// 16-byte aligned); cuDNN's own workspace follows at this offset.
constexpr size_t kDropoutStateBytes = 256;

// One graph per (handle, device, shape, dtype, attn_scale, dropout probability, direction, documents
// per batch row: 0 for the causal mask). A graph is built with, and executed with, the handle of one Context, so
// Contexts never share a graph (nor execute one concurrently). A handle freed with its Context may come back at the
// same address for a new Context: the key then matches, and the graph's handle is that live handle on the same device,
// so reuse is sound. Entries of dead handles stay (one per shape).
struct GraphKey {
  void* handle = nullptr;
  int device = 0;
  int64_t b = 0, s = 0, nq = 0, ng = 0, d = 0;
  int64_t dv = 0;             // value (and output) head width; d for all but multi-latent attention
  int64_t sk = 0, shift = 0;  // key positions; the band's right bound (CausalWithOffset, else 0)
  int64_t window = -1;        // Note [Sliding-window attention]: the band's left bound is window + 1; -1: none
  DType dtype = DType::BFloat16;
  uint32_t scale_bits = 0, dropout_bits = 0;
  bool backward = false;
  bool fused_qkv = false;  // q/k/v (and their gradients) are views of one [s, b, 3·nq·d] buffer
  bool deterministic = false;  // backward: cuDNN's deterministic dQ (Context::deterministic)
  int64_t docs = 0;            // Documents mask: n documents per batch row (Note [Documents on cuDNN])
  bool operator==(const GraphKey&) const = default;
  int64_t batch() const { return docs > 0 ? b * docs : b; }  // cuDNN's batch dimension
  float dropout_p() const { return std::bit_cast<float>(dropout_bits); }
  float scale() const { return std::bit_cast<float>(scale_bits); }
};

struct GraphKeyHash {
  size_t operator()(const GraphKey& k) const {
    size_t h = std::hash<void*>()(k.handle);
    auto mix = [&h](uint64_t v) { h ^= std::hash<uint64_t>()(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
    mix(uint64_t(k.device));
    for (int64_t v : {k.b, k.s, k.nq, k.ng, k.d, k.dv, k.sk, k.shift, k.docs, k.window}) mix(uint64_t(v));
    mix(uint64_t(k.dtype));
    mix(k.scale_bits);
    mix(k.dropout_bits);
    mix(uint64_t(k.backward));
    mix(uint64_t(k.fused_qkv));
    mix(uint64_t(k.deterministic));
    return h;
  }
};

// A built graph, or why cuDNN declined the configuration (graph null).
struct CachedGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace_bytes = 0;
  std::string unsupported;
};

// The shape part of a GraphKey: from separate q [s, b, nq, d], k [s, b, ng, d], or (fused) from
// the output [s, b, nq, d] of attention over a [s, b, 3·nq·d] buffer.
struct Geometry {
  int64_t s = 0, b = 0, nq = 0, ng = 0, d = 0, dv = 0;
  DType dtype = DType::BFloat16;
  bool fused_qkv = false;
  int64_t docs = 0;
  int64_t sk = 0, shift = 0;
  int64_t window = -1;
};

// The band's right bound for sk keys: a bound past the last key is the same as sk (all keys seen).
int64_t band_shift(const AttnMask& mask, int64_t sk) {
  return mask.kind == AttnMask::Kind::CausalWithOffset ? std::min(mask.q_offset - mask.k_offset, sk) : 0;
}

// Documents per batch row (the shape of cu_seqlens), 0 for the causal mask.
int64_t documents(const AttnMask& mask) {
  if (mask.kind != AttnMask::Kind::Documents) return 0;
  return mask.cu_seqlens.size(mask.cu_seqlens.dim() - 1) - 1;
}

// The mask's part of the geometry: documents per row, key positions and the band's right bound.
Geometry with_mask(Geometry g, const AttnMask& mask, int64_t sk) {
  g.docs = documents(mask);
  g.sk = sk;
  g.shift = band_shift(mask, sk);
  g.window = mask.window_left;
  return g;
}

Geometry split_geometry(const Tensor& q, const Tensor& k, const Tensor& v, const AttnMask& mask) {
  return with_mask({q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), v.size(3), q.dtype(), false}, mask,
                   k.size(0));
}

Geometry fused_geometry(const Tensor& qkv, const Tensor& out, const AttnMask& mask) {
  return with_mask({out.size(0), out.size(1), out.size(2), out.size(2), out.size(3), out.size(3), qkv.dtype(), true}, mask,
                   out.size(0));
}

GraphKey make_key(Context& ctx, const Geometry& g, float softmax_scale, float dropout_p, bool backward) {
  MG_ASSERT(ctx.cudnn_handle() != nullptr, "cuDNN attention on a context without a cuDNN handle ({})",
            ctx.device().str());
  GraphKey key;
  key.handle = ctx.cudnn_handle();
  key.device = ctx.device().index;
  key.s = g.s;
  key.b = g.b;
  key.nq = g.nq;
  key.ng = g.ng;
  key.d = g.d;
  key.dv = g.dv;
  key.dtype = g.dtype;
  key.scale_bits = std::bit_cast<uint32_t>(softmax_scale);
  key.dropout_bits = dropout_p > 0.0f ? std::bit_cast<uint32_t>(dropout_p) : 0u;
  key.backward = backward;
  key.fused_qkv = g.fused_qkv;
  key.deterministic = backward && ctx.deterministic();
  key.docs = g.docs;
  key.sk = g.sk;
  key.shift = g.shift;
  key.window = g.window;
  return key;
}

fe::DataType_t io_type(DType t) {
  switch (t) {
    case DType::BFloat16: return fe::DataType_t::BFLOAT16;
    case DType::Float16: return fe::DataType_t::HALF;
    default: break;
  }
  MG_ASSERT(false, "cuDNN attention takes bf16 or fp16, got {}", to_string(t));
  return fe::DataType_t::NOT_SET;
}

// Logical [b, h, s, d] over sequence-first memory [s, b, h, d]; seq is k.s (queries) or k.sk (keys).
// width: the head width, k.d (q, k) or k.dv (v, o; Note [Value heads of another width on the GPU]).
std::vector<int64_t> bhsd_dims(const GraphKey& k, int64_t heads, int64_t seq, int64_t width) {
  return {k.batch(), heads, seq, width};
}
std::vector<int64_t> sbhd_strides(const GraphKey& k, int64_t heads, int64_t width) {
  return {heads * width, width, k.b * heads * width, 1};
}

// q, k, v and their gradients: their own [s, b, h, d] tensors, or views of the fused buffer.
std::vector<int64_t> qkv_strides(const GraphKey& k, int64_t heads, int64_t width) {
  if (!k.fused_qkv) return sbhd_strides(k, heads, width);
  const int64_t row = 3 * k.nq * k.d;  // one token's fused row
  return {row, 3 * k.d, k.b * row, 1};
}

using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

TensorPtr activation(fe::graph::Graph& graph, const GraphKey& k, const char* name, Uid uid, int64_t heads, int64_t seq,
                     int64_t width, const std::vector<int64_t>& strides) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim(bhsd_dims(k, heads, seq, width))
                          .set_stride(strides));
}

void mark_activation_output(const TensorPtr& t, const GraphKey& k, Uid uid, int64_t heads, int64_t seq, int64_t width,
                            const std::vector<int64_t>& strides) {
  t->set_output(true).set_uid(uid).set_dim(bhsd_dims(k, heads, seq, width)).set_stride(strides);
}

// Our lse [b, nq, s] as cuDNN's Stats [b, nq, s, 1].
std::vector<int64_t> stats_dims(const GraphKey& k) { return {k.batch(), k.nq, k.s, 1}; }
std::vector<int64_t> stats_strides(const GraphKey& k) { return {k.nq * k.s, k.s, 1, 1}; }

TensorPtr int64_scalar(fe::graph::Graph& graph, const char* name, Uid uid) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim({1, 1, 1, 1})
                          .set_stride({1, 1, 1, 1})
                          .set_data_type(fe::DataType_t::INT64));
}

// The Documents mask's tensors (Note [Documents on cuDNN]); all null for the causal mask.
struct Ragged {
  TensorPtr q, k, o, stats, seq_len_q, seq_len_kv;
};

Ragged ragged_tensors(fe::graph::Graph& graph, const GraphKey& k) {
  if (k.docs == 0) return {};
  auto index = [&](const char* name, DocumentUid uid, int64_t n, fe::DataType_t type) {
    return graph.tensor(fe::graph::Tensor_attributes()
                            .set_name(name)
                            .set_uid(uid)
                            .set_dim({n, 1, 1, 1})
                            .set_stride({1, 1, 1, 1})
                            .set_data_type(type));
  };
  const int64_t n = k.batch();
  return {index("q_offsets", kRaggedQ, n + 1, fe::DataType_t::INT64),
          index("k_offsets", kRaggedK, n + 1, fe::DataType_t::INT64),
          index("o_offsets", kRaggedO, n + 1, fe::DataType_t::INT64),
          index("stats_offsets", kRaggedStats, n + 1, fe::DataType_t::INT64),
          index("seq_len_q", kSeqLenQ, n, fe::DataType_t::INT32),
          index("seq_len_kv", kSeqLenKV, n, fe::DataType_t::INT32)};
}

void set_ragged(const TensorPtr& t, const TensorPtr& offsets) {
  if (offsets) t->set_ragged_offset(offsets);
}

// The padding mask with the documents' lengths, on SDPA_attributes or SDPA_backward_attributes.
template <typename Options>
void set_documents(Options& options, const GraphKey& k, const Ragged& r) {
  if (k.docs == 0) return;
  options.set_padding_mask(true).set_seq_len_q(r.seq_len_q).set_seq_len_kv(r.seq_len_kv);
  if (k.b == 1) options.set_max_total_seq_len_q(k.s).set_max_total_seq_len_kv(k.s);
}

void define_forward(fe::graph::Graph& graph, const GraphKey& k) {
  const Ragged r = ragged_tensors(graph, k);
  TensorPtr q = activation(graph, k, "q", kQ, k.nq, k.s, k.d, qkv_strides(k, k.nq, k.d));
  TensorPtr kk = activation(graph, k, "k", kK, k.ng, k.sk, k.d, qkv_strides(k, k.ng, k.d));
  TensorPtr v = activation(graph, k, "v", kV, k.ng, k.sk, k.dv, qkv_strides(k, k.ng, k.dv));
  set_ragged(q, r.q);
  set_ragged(kk, r.k);
  set_ragged(v, r.k);
  auto options = fe::graph::SDPA_attributes()
                     .set_name("attention_forward")
                     .set_generate_stats(true)
                     .set_attn_scale(k.scale())
                     .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                     .set_diagonal_band_right_bound(int(k.shift));
  // Note [Sliding-window attention]: cuDNN keeps key j when j + left_bound > i (top-left aligned).
  if (k.window >= 0) options.set_diagonal_band_left_bound(int(k.window + 1));
  set_documents(options, k, r);
  if (k.dropout_bits != 0)
    options.set_dropout(k.dropout_p(), int64_scalar(graph, "seed", kSeed), int64_scalar(graph, "offset", kOffset));
  auto [o, stats] = graph.sdpa(q, kk, v, options);
  mark_activation_output(o, k, kO, k.nq, k.s, k.dv, sbhd_strides(k, k.nq, k.dv));
  set_ragged(o, r.o);
  stats->set_output(true)
      .set_uid(kStats)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim(stats_dims(k))
      .set_stride(stats_strides(k));
  set_ragged(stats, r.stats);
}

void define_backward(fe::graph::Graph& graph, const GraphKey& k) {
  const Ragged r = ragged_tensors(graph, k);
  TensorPtr q = activation(graph, k, "q", kQ, k.nq, k.s, k.d, qkv_strides(k, k.nq, k.d));
  TensorPtr kk = activation(graph, k, "k", kK, k.ng, k.sk, k.d, qkv_strides(k, k.ng, k.d));
  TensorPtr v = activation(graph, k, "v", kV, k.ng, k.sk, k.dv, qkv_strides(k, k.ng, k.dv));
  TensorPtr o = activation(graph, k, "o", kO, k.nq, k.s, k.dv, sbhd_strides(k, k.nq, k.dv));
  TensorPtr grad_o = activation(graph, k, "grad_o", kGradO, k.nq, k.s, k.dv, sbhd_strides(k, k.nq, k.dv));
  TensorPtr stats = graph.tensor(fe::graph::Tensor_attributes()
                                     .set_name("stats")
                                     .set_uid(kStats)
                                     .set_dim(stats_dims(k))
                                     .set_stride(stats_strides(k))
                                     .set_data_type(fe::DataType_t::FLOAT));
  set_ragged(q, r.q);
  set_ragged(kk, r.k);
  set_ragged(v, r.k);
  set_ragged(o, r.o);
  set_ragged(grad_o, r.o);
  set_ragged(stats, r.stats);
  auto options = fe::graph::SDPA_backward_attributes()
                     .set_name("attention_backward")
                     .set_attn_scale(k.scale())
                     .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                     .set_diagonal_band_right_bound(int(k.shift));
  if (k.window >= 0) options.set_diagonal_band_left_bound(int(k.window + 1));
  set_documents(options, k, r);
  // Without it, dQ is accumulated with atomics over the key blocks: the last bits vary from run to
  // run. The deterministic algorithm goes through a dP workspace of b·h·s·s·2 bytes instead.
  if (k.deterministic) options.set_deterministic_algorithm(true);
  if (k.dropout_bits != 0)
    options.set_dropout(k.dropout_p(), int64_scalar(graph, "seed", kSeed), int64_scalar(graph, "offset", kOffset));
  auto [grad_q, grad_k, grad_v] = graph.sdpa_backward(q, kk, v, o, grad_o, stats, options);
  mark_activation_output(grad_q, k, kGradQ, k.nq, k.s, k.d, qkv_strides(k, k.nq, k.d));
  mark_activation_output(grad_k, k, kGradK, k.ng, k.sk, k.d, qkv_strides(k, k.ng, k.d));
  mark_activation_output(grad_v, k, kGradV, k.ng, k.sk, k.dv, qkv_strides(k, k.ng, k.dv));
  set_ragged(grad_q, r.q);
  set_ragged(grad_k, r.k);
  set_ragged(grad_v, r.k);
}

// The error codes by which the frontend says "this configuration is not supported" while building
// (support-surface checks, no engine or plan for it); any other code is a failure.
bool is_unsupported(fe::error_code_t code) {
  return code == fe::error_code_t::GRAPH_NOT_SUPPORTED ||
         code == fe::error_code_t::GRAPH_EXECUTION_PLAN_CREATION_FAILED ||
         code == fe::error_code_t::HEURISTIC_QUERY_FAILED || code == fe::error_code_t::CUDNN_BACKEND_API_FAILED;
}

// Records an unsupported verdict and returns false; throws on any other error.
bool build_step(fe::error_t err, const char* step, CachedGraph& entry) {
  if (err.is_good()) return true;
  if (!is_unsupported(err.get_code())) {
    int device = -1;
    cudaGetDevice(&device);
    mg_library_failure("cuDNN frontend", step, __FILE__, __LINE__, err.get_message(), device);
  }
  entry.unsupported = std::string(step) + ": " + err.get_message();
  return false;
}

// Some frontend paths throw (cudnn_frontend::cudnnException, std::runtime_error from its loaders)
// instead of returning an error_t: those become megatron::Error too; ours pass through.
template <typename F>
void rethrow_frontend_exceptions(const char* what, F&& f) {
  try {
    f();
  } catch (const Error&) {
    throw;
  } catch (const InternalError&) {
    throw;
  } catch (const std::exception& e) {
    int device = -1;
    cudaGetDevice(&device);
    mg_library_failure("cuDNN frontend", what, __FILE__, __LINE__, e.what(), device);
  }
}

std::shared_ptr<const CachedGraph> build_graph(const GraphKey& key) {
  auto entry = std::make_shared<CachedGraph>();
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(io_type(key.dtype))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  if (key.backward)
    define_backward(*graph, key);
  else
    define_forward(*graph, key);
  auto handle = static_cast<cudnnHandle_t>(key.handle);
  if (!build_step(graph->validate(), "validate", *entry) ||
      !build_step(graph->build_operation_graph(handle), "build_operation_graph", *entry) ||
      !build_step(graph->create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans", *entry) ||
      !build_step(graph->check_support(), "check_support", *entry) ||
      !build_step(graph->build_plans(), "build_plans", *entry))
    return entry;
  CUDNN_FE_CHECK(graph->get_workspace_size(entry->workspace_bytes));
  entry->graph = std::move(graph);
  return entry;
}

// The process-wide cache of built graphs. Thread-safe; a graph is built under the lock (once per
// configuration). Intentionally never destroyed: graphs hold cuDNN descriptors that must not be
// released after the CUDA runtime has shut down at exit.
class GraphCache {
 public:
  std::shared_ptr<const CachedGraph> get(const GraphKey& key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = graphs_.find(key);
    if (it != graphs_.end()) return it->second;
    std::shared_ptr<const CachedGraph> entry;
    rethrow_frontend_exceptions("building the attention graph", [&] { entry = build_graph(key); });
    graphs_.emplace(key, entry);
    return entry;
  }

 private:
  std::mutex mu_;
  std::unordered_map<GraphKey, std::shared_ptr<const CachedGraph>, GraphKeyHash> graphs_;
};

GraphCache& graph_cache() {
  static GraphCache* cache = new GraphCache();
  return *cache;
}

// The graph for this direction when cuDNN runs it, else null and why. With dropout both directions
// must be supported (Note [Attention dropout on the GPU]).
struct Lookup {
  std::shared_ptr<const CachedGraph> entry;
  std::string unsupported;
};

Lookup lookup(Context& ctx, const Geometry& g, float softmax_scale, float dropout_p, bool backward) {
  // Note [Value heads of another width on the GPU]: one ragged offset array serves k and v.
  if (g.docs > 0 && g.dv != g.d)
    return {nullptr, "packed documents with value heads of another width than the query/key heads"};
  if (g.shift < 0)
    return {nullptr, "cuDNN's diagonal band takes no negative right bound (q_offset - k_offset = " +
                         std::to_string(g.shift) + ")"};
  if (g.window >= 0 && (g.docs > 0 || g.shift != 0))
    return {nullptr, "a sliding window runs on cuDNN with the plain causal mask only (not with documents or offsets)"};
  auto entry = graph_cache().get(make_key(ctx, g, softmax_scale, dropout_p, backward));
  if (!entry->graph) return {nullptr, entry->unsupported};
  if (dropout_p > 0.0f) {
    auto other = graph_cache().get(make_key(ctx, g, softmax_scale, dropout_p, !backward));
    if (!other->graph)
      return {nullptr, std::string("with dropout both directions must run on cuDNN, and the ") +
                           (backward ? "forward" : "backward") + " does not: " + other->unsupported};
  }
  return {std::move(entry), ""};
}

bool all_aligned(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers)
    if (reinterpret_cast<uintptr_t>(p) % kAlignment != 0) return false;
  return true;
}

// With dropout a fallback would change the mask between forward and backward, so misalignment is
// the caller's error there; without dropout the row-wise kernels (or, for the fused QKV buffer,
// the split copies) take over. In the fused buffer k and v sit d elements apart, so d·(element
// size) must be a multiple of 16 bytes as well.
bool check_alignment(std::initializer_list<const void*> pointers, float dropout_p) {
  if (all_aligned(pointers)) return true;
  MG_CHECK(dropout_p <= 0.0f,
           "attention with dropout on the GPU needs 16-byte aligned q, k, v, out, lse and gradients "
           "(cuDNN's dropout mask has no row-wise fallback); allocate them as whole tensors");
  return false;
}

// Head h's q, k, v in a fused buffer row start at h·3d, h·3d + d, h·3d + 2d: the three base pointers.
struct QkvPointers {
  void *q, *k, *v;
};
QkvPointers fused_pointers(const Tensor& qkv, int64_t d) {
  char* base = static_cast<char*>(qkv.raw_data());
  const size_t head = size_t(d) * size_of(qkv.dtype());
  return {base, base + head, base + 2 * head};
}

// What execute() needs to write Note [Documents on cuDNN]'s index; mask null for the causal mask.
struct DocumentRows {
  const AttnMask* mask = nullptr;
  int64_t b = 0, s = 0, nq = 0, q_row = 0, k_row = 0, o_row = 0;
};

DocumentRows split_rows(const AttnMask& mask, const Tensor& q, const Tensor& k) {
  if (mask.kind != AttnMask::Kind::Documents) return {};
  return {&mask, q.size(1), q.size(0), q.size(2), q.size(2) * q.size(3), k.size(2) * k.size(3), q.size(2) * q.size(3)};
}

DocumentRows fused_rows(const AttnMask& mask, const Tensor& out) {
  if (mask.kind != AttnMask::Kind::Documents) return {};
  const int64_t row = out.size(2) * out.size(3);
  return {&mask, out.size(1), out.size(0), out.size(2), 3 * row, 3 * row, row};
}

size_t round_up(size_t bytes) { return (bytes + kDropoutStateBytes - 1) / kDropoutStateBytes * kDropoutStateBytes; }

void execute(Context& ctx, const CachedGraph& entry, std::unordered_map<int64_t, void*>& pack, float dropout_p,
             uint64_t seed, uint64_t offset, const DocumentRows& docs) {
  const size_t state_bytes = dropout_p > 0.0f ? kDropoutStateBytes : 0;
  // Note [Documents on cuDNN]: four offset arrays of entries + 1 int64 and the lengths, each 16-byte aligned.
  const int64_t entries = docs.mask ? docs.b * documents(*docs.mask) : 0;
  const size_t offsets_bytes = (size_t(entries + 1) * sizeof(int64_t) + 15) / 16 * 16;
  const size_t index_bytes = docs.mask ? round_up(4 * offsets_bytes + size_t(entries) * sizeof(int32_t)) : 0;
  const size_t total = state_bytes + index_bytes + size_t(entry.workspace_bytes);
  Tensor workspace;
  char* base = nullptr;
  if (total > 0) {
    workspace = ctx.workspace(total);
    base = static_cast<char*>(workspace.raw_data());
  }
  if (state_bytes > 0) {
    // The kernel writes the seed at base[0..8) and the offset at base[8..16) (see
    // write_cudnn_dropout_state for how our (seed, offset) become cuDNN's): cuDNN must read the
    // offset there (it once read base + 16, bytes nothing wrote — zero only while the pool handed
    // back freshly mapped memory, so the masks changed once the pool kept its memory).
    write_cudnn_dropout_state(ctx, reinterpret_cast<int64_t*>(base), seed, offset);
    pack[kSeed] = base;
    pack[kOffset] = base + sizeof(int64_t);
  }
  if (docs.mask) {
    char* at = base + state_bytes;
    const CudnnDocumentIndex index{reinterpret_cast<int64_t*>(at), reinterpret_cast<int64_t*>(at + offsets_bytes),
                                   reinterpret_cast<int64_t*>(at + 2 * offsets_bytes),
                                   reinterpret_cast<int64_t*>(at + 3 * offsets_bytes),
                                   reinterpret_cast<int32_t*>(at + 4 * offsets_bytes)};
    write_cudnn_document_index(ctx, *docs.mask, docs.b, docs.s, docs.nq, docs.q_row, docs.k_row, docs.o_row, index);
    pack[kRaggedQ] = index.q_offsets;
    pack[kRaggedK] = index.k_offsets;
    pack[kRaggedO] = index.o_offsets;
    pack[kRaggedStats] = index.stats_offsets;
    pack[kSeqLenQ] = index.seq_lens;
    pack[kSeqLenKV] = index.seq_lens;
  }
  void* cudnn_workspace = entry.workspace_bytes > 0 ? base + state_bytes + index_bytes : nullptr;
  rethrow_frontend_exceptions("executing the attention graph", [&] {
    CUDNN_FE_CHECK(entry.graph->execute(static_cast<cudnnHandle_t>(ctx.cudnn_handle()), pack, cudnn_workspace));
  });
}

}  // namespace

CudnnAttentionSupport cudnn_attention_support(Context& ctx, const Tensor& q, const Tensor& k, const AttnMask& mask,
                                              float softmax_scale, float dropout_p, bool backward) {
  if (q.dtype() != DType::BFloat16 && q.dtype() != DType::Float16)
    return {false, "cuDNN attention takes bf16 or fp16, not " + std::string(to_string(q.dtype()))};
  Lookup found = lookup(ctx, split_geometry(q, k, /*v=*/k, mask), softmax_scale, dropout_p, backward);
  return {found.entry != nullptr, found.unsupported};
}

bool cudnn_attention_forward(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const AttnMask& mask,
                             float softmax_scale, float dropout_p, uint64_t seed, uint64_t offset, Tensor& out,
                             Tensor& lse) {
  auto entry = lookup(ctx, split_geometry(q, k, v, mask), softmax_scale, dropout_p, /*backward=*/false).entry;
  if (!entry) return false;
  if (!check_alignment({q.raw_data(), k.raw_data(), v.raw_data(), out.raw_data(), lse.raw_data()}, dropout_p))
    return false;
  std::unordered_map<int64_t, void*> pack = {
      {kQ, q.raw_data()}, {kK, k.raw_data()}, {kV, v.raw_data()}, {kO, out.raw_data()}, {kStats, lse.raw_data()}};
  execute(ctx, *entry, pack, dropout_p, seed, offset, split_rows(mask, q, k));
  return true;
}

bool cudnn_attention_backward(Context& ctx, const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, const AttnMask& mask, float softmax_scale,
                              float dropout_p, uint64_t seed, uint64_t offset, Tensor& grad_q, Tensor& grad_k,
                              Tensor& grad_v) {
  auto entry = lookup(ctx, split_geometry(q, k, v, mask), softmax_scale, dropout_p, /*backward=*/true).entry;
  if (!entry) return false;
  if (!check_alignment({grad_out.raw_data(), q.raw_data(), k.raw_data(), v.raw_data(), out.raw_data(),
                        lse.raw_data(), grad_q.raw_data(), grad_k.raw_data(), grad_v.raw_data()},
                       dropout_p))
    return false;
  std::unordered_map<int64_t, void*> pack = {
      {kQ, q.raw_data()},          {kK, k.raw_data()},          {kV, v.raw_data()},
      {kO, out.raw_data()},        {kGradO, grad_out.raw_data()}, {kStats, lse.raw_data()},
      {kGradQ, grad_q.raw_data()}, {kGradK, grad_k.raw_data()}, {kGradV, grad_v.raw_data()}};
  execute(ctx, *entry, pack, dropout_p, seed, offset, split_rows(mask, q, k));
  return true;
}

CudnnAttentionSupport cudnn_attention_qkv_support(Context& ctx, const Tensor& qkv, const Tensor& out,
                                                  const AttnMask& mask, float softmax_scale, float dropout_p,
                                                  bool backward) {
  if (qkv.dtype() != DType::BFloat16 && qkv.dtype() != DType::Float16)
    return {false, "cuDNN attention takes bf16 or fp16, not " + std::string(to_string(qkv.dtype()))};
  Lookup found = lookup(ctx, fused_geometry(qkv, out, mask), softmax_scale, dropout_p, backward);
  return {found.entry != nullptr, found.unsupported};
}

bool cudnn_attention_forward_qkv(Context& ctx, const Tensor& qkv, const AttnMask& mask, float softmax_scale,
                                 float dropout_p, uint64_t seed, uint64_t offset, Tensor& out, Tensor& lse) {
  auto entry = lookup(ctx, fused_geometry(qkv, out, mask), softmax_scale, dropout_p, /*backward=*/false).entry;
  if (!entry) return false;
  const QkvPointers in = fused_pointers(qkv, out.size(3));
  if (!check_alignment({in.q, in.k, in.v, out.raw_data(), lse.raw_data()}, dropout_p)) return false;
  std::unordered_map<int64_t, void*> pack = {
      {kQ, in.q}, {kK, in.k}, {kV, in.v}, {kO, out.raw_data()}, {kStats, lse.raw_data()}};
  execute(ctx, *entry, pack, dropout_p, seed, offset, fused_rows(mask, out));
  return true;
}

bool cudnn_attention_backward_qkv(Context& ctx, const Tensor& grad_out, const Tensor& qkv, const Tensor& out,
                                  const Tensor& lse, const AttnMask& mask, float softmax_scale, float dropout_p,
                                  uint64_t seed, uint64_t offset, Tensor& grad_qkv) {
  auto entry = lookup(ctx, fused_geometry(qkv, out, mask), softmax_scale, dropout_p, /*backward=*/true).entry;
  if (!entry) return false;
  const QkvPointers in = fused_pointers(qkv, out.size(3)), grad = fused_pointers(grad_qkv, out.size(3));
  if (!check_alignment({grad_out.raw_data(), in.q, in.k, in.v, out.raw_data(), lse.raw_data(), grad.q, grad.k,
                        grad.v},
                       dropout_p))
    return false;
  std::unordered_map<int64_t, void*> pack = {
      {kQ, in.q},         {kK, in.k},          {kV, in.v},
      {kO, out.raw_data()}, {kGradO, grad_out.raw_data()}, {kStats, lse.raw_data()},
      {kGradQ, grad.q},   {kGradK, grad.k},    {kGradV, grad.v}};
  execute(ctx, *entry, pack, dropout_p, seed, offset, fused_rows(mask, out));
  return true;
}

}  // namespace megatron::cuda

#endif  // MEGATRON_WITH_CUDA

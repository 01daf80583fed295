#include "megatron/core/packed_seq_params.h"

#include <algorithm>

namespace megatron {

Tensor cu_seqlens_from_segments(const Tensor& segments) {
  MG_ASSERT(segments.defined() && segments.dim() == 2 && segments.dtype() == DType::Int32 &&
                segments.device().is_host(),
            "document segments must be a host int32 [b, s] tensor, got {}", segments.defined() ? segments.str() : "undefined");
  const int64_t b = segments.size(0), s = segments.size(1);
  const int32_t* seg = segments.data<int32_t>();
  std::vector<std::vector<int32_t>> rows(static_cast<size_t>(b));
  size_t n = 1;
  for (int64_t i = 0; i < b; ++i) {
    std::vector<int32_t>& cu = rows[size_t(i)];
    cu.push_back(0);
    for (int64_t j = 1; j < s; ++j)
      if (seg[i * s + j] != seg[i * s + j - 1]) cu.push_back(int32_t(j));
    cu.push_back(int32_t(s));
    n = std::max(n, cu.size() - 1);
  }
  std::vector<int64_t> flat;
  flat.reserve(size_t(b) * (n + 1));
  for (auto& cu : rows) {
    cu.resize(n + 1, int32_t(s));  // fewer documents: empty ones at the end
    flat.insert(flat.end(), cu.begin(), cu.end());
  }
  return Tensor::from_ints(flat, {b, int64_t(n + 1)}, DType::Int32);
}

PackedSeqParams make_packed_seq_params(const Tensor& cu_seqlens, Device device) {
  MG_ASSERT(cu_seqlens.defined() && cu_seqlens.dim() == 2 && cu_seqlens.dtype() == DType::Int32 &&
                cu_seqlens.device().is_host() && cu_seqlens.size(1) >= 2,
            "cu_seqlens must be a host int32 [b, n + 1] tensor, got {}", cu_seqlens.defined() ? cu_seqlens.str() : "undefined");
  PackedSeqParams p;
  p.batch = cu_seqlens.size(0);
  p.max_documents = cu_seqlens.size(1) - 1;
  const int32_t* cu = cu_seqlens.data<int32_t>();
  p.cu_seqlens_host.assign(cu, cu + cu_seqlens.numel());
  p.seq_length = p.row(0)[p.max_documents];
  for (int64_t i = 0; i < p.batch; ++i) {
    const int32_t* r = p.row(i);
    MG_CHECK(r[0] == 0 && r[p.max_documents] == p.seq_length, "cu_seqlens row {} runs from {} to {}, not 0 to {}", i,
             r[0], r[p.max_documents], p.seq_length);
    for (int64_t t = 0; t < p.max_documents; ++t)
      MG_CHECK(r[t] <= r[t + 1], "cu_seqlens row {} decreases at document {}", i, t);
  }
  p.cu_seqlens = cu_seqlens.to(device);
  return p;
}

void add_context_parallel_chunks(PackedSeqParams& p, int cp_size, Device device) {
  MG_ASSERT(p.batch == 1, "context-parallel documents for {} sequences", p.batch);
  const int64_t chunks = 2 * int64_t(cp_size), c = p.seq_length / chunks;
  MG_ASSERT(c * chunks == p.seq_length, "{} positions in {} chunks", p.seq_length, chunks);
  const int32_t* cu = p.row(0);
  p.chunk_cu_seqlens.clear();
  for (int64_t g = 0; g < chunks; ++g) {
    const int64_t begin = g * c, end = begin + c;
    std::vector<int64_t> local{0};
    for (int64_t t = 1; t < p.max_documents; ++t)
      if (cu[t] > begin && cu[t] < end && cu[t] != local.back() + begin) local.push_back(cu[t] - begin);
    local.push_back(c);
    p.chunk_cu_seqlens.push_back(Tensor::from_ints(local, {int64_t(local.size())}, DType::Int32).to(device));
  }
}

}  // namespace megatron

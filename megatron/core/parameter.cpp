#include "megatron/core/parameter.h"

#include "megatron/runtime/check.h"

namespace megatron {

const char* grad_reduce_group_name(GradReduceGroup g) {
  return g == GradReduceGroup::DataContext ? "data-context-parallel" : "expert-data-parallel";
}

Shape local_shape(const ShardSpec& spec) {
  Shape s = spec.global_shape;
  if (spec.partition_dim >= 0) s[size_t(spec.partition_dim)] /= spec.size;
  return s;
}

ShardSpec unsharded(const Shape& shape) {
  ShardSpec s;
  s.global_shape = shape;
  return s;
}

std::vector<ShardBox> shard_boxes(const ShardSpec& spec) {
  const Shape local = local_shape(spec);
  const size_t nd = spec.global_shape.size();
  std::vector<int64_t> zeros(nd, 0);
  if (spec.partition_dim < 0) return {ShardBox{zeros, zeros, std::vector<int64_t>(local.begin(), local.end())}};
  const size_t d = size_t(spec.partition_dim);
  MG_ASSERT(d < nd, "partition dim {} of a {}-d tensor", d, nd);
  const int64_t global_block = spec.global_shape[d] / spec.chunks;
  const int64_t piece = global_block / spec.size;
  MG_ASSERT(piece * spec.size * spec.chunks == spec.global_shape[d], "dimension {} of size {} does not split into {} x {}",
            d, spec.global_shape[d], spec.chunks, spec.size);
  std::vector<ShardBox> boxes;
  for (int c = 0; c < spec.chunks; ++c) {
    ShardBox b{zeros, zeros, std::vector<int64_t>(local.begin(), local.end())};
    b.global_offset[d] = c * global_block + spec.rank * piece;
    b.local_offset[d] = c * piece;
    b.shape[d] = piece;
    boxes.push_back(std::move(b));
  }
  return boxes;
}

std::vector<FlatRun> flat_runs(const ShardBox& box, const Shape& global_shape, const Shape& local_shape) {
  const size_t nd = global_shape.size();
  std::vector<FlatRun> runs;
  if (nd == 0) return {FlatRun{0, 0, 1}};
  std::vector<int64_t> gstride(nd, 1), lstride(nd, 1);
  for (size_t d = nd - 1; d-- > 0;) {
    gstride[d] = gstride[d + 1] * global_shape[d + 1];
    lstride[d] = lstride[d + 1] * local_shape[d + 1];
  }
  int64_t rows = 1;
  for (size_t d = 0; d + 1 < nd; ++d) rows *= box.shape[d];
  const int64_t len = box.shape[nd - 1];
  if (len == 0 || rows == 0) return runs;
  std::vector<int64_t> idx(nd, 0);  // row index within the box (last dim unused)
  for (int64_t r = 0; r < rows; ++r) {
    int64_t g = 0, l = 0;
    for (size_t d = 0; d < nd; ++d) {
      g += (box.global_offset[d] + idx[d]) * gstride[d];
      l += (box.local_offset[d] + idx[d]) * lstride[d];
    }
    if (!runs.empty() && runs.back().global_start + runs.back().count == g &&
        runs.back().local_start + runs.back().count == l) {
      runs.back().count += len;
    } else {
      runs.push_back(FlatRun{g, l, len});
    }
    for (size_t d = nd - 1; d-- > 0;) {  // next row
      if (++idx[d] < box.shape[d]) break;
      idx[d] = 0;
    }
  }
  return runs;
}

}  // namespace megatron

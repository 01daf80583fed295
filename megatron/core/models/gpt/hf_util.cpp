// The tensor helpers hf_util.h declares (rows, transposes, the grouped QKV layout, the shape-checked
// HF reader, Megatron's layer names, config.json's floats) and RowParts (hf_mapping.h), the piecewise
// tensor every HF mapping hands on.
#include "megatron/core/models/gpt/hf_util.h"

#include <fmt/format.h>

#include <algorithm>
#include <string>

namespace megatron {

namespace hf_detail {

// ---- small host helpers on row-major matrices --------------------------------------------------
Tensor as_fp32(const Tensor& t) {
  Tensor h = host(t);
  return h.dtype() == DType::Float32 ? h : h.to(DType::Float32);
}

Tensor host(const Tensor& t) { return t.device().is_host() ? t : t.to(Device::cpu()); }

Tensor transpose2d(const Tensor& t) { return transposed(t).materialize(); }

// Concatenates along dim 0.
Tensor concat_rows(const std::vector<Tensor>& parts) { return RowParts(parts).materialize(); }

// q [nq·d, ...], k/v [ng·d, ...] -> grouped [ng·(nq/ng+2)·d, ...] (per group: its q heads, k, v).
Tensor merge_qkv(const Tensor& q, const Tensor& k, const Tensor& v, int64_t nq, int64_t ng, int64_t d) {
  return merge_qkv_rows(q, k, v, nq, ng, d).materialize();
}

std::vector<int64_t> merged_qkv_order(int64_t nq, int64_t ng, int64_t d) {
  const int64_t per = nq / ng;
  std::vector<int64_t> order;
  for (int64_t g = 0; g < ng; ++g) {
    for (int64_t r = g * per * d; r < (g + 1) * per * d; ++r) order.push_back(r);
    for (int64_t r = g * d; r < (g + 1) * d; ++r) order.push_back(nq * d + r);
    for (int64_t r = g * d; r < (g + 1) * d; ++r) order.push_back((nq + ng) * d + r);
  }
  return order;
}

void split_qkv_order(int64_t nq, int64_t ng, int64_t d, std::vector<int64_t>& q, std::vector<int64_t>& k,
                     std::vector<int64_t>& v) {
  const std::vector<int64_t> merged = merged_qkv_order(nq, ng, d);
  std::vector<int64_t> stacked(merged.size());  // row i of [q; k; v] is row stacked[i] of the grouped QKV
  for (size_t r = 0; r < merged.size(); ++r) stacked[size_t(merged[r])] = int64_t(r);
  q.assign(stacked.begin(), stacked.begin() + nq * d);
  k.assign(stacked.begin() + nq * d, stacked.begin() + (nq + ng) * d);
  v.assign(stacked.begin() + (nq + ng) * d, stacked.end());
}

// The inverse of merge_qkv.
void split_qkv(const Tensor& qkv, int64_t nq, int64_t ng, int64_t d, Tensor& q, Tensor& k, Tensor& v) {
  std::vector<int64_t> qs, ks, vs;
  split_qkv_order(nq, ng, d, qs, ks, vs);
  q = rows_of(qkv, qs).materialize(), k = rows_of(qkv, ks).materialize(), v = rows_of(qkv, vs).materialize();
}

RowParts rows_of(const Tensor& t, const std::vector<int64_t>& order) {
  Tensor src = host(t);
  std::vector<Tensor> parts;
  for (size_t i = 0; i < order.size();) {
    size_t j = i + 1;
    while (j < order.size() && order[j] == order[j - 1] + 1) ++j;  // a run of consecutive rows is one view
    parts.push_back(src.slice(order[i], order[j - 1] + 1));
    i = j;
  }
  MG_ASSERT(!parts.empty(), "rows_of without rows");
  return RowParts(std::move(parts));
}

namespace {
// dst[a][b] = src[rows[b]][cols[a]] for a in [a0, a1), b over rows, elements of type T.
template <typename T>
void gather_transposed(const T* src, int64_t src_cols, const std::vector<int64_t>& rows,
                       const std::vector<int64_t>& cols, int64_t a0, int64_t a1, T* dst) {
  const int64_t n = int64_t(rows.size());
  for (int64_t b = 0; b < n; ++b) {
    const T* row = src + rows[size_t(b)] * src_cols;
    for (int64_t a = a0; a < a1; ++a) dst[(a - a0) * n + b] = row[cols[size_t(a)]];
  }
}
}  // namespace

RowParts transposed(const Tensor& t, std::vector<int64_t> rows, std::vector<int64_t> cols) {
  Tensor src = host(t);
  MG_ASSERT(src.dim() == 2, "transposed() of a {}-d tensor", src.dim());
  if (rows.empty())
    for (int64_t r = 0; r < src.size(0); ++r) rows.push_back(r);
  if (cols.empty())
    for (int64_t c = 0; c < src.size(1); ++c) cols.push_back(c);
  const int64_t out_rows = int64_t(cols.size()), out_cols = int64_t(rows.size()), src_cols = src.size(1);
  const size_t es = size_of(src.dtype());
  // Note [Streaming conversion]: blocks of about 4 MiB, so a transpose costs its source alone.
  const int64_t block = std::max<int64_t>(1, (int64_t(4) << 20) / std::max<int64_t>(1, out_cols * int64_t(es)));
  auto make = [src, rows = std::move(rows), cols = std::move(cols), src_cols](int64_t a0, int64_t a1) {
    Tensor out = Tensor::empty({a1 - a0, int64_t(rows.size())}, src.dtype());
    switch (size_of(src.dtype())) {
      case 1:
        gather_transposed(static_cast<const uint8_t*>(src.raw_data()), src_cols, rows, cols, a0, a1,
                          static_cast<uint8_t*>(out.raw_data()));
        break;
      case 2:
        gather_transposed(static_cast<const uint16_t*>(src.raw_data()), src_cols, rows, cols, a0, a1,
                          static_cast<uint16_t*>(out.raw_data()));
        break;
      case 4:
        gather_transposed(static_cast<const uint32_t*>(src.raw_data()), src_cols, rows, cols, a0, a1,
                          static_cast<uint32_t*>(out.raw_data()));
        break;
      default:
        MG_ASSERT(size_of(src.dtype()) == 8, "transposed() of {}", to_string(src.dtype()));
        gather_transposed(static_cast<const uint64_t*>(src.raw_data()), src_cols, rows, cols, a0, a1,
                          static_cast<uint64_t*>(out.raw_data()));
    }
    return out;
  };
  return RowParts(RowParts::Blocks{{out_rows, out_cols}, src.dtype(), block, std::move(make)});
}

// Pads the rows of a [V, h] table to `rows` with zeros, or strips it back.
Tensor resize_rows(const Tensor& t, int64_t rows) { return pad_rows(t, rows).materialize(); }

RowParts merge_qkv_rows(const Tensor& q, const Tensor& k, const Tensor& v, int64_t nq, int64_t ng, int64_t d) {
  const int64_t per = nq / ng;
  std::vector<Tensor> parts;
  for (int64_t g = 0; g < ng; ++g) {
    parts.push_back(q.slice(g * per * d, (g + 1) * per * d));
    parts.push_back(k.slice(g * d, (g + 1) * d));
    parts.push_back(v.slice(g * d, (g + 1) * d));
  }
  return RowParts(std::move(parts));
}

RowParts pad_rows(const Tensor& t, int64_t rows) {
  Tensor src = host(t);
  if (src.size(0) >= rows) return RowParts(src.slice(0, rows));
  return RowParts({src}, rows - src.size(0));
}

Tensor HFReader::operator()(const std::string& name, const Shape& expected) const {
  Tensor t = get(name);
  MG_CHECK(is_floating(t.dtype()), "HF tensor '{}' has dtype {}, expected a floating-point type", name,
           to_string(t.dtype()));
  MG_CHECK(t.shape() == expected,
           "HF tensor '{}' has shape {}, but the config needs {}: the weights do not belong to this config.json", name,
           shape_str(t.shape()), shape_str(expected));
  return host(t);
}

std::string layer(int i, const char* rest) { return fmt::format("decoder.layers.{}.{}", i, rest); }

double shortest(float x) { return std::stod(fmt::format("{}", x)); }

}  // namespace hf_detail

// ---- RowParts (hf_mapping.h) ---------------------------------------------------------------------
Shape RowParts::shape() const {
  if (blocks) return blocks->shape;
  MG_ASSERT(!parts.empty(), "RowParts without parts");
  Shape shape = parts[0].shape();
  if (shape.empty()) return shape;
  shape[0] = zero_rows;
  for (const Tensor& p : parts) shape[0] += p.size(0);
  return shape;
}

DType RowParts::dtype() const {
  if (blocks) return blocks->dtype;
  DType d = parts.at(0).dtype();
  for (const Tensor& p : parts)
    if (p.dtype() != d) d = DType::Float32;  // mixed pieces: fp32 holds each exactly
  return d;
}

size_t RowParts::count() const {
  if (!blocks) return parts.size();
  return size_t((blocks->shape[0] + blocks->block_rows - 1) / blocks->block_rows);
}

Tensor RowParts::piece(size_t k) const {
  if (!blocks) return parts.at(k);
  const int64_t begin = int64_t(k) * blocks->block_rows;
  return blocks->make(begin, std::min(blocks->shape[0], begin + blocks->block_rows));
}

Tensor RowParts::materialize() const {
  if (!blocks && parts.size() == 1 && zero_rows == 0) return hf_detail::as_fp32(parts[0]);
  Tensor out = Tensor::zeros(shape(), DType::Float32);
  int64_t row = 0;
  for (size_t k = 0; k < count(); ++k) {
    const Tensor p = piece(k);
    if (p.numel() == 0) continue;
    out.slice(row, row + p.size(0)).copy_from(p);
    row += p.size(0);
  }
  return out;
}

}  // namespace megatron

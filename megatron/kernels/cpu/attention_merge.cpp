// Context-parallel attention's helpers, CPU reference: merging partial attention results over key
// blocks (Note [Merging attention over key blocks] in kernels/op_list.inc) and row copies.
#include <cmath>
#include <cstring>
#include <limits>

#include "megatron/kernels/cpu/cpu_common.h"
#include "megatron/kernels/cpu/cpu_ops.h"

namespace megatron::cpu {

namespace {
// [b, nq, R] fp32 on the host, with R >= row_offset + rows.
void check_lse_rows(const Tensor& t, int64_t b, int64_t nq, int64_t row_offset, int64_t rows, const char* name) {
  assert_fp32(t, name);
  MG_ASSERT(t.dim() == 3 && t.size(0) == b && t.size(1) == nq && row_offset >= 0 && row_offset + rows <= t.size(2),
            "{} {}: rows [{}, {}) of [{}, {}, *]", name, t.str(), row_offset, row_offset + rows, b, nq);
}
}  // namespace

void attention_merge(Context& ctx, const Tensor& out_blk, const Tensor& lse_blk, int64_t row_offset, Tensor& out_acc,
                     Tensor& lse_acc) {
  (void)ctx;
  MG_ASSERT(out_blk.dim() == 4 && out_acc.dim() == 4, "attention_merge: out_blk {} and out_acc {} are [s, b, nq, d]",
            out_blk.str(), out_acc.str());
  const int64_t r = out_blk.size(0), b = out_blk.size(1), nq = out_blk.size(2), d = out_blk.size(3);
  const int64_t R = out_acc.size(0);
  MG_ASSERT(out_acc.size(1) == b && out_acc.size(2) == nq && out_acc.size(3) == d && out_acc.dtype() == out_blk.dtype(),
            "attention_merge: out_acc {} for out_blk {}", out_acc.str(), out_blk.str());
  MG_ASSERT(row_offset >= 0 && row_offset + r <= R, "attention_merge: rows [{}, {}) of {}", row_offset, row_offset + r,
            R);
  check_lse_rows(lse_blk, b, nq, 0, r, "lse_blk");
  MG_ASSERT(lse_blk.size(2) == r, "lse_blk {} for {} rows", lse_blk.str(), r);
  check_lse_rows(lse_acc, b, nq, row_offset, r, "lse_acc");
  MG_ASSERT(lse_acc.size(2) == R, "lse_acc {} for {} rows", lse_acc.str(), R);
  FloatIn ob(out_blk);
  FloatOut oa(out_acc, /*load=*/true);
  const float* lb = lse_blk.data<float>();
  float* la = lse_acc.data<float>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t h = 0; h < nq; ++h)
      for (int64_t i = 0; i < r; ++i) {
        const float l1 = la[(bi * nq + h) * R + row_offset + i], l2 = lb[(bi * nq + h) * r + i];
        if (l2 == neg_inf) continue;  // the block gives this row nothing
        const float m = std::max(l1, l2);
        const float lse = m + std::log(std::exp(l1 - m) + std::exp(l2 - m));
        const float w1 = std::exp(l1 - lse), w2 = std::exp(l2 - lse);  // l1 = -inf: w1 = 0
        float* acc = oa.data() + (((row_offset + i) * b + bi) * nq + h) * d;
        const float* blk = ob.data() + ((i * b + bi) * nq + h) * d;
        for (int64_t e = 0; e < d; ++e) acc[e] = w1 * acc[e] + w2 * blk[e];
        la[(bi * nq + h) * R + row_offset + i] = lse;
      }
}

void lse_copy_rows(Context& ctx, const Tensor& src, int64_t src_row, Tensor& dst, int64_t dst_row, int64_t rows) {
  (void)ctx;
  MG_ASSERT(src.dim() == 3 && dst.dim() == 3, "lse_copy_rows: src {} and dst {} are [b, nq, *]", src.str(), dst.str());
  const int64_t b = src.size(0), nq = src.size(1);
  check_lse_rows(src, b, nq, src_row, rows, "src");
  check_lse_rows(dst, b, nq, dst_row, rows, "dst");
  const int64_t S = src.size(2), D = dst.size(2);
  const float* s = src.data<float>();
  float* t = dst.data<float>();
  for (int64_t row = 0; row < b * nq; ++row)
    std::memmove(t + row * D + dst_row, s + row * S + src_row, size_t(rows) * sizeof(float));
}

void copy_rows(Context& ctx, const Tensor& src, int64_t src_row, Tensor& dst, int64_t dst_row, int64_t rows) {
  (void)ctx;
  MG_ASSERT(src.defined() && dst.defined() && src.dim() >= 1 && dst.dim() >= 1 && src.dtype() == dst.dtype(),
            "copy_rows: src {} and dst {}", src.defined() ? src.str() : "undefined", dst.defined() ? dst.str() : "undefined");
  MG_ASSERT(src.device().is_host() && dst.device().is_host(), "copy_rows on the CPU needs host tensors");
  const int64_t row_elems = src.size(0) == 0 ? 0 : src.numel() / src.size(0);
  MG_ASSERT(dst.size(0) == 0 || dst.numel() / dst.size(0) == row_elems, "copy_rows: rows of {} and {} differ",
            src.str(), dst.str());
  MG_ASSERT(src_row >= 0 && dst_row >= 0 && src_row + rows <= src.size(0) && dst_row + rows <= dst.size(0),
            "copy_rows: rows [{}, +{}) of {} into [{}, +{}) of {}", src_row, rows, src.str(), dst_row, rows, dst.str());
  const size_t row_bytes = size_t(row_elems) * size_of(src.dtype());
  std::memmove(static_cast<char*>(dst.raw_data()) + size_t(dst_row) * row_bytes,
               static_cast<const char*>(src.raw_data()) + size_t(src_row) * row_bytes, size_t(rows) * row_bytes);
}

}  // namespace megatron::cpu

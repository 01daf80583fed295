// Layout changes, CPU reference: transpose of the two leading dimensions.
//
// x [a, b, rest...] -> out [b, a, rest...] for any dtype: each (i, j) block of prod(rest) elements
// is one memcpy, so no conversion happens (used for batch-first <-> sequence-first).
#include <cstring>
#include <utility>

#include "megatron/kernels/cpu/cpu_common.h"
#include "megatron/kernels/cpu/cpu_ops.h"

namespace megatron::cpu {

void transpose_01(Context& ctx, const Tensor& x, Tensor& out) {
  MG_ASSERT(x.defined() && out.defined() && x.dim() >= 2, "transpose_01 needs x [a, b, ...], got {}",
            x.defined() ? x.str() : "undefined");
  MG_ASSERT(x.device().is_host() && out.device().is_host(), "transpose_01 on the CPU needs host tensors");
  Shape want = x.shape();
  std::swap(want[0], want[1]);
  MG_ASSERT(out.shape() == want && out.dtype() == x.dtype(), "out is {}, expected {} {}", out.str(),
            to_string(x.dtype()), shape_str(want));
  MG_ASSERT(out.raw_data() != x.raw_data() || x.numel() == 0, "transpose_01 cannot run in place");
  const int64_t a = x.size(0), b = x.size(1);
  const size_t block = a * b == 0 ? 0 : x.nbytes() / size_t(a * b);
  const char* src = static_cast<const char*>(x.raw_data());
  char* dst = static_cast<char*>(out.raw_data());
  for (int64_t i = 0; i < a; ++i)
    for (int64_t j = 0; j < b; ++j)
      std::memcpy(dst + size_t(j * a + i) * block, src + size_t(i * b + j) * block, block);
}

}  // namespace megatron::cpu

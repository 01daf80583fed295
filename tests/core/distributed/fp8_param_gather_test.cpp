// --fp8-param-gather on thread-ranks (Note [FP8 parameters]): two FP8 linear layers and a bf16
// norm weight under DistributedDataParallel and the distributed optimizer, stepped with synthetic
// gradients (--fp8-cpu-reference's ops: the FP8 ops' CPU reference).
//   - after every step the FP8 bytes of each weight are the quantisation of its fp32 master,
//     computed here on its own: the scale from the whole master's amax (tensorwise) or from the
//     previous master's (delayed, history length 1), x·scale rounded by the runtime's encoder;
//     scale_inv = 1/scale on every rank; blockwise (wider weights, tiles cut by the shards):
//     fp8_block_quantize's bytes of the whole master and its tiles' scale inverses;
//   - data parallelism 2 gives data parallelism 1's bytes and masters bit for bit (every rank has
//     the same gradient, so the reduced mean is it exactly);
//   - the FP8 weights' buffer — what the all-gather moves — is half the bytes of the bf16 buffer the
//     same weights get without the flag, bucket by bucket;
//   - an expert's FP8 weight gets an FP8 buffer of the expert-data-parallel group;
//   - the FP8 weights need the distributed optimizer (one line).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <map>

#include "megatron/core/distributed/distributed_data_parallel.h"
#include "megatron/core/fp8_utils.h"
#include "megatron/core/optimizer/optimizer.h"
#include "megatron/core/tensor_parallel/fp8_linear.h"
#include "megatron/core/tensor_parallel/layers.h"
#include "megatron/runtime/philox.h"
#include "tests/core/thread_ranks.h"
#include "tests/test_util.h"

namespace megatron {
namespace {

using testing::run_thread_ranks;

Fp8Config fp8_config(Fp8Recipe recipe, bool param_gather) {
  Fp8Config c;
  c.format = "hybrid";
  c.recipe = recipe;
  c.param_gather = param_gather;
  return c;
}

DDPConfig ddp_config(int64_t bucket_size) {
  DDPConfig c;
  c.use_distributed_optimizer = true;
  c.bucket_size = bucket_size;
  return c;
}

OptimizerConfig adam_config() {
  OptimizerConfig c;
  c.lr = 1e-2;
  c.weight_decay = 0.1;
  c.adam_beta2 = 0.95;
  c.bf16 = true;
  return c;
}

// Two FP8 layers (their weights 48x32 and 16x48, or wider ones: `wide` gives 272x160 and 144x272,
// several 128x128 tiles with partial ones at the edges) and a bf16 norm weight, in bf16.
struct Model {
  ParamAndGradBuffer buf{DType::BFloat16, Device::cpu()};
  Linear fc1, fc2;
  Parameter* norm;
  Model(const Fp8Config& fp8, const DDPConfig& cfg, int dp, bool wide = false)
      : fc1(buf, "fc1", wide ? 160 : 32, wide ? 272 : 48, false, ParamInit::Normal),
        fc2(buf, "fc2", wide ? 272 : 48, wide ? 144 : 16, false, ParamInit::ScaledNormal) {
    norm = buf.add("norm.weight", {16}, true, ParamInit::Ones);
    fc1.enable_fp8(fp8, Device::cpu());
    fc2.enable_fp8(fp8, Device::cpu());
    buf.allocate(cfg, dp);
    buf.init_weights(1234, 0.02f, 2, false);
  }
  std::vector<Linear*> linears() { return {&fc1, &fc2}; }
};

// The same gradient on every rank: the data-parallel mean is it exactly.
void set_grads(ParamAndGradBuffer& buf, int step) {
  for (Parameter* p : buf.parameters()) {
    std::vector<float> g(size_t(p->main_grad.numel()));
    for (size_t i = 0; i < g.size(); ++i) g[i] = 0.05f * philox_normal(uint64_t(step), std::hash<std::string>{}(p->name), i);
    p->main_grad.copy_from(Tensor::from_floats(g, p->main_grad.shape()));
  }
}

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const Tensor h = t.to(Device::cpu());
  std::vector<uint8_t> out(h.nbytes());
  std::memcpy(out.data(), h.raw_data(), out.size());
  return out;
}

float amax_of(const std::vector<float>& v) {
  float a = 0.0f;
  for (float x : v) a = std::max(a, std::fabs(x));
  return a;
}

// The e4m3 bytes of master · scale, by the runtime's encoder.
std::vector<uint8_t> quantised(const std::vector<float>& master, float scale) {
  std::vector<uint8_t> out;
  for (float x : master) out.push_back(to_fp8_e4m3(x * scale).bits);
  return out;
}

struct Result {
  std::map<std::string, std::vector<uint8_t>> bytes;
  std::map<std::string, std::vector<float>> masters;
};

// The blockwise recipe's FP8 weight from the whole master: fp8_block_quantize with 128x128 tiles
// and power-of-two scales (the CPU reference), its bytes and its tiles' scale inverses.
std::pair<std::vector<uint8_t>, std::vector<float>> block_quantised(Context& ctx, const std::vector<float>& master,
                                                                    const Shape& shape) {
  Tensor q = Tensor::empty(shape, DType::Float8E4M3);
  Tensor si = Tensor::empty(fp8_block_scale_shape(shape[0], shape[1], true), DType::Float32);
  ops::fp8_block_quantize(ctx, Tensor::from_floats(master, shape), true, true, q, si);
  return {bytes_of(q), si.to_floats()};
}

// Trains `steps` steps with data parallelism `dp`; checks every step's FP8 weights against the
// masters and returns the last step's. Blockwise runs the wide model, with buckets that cut both
// weights' tiles across the shards.
Result train(Fp8Recipe recipe, int dp, int steps) {
  Result result;
  const bool blockwise = recipe == Fp8Recipe::Blockwise;
  run_thread_ranks(dp, [&](ParallelState& ps) {
    Context ctx;
    const DDPConfig cfg = ddp_config(blockwise ? 30000 : 700);  // 700: fc2's weight in a bucket of its own, fc1's cut by the shards
    Model m(fp8_config(recipe, true), cfg, dp, blockwise);
    DistributedDataParallel ddp(ps, {&m.buf}, cfg);
    AdamOptimizer opt(ddp.parameters(), adam_config(), ddp);
    ASSERT_TRUE(opt.has_fp8_params());
    opt.copy_main_params_to_model_params(ctx);  // the first FP8 values, from the initial masters
    std::map<std::string, float> previous_amax;  // delayed: the amax the last quantisation recorded
    for (Linear* l : m.linears()) {
      const Parameter& w = *l->weight();
      EXPECT_EQ(w.data.dtype(), DType::Float8E4M3) << w.name;
      previous_amax[w.name] = amax_of(opt.gather_state(ctx, w.name).master.to_floats());
      if (blockwise) {  // a tile lies across the two ranks' shards
        const ParamShard first = ddp.shard(w.name, 0);
        const int64_t end = first.start + first.count, cols = w.data.size(1);
        if (dp == 2) EXPECT_TRUE(end < w.data.numel() && ((end / cols) % 128 != 0 || end % cols != 0)) << w.name;
      }
    }
    EXPECT_EQ(m.norm->data.dtype(), DType::BFloat16);
    for (int step = 0; step < steps; ++step) {
      ddp.zero_grad(ctx);
      set_grads(m.buf, step);
      finalize_model_grads(ctx, ddp);
      for (Linear* l : m.linears()) {  // the model's step (GPTModel::finish_fp8_step)
        if (recipe != Fp8Recipe::Delayed) continue;
        Tensor h = l->fp8()->forward_scaling().mutable_amax_history();
        ps.data_context().all_reduce(ctx, h, ReduceOp::Max)->wait();
        l->fp8()->update(ctx);
      }
      ASSERT_TRUE(opt.step(ctx).update_successful);
      ddp.finish_param_sync(ctx);
      for (Linear* l : m.linears()) {
        const Parameter& w = *l->weight();
        const std::vector<float> master = opt.gather_state(ctx, w.name).master.to_floats();
        const std::string what = fmt::format("{} step {} rank {}", w.name, step, ps.dp_rank());
        if (ps.dp_rank() == 0 && step + 1 == steps) {
          result.bytes[w.name] = bytes_of(w.data);
          result.masters[w.name] = master;
        }
        if (blockwise) {
          const auto [bytes, scale_inv] = block_quantised(ctx, master, w.data.shape());
          EXPECT_EQ(bytes_of(w.data), bytes) << what;
          const Fp8Param& p = *l->fp8()->param();
          const std::vector<float> grid = p.block_scale_inv.to_floats();
          const int64_t ld = p.block_scale_inv.size(1), tiles_c = (w.data.size(1) + 127) / 128;
          const int64_t want_ld = int64_t(scale_inv.size()) / ((w.data.size(0) + 127) / 128);
          for (int64_t i = 0; i < (w.data.size(0) + 127) / 128; ++i)
            for (int64_t j = 0; j < tiles_c; ++j)
              EXPECT_EQ(grid[size_t(i * ld + j)], scale_inv[size_t(i * want_ld + j)]) << what << " tile " << i << "," << j;
          continue;
        }
        const float amax = amax_of(master);
        const float scale = 448.0f / (recipe == Fp8Recipe::Tensorwise ? amax : previous_amax[w.name]);
        previous_amax[w.name] = amax;
        EXPECT_EQ(bytes_of(w.data), quantised(master, scale)) << what;
        EXPECT_EQ(l->fp8()->forward_scaling().scale_inv(1).to_floats()[0], 1.0f / scale) << what;
      }
    }
  });
  return result;
}

TEST(Fp8ParamGather, Fp8WeightsAreTheQuantisedMastersAndDp2IsDp1) {
  for (Fp8Recipe recipe : {Fp8Recipe::Delayed, Fp8Recipe::Tensorwise, Fp8Recipe::Blockwise}) {
    SCOPED_TRACE(to_string(recipe));
    const Result one = train(recipe, 1, 3);
    const Result two = train(recipe, 2, 3);
    ASSERT_EQ(one.bytes.size(), 2u);
    EXPECT_EQ(two.bytes, one.bytes);
    EXPECT_EQ(two.masters, one.masters);
  }
}

// The FP8 weights' buffer against the bf16 one the same weights get without the flag: half the
// bytes in every bucket (the all-gather moves each bucket's bytes), the same layout in elements.
TEST(Fp8ParamGather, WeightBufferAndAllGatherAreHalfOfBf16) {
  const int dp = 2;
  run_thread_ranks(dp, [&](ParallelState& ps) {
    const DDPConfig cfg = ddp_config(700);
    Model fp8(fp8_config(Fp8Recipe::Delayed, true), cfg, dp);
    DistributedDataParallel ddp(ps, {&fp8.buf}, cfg);
    // the reference: bf16 weights of the same shapes, laid out alone
    std::vector<Parameter> plain(2);
    std::vector<Parameter*> plain_ptrs;
    for (size_t i = 0; i < 2; ++i) {
      const Parameter& w = *fp8.linears()[i]->weight();
      plain[i].name = w.name;
      plain[i].data = Tensor::zeros(w.data.shape(), DType::BFloat16);
      plain[i].main_grad = Tensor::zeros(w.data.shape(), DType::Float32);
      plain_ptrs.push_back(&plain[i]);
    }
    ParamAndGradBuffer bf16(DType::BFloat16, Device::cpu(), plain_ptrs, cfg, dp);
    ASSERT_EQ(ddp.num_buffers(), 2);  // the bf16 norm weight, the FP8 weights
    const ParamAndGradBuffer& weights = ddp.buffer(1);
    ASSERT_EQ(weights.param_buffer().dtype(), DType::Float8E4M3);
    EXPECT_EQ(ddp.buffer(0).param_buffer().dtype(), DType::BFloat16);
    EXPECT_EQ(weights.param_buffer().numel(), bf16.param_buffer().numel());
    EXPECT_EQ(2 * weights.param_buffer().nbytes(), bf16.param_buffer().nbytes());
    EXPECT_EQ(weights.param_buffer().nbytes(), size_t(weights.param_buffer().numel()));
    ASSERT_EQ(weights.buckets().size(), bf16.buckets().size());
    ASSERT_GE(weights.buckets().size(), 2u);
    for (size_t b = 0; b < weights.buckets().size(); ++b)
      EXPECT_EQ(2 * weights.buckets()[b].param_data.nbytes(), bf16.buckets()[b].param_data.nbytes()) << "bucket " << b;
    for (Linear* l : fp8.linears()) {
      EXPECT_EQ(l->weight()->data.nbytes(), size_t(l->weight()->data.numel())) << l->weight()->name;
      EXPECT_EQ(l->weight()->main_grad.dtype(), DType::Float32);
    }
  });
}

// An expert's FP8 weight (reduce group ExpertData, as SequentialMLP marks its weights) gets an FP8
// buffer of the expert-data-parallel group beside the dense one, and is quantised from its masters
// with its amax reduced over that group: after a step its bytes are its master's quantisation
// (tensorwise: the whole master's amax) on both ranks.
TEST(Fp8ParamGather, ExpertWeightsGetAnFp8BufferOfTheirGroup) {
  run_thread_ranks(2, [&](ParallelState& ps) {
    Context ctx;
    const DDPConfig cfg = ddp_config(700);
    Model m(fp8_config(Fp8Recipe::Tensorwise, true), cfg, 2);
    m.buf.find("fc2.weight")->reduce_group = GradReduceGroup::ExpertData;
    DistributedDataParallel ddp(ps, {&m.buf}, cfg);
    ASSERT_EQ(ddp.num_buffers(), 3);  // bf16 norm, FP8 fc1 (data parallel), FP8 fc2 (expert data parallel)
    EXPECT_EQ(ddp.buffer(0).param_buffer().dtype(), DType::BFloat16);
    EXPECT_EQ(ddp.buffer(1).param_buffer().dtype(), DType::Float8E4M3);
    EXPECT_EQ(ddp.buffer_group(1), GradReduceGroup::DataContext);
    EXPECT_EQ(ddp.buffer(2).param_buffer().dtype(), DType::Float8E4M3);
    EXPECT_EQ(ddp.buffer_group(2), GradReduceGroup::ExpertData);
    AdamOptimizer opt(ddp.parameters(), adam_config(), ddp);
    opt.copy_main_params_to_model_params(ctx);
    ddp.zero_grad(ctx);
    set_grads(m.buf, 0);
    finalize_model_grads(ctx, ddp);
    ASSERT_TRUE(opt.step(ctx).update_successful);
    ddp.finish_param_sync(ctx);
    const Parameter& w = *m.fc2.weight();
    const std::vector<float> master = opt.gather_state(ctx, w.name).master.to_floats();
    const float scale = 448.0f / amax_of(master);
    EXPECT_EQ(bytes_of(w.data), quantised(master, scale)) << "rank " << ps.dp_rank();
    EXPECT_EQ(m.fc2.fp8()->forward_scaling().scale_inv(1).to_floats()[0], 1.0f / scale);
  });
}

TEST(Fp8ParamGather, NeedsTheDistributedOptimizer) {
  run_thread_ranks(1, [&](ParallelState& ps) {
    DDPConfig cfg;
    Model m(fp8_config(Fp8Recipe::Tensorwise, true), cfg, 1);
    EXPECT_EQ(testing::error_of([&] { DistributedDataParallel ddp(ps, {&m.buf}, cfg); }),
              "--fp8-param-gather only works with the distributed optimizer: add --use-distributed-optimizer");
  });
}

}  // namespace
}  // namespace megatron

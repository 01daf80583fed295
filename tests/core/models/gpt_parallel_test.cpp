// Every parallel layout of a GPTModel gives the single-process training run, in one process: the
// ranks are threads over a local communicator (make_local_group), each with its own Context,
// ParallelState, model chunks, DistributedDataParallel and AdamOptimizer, driven exactly as
// pretrain() drives them (forward_backward, finalize_model_grads, step). Losses and grad norms of
// every step and the final weights (assembled from the shards) are compared at 1e-6 (fp32). The
// same comparison runs end to end under mpirun in tests/core/parallel.
//
// Note [Comparing weights across layouts]: a layout changes the order of fp32 sums (partial GEMMs
// reduced over tensor-parallel ranks, gradients over data-parallel ranks, the norm over stages), so
// the gradients differ by rounding. Adam divides each by its own magnitude, so where a gradient is
// itself tiny — a small-norm tensor such as a bias that started at zero — the relative difference
// of the weight is larger than elsewhere. Adam's eps is 1e-4 here (see run_rank) so that no update
// divides pure rounding noise by itself; then the model as a whole agrees within 1e-6 of its norm
// and every tensor within 1e-5 of its own (the biases of row-parallel layers come closest, ~3e-6).
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <mutex>
#include <thread>

#include "megatron/core/comm/communicator.h"
#include "megatron/core/distributed/distributed_data_parallel.h"
#include "megatron/core/models/gpt/gpt_model.h"
#include "megatron/core/optimizer/optimizer.h"
#include "megatron/core/pipeline_parallel/schedules.h"
#include "megatron/runtime/philox.h"
#include "tests/core/model_test_util.h"

namespace megatron {
namespace {

constexpr int64_t kSeq = 16, kMicroBatch = 2, kGlobalBatch = 16, kVocab = 120;

TransformerConfig config(bool llama) {
  TransformerConfig c;
  c.num_layers = 8;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.vocab_size = kVocab;
  c.make_vocab_size_divisible_by = 32;  // 128 for TP 1, 2 and 4 alike
  c.max_position_embeddings = kSeq;
  c.hidden_dropout = 0.0f;
  c.attention_dropout = 0.0f;
  if (llama) {
    c.num_attention_heads = 8;
    c.num_query_groups = 4;  // GQA; TP 4 holds one group of two heads
    testing::use_llama_layers(c);
    c.ffn_hidden_size = 48;
  }
  return c;
}

// Sample i of step t: deterministic tokens; labels are the next tokens.
MicroBatch sample_batch(int64_t first_sample, int64_t count) {
  std::vector<int64_t> tokens, labels, positions;
  for (int64_t i = first_sample; i < first_sample + count; ++i) {
    for (int64_t j = 0; j <= kSeq; ++j) {
      const int64_t id = int64_t(philox_element(77, uint64_t(i), uint64_t(j)) % uint64_t(kVocab));
      if (j < kSeq) tokens.push_back(id), positions.push_back(j);
      if (j > 0) labels.push_back(id);
    }
  }
  MicroBatch b;
  b.tokens = Tensor::from_ints(tokens, {count, kSeq});
  b.labels = Tensor::from_ints(labels, {count, kSeq});
  b.position_ids = Tensor::from_ints(positions, {count, kSeq});
  std::vector<float> mask(size_t(count * kSeq), 1.0f);
  for (size_t k = 0; k < mask.size(); k += 5) mask[k] = 0.0f;  // some masked tokens
  b.loss_mask = Tensor::from_floats(mask, {count, kSeq});
  return b;
}

ForwardOutput forward_step(Context& ctx, const MicroBatch& b, const GPTModel& model, const Tensor& input,
                           GPTModel::Stash& stash) {
  const bool first = model.pre_process(), last = model.post_process();
  Tensor out = model.forward_step(ctx, first ? b.tokens : Tensor(), first ? b.position_ids : Tensor(),
                                  last ? b.labels : Tensor(), input, stash);
  return ForwardOutput{out, last ? b.loss_mask : Tensor()};
}

struct Layout {
  int tp = 1, pp = 1, dp = 1, vpp = 1;
  bool sp = false, distopt = false, overlap = false;
  int64_t bucket = 0;
  int first_stage_layers = 0, last_stage_layers = 0;  // uneven pipeline stages
};

struct Result {
  std::vector<double> losses, grad_norms;
  std::map<std::string, std::vector<float>> weights;  // full tensors
};

void run_rank(std::unique_ptr<Communicator> world, const Layout& l, bool llama, int steps, Result& result,
              std::mutex& mu) {
  ParallelConfig pc;
  pc.tensor_model_parallel_size = l.tp;
  pc.pipeline_model_parallel_size = l.pp;
  pc.virtual_pipeline_model_parallel_size = l.vpp;
  pc.sequence_parallel = l.sp;
  ParallelState ps(std::move(world), pc);
  Context ctx(Device::cpu(), 1234);
  TransformerConfig c = config(llama);
  c.tensor_model_parallel_size = l.tp;
  c.sequence_parallel = l.sp;
  c.pipeline_model_parallel_size = l.pp;
  c.virtual_pipeline_model_parallel_size = l.vpp;
  c.decoder_first_pipeline_num_layers = l.first_stage_layers;
  c.decoder_last_pipeline_num_layers = l.last_stage_layers;
  DDPConfig ddp_config;
  ddp_config.use_distributed_optimizer = l.distopt;
  ddp_config.overlap_grad_reduce = l.overlap;
  ddp_config.overlap_param_gather = l.overlap && l.distopt;
  if (l.bucket > 0) ddp_config.bucket_size = l.bucket;
  std::vector<std::unique_ptr<GPTModel>> chunks;
  std::vector<const ModelChunk*> chunk_ptrs;
  std::vector<ParamAndGradBuffer*> buffers;
  for (int v = 0; v < l.vpp; ++v) {
    chunks.push_back(std::make_unique<GPTModel>(c, Device::cpu(), &ps, v));
    chunks.back()->init_weights(1234);
    chunk_ptrs.push_back(chunks.back().get());
    buffers.push_back(&chunks.back()->params());
  }
  DistributedDataParallel ddp(ps, buffers, ddp_config);
  for (auto& m : chunks) {
    if (m->pre_process() && m->post_process() && c.share_embeddings_and_output_weights) {
      ddp.set_expected_accumulations(m->params().find("embedding.word_embeddings.weight"), 2);
    }
  }
  OptimizerConfig oc;
  oc.lr = 1e-3;
  oc.weight_decay = 0.1;
  oc.clip_grad = 0.5;  // clipping is active: the norm must be global
  // Note [Adam's undetermined elements] (tests/golden): where a gradient is rounding noise (the
  // key bias's is exactly zero in exact arithmetic), Adam's g/(|g| + eps) amplifies the noise of
  // any summation order to a step of up to lr. An eps well above that noise keeps every update a
  // smooth function of the gradient, so the layouts can be compared element for element.
  oc.adam_eps = 1e-4;
  AdamOptimizer optimizer(ddp.parameters(), oc, ddp);

  const int num_mb = int(kGlobalBatch / (kMicroBatch * ps.dp_size()));
  std::vector<double> losses, norms;
  for (int step = 0; step < steps; ++step) {
    // Megatron's sampler: microbatch j of dp rank r holds samples (j·dp + r)·mbs ...
    int j = 0;
    BatchIterator data = [&]() {
      const int64_t first = step * kGlobalBatch + (int64_t(j) * ps.dp_size() + ps.dp_rank()) * kMicroBatch;
      ++j;
      return sample_batch(first, kMicroBatch);
    };
    ddp.zero_grad(ctx);
    ddp.finish_param_sync(ctx);
    ForwardBackwardArgs a;
    a.num_microbatches = num_mb;
    a.micro_batch_size = kMicroBatch;
    a.seq_length = kSeq;
    LossSums sums = forward_backward(ctx, &ps, chunk_ptrs, typed_forward_step<GPTModel>(forward_step), data, a, &ddp);
    finalize_model_grads(ctx, ddp);
    OptimizerStepResult r = optimizer.step(ctx);
    losses.push_back(sums.num_tokens > 0 ? sums.loss_sum / sums.num_tokens : 0.0);
    norms.push_back(r.grad_norm.value_or(-1.0));
  }
  ddp.finish_param_sync(ctx);

  std::lock_guard<std::mutex> lock(mu);
  if (ps.rank() == ps.world_size() - 1) result.losses = losses, result.grad_norms = norms;
  if (ps.rank() == 0) result.grad_norms = norms;  // every rank agrees; checked below via the last rank too
  for (auto& m : chunks) {
    for (Parameter* p : m->params().parameters()) {
      if (p->shared_embedding_copy) continue;
      std::vector<float>& full = result.weights[p->name];
      if (full.empty()) full.assign(size_t(shape_numel(p->shard.global_shape)), NAN);
      const std::vector<float> local = p->data.to_floats();
      const Shape lshape = p->data.shape();
      for (const ShardBox& box : shard_boxes(p->shard)) {
        for (const FlatRun& run : flat_runs(box, p->shard.global_shape, lshape)) {
          for (int64_t k = 0; k < run.count; ++k) {
            float& dst = full[size_t(run.global_start + k)];
            const float v = local[size_t(run.local_start + k)];
            if (std::isnan(dst)) {
              dst = v;
            } else {
              EXPECT_EQ(dst, v) << p->name << " differs between the ranks holding it";
            }
          }
        }
      }
    }
  }
}

Result train(const Layout& l, bool llama, int steps = 5) {
  Result result;
  std::mutex mu;
  const int world = l.tp * l.pp * l.dp;
  auto comms = make_local_group(world);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r]() {
      try {
        run_rank(std::move(comms[size_t(r)]), l, llama, steps, result, mu);
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) EXPECT_TRUE(errors[size_t(r)].empty()) << "rank " << r << ": " << errors[size_t(r)];
  return result;
}

void expect_equal_runs(const Result& got, const Result& want) {
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t i = 0; i < want.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], want.losses[i], 1e-6 * std::abs(want.losses[i])) << "loss at step " << i;
    EXPECT_NEAR(got.grad_norms[i], want.grad_norms[i], 1e-6 * std::abs(want.grad_norms[i])) << "norm at step " << i;
  }
  // The weights: the whole model within 1e-6 of its norm, and every tensor within 1e-5 of its own
  // (Note [Comparing weights across layouts]).
  ASSERT_EQ(got.weights.size(), want.weights.size());
  double total_diff = 0, total_norm = 0;
  for (const auto& [name, w] : want.weights) {
    auto it = got.weights.find(name);
    ASSERT_NE(it, got.weights.end()) << name;
    const std::vector<float>& g = it->second;
    ASSERT_EQ(g.size(), w.size()) << name;
    double diff = 0, norm = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      ASSERT_FALSE(std::isnan(g[i])) << name << " element " << i << " held by no rank";
      diff += double(g[i] - w[i]) * double(g[i] - w[i]);
      norm += double(w[i]) * double(w[i]);
    }
    EXPECT_LE(std::sqrt(diff), 1e-5 * std::sqrt(norm)) << name;
    total_diff += diff;
    total_norm += norm;
  }
  EXPECT_LE(std::sqrt(total_diff), 1e-6 * std::sqrt(total_norm));
}

const Result& single(bool llama) {
  static const Result gpt = train(Layout{}, false), lla = train(Layout{}, true);
  return llama ? lla : gpt;
}

struct Case {
  std::string name;
  Layout layout;
  bool llama;
};

// TP ∈ {1, 2, 4} × PP ∈ {1, 2, 4} × DP ∈ {1, 2} (world <= 8), each plain and with every feature
// its layout allows: sequence parallelism (TP > 1), the distributed optimizer with overlapped
// gradient reduction, small buckets and overlapped parameter gathers (DP > 1), interleaving with 2
// virtual stages (PP > 1); GPT-2 and Llama styles; uneven first/last pipeline stages.
std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (bool llama : {false, true}) {
    for (int tp : {1, 2, 4}) {
      for (int pp : {1, 2, 4}) {
        for (int dp : {1, 2}) {
          if (tp * pp * dp > 8 || tp * pp * dp == 1) continue;
          const std::string base = std::string(llama ? "llama_" : "gpt_") + "tp" + std::to_string(tp) + "_pp" +
                                   std::to_string(pp) + "_dp" + std::to_string(dp);
          cases.push_back({base, Layout{tp, pp, dp}, llama});
          Layout all{tp, pp, dp};
          all.sp = tp > 1;
          all.distopt = all.overlap = dp > 1;
          all.bucket = dp > 1 ? 2500 : 0;
          all.vpp = pp > 1 ? 2 : 1;
          if (all.sp || all.distopt || all.vpp > 1) {
            cases.push_back({base + std::string(all.sp ? "_sp" : "") + (all.distopt ? "_distopt_overlap" : "") +
                                 (all.vpp > 1 ? "_vpp2" : ""),
                             all, llama});
          }
        }
      }
    }
  }
  Layout uneven{1, 4, 1};
  uneven.first_stage_layers = 1;
  uneven.last_stage_layers = 3;
  cases.push_back({"gpt_pp4_uneven_1_2_2_3", uneven, false});
  uneven.tp = 2;
  uneven.first_stage_layers = 3;
  uneven.last_stage_layers = 1;
  cases.push_back({"llama_tp2_pp4_uneven_3_2_2_1", uneven, true});
  return cases;
}

class GPTParallel : public ::testing::TestWithParam<Case> {};

TEST_P(GPTParallel, EqualsSingleProcess) {
  const Case& c = GetParam();
  expect_equal_runs(train(c.layout, c.llama), single(c.llama));
}

INSTANTIATE_TEST_SUITE_P(Layouts, GPTParallel, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

}  // namespace
}  // namespace megatron

#include "megatron/training/inference_model.h"

#include "megatron/runtime/check.h"
#include "megatron/training/checkpointing.h"
#include "megatron/training/training.h"

namespace megatron {

void check_inference_layout(const Arguments& args, const LaunchInfo& launch) {
  MG_CHECK(args.pipeline_model_parallel_size <= 1,
           "--pipeline-model-parallel-size {}: inference runs tensor parallelism only (every rank holds every "
           "layer); drop the flag: a checkpoint saved with any pipeline layout loads",
           args.pipeline_model_parallel_size);
  MG_CHECK(args.context_parallel_size <= 1,
           "--context-parallel-size {}: generation decodes one token per sequence a step, which context parallelism "
           "cannot split; drop the flag",
           args.context_parallel_size);
  MG_CHECK(args.expert_model_parallel_size <= 1,
           "--expert-model-parallel-size {}: there is no expert-parallel inference; drop the flag: a checkpoint "
           "saved with any expert layout loads",
           args.expert_model_parallel_size);
  const int tp = args.tensor_model_parallel_size;
  MG_CHECK(launch.world_size == tp,
           "--tensor-model-parallel-size {} runs on {} ranks and {} were launched: launch mpirun -np {} (one job "
           "per model replica)",
           tp, tp, launch.world_size, tp);
  if (tp > 1) {
    MG_CHECK(args.num_experts == 0,
             "--tensor-model-parallel-size {}: MoE layers under tensor parallelism need sequence parallelism, which "
             "inference does not run; run this model on one rank",
             tp);
    MG_CHECK(!args.multi_latent_attention,
             "--tensor-model-parallel-size {}: multi-latent attention's KV cache runs on one rank; run this model on "
             "one rank",
             tp);
  }
}

InferenceModel load_inference_model(Arguments args, const LaunchInfo& launch, int64_t vocab_size, uint64_t seed) {
  check_inference_layout(args, launch);
  args.sequence_parallel = false;  // Note [Tensor-parallel inference]
  args.no_load_rng = args.no_load_optim = true;
  InferenceModel m;
  const Device device = select_device(args.device, launch.local_rank);
  if (args.tensor_model_parallel_size > 1) {
    ParallelConfig layout;
    layout.tensor_model_parallel_size = args.tensor_model_parallel_size;
    m.ps = std::make_unique<ParallelState>(
        init_world(launch, device, std::chrono::minutes(args.distributed_timeout_minutes)), layout);
  }
  m.ctx = std::make_unique<Context>(device, seed);
  TransformerConfig config = transformer_config_from_args(args, vocab_size);
  config.hidden_dropout = config.attention_dropout = 0.0f;
  config.recompute_granularity.clear();
  config.inference_only = true;  // the weights alone: no gradient buffer
  m.model = std::make_unique<GPTModel>(config, device, m.ps.get());
  Checkpointer checkpointer(args, m.ps.get());
  MG_CHECK(checkpointer.load(*m.ctx, args.load, *m.model, nullptr, nullptr).has_value(), "no checkpoint in {}",
           args.load);
  if (m.ps) m.group = std::make_unique<InferenceGroup>(m.ps->tensor());
  return m;
}

}  // namespace megatron

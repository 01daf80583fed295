// pretrain_gpt: Megatron-LM's pretrain_gpt.py in C++ — the dataset provider, the model provider and
// the forward step with its loss function, handed to pretrain(). Megatron launch scripts run with `python pretrain_gpt.py` replaced by
// `build/bin/pretrain_gpt`.
#include <chrono>
#include <cstdio>

#include "megatron/core/comm/communicator.h"
#include "megatron/core/datasets/blended_megatron_dataset_builder.h"
#include "megatron/core/datasets/data_loader.h"
#include "megatron/core/models/gpt/gpt_layer_specs.h"
#include "megatron/core/models/gpt/gpt_model.h"
#include "megatron/core/packed_seq_params.h"
#include "megatron/core/transformer/context_parallel.h"
#include "megatron/training/training.h"

using namespace megatron;

namespace {

GPTDataArgs data_args(const Arguments& a) {
  GPTDataArgs d;
  d.data_path = a.data_path;
  d.train_data_path = a.train_data_path;
  d.valid_data_path = a.valid_data_path;
  d.test_data_path = a.test_data_path;
  d.split = a.split;
  d.mock_data = a.mock_data;
  if (!a.data_cache_path.empty()) d.data_cache_path = a.data_cache_path;
  d.seq_length = a.seq_length;
  d.seed = a.seed;
  d.reset_position_ids = a.reset_position_ids;
  d.reset_attention_mask = a.reset_attention_mask;
  d.eod_mask_loss = a.eod_mask_loss;
  d.create_attention_mask_in_dataloader = !a.no_create_attention_mask_in_dataloader;  // (documents, not a mask)
  if (a.train_samples > 0) d.train_samples = a.train_samples;
  d.train_iters = a.train_iters;
  d.eval_interval = a.eval_interval;
  d.eval_iters = a.eval_iters;
  d.global_batch_size = a.global_batch_size;
  return d;
}

// A data iterator over one split: the loader's next micro-batch, an error when it runs dry. Each
// context-parallel rank keeps its rows (Megatron's get_batch_on_this_cp_rank) and the documents of
// the whole sequence (Note [Packed sequences]).
BatchIterator make_iterator(std::shared_ptr<const MegatronDataset> dataset, const Arguments& a, int64_t consumed,
                            const char* split) {
  if (!dataset) return {};
  DataLoaderOptions o;
  o.micro_batch_size = a.micro_batch_size;
  o.data_parallel_size = a.data_parallel_size;
  o.data_parallel_rank = a.data_parallel_rank;
  o.consumed_samples = consumed;
  o.pin_memory = select_device(a.device).is_cuda();  // pinned batches copy to the GPU asynchronously
  auto loader = std::make_shared<DataLoader>(std::move(dataset), o);
  const int cp = a.context_parallel_size, cp_rank = a.context_parallel_rank;
  return [loader, split, cp, cp_rank]() {
    std::optional<GPTBatch> b = loader->next();
    MG_CHECK(b.has_value(), "the {} data ran out: the dataset has fewer samples than training asks for", split);
    Tensor cu = b->attention_segments.defined() ? cu_seqlens_from_segments(b->attention_segments) : Tensor();
    return MicroBatch{cp_split_rows(b->tokens, cp_rank, cp), cp_split_rows(b->labels, cp_rank, cp),
                      cp_split_rows(b->loss_mask, cp_rank, cp), cp_split_rows(b->position_ids, cp_rank, cp), cu};
  };
}

DataIterators train_valid_test_data_iterators(const Arguments& a, const Tokenizer* tokenizer, int64_t consumed_train,
                                              int64_t consumed_valid) {
  if (a.reset_attention_mask || a.reset_position_ids || a.eod_mask_loss) {
    const char* flag = a.reset_attention_mask ? "--reset-attention-mask"
                       : a.reset_position_ids ? "--reset-position-ids"
                                              : "--eod-mask-loss";
    int64_t eod = -1;
    std::string why;
    try {
      eod = tokenizer->eod();
    } catch (const Error& e) {
      why = e.what();
    }
    MG_CHECK(eod >= 0 && eod < tokenizer->vocab_size(),
             "{} finds documents by their end-of-document token, and the {} tokenizer has none ({}): use a "
             "tokenizer with an EOS/EOD token",
             flag, a.tokenizer_type, why.empty() ? fmt::format("eod {}", eod) : why);
  }
  // The tokenizer outlives the iterators (pretrain owns it); a non-owning shared_ptr hands it over.
  std::shared_ptr<const Tokenizer> tok(tokenizer, [](const Tokenizer*) {});
  print_rank_last("> building train, validation, and test datasets for GPT ...");
  SplitDatasets ds = build_train_valid_test_datasets(data_args(a), tok);
  print_rank_last("> finished creating GPT datasets ...");
  DataIterators it;
  it.train = make_iterator(ds[0], a, consumed_train, "training");
  // --eval-iters 0 turns evaluation off (Megatron's do_valid/do_test need eval_iters > 0): no loaders
  // for splits that are never read, which may also be empty (a small corpus, the default split).
  if (a.eval_iters > 0) {
    it.valid = make_iterator(ds[1], a, consumed_valid, "validation");
    it.test = make_iterator(ds[2], a, 0, "test");
  }
  return it;
}

// Megatron's model_provider: the GPT decoder's layer specs from the config, this rank's chunk.
std::unique_ptr<ModelChunk> model_provider(const TransformerConfig& config, Device device, const ParallelState& ps,
                                           int vp_stage) {
  print_rank_last("building GPT model ...");
  TransformerConfig c = config;
  c.finalize();
  return std::make_unique<GPTModel>(c, device, &ps, vp_stage, get_gpt_decoder_block_spec(c));
}

// Megatron's forward_step: one micro-batch through this rank's model chunk (the first stage reads
// the tokens, the last the labels); its loss function is the masked mean of the per-token losses
// (Megatron's loss_func with the loss mask), or their sum with --calculate-per-token-loss (Note
// [Per-token loss] in core/pipeline_parallel/schedules.h).
ForwardOutput forward_step(Context& ctx, const MicroBatch& b, const GPTModel& model, const Tensor& input,
                           GPTModel::Stash& stash) {
  const Device d = ctx.device();
  auto on_device = [&](const Tensor& t) { return t.device() == d ? t : t.to(d); };
  const bool first = model.pre_process(), last = model.post_process();
  // The MTP block on the last stage embeds the shifted tokens and weighs its losses by the loss mask
  // (Megatron's get_batch with mtp_on_this_rank).
  const bool inputs = first || model.has_mtp();
  Tensor output = model.forward_step(ctx, inputs ? on_device(b.tokens) : Tensor(),
                                     inputs ? on_device(b.position_ids) : Tensor(), last ? on_device(b.labels) : Tensor(),
                                     input, stash, b.cu_seqlens, model.has_mtp() ? on_device(b.loss_mask) : Tensor());
  if (!last) return ForwardOutput{output, Tensor(), {}};
  return ForwardOutput{output, Tensor(),
                       masked_token_loss(on_device(b.loss_mask), model.cp_group(), model.config().calculate_per_token_loss)};
}

}  // namespace

int main(int argc, char** argv) {
  const auto program_start = std::chrono::steady_clock::now();
  try {
    std::optional<Arguments> args =
        parse_args(argc, argv, "Pretrain a GPT or Llama model (Megatron-LM's pretrain_gpt)");
    if (!args) return 0;
    // --nproc-per-node N: this process becomes the launcher of N workers (torchrun's job).
    if (args->nproc_per_node > 0 && detect_launch().kind == LaunchInfo::Single) {
      return launch_local_workers(argc, argv, args->nproc_per_node, select_device(args->device).is_host());
    }
    PretrainCallbacks callbacks{train_valid_test_data_iterators, typed_forward_step<GPTModel>(forward_step),
                                model_provider};
    return pretrain(*args, callbacks, program_start);
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    abort_job(1);  // the other ranks would wait for this one until their timeout
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    abort_job(2);
    return 2;
  }
}

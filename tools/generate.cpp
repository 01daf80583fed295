// generate: text from a checkpoint — greedy, temperature, top-k, top-p. A small tool for the demo
// and for checking a model: the prompts run as one batch through the InferenceEngine (KV cache), as
// the text generation server (tools/text_generation_server) runs its requests.
//
//   build/bin/generate --load ckpt --tokenizer-type GPT2BPETokenizer --vocab-file v.json --merge-file m.txt \
//       --prompt "Hello" --max-new-tokens 40 --temperature 0.8 --top-k 40
//
// Tensor-parallel: mpirun -np N build/bin/generate --tensor-model-parallel-size N ... (rank 0 runs
// the engine and prints, the other ranks run each forward with it: Note [Tensor-parallel inference]).
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>

#include "megatron/core/inference/generation.h"
#include "megatron/training/checkpointing.h"
#include "megatron/training/inference_model.h"
#include "megatron/training/training.h"

using namespace megatron;

int main(int argc, char** argv) {
  const LaunchInfo launch = detect_launch();
  try {
    Arguments args;
    std::vector<std::string> prompts;
    int max_new_tokens = 64;
    SamplingParams sampling;
    CLI::App app("Generate text from a megatron.cpp checkpoint");
    app.add_option("--load", args.load, "Checkpoint directory")->required();
    app.add_option("--tokenizer-type", args.tokenizer_type, "Tokenizer type (as pretrain_gpt)")->required();
    app.add_option("--vocab-file", args.vocab_file, "Vocabulary file");
    app.add_option("--merge-file", args.merge_file, "Merges file");
    app.add_option("--tokenizer-model", args.tokenizer_model, "Tokenizer model");
    app.add_option("--vocab-size", args.vocab_size, "NullTokenizer vocabulary size");
    app.add_option("--prompt", prompts, "Prompt (repeat for several)")->required();
    app.add_option("--max-new-tokens", max_new_tokens, "Tokens to generate per prompt")->capture_default_str();
    app.add_flag("--greedy", sampling.greedy, "Greedy decoding");
    app.add_option("--temperature", sampling.temperature, "Sampling temperature")->capture_default_str();
    app.add_option("--top-k", sampling.top_k, "Top-k filter (0: off)")->capture_default_str();
    app.add_option("--top-p", sampling.top_p, "Nucleus filter (0: off)")->capture_default_str();
    app.add_option("--seed", sampling.seed, "Random seed")->capture_default_str();
    app.add_option("--device", args.device, "auto, cpu or cuda")->capture_default_str();
    app.add_option("--tensor-model-parallel-size", args.tensor_model_parallel_size,
                   "Tensor-parallel size: run under mpirun -np N (any checkpoint layout loads)")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      return app.exit(e);
    }
    const std::string tokenizer_type = args.tokenizer_type;
    apply_checkpoint_args(args, args.load);
    args.tokenizer_type = tokenizer_type;
    std::unique_ptr<Tokenizer> tokenizer = build_tokenizer(tokenizer_args_from_args(args));
    InferenceModel loaded = load_inference_model(args, launch, tokenizer->vocab_size(), sampling.seed);
    if (loaded.follower()) {
      loaded.group->follow(*loaded.model, *loaded.ctx);
      return 0;
    }
    InferenceEngine engine(*loaded.model, *loaded.ctx, tokenizer->vocab_size(),
                           {.max_batch_size = int64_t(prompts.size()), .group = loaded.group.get()});
    std::vector<GenerationRequest> requests;
    for (const std::string& prompt : prompts) {
      GenerationRequest r;
      r.prompt = tokenizer->tokenize(prompt);
      MG_CHECK(!r.prompt.empty(), "prompt '{}' tokenizes to nothing", prompt);
      // Up to --max-new-tokens, as far as the model's positions allow.
      r.max_new_tokens = std::min<int64_t>(max_new_tokens, engine.max_sequence_length() - int64_t(r.prompt.size()));
      r.sampling = sampling;
      r.stop_tokens = {tokenizer->eod()};
      requests.push_back(std::move(r));
    }
    std::vector<GenerationResult> results = engine.generate(requests);  // one batch, KV cache
    if (loaded.group) loaded.group->stop(*loaded.ctx);
    for (size_t i = 0; i < prompts.size(); ++i) {
      std::vector<int64_t> generated = results[i].tokens;
      if (results[i].finish_reason == "stop") generated.pop_back();  // the eod
      // Prompt and continuation decoded together, so the tokenizer places the space between them.
      std::vector<int64_t> all = requests[i].prompt;
      all.insert(all.end(), generated.begin(), generated.end());
      std::printf("%s\n", tokenizer->detokenize(all).c_str());
    }
    std::fflush(stdout);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    std::fflush(stderr);
    if (launch.world_size > 1) abort_job(1);  // the other ranks would wait for this one until their timeout
    return 1;
  }
}

"""Reference generation throughput: HuggingFace transformers `generate` with a static KV cache, on the GPU.

Run in the same command on the GPU machine as our bench/decode_throughput (bench/decode_gpu.sh), so both share
one machine. Randomly initialised models, bf16 on cuda, SDPA attention:
  gpt-1.3B:  GPT-2 architecture (GPT2LMHeadModel), 24 layers, hidden 2048, 16 heads, vocab 50304, 2048 positions
  llama-1B:  Llama-3.2-1B-style (LlamaForCausalLM), 16 layers, hidden 2048, 32 heads, 8 kv heads, ffn 8192,
             vocab 128256, rope theta 500000, tied embeddings
Systems:
  hf-static-compile: generation_config.cache_implementation = "static", compiled as HF documents for it: with a
                     transformers that compiles by itself (GenerationConfig has disable_compile: 4.48 on), generate
                     compiles the decode steps' forward (CompileConfig's default, mode "reduce-overhead"; the
                     prefill runs eager); with an older one, model.forward = torch.compile(model.forward,
                     mode="reduce-overhead", fullgraph=True) as its "Static kv-cache and torch.compile" guide did.
                     The JSON's "compile" says which.
  hf-static-eager:   the static cache, nothing compiled (disable_compile)
Measurement, the same as decode_throughput's: random prompts of --prompt tokens at each batch size;
  prefill: generate(max_new_tokens=1);  prefill_tokens_per_s = batch * prompt / that time
  decode:  generate(max_new_tokens=new, min_new_tokens=new), greedy, no eos;
           decode_tokens_per_s = batch * (new - 1) / (that time - the prefill time)
medians of --repeats runs after --warmup runs (the compiled system's first runs compile and record CUDA graphs).
One JSON line per (system, model, batch); a failure is a JSON line with "error".

  python3 hf_generate_reference.py [--models gpt-1.3B,llama-1B] [--batch 1,32] [--systems compile,eager]
  python3 hf_generate_reference.py --models tiny --batch 1,2 --prompt 16 --new-tokens 8 --device cpu \
      --systems eager   (a smoke run; peak_mem_GiB is 0 on the CPU)
"""
import argparse, json, time, traceback

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

MODELS = {
    "gpt-1.3B": lambda: GPT2LMHeadModel(GPT2Config(n_layer=24, n_embd=2048, n_head=16, vocab_size=50304,
                                                  n_positions=2048, resid_pdrop=0.0, embd_pdrop=0.0,
                                                  attn_pdrop=0.0)),
    "llama-1B": lambda: LlamaForCausalLM(LlamaConfig(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32,
                                                    num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                                                    rope_theta=500000.0, rms_norm_eps=1e-5,
                                                    max_position_embeddings=131072, tie_word_embeddings=True)),
    "tiny": lambda: GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1024, n_positions=2048,
                                              bos_token_id=0, eos_token_id=0)),
}


def build(name, device, system):
    """The model, and how it is compiled: "none", "generate-auto" or "forward"."""
    with torch.device(device):
        model = MODELS[name]()
    model = model.to(torch.bfloat16).eval()
    model.config._attn_implementation = "sdpa"
    g = model.generation_config
    g.cache_implementation = "static"
    g.eos_token_id = None
    g.pad_token_id = 0
    g.do_sample = False
    auto = hasattr(g, "disable_compile")  # newer transformers compile the decode steps themselves
    if auto:
        g.disable_compile = system != "compile"
    if system != "compile":
        return model, "none"
    if auto:
        return model, "generate-auto"
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    return model, "forward"


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def measure(model, batch, prompt, new, warmup, repeats, device):
    vocab = model.config.vocab_size
    gen = torch.Generator(device=device).manual_seed(7)
    ids = torch.randint(0, vocab, (batch, prompt), device=device, generator=gen)
    mask = torch.ones_like(ids)

    def timed(n):
        times = []
        for rep in range(warmup + repeats):
            sync(device)
            t0 = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False)
            sync(device)
            if rep >= warmup:
                times.append(time.perf_counter() - t0)
            assert out.shape == (batch, prompt + n), f"generated {tuple(out.shape)}, expected {(batch, prompt + n)}"
        return sorted(times)[len(times) // 2]

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    prefill_s = timed(1)
    total_s = timed(new)
    decode_s = total_s - prefill_s  # not positive only when the timings are noise (a tiny smoke run): null
    return dict(prefill_tokens_per_s=round(batch * prompt / prefill_s, 1),
                decode_tokens_per_s=round(batch * (new - 1) / decode_s, 1) if decode_s > 0 else None,
                prefill_s=round(prefill_s, 4), generate_s=round(total_s, 4),
                peak_mem_GiB=round(torch.cuda.max_memory_allocated() / 2**30, 3) if device == "cuda" else 0.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt-1.3B,llama-1B")
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--systems", default="compile,eager")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for system in args.systems.split(","):
        for name in args.models.split(","):
            torch._dynamo.reset()
            model, compiled = build(name, args.device, system)
            for batch in [int(b) for b in args.batch.split(",")]:
                row = {"system": f"hf-static-{system}", "model": name, "batch": batch, "device": args.device, "prompt": args.prompt,
                       "new_tokens": args.new_tokens, "compile": compiled, "torch": torch.__version__,
                       "transformers": transformers.__version__,
                       "params": sum(p.numel() for p in model.parameters())}
                try:
                    row.update(measure(model, batch, args.prompt, args.new_tokens, args.warmup, args.repeats,
                                       args.device))
                except Exception as e:  # one line per failure, then the next measurement
                    row["error"] = f"{type(e).__name__}: {e}"[:500]
                    traceback.print_exc()
                print(json.dumps(row), flush=True)
            del model
            if args.device == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

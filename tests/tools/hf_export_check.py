#!/usr/bin/env python3
"""The HuggingFace side of tests/tools/hf_export_test.cpp: loads a folder that convert_checkpoint
--from megatron wrote with transformers' AutoModelForCausalLM (and AutoTokenizer where the folder
has tokenizer files) and compares its log-probabilities with megatron.cpp's on the same tokens.

    hf_export_check.py HF_DIR OURS.safetensors [--tol 1e-5] [--dtype bfloat16]

OURS.safetensors holds `tokens` [b, s] (as fp32) and `logits` [b, s, v] (fp32, megatron.cpp's on the
unpadded vocabulary v; its padded rows are not part of the HF model). The HF model is run in fp32
(a bf16 export's weights load exactly into fp32); log-softmax over v on both sides.

Prints `hf_export_check: <model_type> max |d log-prob| <x> over <n> positions` and exits 1 past
--tol or when --dtype (the dtype the export must load as with dtype="auto") is not met. Exit 3:
torch or transformers cannot be imported (the caller skips).
"""
import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

try:
    import torch
    import transformers
    from safetensors.torch import load_file
except ImportError as e:  # the C++ test prints this and skips
    print(f"hf_export_check: cannot import torch/transformers/safetensors: {e}")
    sys.exit(3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir")
    ap.add_argument("ours")
    ap.add_argument("--tol", type=float, default=1e-5)
    ap.add_argument("--dtype", default=None)
    a = ap.parse_args()

    ours = load_file(a.ours)
    tokens = ours["tokens"].round().long()
    logits = ours["logits"].double()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(a.hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        hf_logits = model(input_ids=tokens).logits.double()
    if hf_logits.shape != logits.shape:
        print(f"hf_export_check: HF logits {tuple(hf_logits.shape)}, ours {tuple(logits.shape)}")
        return 1
    diff = (torch.log_softmax(hf_logits, -1) - torch.log_softmax(logits, -1)).abs().max().item()
    config = json.load(open(os.path.join(a.hf_dir, "config.json")))
    print(f"hf_export_check: {config['model_type']} ({type(model).__name__}) max |d log-prob| {diff:.3e} over "
          f"{tokens.numel()} positions (transformers {transformers.__version__}, torch {torch.__version__})")
    ok = diff <= a.tol
    if a.dtype:
        auto = transformers.AutoModelForCausalLM.from_pretrained(a.hf_dir, dtype="auto")
        loaded = str(auto.dtype).replace("torch.", "")
        print(f"hf_export_check: dtype=\"auto\" loads as {loaded}")
        ok = ok and loaded == a.dtype
    gen_path = os.path.join(a.hf_dir, "generation_config.json")
    if os.path.exists(gen_path):
        gen = transformers.GenerationConfig.from_pretrained(a.hf_dir)
        print(f"hf_export_check: generation_config bos {gen.bos_token_id} eos {gen.eos_token_id}")
    if os.path.exists(os.path.join(a.hf_dir, "tokenizer_config.json")):
        tok = transformers.AutoTokenizer.from_pretrained(a.hf_dir)
        ids = tok("To be, or not to be", add_special_tokens=False).input_ids
        print(f"hf_export_check: tokenizer {type(tok).__name__} eos {tok.eos_token_id} ids {ids}")
        if os.path.exists(gen_path) and tok.eos_token_id != gen.eos_token_id:
            print("hf_export_check: the tokenizer's eos differs from generation_config.json's")
            ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

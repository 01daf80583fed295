#!/usr/bin/env python3
"""Summarises bench/run_multi_gpu.sh's runs: one JSON line per run against its model's single-GPU run.

A run named <model>_<layout> (log <run>.log, per-iteration losses <run>.loss.jsonl) is compared with
<model>_single. Step time, TFLOP/s/GPU and tokens/s are medians over iterations 6.. (the first five
include allocation and autotuning). Fields:
  scaling = tokens/s per GPU / the reference's tokens/s per GPU (1.0 = linear; DP=2 goal >= 0.95). The
    reference is <model>_single (one GPU) or <model>_reference (the fewest GPUs the model fits on).
  tflops_per_gpu_vs_single                                   (model-parallel layouts)
  loss_max_rel_diff over every iteration against the single GPU; loss_ok when <= 1e-2 (bf16).
Usage: bench/multi_gpu_summary.py DIR
"""
import json
import re
import statistics
import sys
from pathlib import Path

ITER = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|")
FIELD = {
    "ms": re.compile(r"elapsed time per iteration \(ms\): ([\d.]+)"),
    "tflops": re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([\d.]+)"),
    "tok": re.compile(r"tokens per second per GPU: ([\d.]+)"),
    "gbs": re.compile(r"global batch size:\s+(\d+)"),
}
PEAK_TFLOPS = 989.0  # H200 dense bf16 (../shared/BENCHMARKS.md)
SKIP = 5  # warm-up iterations left out of the medians
LOSS_TOL = 1e-2


def parse(run_dir: Path, name: str):
    text = (run_dir / f"{name}.log").read_text(errors="replace")
    rows = []
    for line in text.splitlines():
        m = ITER.search(line)
        if not m:
            continue
        row = {"iteration": int(m.group(1))}
        for k, rx in FIELD.items():
            f = rx.search(line)
            if f:
                row[k] = float(f.group(1))
        rows.append(row)
    g = re.search(r"running on \S+ \((\d+) ranks", text)
    gpus = int(g.group(1)) if g else 1
    losses = []
    loss_file = run_dir / f"{name}.loss.jsonl"
    if loss_file.exists():
        losses = [json.loads(l)["lm_loss"] for l in loss_file.read_text().splitlines() if l.strip()]
    timed = [r for r in rows if r["iteration"] > SKIP] or rows
    med = lambda k: statistics.median(r[k] for r in timed) if timed and k in timed[0] else None
    out = {"gpus": gpus, "iterations": len(rows), "ms_per_iteration": med("ms"), "tflops_per_gpu": med("tflops"),
           "tokens_per_s_per_gpu": med("tok"), "losses": losses}
    if out["tokens_per_s_per_gpu"] is not None:
        out["tokens_per_s"] = out["tokens_per_s_per_gpu"] * gpus
    return out


def main():
    run_dir = Path(sys.argv[1])
    names = sorted(p.name[:-4] for p in run_dir.glob("*.log"))
    runs = {n: parse(run_dir, n) for n in names}
    for name in names:
        r = runs[name]
        model, _, layout = name.partition("_")
        line = {"bench": "multi_gpu", "model": model, "layout": layout, "gpus": r["gpus"],
                "iterations": r["iterations"]}
        for k in ("ms_per_iteration", "tflops_per_gpu", "tokens_per_s"):
            if r.get(k) is not None:
                line[k] = round(r[k], 1)
        if r.get("tflops_per_gpu") is not None:
            line["mfu"] = round(r["tflops_per_gpu"] / PEAK_TFLOPS, 3)
        single = runs.get(f"{model}_single") or runs.get(f"{model}_reference")
        if r["iterations"] == 0:
            line["error"] = "no iteration line in the log"
        elif single and layout not in ("single", "reference") and single.get("tokens_per_s"):
            line["scaling"] = round((r["tokens_per_s"] / r["gpus"]) / (single["tokens_per_s"] / single["gpus"]), 3)
            line["reference_gpus"] = single["gpus"]
            if single.get("tflops_per_gpu"):
                line["tflops_per_gpu_vs_single"] = round(r["tflops_per_gpu"] / single["tflops_per_gpu"], 3)
            a, b = r["losses"], single["losses"]
            if a and len(a) == len(b):
                diff = max(abs(x - y) / abs(y) for x, y in zip(a, b))
                line["loss_max_rel_diff"] = float(f"{diff:.2e}")
                line["loss_ok"] = diff <= LOSS_TOL
                line["loss_first_last"] = [round(a[0], 4), round(a[-1], 4)]
            else:
                line["loss_ok"] = False
                line["error"] = f"{len(a)} losses against the single GPU's {len(b)}"
        elif layout in ("single", "reference"):
            line["loss_first_last"] = [round(r["losses"][0], 4), round(r["losses"][-1], 4)] if r["losses"] else None
        print(json.dumps(line))


if __name__ == "__main__":
    main()

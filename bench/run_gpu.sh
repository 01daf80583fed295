#!/usr/bin/env bash
# One run on the GPU machine: GPU op tests, golden fixtures on the GPU, a bf16 training run on real text, the
# 1.3B startup time, and throughput against the PyTorch reference on the same GPU.
# Runs from the repository root on the GPU machine with the binaries staged in .device/ (see
# bench/stage_gpu.sh). Usage: bench/run_gpu.sh [tests|train|bench|graph|all] [presets...]
# (graph: each preset's step with the forward and backward as one CUDA graph against the eager step,
# alternating twice in the same call; determinism: each preset twice with and twice without
# --deterministic, whether the runs agree and what it costs; neither is part of all.)
set -uo pipefail
what=${1:-all}; shift || true
PRESETS=${*:-gpt2-124M gpt-1.3B llama-1B}
source .device/env.sh
export LD_LIBRARY_PATH=$PWD/.device/lib:$LD_LIBRARY_PATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B=.device/bin
export MEGATRON_BIN_DIR=$PWD/.device/bin  # tests that run the binaries find the staged ones
export MEGATRON_FIXTURES=$PWD/tests/fixtures
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader

if [[ $what == tests || $what == all ]]; then
  echo "== gpu op tests"
  timeout 400 $B/gpu_tests --gtest_brief=1 2>&1 | tee "$OUT/gpu_tests.txt" | tail -40
fi
if [[ $what == train || $what == all ]]; then
  echo "== bf16 training on the GPU (300 iterations, fixture corpus)"
  D=$PWD/tests/fixtures/megatron_data
  FLAGS="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 4 --global-batch-size 8
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 10 --data-path $D/data/shakespeare_spm_text_document
    --split 98,2,0 --tokenizer-type SentencePieceTokenizer --tokenizer-model $D/tok-spm.model --log-interval 1
    --hidden-dropout 0.0 --attention-dropout 0.0
    --eval-interval 1000 --eval-iters 1 --train-iters 300"
  # bf16 and fp16 (dynamic loss scaling) on the GPU against fp32 on the CPU: every iteration's loss.
  for run in "cpu_fp32:--device cpu" "gpu_bf16:--bf16 --device cuda" "gpu_fp16:--fp16 --device cuda"; do
    name=${run%%:*}; rm -f "$OUT/loss_$name.jsonl"
    (cd /tmp && MEGATRON_LOSS_LOG="$OUT/loss_$name.jsonl" timeout 300 $OLDPWD/$B/pretrain_gpt $FLAGS ${run#*:} \
      > "$OUT/train_$name.txt" 2>&1; echo "$name rc=$?")
    grep -E "iteration +(1|100|200|300)/" "$OUT/train_$name.txt" | cut -c1-40,150-330
  done
  python3 - "$OUT" <<'PY'
import json, sys
load = lambda n: [json.loads(l)["lm_loss"] for l in open(f"{sys.argv[1]}/loss_{n}.jsonl")]
ref = load("cpu_fp32")
for n in ("gpu_bf16", "gpu_fp16"):
    got = load(n)
    gaps = [abs(a - b) for a, b in zip(got, ref)]
    tail = lambda v: sum(v[-50:]) / 50
    print(json.dumps({"bench": "loss_curve", "run": n, "vs": "cpu_fp32", "iterations": len(got),
                      "largest_gap": round(max(gaps), 4), "at_iteration": gaps.index(max(gaps)) + 1,
                      "last50_mean": round(tail(got), 4), "last50_mean_fp32": round(tail(ref), 4)}))
PY
  echo "== startup: 1.3B GPT, mock data, bf16"
  (cd /tmp && timeout 200 $OLDPWD/$B/pretrain_gpt --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
    --seq-length 2048 --micro-batch-size 8 --global-batch-size 8 --train-iters 2 --lr 1e-4 --mock-data \
    --tokenizer-type NullTokenizer --vocab-size 50257 --log-interval 1 --eval-iters 0 --bf16 --log-throughput \
    --device cuda > "$OUT/startup_1.3B.txt" 2>&1; echo "rc=$?")
  grep -E "time to|time from|iteration|error" "$OUT/startup_1.3B.txt" | cut -c1-300
fi
if [[ $what == infer || $what == all ]]; then
  echo "== inference: greedy generation from the converted gpt2 fixture, CPU vs GPU"
  W=$(mktemp -d); mkdir -p $W/hf
  cp tests/fixtures/gpt2_model.safetensors $W/hf/model.safetensors
  python3 -c "import json,struct;b=open('$W/hf/model.safetensors','rb').read();n=struct.unpack('<Q',b[:8])[0];print(json.loads(b[8:8+n])['__metadata__']['config'])" > $W/hf/config.json
  $B/convert_checkpoint --from hf --load $W/hf --save $W/ckpt 2>&1 | tail -1
  for dev in cpu cuda; do
    $B/generate --load $W/ckpt --tokenizer-type NullTokenizer --vocab-size 512 --prompt "1 2 3 4 5" --prompt "100 200 300" \
      --max-new-tokens 16 --greedy --device $dev > $W/gen_$dev.txt 2>&1; echo "$dev rc=$?"; cat $W/gen_$dev.txt
  done
  cmp $W/gen_cpu.txt $W/gen_cuda.txt && echo "greedy generation: GPU equals CPU"
fi
if [[ $what == bench || $what == all ]]; then
  echo "== throughput: ours vs PyTorch (same GPU, same call)"
  # One ratio line per preset: ours / PyTorch for each mode, tokens/s (the bar: >= 1 against compile) and peak
  # memory (<= 1); shapes_match says both ran the same seq, micro-batch and padded vocabulary.
  RATIO='import json, sys
rows = lambda f: [json.loads(l) for l in open(f) if l.startswith("{")]
ours = [r for r in rows(sys.argv[2]) if r.get("bench") == "gpt_throughput"]
out = {"bench": "ratio", "preset": sys.argv[1]}
for r in rows(sys.argv[3]) if ours else []:
    o = ours[-1]; m = r["system"]
    out["tokens_per_s_vs_" + m] = round(o["tokens_per_s"] / r["tokens_per_s"], 3)
    out["peak_mem_vs_" + m] = round(o["peak_mem_gb"] * 1e9 / (r["peak_mem_GiB"] * 2**30), 3)
    out["shapes_match"] = all(o.get(k) == r[k] for k in ("seq", "mbs", "vocab"))
if len(out) == 2: out["error"] = "no result from ours or from the reference"
print(json.dumps(out))'
  for p in $PRESETS; do
    rt=150; [[ $p == llama-* ]] && rt=300  # compiling the seq-4096 Llama takes longer
    timeout 300 $B/gpt_throughput --preset "$p" --device cuda --dtype bf16 --steps 10 --warmup 3 2>&1 | tee "$OUT/ours_$p.txt"
    timeout $rt python3 .device/pytorch_reference.py --preset "$p" 2>&1 | grep '^{' | tee "$OUT/ref_$p.jsonl"
    cat "$OUT/ours_$p.txt" "$OUT/ref_$p.jsonl" >> "$OUT/bench.jsonl"
    python3 -c "$RATIO" "$p" "$OUT/ours_$p.txt" "$OUT/ref_$p.jsonl" | tee -a "$OUT/bench.jsonl"
  done
fi
if [[ $what == graph ]]; then
  echo "== CUDA graph: forward and backward as one graph against the eager step (same call, two rounds)"
  GAIN='import json, sys
rows = lambda f: [json.loads(l) for l in open(f) if l.startswith("{\"bench\": \"gpt_throughput")]
e, g = rows(sys.argv[2]), rows(sys.argv[3])
if e and g:
    e, g = e[-1], g[-1]
    print(json.dumps({"bench": "cuda_graph_gain", "preset": sys.argv[1], "round": int(sys.argv[4]),
                      "eager_step_ms": e["step_ms"], "graph_step_ms": g["step_ms"],
                      "tokens_per_s_graph_vs_eager": round(g["tokens_per_s"] / e["tokens_per_s"], 4),
                      "eager_peak_mem_gb": e["peak_mem_gb"], "graph_mem_gb": g["graph_mem_gb"],
                      "loss_eager": e["loss"], "loss_graph": g["loss"]}))
else:
    print(json.dumps({"bench": "cuda_graph_gain", "preset": sys.argv[1], "error": "a run gave no result"}))'
  # The training loop itself: pretrain_gpt, GPT-2 124M shape, 8 microbatches a step, mock data, bf16;
  # the mean ms per iteration of iterations 11-40 from Megatron's iteration line.
  M124="--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --max-position-embeddings 1024
    --micro-batch-size 8 --global-batch-size 64 --train-iters 40 --lr 1e-4 --mock-data --tokenizer-type NullTokenizer
    --vocab-size 50257 --log-interval 10 --eval-iters 0 --bf16 --hidden-dropout 0 --attention-dropout 0 --device cuda"
  for round in 1 2; do
    for mode in eager graph; do
      flag=""; [[ $mode == graph ]] && flag="--cuda-graph-impl local --cuda-graph-scope full_iteration"
      (cd /tmp && timeout 200 $OLDPWD/$B/pretrain_gpt $M124 $flag > "$OUT/pretrain_124M_${mode}_$round.txt" 2>&1)
    done
    python3 - "$OUT" "$round" <<'PY' | tee -a "$OUT/graph.jsonl"
import json, re, sys
def ms(mode):
    t = open(f"{sys.argv[1]}/pretrain_124M_{mode}_{sys.argv[2]}.txt").read()
    v = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", t)]
    return sum(v[1:]) / len(v[1:]) if len(v) > 1 else None
e, g = ms("eager"), ms("graph")
out = {"bench": "cuda_graph_gain", "run": "pretrain_gpt gpt2-124M mbs 8 gbs 64", "round": int(sys.argv[2]),
       "eager_ms_per_iteration": e, "graph_ms_per_iteration": g}
if e and g: out["tokens_per_s_graph_vs_eager"] = round(e / g, 4)
print(json.dumps(out))
PY
  done
  for p in $PRESETS; do
    for round in 1 2; do
      for mode in eager graph; do
        flag=""; [[ $mode == graph ]] && flag=--cuda-graph
        timeout 300 $B/gpt_throughput --preset "$p" --device cuda --dtype bf16 --steps 20 --warmup 3 $flag \
          > "$OUT/graph_${p}_${mode}_$round.txt" 2>&1
        tail -1 "$OUT/graph_${p}_${mode}_$round.txt"
      done
      python3 -c "$GAIN" "$p" "$OUT/graph_${p}_eager_$round.txt" "$OUT/graph_${p}_graph_$round.txt" "$round" |
        tee -a "$OUT/graph.jsonl"
    done
  done
fi
if [[ $what == determinism ]]; then
  echo "== determinism: two runs each, default and --deterministic (cuDNN's deterministic attention backward)"
  for p in $PRESETS; do
    for mode in default deterministic; do
      flag=""; [[ $mode == deterministic ]] && flag=--deterministic
      for run in 1 2; do
        timeout 300 $B/gpt_throughput --preset "$p" --device cuda --dtype bf16 --steps 10 --warmup 3 $flag \
          > "$OUT/det_${p}_${mode}_$run.txt" 2>&1
      done
    done
    python3 - "$OUT" "$p" <<'PY' | tee -a "$OUT/determinism.jsonl"
import json, sys
def row(mode, run):
    for l in open(f"{sys.argv[1]}/det_{sys.argv[2]}_{mode}_{run}.txt"):
        if l.startswith('{"bench": "gpt_throughput"'): return json.loads(l)
d1, d2, t1, t2 = row("default", 1), row("default", 2), row("deterministic", 1), row("deterministic", 2)
print(json.dumps({"bench": "determinism", "preset": sys.argv[2],
                  "default_losses": [d1["loss"], d2["loss"]], "deterministic_losses": [t1["loss"], t2["loss"]],
                  "deterministic_runs_agree": t1["loss"] == t2["loss"],
                  "tokens_per_s_deterministic_vs_default": round((t1["tokens_per_s"] + t2["tokens_per_s"]) /
                                                                 (d1["tokens_per_s"] + d2["tokens_per_s"]), 4),
                  "peak_mem_gb": [d1["peak_mem_gb"], t1["peak_mem_gb"]]}))
PY
  done
fi

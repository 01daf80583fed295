#!/usr/bin/env bash
# FP8 training on one H200: the FP8 GPU tests, throughput of our FP8 recipes against our bf16 and
# PyTorch + torch.compile (bf16) in the same call, whole training steps of several microbatches
# (weight cache, distributed optimizer, FP8 parameters), and convergence on real text (GPT ~125M,
# bf16 against each FP8 recipe).
#
#   here:            FP8_STAGE=.device bench/fp8_gpu.sh stage     # build (sm_90a), binaries + the corpus
#   the GPU machine: bench/fp8_gpu.sh run [tests] [bench] [experts] [steps] [converge]
#
# Output: JSON lines on stdout and under $OUT (loss logs of the convergence runs: loss_<run>.jsonl).
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-run}; shift || true

if [[ $what == stage ]]; then
  set -e
  GPU_BUILD_DIR=${GPU_BUILD_DIR:-build} bench/stage_gpu.sh
  BD=${GPU_BUILD_DIR:-build}
  ninja -C "$BD" preprocess_data >/dev/null
  # The corpus, GPT-2 BPE: Python 3.11's documentation (its reST sources, Debian's python3.11-doc:
  # one document per page, 12 MB) and Debian's fortunes (one document per fortune, as scripts/demo):
  # 3.8M tokens, so 2000 iterations of 4 x 512 tokens see each token about once (the fortunes
  # alone, 0.28M tokens, are memorised within a few hundred iterations).
  mkdir -p .device/data
  TOK=tests/fixtures/megatron_data/tok-gpt2
  [[ -d /usr/share/doc/python3.11/html/_sources ]] || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3.11-doc
  jq -R -s -c 'split("\n%\n")[] | gsub("^\\s+|\\s+$"; "") | select(length > 0) | {text: .}' \
    /usr/share/games/fortunes/{fortunes,literature,people,riddles,science,wisdom,work,songs-poems,humorists,computers} \
    > /tmp/fortunes.jsonl
  find /usr/share/doc/python3.11/html/_sources -name '*.rst.txt' | sort |
    xargs -d '\n' -n 1 jq -R -s -c 'gsub("^\\s+|\\s+$"; "") | select(length > 0) | {text: .}' > /tmp/corpus.jsonl
  cat /tmp/fortunes.jsonl >> /tmp/corpus.jsonl
  "$BD"/bin/preprocess_data --input /tmp/corpus.jsonl --output-prefix .device/data/corpus \
    --tokenizer-type GPT2BPETokenizer --vocab-file $TOK/vocab.json --merge-file $TOK/merges.txt --append-eod \
    --workers 2 --log-interval 100000 >/dev/null
  cp $TOK/vocab.json $TOK/merges.txt .device/data/
  du -sh .device
  exit 0
fi

[[ -f .device/bins.tar.xz && ! -d .device/bin ]] && tar xJf .device/bins.tar.xz -C .device  # carried packed
source .device/env.sh
export LD_LIBRARY_PATH=$PWD/.device/lib:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B=$PWD/.device/bin
export MEGATRON_BIN_DIR=$B  # tests that run the binaries find the staged ones
parts=${*:-tests bench converge}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader

if [[ " $parts " == *" tests "* ]]; then
  echo "== FP8 GPU tests"
  timeout 300 $B/gpu_tests --gtest_brief=1 --gtest_filter="${FP8_TESTS:-CudaFp8*:*Fp8*}" > "$OUT/fp8_gpu_tests.txt" 2>&1
  echo "gpu_tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|^fp8 " "$OUT/fp8_gpu_tests.txt" | head -40
fi

if [[ " $parts " == *" bench "* ]]; then
  echo "== throughput: our bf16 and FP8 recipes, PyTorch + torch.compile (bf16), same GPU"
  run_ours() {  # preset, extra flags...
    local preset=$1; shift
    timeout 240 $B/gpt_throughput --preset "$preset" --steps 10 --warmup 3 --device cuda --dtype bf16 "$@" 2>&1 |
      grep -E '^\{"bench": "gpt_throughput"|error' | tee -a "$OUT/fp8_throughput.jsonl"
  }
  # FP8_BENCH: "preset:flags;preset:flags" (default both shapes of the issue)
  IFS=';' read -ra specs <<< "${FP8_BENCH:-gpt-1.3B:;llama-8B-layers:--seq 4096 --micro-batch-size 2;llama-8B-layers:--seq 4096 --micro-batch-size 2 --layers 16}"
  for spec in "${specs[@]}"; do
    preset=${spec%%:*}; shape=${spec#*:}
    if [[ ${FP8_OURS:-1} == 1 ]]; then  # FP8_OURS=0: only the reference (a second call)
      run_ours "$preset" $shape
      for recipe in delayed tensorwise blockwise; do
        run_ours "$preset" $shape --fp8-format hybrid --fp8-recipe $recipe
      done
    fi
    # where an FP8 step's time goes (per-op CUDA events): the quantisation passes' share
    [[ $preset == gpt-1.3B && ${FP8_OURS:-1} == 1 ]] && timeout 240 $B/gpt_throughput --preset "$preset" --steps 3 --warmup 2 --device cuda \
      --dtype bf16 --fp8-format hybrid --fp8-recipe delayed --profile 2>&1 | grep '"op_profile"' | head -25 |
      tee -a "$OUT/fp8_profile.jsonl"
    torch_shape=${shape//--micro-batch-size/--mbs}  # the same shape flags, the reference's spelling
    [[ ${FP8_TORCH:-1} == 1 ]] && timeout 300 python3 .device/pytorch_reference.py --preset "$preset" $torch_shape --modes compile --steps 12 2>&1 |
      grep '^{' | tee -a "$OUT/fp8_throughput.jsonl"
  done
fi

if [[ " $parts " == *" experts "* ]]; then
  # The routed experts in FP8 (Note [FP8 experts]): gpt_throughput's MoE presets with the grouped
  # experts, bf16 against each per-tensor recipe (tokens/s and peak memory; one microbatch a step,
  # and four: the weights quantised once a step, Note [FP8 weight cache]).
  echo "== MoE experts: bf16 vs FP8 (--moe-grouped-gemm)"
  IFS=";" read -ra specs <<< "${FP8_MOE_BENCH:-mixtral-small:;moe-fine-64x6:;mixtral-small:--micro-batches 4;moe-fine-64x6:--micro-batches 4}"
  for spec in "${specs[@]}"; do
    preset=${spec%%:*}; shape=${spec#*:}
    for fp8 in "" "--fp8-format hybrid --fp8-recipe delayed" "--fp8-format hybrid --fp8-recipe tensorwise"; do
      (cd /tmp && timeout 200 $B/gpt_throughput --preset "$preset" --moe-grouped-gemm --steps 8 --warmup 3 --device cuda \
        --dtype bf16 $shape $fp8 2>&1 | grep -E '^\{"bench": "gpt_throughput"|error' | tee -a "$OUT/fp8_experts.jsonl")
    done
  done
fi

if [[ " $parts " == *" steps "* ]]; then
  # Whole training steps through pretrain_gpt (mock data, GPT 1.3B shape, bf16, 4 microbatches of 8 x
  # 2048 a step): what gpt_throughput's single-microbatch step cannot show — the FP8 weight cache
  # over a step's microbatches (Note [FP8 weight cache]) and --fp8-param-gather with the
  # distributed optimizer (Note [FP8 parameters]): step time and peak memory against bf16.
  echo "== training steps: bf16 vs FP8, weight cache, distributed optimizer, FP8 parameters (GPT 1.3B, 4 x 8 x 2048 a step)"
  FLAGS="--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048
    --micro-batch-size 8 --global-batch-size 32 --train-iters ${STEPS_ITERS:-8} --lr 1e-4 --mock-data --vocab-size 50257
    --hidden-dropout 0.0 --attention-dropout 0.0 --split 100,0,0 --log-interval 1 --eval-iters 0 --bf16 --device cuda"
  for run in "bf16:" "bf16_distopt:--use-distributed-optimizer" \
             "delayed:--fp8-format hybrid --fp8-recipe delayed" \
             "delayed_nocache:--fp8-format hybrid --fp8-recipe delayed --disable-parameter-transpose-cache" \
             "delayed_distopt:--fp8-format hybrid --fp8-recipe delayed --use-distributed-optimizer" \
             "delayed_param_gather:--fp8-format hybrid --fp8-recipe delayed --use-distributed-optimizer --fp8-param-gather" \
             "blockwise_distopt:--fp8-format e4m3 --fp8-recipe blockwise --use-distributed-optimizer" \
             "blockwise_param_gather:--fp8-format e4m3 --fp8-recipe blockwise --use-distributed-optimizer --fp8-param-gather"; do
    name=${run%%:*}
    [[ -n ${FP8_STEPS_RUNS:-} && " $FP8_STEPS_RUNS " != *" $name "* ]] && continue  # a subset: FP8_STEPS_RUNS="bf16 delayed"
    (cd /tmp && timeout ${STEPS_TIMEOUT:-150} $B/pretrain_gpt $FLAGS ${run#*:} > "$OUT/steps_$name.txt" 2>&1; echo "$name rc=$?")
    python3 - "$OUT/steps_$name.txt" "$name" "${run#*:}" <<'PY'
import json, re, statistics, sys
text = open(sys.argv[1]).read()
ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", text)][2:]  # past the warmup
peak = re.findall(r"max allocated: ([0-9.]+)", text)
out = {"bench": "fp8_training_steps", "run": sys.argv[2], "flags": sys.argv[3], "tokens_per_step": 32 * 2048}
if ms:
    med = statistics.median(ms)
    out.update({"iterations_timed": len(ms), "ms_per_step": round(med, 1), "tokens_per_s": round(32 * 2048 / med * 1000)})
if peak:
    out["max_allocated_mb"] = float(peak[0])
if not ms:
    out["error"] = (re.findall(r".*(?:error|Error|refused).*", text) or ["no iteration lines"])[0][:200]
print(json.dumps(out))
PY
  done | tee -a "$OUT/fp8_steps.jsonl"
fi

if [[ " $parts " == *" converge "* ]]; then
  echo "== convergence: GPT 125M on real text (Python docs + fortunes), ${CONVERGE_ITERS:-2000} iterations of ${CONVERGE_MBS:-4} x 512 tokens, seed ${CONVERGE_SEED:-1234}, bf16 vs each FP8 recipe"
  D=$PWD/.device/data
  FLAGS="--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 512 --max-position-embeddings 512
    --micro-batch-size ${CONVERGE_MBS:-4} --global-batch-size ${CONVERGE_MBS:-4} --train-iters ${CONVERGE_ITERS:-2000} --lr 6e-4 --min-lr 6e-5
    --lr-decay-style cosine --lr-warmup-iters 100 --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95
    --hidden-dropout 0.0 --attention-dropout 0.0 --data-path $D/corpus_text_document --split 100,0,0
    --tokenizer-type GPT2BPETokenizer --vocab-file $D/vocab.json --merge-file $D/merges.txt
    --log-interval 500 --eval-iters 0 --bf16 --device cuda --seed ${CONVERGE_SEED:-1234}"
  for run in "bf16:" "fp8_delayed:--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024 --fp8-amax-compute-algo max" \
             "fp8_tensorwise:--fp8-format hybrid --fp8-recipe tensorwise" \
             "fp8_blockwise:--fp8-format e4m3 --fp8-recipe blockwise"; do
    name=${run%%:*}; rm -f "$OUT/loss_$name.jsonl"
    start=$(date +%s)
    (cd /tmp && MEGATRON_LOSS_LOG="$OUT/loss_$name.jsonl" timeout ${CONVERGE_TIMEOUT:-150} $B/pretrain_gpt $FLAGS ${run#*:} \
      > "$OUT/train_$name.txt" 2>&1; echo "$name rc=$? $(( $(date +%s) - start )) s")
    grep -E "iteration +(500|1000|1500|2000)/|error" "$OUT/train_$name.txt" | cut -c1-200
  done
  python3 - "$OUT" <<'PY'
import json, os, sys
load = lambda n: [json.loads(l)["lm_loss"] for l in open(f"{sys.argv[1]}/loss_{n}.jsonl")]
ref = load("bf16")
tail = lambda v: sum(v[-100:]) / len(v[-100:])
for n in ("bf16", "fp8_delayed", "fp8_tensorwise", "fp8_blockwise"):
    try:
        got = load(n)
    except OSError:
        print(json.dumps({"bench": "fp8_convergence", "run": n, "error": "no loss log"})); continue
    print(json.dumps({"bench": "fp8_convergence", "run": n, "iterations": len(got), "seed": int(os.environ.get("CONVERGE_SEED", "1234")), "micro_batch": int(os.environ.get("CONVERGE_MBS", "4")),
                      "final100_mean": round(tail(got), 5), "bf16_final100_mean": round(tail(ref), 5),
                      "relative_to_bf16": round(tail(got) / tail(ref) - 1, 5),
                      "max_loss": round(max(got), 4), "finite": all(x == x and abs(x) < 1e9 for x in got)}))
PY
fi

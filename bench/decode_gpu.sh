#!/usr/bin/env bash
# Generation throughput on the GPU machine, one call: our InferenceEngine (bench/decode_throughput) and
# HuggingFace transformers generate with a static cache (bench/hf_generate_reference.py, torch.compile'd and
# eager) on the same shapes (GPT 1.3B, Llama-3.2-1B-style), prompt 512, 128 new tokens, batch 1 and 32:
# prefill and decode tokens/s, peak memory. JSON lines to $OUT/decode_bench.jsonl, then a summary with our
# ratio to each HF system.
#   here:            bench/decode_gpu.sh stage     (from a CUDA build: $GPU_BUILD_DIR, default build/)
#   the GPU machine: bench/decode_gpu.sh run [tests] [ours] [hf]   (tests: the GPU tests of the inference kernels)
# Environment: DECODE_MODELS (default "gpt-1.3B llama-1B"), DECODE_BATCH (default 1,32), HF_SYSTEMS
# (default compile,eager). One call has 570 s; if torch.compile makes the HF part longer, split it over
# calls on the same (warm) machine, e.g. `run ours`, then DECODE_MODELS=gpt-1.3B `run hf`, then
# DECODE_MODELS=llama-1B `run hf`: the rows accumulate in the unpacked package's results.jsonl (the last
# row of each system, model and batch counts), and every call copies them to $OUT and prints the summary.
set -uo pipefail
cd "$(dirname "$0")/.."
D=.device/decode
if [[ ${1:-run} == stage ]]; then
  set -e
  BD=${GPU_BUILD_DIR:-build}
  grep -q '^MEGATRON_CUDA:[A-Z]*=ON' "$BD/CMakeCache.txt" ||
    { echo "decode_gpu.sh stage: $BD is not a CUDA build; configure one with -DMEGATRON_CUDA=ON (or set GPU_BUILD_DIR)" >&2; exit 1; }
  ninja -C "$BD" bench_decode_throughput gpu_tests pretrain_gpt >/dev/null
  rm -rf $D && mkdir -p $D/pkg/bin $D/pkg/lib
  cp "$BD"/bench/decode_throughput "$BD"/tests/gpu_tests "$BD"/bin/pretrain_gpt $D/pkg/bin/
  strip $D/pkg/bin/*
  ldd "$BD"/bench/decode_throughput |
    awk '$3 ~ /^\// && $1 !~ /^(libc|libm|libstdc\+\+|libgcc_s|libdl|libpthread|librt)\.|^libcu|^libnccl/ {print $3}' |
    xargs -r cp -L -t $D/pkg/lib/
  cp ../shared/gpu/env.sh bench/hf_generate_reference.py $D/pkg/
  tar -C $D/pkg -cJf $D/pkg.tar.xz . && rm -rf $D/pkg
  du -sh $D
  exit 0
fi
shift || true
parts=${*:-ours hf}
START=$(date +%s)
left() { echo $((570 - ($(date +%s) - START))); }
P=/tmp/decodecuda
[[ -x $P/bin/decode_throughput ]] || { mkdir -p $P && tar -C $P -xJf $D/pkg.tar.xz; }
source $P/env.sh
export LD_LIBRARY_PATH=$P/lib:$LD_LIBRARY_PATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
J=$P/results.jsonl; touch $J
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
MODELS=${DECODE_MODELS:-gpt-1.3B llama-1B}
BATCH=${DECODE_BATCH:-1,32}

if [[ " $parts " == *" tests "* ]]; then
  echo "== GPU tests of the inference kernels ($(left) s left)"
  (cd $P && MEGATRON_BIN_DIR=$P/bin timeout 120 $P/bin/gpu_tests --gtest_filter="${DECODE_TEST_FILTER:-*CudaKvCache*:*CudaLogitsSummary*:*CudaAttention*}" 2>&1 |
    grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|Failure|error" | head -40)
fi

if [[ " $parts " == *" ours "* ]]; then
  echo "== megatron.cpp InferenceEngine ($(left) s left)"
  for m in $MODELS; do
    timeout 200 $P/bin/decode_throughput --preset $m --batch $BATCH --prompt 512 --new-tokens 128 --device cuda ${DECODE_FLAGS:-} \
      --dtype bf16 2> $OUT/ours_$m.err | tee -a $J
    [[ ${PIPESTATUS[0]} == 0 ]] || { echo "{\"system\": \"megatron.cpp\", \"model\": \"$m\", \"error\": $(tail -c 400 $OUT/ours_$m.err | jq -Rs .)}" | tee -a $J; }
  done
fi

if [[ " $parts " == *" hf "* ]]; then
  echo "== HF transformers generate, static cache ($(left) s left)"
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
  PYTHONUNBUFFERED=1 timeout $(( $(left) - 10 )) python3 $P/hf_generate_reference.py --models "${MODELS// /,}" \
    --batch $BATCH --systems ${HF_SYSTEMS:-compile,eager} 2> $OUT/hf.err | tee -a $J
  [[ ${PIPESTATUS[0]} == 0 ]] || tail -20 $OUT/hf.err
fi

echo "== summary"
cp $J $OUT/decode_bench.jsonl
python3 - $J <<'PY'
import json, sys
last = {}
for l in open(sys.argv[1]):
    if l.startswith("{"):
        r = json.loads(l)
        last[(r["system"], r["model"], r.get("batch"))] = r
rows = list(last.values())
ok = [r for r in rows if "error" not in r]
for r in rows:
    if "error" in r:
        print(f"{r['system']:18} {r['model']:9} batch {r.get('batch', '-')}: error {r['error'][:200]}")
ours = {(r["model"], r["batch"]): r for r in ok if r["system"] == "megatron.cpp"}
num = lambda v: f"{v:.0f}" if v is not None else "-"
def ratio(o, r, key):
    return f"{o[key] / r[key]:.2f}" if o and o.get(key) and r.get(key) and r["system"] != "megatron.cpp" else ""
print(f"{'system':18} {'model':9} {'batch':>5} {'prefill tok/s':>14} {'decode tok/s':>13} {'peak GiB':>9}"
      f" {'ours/it prefill':>16} {'ours/it decode':>15}")
for r in ok:
    o = ours.get((r["model"], r["batch"]))
    print(f"{r['system']:18} {r['model']:9} {r['batch']:>5} {num(r['prefill_tokens_per_s']):>14} "
          f"{num(r['decode_tokens_per_s']):>13} {r['peak_mem_GiB']:>9.2f} {ratio(o, r, 'prefill_tokens_per_s'):>16} "
          f"{ratio(o, r, 'decode_tokens_per_s'):>15}")
PY

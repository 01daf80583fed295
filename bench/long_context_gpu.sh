#!/usr/bin/env bash
# Long context on the GPU machine, one call: packed documents at seq 32768 (ours, bench/gpt_throughput
# --doc-mean, against bench/pytorch_reference.py --doc-mean: FlexAttention with a document-causal block
# mask, eager and torch.compile), the peak memory of full recomputation at growing sequence lengths (the
# points bench/long_context_memory.py fits), and the GPU tests of packed sequences and the
# context-parallel merge. Runs from the repository root there, with the package `stage` made.
#   LC_STAGE=/work/main/.device/lc bench/long_context_gpu.sh stage    (here, from a CUDA build in build/)
#   bench/long_context_gpu.sh run [what...]   (what: tests packed memory; default all three)
set -uo pipefail
D=${LC_STAGE:-.device/lc}
if [[ ${1:-run} == stage ]]; then
  set -e
  rm -rf $D && mkdir -p $D/pkg/bin $D/pkg/lib
  cp build/bin/pretrain_gpt build/tests/gpu_tests build/bench/gpt_throughput $D/pkg/bin/
  strip $D/pkg/bin/*
  ldd build/bin/pretrain_gpt | awk '$3 ~ /^\// && $1 !~ /^(libc|libm|libstdc\+\+|libgcc_s|libdl|libpthread|librt)\.|^libcu|^libnccl/ {print $3}' |
    xargs -r cp -L -t $D/pkg/lib/
  cp ../shared/gpu/env.sh bench/pytorch_reference.py bench/long_context_gpu.sh $D/pkg/
  tar -C $D/pkg -cJf $D/pkg.tar.xz . && rm -rf $D/pkg
  du -sh $D
  exit 0
fi
shift || true
WHAT=${*:-tests packed memory}
P=/tmp/lc
[[ -x $P/bin/gpt_throughput ]] || { mkdir -p $P && tar -C $P -xJf $D/pkg.tar.xz; }
source $P/env.sh
export LD_LIBRARY_PATH=$P/lib:$LD_LIBRARY_PATH MEGATRON_BIN_DIR=$P/bin MEGATRON_FIXTURES=$PWD/tests/fixtures
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
J=$OUT/long_context.jsonl; touch $J
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
ours() {  # timeout, flags
  (cd /tmp && timeout "$1" $P/bin/gpt_throughput --device cuda --dtype bf16 "${@:2}") 2>&1 | tee -a $OUT/ours.txt |
    grep '^{' >> $J
}
if [[ " $WHAT " == *" tests "* ]]; then
  echo "== GPU tests: packed sequences, attention merge, attention masks"
  (cd /tmp && timeout 120 $P/bin/gpu_tests --gtest_filter='PackedModelGpu.*:AttentionMergeGpu.*:*Document*:*Mask*' 2>&1 |
    tee $OUT/gpu_tests.txt | grep -E "^\[  (PASSED|FAILED) |packed|document|FAILED|error" | head -40)
fi
if [[ " $WHAT " == *" packed "* ]]; then
  echo "== packed documents, llama-1B, seq 32768, micro-batch 1, documents of mean 2048"
  ours 200 --preset llama-1B --seq 32768 --micro-batch-size 1 --doc-mean 2048 --steps 4 --warmup 2
  ours 200 --preset llama-1B --seq 32768 --micro-batch-size 1 --steps 4 --warmup 2
  (PYTHONUNBUFFERED=1 timeout 300 python3 $P/pytorch_reference.py --preset llama-1B --seq 32768 --mbs 1 --doc-mean 2048 \
    --steps 8 2>&1 | tee -a $OUT/ref.txt | grep '^{' >> $J)
fi
if [[ " $WHAT " == *" memory "* ]]; then
  echo "== peak memory under full recomputation"
  for s in 32768 65536 131072; do ours 150 --preset llama-1B --seq $s --micro-batch-size 1 --recompute full --steps 1 --warmup 1; done
  for s in 16384 32768 65536; do ours 150 --preset llama-8B-layers --seq $s --micro-batch-size 1 --recompute full --steps 1 --warmup 1; done
fi
python3 - $J <<'PY' | tee $OUT/summary.txt
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for r in rows:
    if r.get("bench") == "gpt_throughput":
        print(f'ours  {r["preset"]:16} seq {r["seq"]:>6} docs {r.get("documents", 0):>3} recompute {r.get("recompute") or "-":9} '
              f'{r["tokens_per_s"]:>9.0f} tok/s  step {r["step_ms"]:>9.1f} ms  peak {r["peak_mem_gb"]:.1f} GB')
    elif "system" in r:
        print(f'{r["system"]:15} llama seq {r["seq"]:>6} docs {r.get("documents", 0):>3} {r["tokens_per_s"]:>9.0f} tok/s  '
              f'step {r["step_ms"]:>9.1f} ms  peak {r["peak_mem_GiB"] * 1.073741824:.1f} GB')
PY

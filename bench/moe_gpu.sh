#!/usr/bin/env bash
# MoE on the GPU machine, one call: our training step (bench/gpt_throughput's MoE presets) against
# ../shared/bench/pytorch_moe_reference.py (eager and torch.compile) on mixtral-small and a
# fine-grained shape (64 experts, top-6), mixtral-small with a shared expert of 4096 without and with
# --moe-shared-expert-overlap (alltoall dispatcher), then the MoE GPU tests. Runs from the repository root there,
# with the package that `bench/moe_gpu.sh stage` made in .device/moecuda/ (binaries, libraries,
# env.sh, the PyTorch reference). JSON lines to $OUT/moe_bench.jsonl; a summary table last.
#   MOE_STAGE=/work/main/.device/moecuda bench/moe_gpu.sh stage   (here, from a CUDA build in build/)
#   mkdir -p /tmp/moecuda && tar -C /tmp/moecuda -xJf .device/moecuda/pkg.tar.xz && /tmp/moecuda/moe_gpu.sh run
set -uo pipefail
D=${MOE_STAGE:-.device/moecuda}
if [[ ${1:-run} == stage ]]; then
  set -e
  rm -rf $D && mkdir -p $D/pkg/bin $D/pkg/lib
  cp build/bin/pretrain_gpt build/tests/gpu_tests build/bench/gpt_throughput $D/pkg/bin/
  strip $D/pkg/bin/*
  ldd build/bin/pretrain_gpt | awk '$3 ~ /^\// && $1 !~ /^(libc|libm|libstdc\+\+|libgcc_s|libdl|libpthread|librt)\.|^libcu|^libnccl/ {print $3}' |
    xargs -r cp -L -t $D/pkg/lib/
  cp ../shared/gpu/env.sh ../shared/bench/pytorch_moe_reference.py bench/moe_gpu.sh $D/pkg/
  tar -C $D/pkg -cJf $D/pkg.tar.xz . && rm -rf $D/pkg
  du -sh $D
  exit 0
fi
START=$(date +%s)
left() { echo $((570 - ($(date +%s) - START))); }
P=/tmp/moecuda
[[ -x $P/bin/gpt_throughput ]] || { mkdir -p $P && tar -C $P -xJf $D/pkg.tar.xz; }
source $P/env.sh
export LD_LIBRARY_PATH=$P/lib:$LD_LIBRARY_PATH MEGATRON_BIN_DIR=$P/bin MEGATRON_FIXTURES=$PWD/tests/fixtures
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
J=$OUT/moe_bench.jsonl; : > $J
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
FINE="--layers 8 --hidden 2048 --heads 32 --kv 4 --experts 64 --topk 6 --ffn 1024 --seq 4096 --mbs 1 --vocab 32000"
ours() {  # preset, extra flags
  (cd /tmp && timeout 150 $P/bin/gpt_throughput --preset "$1" --device cuda --dtype bf16 --steps 8 --warmup 3 "${@:2}") \
    2>&1 | tee -a $OUT/ours.txt | grep '^{' >> $J
}
echo "== ours"
ours mixtral-small --moe-grouped-gemm --profile
ours mixtral-small
ours moe-fine-64x6 --moe-grouped-gemm --profile
for o in "" --moe-shared-expert-overlap; do ours mixtral-small --moe-grouped-gemm --moe-shared-expert-intermediate-size 4096 $o; done
echo "== pytorch ($(left) s left)"
(PYTHONUNBUFFERED=1 timeout 200 python3 $P/pytorch_moe_reference.py --preset mixtral-small 2>&1 | tee -a $OUT/ref.txt |
  grep '^{' | sed 's/^{/{"preset": "mixtral-small", /' >> $J)
(PYTHONUNBUFFERED=1 timeout 200 python3 $P/pytorch_moe_reference.py $FINE 2>&1 | tee -a $OUT/ref.txt |
  grep '^{' | sed 's/^{/{"preset": "moe-fine-64x6", /' >> $J)
python3 - $J <<'PY' | tee $OUT/summary.txt
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for p in ("mixtral-small", "moe-fine-64x6"):
    ref = {r["system"]: r for r in rows if r.get("preset") == p and "system" in r and "tokens_per_s" in r}
    for r in rows:
        if r.get("bench") == "gpt_throughput" and r["preset"] == p:
            c = ref.get("pytorch-compile", {}).get("tokens_per_s")
            e = ref.get("pytorch-eager", {}).get("tokens_per_s")
            sh = f' shared {r["shared_ffn"]}{" overlap" if r["shared_overlap"] else ""}' if r.get("shared_ffn") else ''
            print(f'{p:14} ours{" grouped" if r["grouped_gemm"] else " seq    "}{sh} {r["tokens_per_s"]:>9.0f} tok/s  mfu {r["mfu"]:.3f}  '
                  f'peak {r["peak_mem_gb"]:.1f} GB  vs compile {r["tokens_per_s"]/c if c else 0:.2f}  vs eager {r["tokens_per_s"]/e if e else 0:.2f}')
    for s, r in ref.items():
        print(f'{p:14} {s:15} {r["tokens_per_s"]:>9.0f} tok/s  mfu {r["mfu"]:.3f}  peak {r["peak_mem_GiB"]*1.073741824:.1f} GB')
for r in rows:
    if r.get("bench") == "op_profile" and r["share"] > 0.03:
        print(f'profile {r["preset"]:14} {r["op"][:40]:40} {r["ms"]:8.2f} ms  {r["share"]:.2f}')
    if r.get("bench") == "step_phases": print(r)
PY
echo "== MoE GPU tests ($(left) s left)"
timeout $(( $(left) > 30 ? $(left) : 30 )) $P/bin/gpu_tests --gtest_filter='*Moe*' 2>&1 | tee $OUT/gpu_moe_tests.txt |
  grep -E "moe on cuda|FAILED|PASSED|rror" | head -40

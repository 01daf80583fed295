#!/usr/bin/env bash
# Training runs on several GPUs of one node against the single-GPU run of the same model, in one call:
# tokens/s and TFLOP/s per GPU from Megatron's iteration line, step time with and without the
# overlapped reduction/gather, and every run's loss over its iterations against the single GPU's.
# Runs from the repository root on the GPU machine with the binaries staged in .device/ (see
# bench/stage_gpu.sh). Usage: bench/run_multi_gpu.sh [tests] [gpt-1.3B] [gpt-2.7B] [bandwidth] [8gpu]
# (the first four: the 2-GPU runs; 8gpu: DP=8 on 1.3B, a 13B shape at TP=8+SP and TP=4 x PP=2 interleaved
# against TP=4 on 4 GPUs, a Llama 8B shape at TP=2 x PP=2 x DP=2 against TP=2 x PP=2 on 4 GPUs).
# Writes $OUT/multi/<run>.log and <run>.loss.jsonl, then bench/multi_gpu_summary.py's JSON lines
# (each run against <model>_single, or <model>_reference for models that need several GPUs).
set -uo pipefail
sets=${*:-tests gpt-1.3B gpt-2.7B bandwidth}
source .device/env.sh
export LD_LIBRARY_PATH=$PWD/.device/lib:$LD_LIBRARY_PATH
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on shared hosts
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/multi"
B=$PWD/.device/bin
export MEGATRON_BIN_DIR=$B
GPUS=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
echo "gpus: $GPUS"

COMMON="--mock-data --tokenizer-type NullTokenizer --vocab-size 50257 --bf16 --lr 3e-4 --min-lr 3e-5
  --lr-decay-style cosine --lr-warmup-iters 5 --train-iters 20 --log-interval 1 --log-throughput --eval-iters 0
  --hidden-dropout 0 --attention-dropout 0 --seed 1234 --device cuda --distributed-timeout-minutes 1"
DP="--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"

# train NAME NPROC FLAGS...: one run (NPROC > 1 through --nproc-per-node).
train() {
  local name=$1 nproc=$2; shift 2
  if [[ $nproc -gt $GPUS ]]; then echo "$name: skipped ($nproc GPUs needed)"; return; fi
  # After a failed multi-GPU run the others would most likely fail the same way: keep the call's time.
  if [[ $nproc -gt 1 && -n ${MULTI_FAILED:-} ]]; then echo "$name: skipped (an earlier multi-GPU run failed)"; return; fi
  local launch=""; [[ $nproc -gt 1 ]] && launch="--nproc-per-node $nproc"
  rm -f "$OUT/multi/$name.loss.jsonl"
  local t0=$SECONDS
  (cd /tmp && MEGATRON_LOSS_LOG="$OUT/multi/$name.loss.jsonl" timeout ${RUN_TIMEOUT:-150} $B/pretrain_gpt $COMMON "$@" $launch \
    > "$OUT/multi/$name.log" 2>&1)
  local rc=$?
  echo "$name: rc=$rc, $((SECONDS - t0)) s; $(grep -E 'iteration +20/' "$OUT/multi/$name.log" | grep -oE 'elapsed[^|]*\|[^|]*\|[^|]*\|')"
  if [[ $rc -ne 0 ]]; then
    tail -5 "$OUT/multi/$name.log"
    [[ $nproc -gt 1 ]] && MULTI_FAILED=1
  fi
}

for s in $sets; do
  case $s in
    tests)
      echo "== multi-GPU tests (NCCL collectives as threads; pretrain_gpt layouts against one GPU)"
      timeout 240 $B/gpu_tests --gtest_brief=1 --gtest_filter='NcclCommunicator*:ParallelMultiGpu*' 2>&1 |
        tee "$OUT/multi_gpu_tests.txt" | grep -E "FAILED|Failure|PASSED|SKIPPED|tests from|multi-gpu" | head -40 ;;
    gpt-1.3B)
      M="--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048
         --micro-batch-size 4 --global-batch-size 32"
      train gpt-1.3B_single 1 $M
      train gpt-1.3B_dp2 2 $M $DP
      train gpt-1.3B_dp2_no-overlap 2 $M --use-distributed-optimizer
      train gpt-1.3B_tp2_sp 2 $M --tensor-model-parallel-size 2 --sequence-parallel
      train gpt-1.3B_pp2 2 $M --pipeline-model-parallel-size 2
      train gpt-1.3B_pp2_interleaved 2 $M --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 ;;
    gpt-2.7B)
      M="--num-layers 32 --hidden-size 2560 --num-attention-heads 32 --seq-length 2048 --max-position-embeddings 2048
         --micro-batch-size 4 --global-batch-size 32"
      train gpt-2.7B_single 1 $M
      train gpt-2.7B_tp2_sp 2 $M --tensor-model-parallel-size 2 --sequence-parallel
      train gpt-2.7B_pp2 2 $M --pipeline-model-parallel-size 2
      train gpt-2.7B_pp2_interleaved 2 $M --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 ;;
    8gpu)
      M="--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048
         --micro-batch-size 8 --global-batch-size 128"
      train gpt-1.3B-gbs128_single 1 $M
      train gpt-1.3B-gbs128_dp8 8 $M $DP
      M="--num-layers 40 --hidden-size 5120 --num-attention-heads 40 --seq-length 2048 --max-position-embeddings 2048
         --micro-batch-size 1 --global-batch-size 32"
      # The 13B shape does not fit one GPU with Adam: its reference is TP=4 on 4 GPUs.
      train gpt-13B_reference 4 $M --tensor-model-parallel-size 4 --sequence-parallel
      train gpt-13B_tp8_sp 8 $M --tensor-model-parallel-size 8 --sequence-parallel
      train gpt-13B_tp4_pp2_interleaved 8 $M --tensor-model-parallel-size 4 --sequence-parallel \
        --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2
      M="--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8
         --ffn-hidden-size 14336 --swiglu --normalization RMSNorm --position-embedding-type rope
         --disable-bias-linear --untie-embeddings-and-output-weights --seq-length 4096 --max-position-embeddings 4096
         --micro-batch-size 1 --global-batch-size 32"
      train llama-8B_reference 4 $M --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel
      train llama-8B_tp2_pp2_dp2 8 $M --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
        --sequence-parallel $DP ;;
    bandwidth)
      echo "== NCCL bandwidth through the Communicator ($GPUS GPUs)"
      timeout 200 $B/comm_bandwidth 2>&1 | tee "$OUT/multi/comm_bandwidth.jsonl" ;;
  esac
done
echo "== summary"
python3 bench/multi_gpu_summary.py "$OUT/multi" | tee "$OUT/multi/summary.jsonl"

#!/usr/bin/env bash
# The functional tests' training commands on the CPU, for "no change of behaviour" checks: each
# command's lm loss, grad norm and validation lines, one .loss file per command, so two builds can
# be compared digit for digit (diff -r OUT_A OUT_B). Runs from anywhere; needs mpirun.
# Usage: bench/compare_losses.sh BIN_DIR OUT_DIR      (BIN_DIR holds pretrain_gpt)
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
B=$(cd "$1" && pwd); O=$2; mkdir -p "$O"; cd "$O"
D=$ROOT/tests/fixtures/megatron_data
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
TINY="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 4 --global-batch-size 8
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 1 --data-path $D/data/shakespeare_spm_text_document
  --split 98,2,0 --tokenizer-type SentencePieceTokenizer --tokenizer-model $D/tok-spm.model --log-interval 1
  --eval-interval 10 --eval-iters 1 --device cpu --data-cache-path $PWD/cache"
GPT="--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32
  --micro-batch-size 2 --global-batch-size 16 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 1
  --weight-decay 0.1 --clip-grad 1.0 --vocab-size 1000 --mock-data --hidden-dropout 0 --attention-dropout 0
  --log-interval 1 --eval-iters 0 --seed 1234 --device cpu --split 100,0,0 --adam-eps 1e-4 --train-iters 5"
LLAMA="--num-layers 4 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2
  --ffn-hidden-size 96 --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear
  --untie-embeddings-and-output-weights --seq-length 32 --max-position-embeddings 32 --micro-batch-size 2
  --global-batch-size 16 --lr 1e-3 --vocab-size 1000 --mock-data --hidden-dropout 0 --attention-dropout 0
  --log-interval 1 --eval-iters 0 --seed 1234 --device cpu --split 100,0,0 --adam-eps 1e-4 --train-iters 5"
MPI="mpirun --oversubscribe --mca mpi_yield_when_idle 1"
[ "$(id -u)" = 0 ] && MPI="$MPI --allow-run-as-root"
run() {
  local name=$1; shift
  "$@" > "$name.log" 2>&1; echo "$name rc=$?"
  grep -o "lm loss: [^|]*\|grad norm: [^|]*\|validation loss at.*" "$name.log" > "$name.loss"
}
run tiny_dropout "$B/pretrain_gpt" $TINY --train-iters 20
run tiny_bf16_full_recompute "$B/pretrain_gpt" $TINY --train-iters 6 --bf16 --recompute-granularity full --recompute-method uniform
run gpt_np1 "$B/pretrain_gpt" $GPT
run gpt_tp2_pp2_sp $MPI -np 4 "$B/pretrain_gpt" $GPT --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel
run gpt_dp2_distopt_overlap $MPI -np 2 "$B/pretrain_gpt" $GPT --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 5000
run gpt_pp2_vpp $MPI -np 2 "$B/pretrain_gpt" $GPT --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2
run llama_np1 "$B/pretrain_gpt" $LLAMA
run llama_tp2_dp2_sp_selective_distopt $MPI -np 4 "$B/pretrain_gpt" $LLAMA --tensor-model-parallel-size 2 --sequence-parallel --recompute-granularity selective --use-distributed-optimizer

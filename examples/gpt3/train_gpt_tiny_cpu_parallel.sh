#!/usr/bin/env bash
# The tiny CPU GPT on 8 ranks: tensor parallel 2 with sequence parallelism, pipeline parallel 2 with
# interleaving, data parallel 2 with the distributed optimizer and overlapped reductions — the same
# losses as the single process (examples/gpt3/train_gpt_tiny_cpu.sh with --num-layers 8). Launched by
# the built-in launcher (it runs mpirun for CPU ranks); `mpirun -np 8 pretrain_gpt ...` works too.
set -euo pipefail
PRETRAIN=${PRETRAIN_GPT:-$(dirname "$0")/../../build/bin/pretrain_gpt}
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$PRETRAIN" --nproc-per-node 8 \
  --tensor-model-parallel-size 2 --sequence-parallel \
  --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 \
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather \
  --num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 \
  --micro-batch-size 2 --global-batch-size 16 --train-iters 50 \
  --lr 1e-3 --lr-decay-style cosine --lr-warmup-iters 5 \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 \
  --log-interval 10 --eval-interval 25 --eval-iters 2 --device cpu "$@"

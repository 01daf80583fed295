#!/usr/bin/env bash
# A tiny GPT on the CPU with synthetic data (--mock-data): a smoke test of the whole loop in seconds.
set -euo pipefail
PRETRAIN=${PRETRAIN_GPT:-$(dirname "$0")/../../build/bin/pretrain_gpt}
"$PRETRAIN" \
  --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 \
  --micro-batch-size 4 --global-batch-size 8 --train-iters 50 \
  --lr 1e-3 --lr-decay-style cosine --lr-warmup-iters 5 \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 \
  --log-interval 10 --eval-interval 25 --eval-iters 2 --device cpu "$@"

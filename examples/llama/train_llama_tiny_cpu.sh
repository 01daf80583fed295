#!/usr/bin/env bash
# A tiny Llama-style model (GQA, SwiGLU, RoPE, RMSNorm) on the CPU with synthetic data.
set -euo pipefail
PRETRAIN=${PRETRAIN_GPT:-$(dirname "$0")/../../build/bin/pretrain_gpt}
"$PRETRAIN" \
  --num-layers 2 --hidden-size 64 --ffn-hidden-size 176 --num-attention-heads 4 \
  --group-query-attention --num-query-groups 2 --seq-length 64 \
  --normalization RMSNorm --swiglu --disable-bias-linear --position-embedding-type rope \
  --untie-embeddings-and-output-weights \
  --micro-batch-size 4 --global-batch-size 8 --train-iters 50 \
  --lr 1e-3 --lr-decay-style cosine --lr-warmup-iters 5 \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 \
  --log-interval 10 --eval-interval 25 --eval-iters 2 --device cpu "$@"

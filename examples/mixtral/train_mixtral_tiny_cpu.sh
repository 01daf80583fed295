#!/usr/bin/env bash
# A tiny Mixtral-style model (4 SwiGLU experts, top-2, GQA, RoPE, RMSNorm) on the CPU with
# synthetic data: the flags of train_mixtral_8x7b.sh at a size that trains in seconds.
set -euo pipefail
PRETRAIN=${PRETRAIN_GPT:-$(dirname "$0")/../../build/bin/pretrain_gpt}
"$PRETRAIN" \
  --num-layers 2 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4 \
  --group-query-attention --num-query-groups 2 --seq-length 64 \
  --normalization RMSNorm --swiglu --disable-bias-linear --position-embedding-type rope \
  --untie-embeddings-and-output-weights \
  --num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 \
  --micro-batch-size 4 --global-batch-size 8 --train-iters 50 \
  --lr 1e-3 --lr-decay-style cosine --lr-warmup-iters 5 \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 \
  --log-interval 10 --eval-interval 25 --eval-iters 2 --device cpu "$@"

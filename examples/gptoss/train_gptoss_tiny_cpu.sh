#!/usr/bin/env bash
# A tiny GPT-OSS-style model on the CPU with synthetic data: the flags of train_gptoss_20b.sh (attention
# sinks, a sliding window on every other layer, YaRN, clamped quick-GeGLU experts with biases, router
# bias) at a size that trains in seconds.
set -euo pipefail
PRETRAIN=${PRETRAIN_GPT:-$(dirname "$0")/../../build/bin/pretrain_gpt}
"$PRETRAIN" \
  --num-layers 4 --hidden-size 64 --ffn-hidden-size 64 --num-attention-heads 4 --kv-channels 16 \
  --group-query-attention --num-query-groups 2 --seq-length 64 --max-position-embeddings 256 \
  --normalization RMSNorm --untie-embeddings-and-output-weights \
  --position-embedding-type yarn --rotary-base 150000 --rotary-scaling-factor 4 \
  --yarn-original-max-position-embeddings 64 --no-yarn-correction-range-round-to-int \
  --quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0 \
  --softmax-type learnable --window-size 15,0 --window-attn-skip-freq 2 \
  --attention-dropout 0.0 --hidden-dropout 0.0 \
  --num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 \
  --moe-grouped-gemm \
  --micro-batch-size 4 --global-batch-size 8 --train-iters 50 \
  --lr 1e-3 --lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 0.1 \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 \
  --log-interval 10 --eval-interval 25 --eval-iters 2 --device cpu "$@"

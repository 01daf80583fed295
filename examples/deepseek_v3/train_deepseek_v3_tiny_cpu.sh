#!/usr/bin/env bash
# A tiny DeepSeek-V3-style model on the CPU with synthetic data: the flags of train_deepseek_v3.sh
# (multi-latent attention with low-rank q and kv, YaRN, a dense first layer, sigmoid group-limited MoE
# with the expert bias and a shared expert) at a size that trains in seconds.
set -euo pipefail
PRETRAIN=${PRETRAIN_GPT:-$(dirname "$0")/../../build/bin/pretrain_gpt}
"$PRETRAIN" \
  --num-layers 3 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4 --seq-length 64 \
  --max-position-embeddings 256 --normalization RMSNorm --swiglu --disable-bias-linear \
  --untie-embeddings-and-output-weights \
  --position-embedding-type rope --rotary-scaling-factor 4 --yarn-original-max-position-embeddings 16 \
  --mscale 1.0 --mscale-all-dim 1.0 \
  --multi-latent-attention --q-lora-rank 32 --kv-lora-rank 24 --qk-head-dim 16 --qk-pos-emb-head-dim 8 \
  --v-head-dim 16 --qk-layernorm \
  --num-experts 8 --moe-layer-freq "([0]*1+[1]*2)" --moe-ffn-hidden-size 48 --moe-shared-expert-intermediate-size 48 \
  --moe-router-topk 2 --moe-router-num-groups 4 --moe-router-group-topk 2 --moe-router-topk-scaling-factor 2.5 \
  --moe-router-score-function sigmoid --moe-router-enable-expert-bias \
  --micro-batch-size 4 --global-batch-size 8 --train-iters 50 \
  --lr 1e-3 --lr-decay-style cosine --lr-warmup-iters 5 \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 \
  --log-interval 10 --eval-interval 25 --eval-iters 2 --device cpu "$@"

#!/usr/bin/env bash
# Tiny Qwen-MoE-style models on the CPU with synthetic data: Qwen3-MoE (--qk-layernorm, 8 experts,
# top-2, the first layer dense) by default; with QWEN2_MOE=1 Qwen2-MoE's routing and gated shared
# expert (--moe-router-pre-softmax --moe-shared-expert-intermediate-size --moe-shared-expert-gate).
set -euo pipefail
PRETRAIN=${PRETRAIN_GPT:-$(dirname "$0")/../../build/bin/pretrain_gpt}
if [[ "${QWEN2_MOE:-0}" == 1 ]]; then
  VARIANT=(--add-qkv-bias --moe-router-pre-softmax --moe-shared-expert-intermediate-size 96
           --moe-shared-expert-gate --moe-shared-expert-overlap --moe-token-dispatcher-type alltoall)
else
  VARIANT=(--qk-layernorm --kv-channels 16 --moe-layer-freq "([0]+[1]*1)")
fi
"$PRETRAIN" \
  --num-layers 2 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4 \
  --group-query-attention --num-query-groups 2 --seq-length 64 \
  --normalization RMSNorm --swiglu --disable-bias-linear --position-embedding-type rope \
  --untie-embeddings-and-output-weights \
  --num-experts 8 --moe-ffn-hidden-size 48 --moe-router-topk 2 --moe-aux-loss-coeff 1e-3 "${VARIANT[@]}" \
  --micro-batch-size 4 --global-batch-size 8 --train-iters 50 \
  --lr 1e-3 --lr-decay-style cosine --lr-warmup-iters 5 \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 \
  --log-interval 10 --eval-interval 25 --eval-iters 2 --device cpu "$@"
